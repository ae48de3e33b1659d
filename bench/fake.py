"""Local overhead per call on torch's ``fake`` process-group backend (collectives return
at once, touching nothing), meshgrad against megatron-core, one process as global rank 0
(tp 0, dp 0, first pipeline stage) of a TP x DP x PP world.

Three models of the same layout:

* ``megatron``: megatron-core 0.16's functions on :class:`bench.ddp.MiniDDP` chunks.
* ``meshgrad drop-in``: torch_impl on the same kind of DDP chunks (the DDP owns the
  gradient storage: DP sync is its ``finish_grad_sync``; non-TP grads are copied).
* ``meshgrad buffers``: torch_impl on plain chunks whose gradients live in meshgrad's
  flat buffers (:func:`torch_impl.buffers.attach_grad_buffers`; meshgrad does DP sync).

Per step, each helper of Megatron's API is timed for each (Megatron's DP sync is the DDP's
``finish_grad_sync``; meshgrad's, with its own buffers, is timed as the bound action
inside finalize), then the whole ``finalize_model_grads``; collectives and copied bytes
are counted per finalize call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bench.counting import CollectiveCounter, FlattenCounter, megatron_finalize_module
from bench.ddp import MiniDDP
from bench.models import Layout, build_chunk, count_non_tp, non_tp_params
from bench.timing import interleaved, paired_ratio

STEPS = ("dp_sync", "non_tp", "embedding", "expert_bias", "reset", "finalize")


def init_fake(world: int) -> None:
    """A fake process group of ``world`` ranks with this process as rank 0."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if dist.get_world_size() == world and dist.get_backend() == "fake":
            return
        dist.destroy_process_group()
    _GROUPS.clear()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


_GROUPS: dict[tuple[int, ...], Any] = {}  # this process's fake groups, by ranks


def _group(ranks: list[int]) -> Any:
    key = tuple(ranks)
    if len(key) <= 1:
        return None
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(key))
    return _GROUPS[key]


def fake_groups(lay: Layout) -> types.SimpleNamespace:
    """Rank 0's groups, Megatron order (rank = (pp*DP + dp)*TP + tp)."""
    tp, dp, pp = lay.tp, lay.dp, lay.pp
    stages = sorted({0, pp - 1})
    return types.SimpleNamespace(
        tp=_group(list(range(tp))),
        pp=_group([s * dp * tp for s in range(pp)]),
        embd=_group([s * dp * tp for s in stages]),
        pos_embd=None,
        dp_cp=_group([d * tp for d in range(dp)]),
        expt_dp=None,  # ep = dp: each expert on one dp rank
        tp_dp_cp=_group(list(range(dp * tp))),
    )


def buffers_to(module: nn.Module, device: Any) -> None:
    """Move registered buffers (router state) to ``device``; parameters stay on meta."""
    for sub in module.modules():
        for name, buf in list(sub._buffers.items()):
            if buf is not None:
                sub._buffers[name] = buf.to(device)


def first_stage_chunk(lay: Layout, device: Any) -> nn.Module:
    """The layout's pp stage 0 chunk: parameters on meta, registered buffers on ``device``."""
    chunk = build_chunk(lay, 0)
    buffers_to(chunk, device)
    return chunk


@contextlib.contextmanager
def megatron_tp_dp_cp(group: Any) -> Iterator[None]:
    """megatron-core 0.16 looks the expert-bias group up in parallel_state: set it there
    for the duration of a measurement (bench only), restore afterwards."""
    from megatron.core import parallel_state as ps

    saved = ps._TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP
    ps._TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP = group
    try:
        yield
    finally:
        ps._TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP = saved


def _per_call(
    fn: Callable[[], object], calls: int = 5, copied: Callable[[], int] | None = None
) -> tuple[float, float]:
    """(collectives, bytes copied) per steady-state call of ``fn`` (one call first: a new
    plan's one-time cross-rank consistency check is not a per-step cost). Bytes come from
    ``copied()`` (meshgrad's cumulative counter) when given, else from megatron-core's
    flatten."""
    fn()
    before = copied() if copied is not None else 0
    with CollectiveCounter() as counter, FlattenCounter() as flat:
        for _ in range(calls):
            fn()
    moved = copied() - before if copied is not None else flat.bytes
    return counter.total / calls, moved / calls


def _by_dtype(grads: list[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    """The gradients grouped by dtype (one flat buffer each), in order within a group."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(g.dtype, []).append(g)
    return groups


def copy_floor(grads: list[torch.Tensor], group: Any) -> Callable[[], None]:
    """The drop-in non-TP step's floor: the gradients staged into one flat buffer per dtype
    (``torch._foreach_copy_``), one collective on it, copied back (buffers made here, once)."""
    staged: list[tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]] = []
    for dtype, members in _by_dtype(grads).items():
        flat = torch.empty(sum(g.numel() for g in members), dtype=dtype, device=members[0].device)
        views = [v.view(g.shape) for v, g in zip(flat.split([g.numel() for g in members]), members)]
        staged.append((flat, views, members))

    def run() -> None:
        for flat, views, members in staged:
            torch._foreach_copy_(views, members)
            dist.all_reduce(flat, group=group)
            torch._foreach_copy_(members, views)

    return run


def staging_floor(grads: list[torch.Tensor], group: Any) -> Callable[[], None]:
    """:func:`copy_floor` with meshgrad's own staging (``torch_impl.run.staging``: on CPU,
    strided runs for gradients laid out layer after layer in one storage) in place of
    ``_foreach_copy_``: the same copies as meshgrad's drop-in step, without any check, so
    that the step over it is what the checks and the pipeline cost."""
    from torch_impl.run.staging import _Staging

    stages = [_Staging(members, [g.numel() for g in members], dtype, keep=True)
              for dtype, members in _by_dtype(grads).items()]

    def run() -> None:
        for stage in stages:
            staged = stage.copy_in()
            dist.all_reduce(staged[0], group=group)
            stage.copy_out(staged)

    return run


def inside_finalize(model: list[Any], *, rounds: int, batch: int, sync: Callable[[], object] | None) -> dict[str, float]:
    """Per step, the median seconds of meshgrad's bound actions inside finalize."""
    from torch_impl.finalize import ModelState

    programs = list(ModelState.of(model).programs.values())
    if not programs:
        return {}
    program = programs[-1][1]
    samples: dict[str, list[float]] = {}
    with torch.no_grad():
        for _ in range(rounds):
            totals: dict[str, float] = {}
            for _ in range(batch):
                for action, op in program.ops:
                    start = time.perf_counter()
                    op()
                    if sync is not None:
                        sync()
                    name = "+".join(str(s) for s in getattr(action, "steps", (action.step,)))
                    totals[name] = totals.get(name, 0.0) + time.perf_counter() - start
            for name, total in totals.items():
                samples.setdefault(name, []).append(total / batch)
    return {name: statistics.median(v) for name, v in samples.items()}


def measure_layout(
    lay: Layout, *, rounds: int, batch: int, device: str = "cpu", with_megatron: bool = True
) -> dict[str, Any]:
    """Every step and the whole finalize for the three models of ``lay``.

    Returns:
      A JSON-able dict: per model, per step ``{"median", "min", "max"}`` seconds, plus
      collectives and copied bytes per finalize call and goal ratios.
    """
    import torch_impl
    from torch_impl.buffers import attach_grad_buffers
    from torch_impl.finalize import execution_stats

    init_fake(lay.world)
    pgc = fake_groups(lay)
    sync = torch.cuda.synchronize if device.startswith("cuda") else None

    own = [first_stage_chunk(lay, device)]
    bufs = attach_grad_buffers(own, pgc, lazy=True, device=device)
    dropin = [MiniDDP(first_stage_chunk(lay, device), pgc.dp_cp, device=device)]
    cfg = own[0].config
    moe = bool(lay.moe_experts)

    def mg_steps(model: list[Any], own_dp: bool) -> dict[str, Callable[[], object]]:
        steps: dict[str, Callable[[], object]] = {}
        if not own_dp:
            steps["dp_sync"] = lambda: [c.finish_grad_sync() for c in model]
        steps["non_tp"] = lambda: torch_impl._allreduce_non_tensor_model_parallel_grads(model, cfg, pgc.tp)
        # Word embedding only: the layouts have no learned position embedding (pos_embd
        # group of size 1), for which Megatron's helper returns at once.
        if pgc.embd is not None:
            steps["embedding"] = lambda: torch_impl._allreduce_word_embedding_grads(model, cfg, pgc.embd, pgc.pp)
        if moe:
            steps["expert_bias"] = lambda: torch_impl._update_router_expert_bias(model, cfg, pgc.tp_dp_cp)
        steps["reset"] = lambda: torch_impl.reset_model_temporary_tensors(cfg, model)
        steps["finalize"] = lambda: torch_impl.finalize_model_grads(model, pg_collection=pgc)
        return steps

    models: dict[str, dict[str, Callable[[], object]]] = {
        "meshgrad drop-in": mg_steps(dropin, False),
        "meshgrad buffers": mg_steps(own, True),
    }
    fmg = megatron_finalize_module() if with_megatron else None
    mc: list[Any] = []
    if fmg is not None:
        mc = [MiniDDP(first_stage_chunk(lay, device), pgc.dp_cp, device=device)]
        # megatron-core needs a pipeline group object even for PP = 1 (it calls .size()).
        if pgc.pp is None and (0,) not in _GROUPS:
            _GROUPS[(0,)] = dist.new_group([0])
        mpp = pgc.pp if pgc.pp is not None else _GROUPS[(0,)]
        mpgc = types.SimpleNamespace(tp=pgc.tp, pp=mpp, embd=pgc.embd, pos_embd=None, dp_cp=pgc.dp_cp)
        msteps: dict[str, Callable[[], object]] = {
            "dp_sync": lambda: [c.finish_grad_sync() for c in mc],
            "non_tp": lambda: fmg._allreduce_non_tensor_model_parallel_grads(mc, cfg, pgc.tp),
            "reset": lambda: fmg.reset_model_temporary_tensors(cfg, mc),
            "finalize": lambda: fmg.finalize_model_grads(mc, None, mpgc),
        }
        if pgc.embd is not None:
            msteps["embedding"] = lambda: fmg._allreduce_word_embedding_grads(mc, cfg, pgc.embd, pgc.pp)
        if moe:
            msteps["expert_bias"] = lambda: fmg._update_router_expert_bias(mc, cfg)
        models = {"megatron": msteps, **models}

    out: dict[str, Any] = {
        "layout": dataclasses.asdict(lay),
        "device": device,
        "params": sum(1 for _ in own[0].parameters()),
        "non_tp_tensors": count_non_tp(own[0]),
        "grad_bytes": bufs.nbytes,
        "time": {},
        "collectives": {},
        "bytes_copied": {},
    }
    non_tp_grads = [p.main_grad for p in non_tp_params(dropin[0].module)]
    floors = {"floor": copy_floor(non_tp_grads, pgc.tp), "staging floor": staging_floor(non_tp_grads, pgc.tp)}
    with megatron_tp_dp_cp(pgc.tp_dp_cp) if (fmg is not None and moe) else contextlib.nullcontext():
        for step in STEPS:
            cands = {f"{m}/{step}": fns[step] for m, fns in models.items() if step in fns}
            if step == "non_tp":
                cands.update({f"{name}/non_tp": run for name, run in floors.items()})
            if cands:
                timed = interleaved(cands, rounds=rounds, batch=batch, sync=sync)
                for name, t in timed.items():
                    m, _, s = name.partition("/")
                    out["time"].setdefault(m, {})[s] = t
        for m, fns in models.items():
            model = {"meshgrad buffers": own, "meshgrad drop-in": dropin}.get(m)
            counter = (lambda model=model: execution_stats(model).bytes_copied) if model is not None else None
            out["collectives"][m], out["bytes_copied"][m] = _per_call(fns["finalize"], copied=counter)
    out["time"]["meshgrad buffers"]["dp_sync"] = {
        "median": inside_finalize(own, rounds=rounds, batch=batch, sync=sync).get("dp_sync", 0.0)
    }
    out["ratios"] = ratios(out)
    # Paired per round (same round, same machine phase), then the median.
    for name in floors:
        out["ratios"][f"non_tp drop-in / {name}"] = paired_ratio(out["time"]["meshgrad drop-in"]["non_tp"],
                                                                 out["time"][name]["non_tp"])
    del bufs, own, dropin, mc
    return out


def ratios(result: dict[str, Any]) -> dict[str, float | None]:
    """meshgrad / megatron per step (median times), with meshgrad's buffers."""
    t = result["time"]
    if "megatron" not in t:
        return {}
    out: dict[str, float | None] = {}
    for step in STEPS:
        m = t["megatron"].get(step, {}).get("median")
        g = t["meshgrad buffers"].get(step, {}).get("median")
        d = t["meshgrad drop-in"].get(step, {}).get("median")
        out[f"{step} (buffers)"] = g / m if m and g is not None else None
        out[f"{step} (drop-in)"] = d / m if m and d is not None else None
    return out


def launch_counts(lay: Layout, *, mixed: bool = False, tp_avg: bool = False, tokens: bool = False) -> dict[str, float]:
    """Collectives per finalize call of megatron-core and meshgrad (both paths) on one
    configuration of ``lay``.

    Args:
      lay: the layout (``moe_experts`` adds routers with expert bias).
      mixed: q/k layernorms in bfloat16, the rest float32 (gradients in their dtype).
      tp_avg: one ``average_gradients_across_tp_domain`` parameter per layer.
      tokens: pass num_tokens (broadcast over pp, SUM over dp_cp).
    """
    import torch_impl
    from torch_impl.buffers import attach_grad_buffers

    init_fake(lay.world)
    pgc = fake_groups(lay)

    def chunk() -> nn.Module:
        c = build_chunk(lay, 0)
        for name, p in c.named_parameters():
            if mixed and ("q_layernorm" in name or "k_layernorm" in name):
                p.data = torch.empty(p.shape, dtype=torch.bfloat16, device="meta")
            if tp_avg and name.endswith("pre_mlp_layernorm.bias"):
                p.average_gradients_across_tp_domain = True
        return c

    own = [chunk()]
    attach_grad_buffers(own, pgc, lazy=True, device="cpu")
    dropin = [MiniDDP(chunk(), pgc.dp_cp, dtype=None)]
    n = torch.tensor(8) if tokens else None
    counts: dict[str, float] = {
        "meshgrad buffers": _per_call(lambda: torch_impl.finalize_model_grads(own, num_tokens=n, pg_collection=pgc))[0],
        "meshgrad drop-in": _per_call(lambda: torch_impl.finalize_model_grads(dropin, num_tokens=n, pg_collection=pgc))[0],
    }
    fmg = megatron_finalize_module()
    if fmg is not None:
        mc = [MiniDDP(chunk(), pgc.dp_cp, dtype=None)]
        if pgc.pp is None and (0,) not in _GROUPS:
            _GROUPS[(0,)] = dist.new_group([0])
        mpp = pgc.pp if pgc.pp is not None else _GROUPS[(0,)]
        mpgc = types.SimpleNamespace(tp=pgc.tp, pp=mpp, embd=pgc.embd, pos_embd=None, dp_cp=pgc.dp_cp)
        with megatron_tp_dp_cp(pgc.tp_dp_cp):
            counts["megatron"] = _per_call(lambda: fmg.finalize_model_grads(mc, None if n is None else n.clone(), mpgc))[0]
    return counts
