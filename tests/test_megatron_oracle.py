"""Black-box oracle: megatron-core's ``finalize_model_grads`` module against torch_impl.

In one gloo world per size (4 and 8 ranks), Megatron's ``parallel_state`` is initialized
for a few layouts; for each layout every rank runs, on two builds of one model with
identical inputs, the same call through megatron-core and through :mod:`torch_impl`, with
the same Megatron objects (``TransformerConfig``, ``DistributedDataParallelConfig`` as
``chunk.ddp_config``, the ``ProcessGroupCollection`` of ``use_mpu_process_groups()``, or
no groups at all so both look them up in ``parallel_state``). The tests require identical
gradients, router state and DDP calls, or that both raise (ours as MegatronAssertionError,
an AssertionError too, where Megatron asserts).

megatron-core is used only as a black box: its functions are called, never read. Data are
small integers, so every comparison is bit-exact. Skipped without megatron-core.

One difference is pinned rather than matched: megatron-core 0.16.1 updates the expert bias
of routers in eval mode and of routers flagged ``frozen_expert_bias``; SPEC 2.8 (the newer
API) keeps them (``SPEC_KEEPS``). And where current Megatron-Core asserts but 0.16.1 did not
(``CURRENT_RAISES``), ours raises. ``test_oracle_cases_are_not_vacuous`` checks that every
comparison exercises something (a value changed, or megatron-core raised where it must).
A case whose subject does not depend on the layout (``LAYOUT_FREE``) runs on the first
layout of each world only.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from parity_tests.scenarios import (  # noqa: E402
    POS_EMB,
    WORD_EMB,
    ParamLayout,
    RankData,
    RouterLayout,
    Scenario,
    gpt_params,
    make_rank_inputs,
)
from parity_tests.torch_world import build_model, load_inputs, read_outputs  # noqa: E402
from parity_tests.world_cases import run_cases  # noqa: E402
from parity_tests.megatron_state import fake_ddp, import_megatron_core, initialize_parallel_state  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Layout:
    """A Megatron parallel layout (rank order tp-cp-ep-dp-pp) and its embedding stages."""

    name: str
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int = 1
    embd: tuple[int, ...] | None = None  # pp stages of the embedding group (None: first, last)
    pos: tuple[int, ...] | None = None  # pp stages of the position-embedding group (None: first)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp


LAYOUTS: dict[int, tuple[Layout, ...]] = {
    4: (Layout("tp2pp2-pos01", tp=2, pp=2, pos=(0, 1)), Layout("dp2tp2-ep2", dp=2, tp=2, ep=2)),
    8: (
        Layout("pp2dp2tp2", pp=2, dp=2, tp=2),
        Layout("pp2tp2cp2-pos01", pp=2, tp=2, cp=2, pos=(0, 1)),
        Layout("pp4tp2-embd023-pos013", pp=4, tp=2, embd=(0, 2, 3), pos=(0, 1, 3)),
        Layout("dp2cp2tp2-ep4", dp=2, cp=2, tp=2, ep=4),
    ),
}

#: Equal-sized routers (megatron-core stacks the token counts of all routers).
ROUTERS = (
    RouterLayout("decoder.layers.0.mlp.router", 4),
    RouterLayout("decoder.layers.1.mlp.router", 4),
)
ALL_ON = dict(sequence_parallel=True, qk_layernorm=True, has_cond_embedder=True)
BIAS = dict(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.25, num_moe_experts=4)


# =========================================================================== worker side


def _mf() -> Any:
    """megatron-core's finalize_model_grads module (its package re-exports the function
    under the module's name)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.distributed  # noqa: F401
    return sys.modules["megatron.core.distributed.finalize_model_grads"]


def _transformer_config(layout: Layout, fields: dict[str, Any]) -> Any:
    """Megatron's own TransformerConfig; fields set after construction (its __post_init__
    validates model options that finalization does not read)."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2)
    sizes = dict(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        pipeline_dtype=torch.float32,
    )
    for name, value in {**sizes, **fields}.items():
        setattr(config, name, value)
    return config


def _ddp_config(fields: dict[str, Any]) -> Any:
    from megatron.core.distributed import DistributedDataParallelConfig

    config = DistributedDataParallelConfig()
    for name, value in fields.items():
        setattr(config, name, value)
    return config


class _Env:
    """One rank's state for one layout: Megatron's groups and a few DeviceMeshes."""

    def __init__(self, layout: Layout, rank: int) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.process_groups_config import ProcessGroupCollection

        self.layout, self.rank, self.ps = layout, rank, ps
        initialize_parallel_state(ps, layout)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.pgc = ProcessGroupCollection.use_mpu_process_groups()
        self.stage = rank // (layout.world // layout.pp)

    def close(self) -> None:
        self.ps.destroy_model_parallel()

    def scenario(self, **kw: Any) -> Scenario:
        lay = self.layout
        base = dict(pp=lay.pp, dp=lay.dp, cp=lay.cp, tp=lay.tp, ep=lay.ep, etp=lay.etp, params=gpt_params(experts=True))
        base.update(kw)
        return Scenario(lay.name, **base)


def _side(call: Callable[[], Any]) -> tuple[Any, ...]:
    try:
        return ("ok", call())
    except Exception as err:  # compared in the parent
        return ("error", type(err).__name__, str(err)[:400])


def _pair(
    env: _Env,
    call: Callable[[Any, list[Any], Any], Any],
    *,
    config: dict[str, Any] | None = None,
    ddp: dict[str, Any] | None = None,
    wrap: str = "none",
    scenario: dict[str, Any] | None = None,
    prepare: Callable[[list[Any], Any], None] | None = None,
) -> dict[str, Any]:
    """Run ``call(impl, model, cfg)`` with megatron-core and with torch_impl on two builds
    of one model.

    Args:
      env: the layout's groups.
      call: the call; ``impl`` is megatron's module or ``torch_impl``.
      config: TransformerConfig fields.
      ddp: DistributedDataParallelConfig fields (set as ``ddp_config`` on every chunk).
      wrap: "none", "module" (a ``.module`` wrapper) or "ddp" (a :func:`~parity_tests.megatron_state.fake_ddp` chunk).
      scenario: Scenario overrides (dtype, params, routers, num_chunks, ...).
      prepare: called on each copy after its inputs are loaded (e.g. DTensor gradients).

    Returns:
      {"megatron": side, "ours": side}; a side is ("ok", (RankData, extra)) or
      ("error", type name, message).
    """
    import torch.distributed as dist

    import torch_impl

    scen = env.scenario(**(scenario or {}))
    cfg = _transformer_config(env.layout, dict(config or {}))
    ddp_cfg = _ddp_config(dict(ddp or {}))
    base = build_model(scen, env.rank, cfg)
    data = make_rank_inputs(scen, env.rank)
    out: dict[str, Any] = {}
    for side, impl in (("megatron", _mf()), ("ours", torch_impl)):
        # megatron-core gets a second build of the same chunks (cheaper than a deep copy);
        # torch_impl, last, the first
        inner = build_model(scen, env.rank, cfg) if side == "megatron" else base
        for chunk in inner:
            chunk.config = cfg  # one config object, as Megatron shares it
            if wrap != "ddp":
                chunk.ddp_config = ddp_cfg
        load_inputs(inner, scen, data)
        if prepare is not None:
            prepare(inner, env)
        if wrap == "ddp":
            model = [fake_ddp(c, ddp_cfg, env.pgc.dp_cp, env.pgc.expt_dp) for c in inner]
        elif wrap == "module":
            model = [_Wrapper(c, ddp_cfg) for c in inner]
        else:
            model = inner
        result = _side(lambda: call(impl, model, cfg))
        dist.barrier()
        if result[0] == "ok":
            calls = [list(getattr(m, "calls", [])) for m in model]
            kinds = _localize(inner)
            result = ("ok", (read_outputs(inner, scen, data), {"calls": calls, "value": result[1], "dtensors": kinds}))
        out[side] = result
    out["inputs"] = data
    return out


def _localize(model: list[Any]) -> dict[str, Any]:
    """Replace DTensor gradients by their local shards (for reading); return, per such
    gradient, its placements and the attribute set on it."""
    out = {}
    for index, chunk in enumerate(model):
        for name, p in chunk.named_parameters():
            g = getattr(p, "main_grad", None)
            if g is not None and hasattr(g, "to_local"):
                out[f"{index}/{name}"] = ([str(x) for x in g.placements], getattr(g, "tag", None))
                p.main_grad = g.to_local()
    return out


def _Wrapper(module: Any, ddp_config: Any) -> Any:
    """A ``.module`` wrapper holding the DDP config but not the model config (which is
    found along the ``.module`` chain), like Megatron's DDP(Float16Module(model))."""
    from torch import nn

    class WrapperLike(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = module
            self.ddp_config = ddp_config

    return WrapperLike()


def _frozen(name: str) -> tuple[ParamLayout, ...]:
    return tuple(dataclasses.replace(p, requires_grad=False) if p.name == name else p for p in gpt_params(experts=True))


def _dtensor_grads(model: list[Any], env: _Env, only_sequence_parallel: bool = True) -> None:
    """Turn (sequence-parallel) gradients into DTensors over the tp mesh (Shard(0), or
    Replicate when the first dim does not split), with an attribute set on them."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = _mesh(env)["tp"]
    for chunk in model:
        for _, p in chunk.named_parameters():
            if (getattr(p, "sequence_parallel", False) or not only_sequence_parallel) and hasattr(p, "main_grad"):
                whole = p.main_grad
                placement = Shard(0) if whole.shape[0] % env.layout.tp == 0 else Replicate()
                d = distribute_tensor(whole, mesh, [placement], src_data_rank=None)
                d.tag = "kept"
                p.main_grad = d


_MESHES: dict[Any, Any] = {}


def _mesh(env: _Env) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    lay = env.layout
    key = (lay.pp, lay.dp, lay.cp, lay.tp)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", key, mesh_dim_names=("pp", "dp", "cp", "tp"))
    return _MESHES[key]


def _dtensor_helpers(impl: Any, model: list[Any], cfg: Any, env: _Env) -> dict[str, Any]:
    """_unshard_if_dtensor / _reshard_if_dtensor on a DTensor and a plain tensor."""
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _mesh(env)["tp"]
    local = torch.arange(8.0).reshape(4, 2) + 100 * env.rank
    ref = distribute_tensor(torch.zeros(4 * env.layout.tp, 2), mesh, [Shard(0)])
    ref.to_local().copy_(local)
    ref.tag = "kept"
    whole = impl._unshard_if_dtensor(ref)
    again = impl._reshard_if_dtensor(whole * 2, ref)
    plain = torch.ones(3)
    return {
        "whole": whole.tolist(),
        "again": again.to_local().tolist(),
        "placements": [str(p) for p in again.placements],
        "mesh": again.device_mesh.mesh.tolist(),
        "tag": getattr(again, "tag", None),
        "plain_unshard_is_same": impl._unshard_if_dtensor(plain) is plain,
        "plain_reshard_is_ref": impl._reshard_if_dtensor(torch.zeros(3), plain) is plain,
    }


def _getters(impl: Any, model: list[Any], cfg: Any) -> dict[str, Any]:
    """The pure helpers: returned parameters by name."""
    import torch

    module = model[0]
    names = {id(p): n for n, p in module.named_parameters()}
    p = torch.nn.Parameter(torch.zeros(1))
    q = torch.nn.Parameter(torch.zeros(1))
    q.main_grad = torch.zeros(1)
    word = impl._get_shared_word_embedding_weight(module, cfg)
    return {
        "main_grad_attr": (impl._get_main_grad_attr(p), impl._get_main_grad_attr(q)),
        "word": None if word is None else names.get(id(word)),
        "pos": names.get(id(impl._get_position_embedding_weight(module))),
    }


def _pos_groups(env: _Env) -> tuple[Any, Any]:
    return env.pgc.pos_embd, env.pgc.pp


#: Cases whose subject does not depend on the layout (a local reset, the ``.module``
#: wrapper): run on the first layout of each world only. The same calls without the wrapper
#: run on every layout.
LAYOUT_FREE = frozenset({"reset", "reset-aux-only", "reset-off", "nontp-wrapped", "word-wrapped"})


def subcases(layout: Layout) -> dict[str, Callable[[_Env], dict[str, Any]]]:
    """Every comparison run on ``layout``, by name (the same on every rank)."""
    import torch

    cases: dict[str, Callable[[_Env], dict[str, Any]]] = {}
    first = layout == LAYOUTS[layout.world][0]

    def add(name: str, call: Callable[..., Any], **kw: Any) -> None:
        if first or name not in LAYOUT_FREE:
            cases[name] = lambda env: _pair(env, lambda impl, model, cfg: call(impl, model, cfg, env), **kw)

    # ---- pure helpers
    add("getters", lambda impl, m, cfg, env: _getters(impl, m, cfg))
    add("getters-mtp-untied", lambda impl, m, cfg, env: _getters(impl, m, cfg), config=dict(mtp_num_layers=1))
    add("dtensor-helpers", lambda impl, m, cfg, env: _dtensor_helpers(impl, m, cfg, env))
    # ---- 2.4 non-tensor-parallel grads
    nontp = lambda impl, m, cfg, env: impl._allreduce_non_tensor_model_parallel_grads(m, cfg, env.pgc.tp)  # noqa: E731
    add("nontp", nontp, config=ALL_ON)
    add("nontp-seqpar-only", nontp, config=dict(sequence_parallel=True))
    add("nontp-none", nontp, config={})
    add("nontp-bf16", nontp, config=ALL_ON, scenario=dict(dtype="bfloat16"))
    add("nontp-fp16-grad", nontp, config=ALL_ON, scenario=dict(dtype="float16", grad_attr="grad"))
    add("nontp-wrapped", nontp, config=ALL_ON, wrap="module")
    add("nontp-lookup", lambda impl, m, cfg, env: impl._allreduce_non_tensor_model_parallel_grads(m, cfg), config=ALL_ON)
    add("layernorm-alias", lambda impl, m, cfg, env: impl._allreduce_layernorm_grads(m, cfg, env.pgc.tp), config=ALL_ON)
    add("nontp-dtensor", nontp, config=ALL_ON, prepare=_dtensor_grads)
    # Megatron-FSDP: every gradient is a DTensor; the local shards are reduced.
    add("nontp-dtensor-fsdp", nontp, config=ALL_ON, ddp=dict(use_megatron_fsdp=True),
        prepare=lambda m, env: _dtensor_grads(m, env, only_sequence_parallel=False))
    add("nontp-dtensor-all", nontp, config=ALL_ON, prepare=lambda m, env: _dtensor_grads(m, env, False))
    # ---- 2.2 conditional embedder
    cond = lambda impl, m, cfg, env: impl._allreduce_conditional_embedding_grads(m, cfg, env.pgc.pp)  # noqa: E731
    add("cond", cond, config=dict(has_cond_embedder=True), scenario=dict(num_chunks=2))
    add("cond-off", cond, config={}, scenario=dict(num_chunks=2))
    add("cond-lookup", lambda impl, m, cfg, env: impl._allreduce_conditional_embedding_grads(m, cfg),
        config=dict(has_cond_embedder=True), scenario=dict(num_chunks=2))
    # ---- 2.6 / 2.7 embeddings
    word = lambda impl, m, cfg, env: impl._allreduce_word_embedding_grads(m, cfg, env.pgc.embd, env.pgc.pp)  # noqa: E731
    add("word", word, scenario=dict(num_chunks=2))
    add("word-lookup", lambda impl, m, cfg, env: impl._allreduce_word_embedding_grads(m, cfg), scenario=dict(num_chunks=2))
    add("word-untied", word, scenario=dict(config=dict(share_embeddings_and_output_weights=False)))
    add("word-untied-mtp", word, config=dict(mtp_num_layers=1), scenario=dict(num_chunks=2, config=dict(share_embeddings_and_output_weights=False)))
    add("word-mtp", word, config=dict(mtp_num_layers=1), scenario=dict(num_chunks=2))
    add("word-frozen", word, scenario=dict(params=_frozen(WORD_EMB)))
    add("word-wrapped", word, wrap="module", scenario=dict(num_chunks=2))
    add("word-bf16", word, scenario=dict(dtype="bfloat16"))
    pos = lambda impl, m, cfg, env: impl._allreduce_position_embedding_grads(m, cfg, *_pos_groups(env))  # noqa: E731
    add("pos", pos, scenario=dict(num_chunks=2))
    add("pos-frozen", pos, scenario=dict(params=_frozen(POS_EMB)))
    add("pos-mtp", pos, config=dict(mtp_num_layers=1), scenario=dict(num_chunks=2))
    add("embedding-getter", lambda impl, m, cfg, env: impl._allreduce_embedding_grad(
        m, env.pgc.embd, env.pgc.pp, lambda mod: mod.get_parameter("decoder.final_layernorm.weight"), config=cfg))
    add("embedding-getter-mtp", lambda impl, m, cfg, env: impl._allreduce_embedding_grad(
        m, env.pgc.embd, env.pgc.pp, lambda mod: mod.get_parameter("decoder.final_layernorm.weight"), config=cfg),
        config=dict(mtp_num_layers=1), scenario=dict(num_chunks=2))
    add("embedding-getter-pos-mtp", lambda impl, m, cfg, env: impl._allreduce_embedding_grad(
        m, env.pgc.pos_embd, env.pgc.pp, lambda mod: mod.get_parameter("decoder.final_layernorm.weight"),
        skip_if_none=False, config=cfg), config=dict(mtp_num_layers=1), scenario=dict(num_chunks=2))
    # ---- 2.8 / 2.10 routers
    bias = lambda impl, m, cfg, env: impl._update_router_expert_bias(m, cfg)  # noqa: E731
    add("expert-bias", bias, config=BIAS, scenario=dict(routers=ROUTERS))
    add("expert-bias-off", bias, config={}, scenario=dict(routers=ROUTERS))
    add("expert-bias-eval-frozen", bias, config=BIAS, scenario=dict(routers=(
        RouterLayout("decoder.layers.0.mlp.router", 4),
        RouterLayout("decoder.layers.1.mlp.router", 4, training=False),
        RouterLayout("decoder.layers.2.mlp.router", 4, frozen_expert_bias=True),
    )))
    reset = lambda impl, m, cfg, env: impl.reset_model_temporary_tensors(cfg, m)  # noqa: E731
    add("reset", reset, config=dict(BIAS, moe_router_load_balancing_type="global_aux_loss"), scenario=dict(routers=ROUTERS))
    add("reset-aux-only", reset, config=dict(moe_router_load_balancing_type="global_aux_loss"), scenario=dict(routers=ROUTERS))
    add("reset-off", reset, config={}, scenario=dict(routers=ROUTERS))
    # ---- finalize_model_grads with DDP-like chunks
    def fin(pgc: str = "pgc", tokens: bool = False, force: bool = False) -> Callable[..., Any]:
        def call(impl: Any, m: list[Any], cfg: Any, env: _Env) -> Any:
            groups = env.pgc if pgc == "pgc" else None
            n = torch.tensor(4 if env.stage == env.layout.pp - 1 else 7) if tokens else None
            return impl.finalize_model_grads(m, num_tokens=n, pg_collection=groups, force_all_reduce=force)
        return call

    everything = dict(ALL_ON, **BIAS, moe_router_load_balancing_type="global_aux_loss")
    two = dict(num_chunks=2, routers=ROUTERS)
    add("finalize", fin(), config=everything, wrap="ddp", scenario=two)
    add("finalize-lookup", fin("none"), config=everything, wrap="ddp", scenario=two)
    add("finalize-bias-off", fin(), config=dict(ALL_ON, moe_router_load_balancing_type="global_aux_loss"),
        wrap="ddp", scenario=two)
    add("finalize-tokens", fin(tokens=True), config=dict(everything, calculate_per_token_loss=True), wrap="ddp", scenario=two)
    add("finalize-force", fin(force=True), config=ALL_ON, ddp=dict(use_distributed_optimizer=True), wrap="ddp")
    add("finalize-avgcoll", fin(), config=ALL_ON, ddp=dict(average_in_collective=True), wrap="ddp")
    add("finalize-bf16", fin(tokens=True), config=dict(ALL_ON, calculate_per_token_loss=True), wrap="ddp",
        scenario=dict(dtype="bfloat16", num_chunks=2))
    add("finalize-fp16", fin(), config=ALL_ON, wrap="ddp", scenario=dict(dtype="float16"))
    add("finalize-mtp", fin(), config=dict(ALL_ON, mtp_num_layers=1), wrap="ddp", scenario=dict(num_chunks=2))
    add("finalize-untied", fin(), config=ALL_ON, wrap="ddp", scenario=dict(config=dict(share_embeddings_and_output_weights=False)))
    add("finalize-dtensor", fin(), config=ALL_ON, wrap="ddp", prepare=_dtensor_grads)
    # ---- errors: both must raise (ours: not AssertionError)
    if layout.pos is None or len(layout.pos) == layout.pp:
        # Only where every rank is a member: elsewhere only members can tell (see the README).
        add("finalize-pos-frozen", fin(), config=ALL_ON, wrap="ddp", scenario=dict(params=_frozen(POS_EMB)))
    if layout == LAYOUTS[4][0]:
        # Megatron asserts hasattr(pg_collection, ...) first and ours checks the same fields
        # first (tests/test_torch_finalize_local.py), whatever the layout: one layout suffices.
        for missing in ("tp", "pp", "embd", "pos_embd", "dp_cp"):
            add(f"finalize-pgc-without-{missing}", _without(missing), config=ALL_ON, wrap="ddp")
    # ---- groups megatron-core does not take from the collection: both work without them
    add("finalize-pgc-without-tp_dp_cp", _without("tp_dp_cp"), config=everything, wrap="ddp", scenario=two)
    add("finalize-pgc-without-expt_dp", _without("expt_dp"), config=everything, wrap="ddp", scenario=two)
    return cases


def _without(field: str) -> Callable[..., Any]:
    def call(impl: Any, m: list[Any], cfg: Any, env: _Env) -> Any:
        from megatron.core.process_groups_config import ProcessGroupCollection

        pgc = ProcessGroupCollection()
        for f in dataclasses.fields(ProcessGroupCollection):
            if f.name != field and hasattr(env.pgc, f.name):
                setattr(pgc, f.name, getattr(env.pgc, f.name))
        return impl.finalize_model_grads(m, pg_collection=pgc)

    return call


def _run_world(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for layout in LAYOUTS[world]:
        env = _Env(layout, rank)
        try:
            for name, case in subcases(layout).items():
                out[f"{layout.name}/{name}"] = case(env)
        finally:
            env.close()
    return out


def case_world(rank: int, world: int) -> dict[str, Any]:
    return _run_world(rank, world)


# =========================================================================== tests (parent)

#: Calls that change nothing, by design (the others must change some value somewhere).
NO_EFFECT = {"getters", "getters-mtp-untied", "dtensor-helpers", "cond-off", "word-untied", "word-frozen", "reset-off"}
#: Calls on which megatron-core must raise on some layout (ours must raise too).
#: Where current Megatron-Core (the 0.19 API, tests/test_megatron019_oracle.py) asserts and
#: 0.16.1 did not: 0.16.1 took tp_dp_cp from parallel_state when the collection lacked it.
CURRENT_RAISES = {"finalize-pgc-without-tp_dp_cp"}
MUST_RAISE = {"pos-frozen", "finalize-pos-frozen"} | {f"finalize-pgc-without-{g}" for g in ("tp", "pp", "embd", "pos_embd", "dp_cp")}
#: Routers of "expert-bias-eval-frozen" that megatron-core 0.16.1 updates and SPEC 2.8
#: does not: one in eval mode, one flagged frozen_expert_bias (newer Megatron semantics).
SPEC_KEEPS = {(0, "decoder.layers.1.mlp.router"), (0, "decoder.layers.2.mlp.router")}


def _names(world: int) -> list[str]:
    return [f"{layout.name}/{name}" for layout in LAYOUTS[world] for name in subcases(layout)]


_WORLDS: dict[int, Any] = {}


def _world(world: int) -> list[dict[str, Any]]:
    if world not in _WORLDS:
        got = run_cases(__name__, ["case_world"], world, timeout=400, prepare=import_megatron_core)["case_world"]
        problems = [f"rank {r}: {s}: {v}" for r, (s, v) in enumerate(got) if s != "ok"]
        _WORLDS[world] = problems or [v for _, v in got]
    result = _WORLDS[world]
    if result and isinstance(result[0], str):
        pytest.fail("\n".join(result))
    return result


def _diff(a: RankData, b: RankData, skip_routers: frozenset = frozenset()) -> list[str]:
    """Every gradient / router field that differs (bit for bit) between ``a`` and ``b``."""
    diffs = []
    for key, x in a.grads.items():
        y = b.grads[key]
        if (x is None) != (y is None) or (x is not None and not np.array_equal(x, y)):
            diffs.append(f"grad {key}: megatron {x} ours {y}")
    for key, s in a.routers.items():
        if key in skip_routers:
            continue
        t = b.routers[key]
        for field in ("local_tokens_per_expert", "expert_bias", "qb_beta", "qb_beta_accum", "qb_beta_count"):
            if not np.array_equal(getattr(s, field), getattr(t, field)):
                diffs.append(f"router {key}.{field}: megatron {getattr(s, field)} ours {getattr(t, field)}")
        if s.aux_loss_resets != t.aux_loss_resets:
            diffs.append(f"router {key}: aux-loss resets megatron {s.aux_loss_resets} ours {t.aux_loss_resets}")
    return diffs


def _compare(name: str, per_rank: list[dict[str, Any]]) -> None:
    """Both raise (ours not AssertionError) or both return identical state and calls."""
    known = name.endswith("/expert-bias-eval-frozen")
    problems = []
    for rank, pair in enumerate(per_rank):
        meg, ours = pair["megatron"], pair["ours"]
        if meg[0] == "error":
            if ours[0] != "error":
                problems.append(f"rank {rank}: megatron raised {meg[1]}: {meg[2]}; ours did not")
            elif ours[1] == "AssertionError":
                problems.append(f"rank {rank}: ours raised AssertionError: {ours[2]}")
            continue
        if ours[0] != "ok":
            if name.split("/")[-1] in CURRENT_RAISES and ours[1] == "MegatronAssertionError":
                continue
            problems.append(f"rank {rank}: ours raised {ours[1]}: {ours[2]}; megatron did not")
            continue
        (m_data, m_extra), (o_data, o_extra) = meg[1], ours[1]
        problems += [f"rank {rank}: {d}" for d in _diff(m_data, o_data, SPEC_KEEPS if known else frozenset())]
        if known:  # ours keeps the eval / frozen routers' bias (SPEC 2.8); 0.16.1 updates it
            kept = [d for d in _diff(pair["inputs"], o_data) if any(f"router {k}" in d for k in SPEC_KEEPS)]
            problems += [f"rank {rank}: ours changed {d}" for d in kept]
        if m_extra != o_extra:
            problems.append(f"rank {rank}: calls/values differ: megatron {m_extra} ours {o_extra}")
    assert not problems, "\n".join(problems[:30])


@pytest.mark.parametrize("name", _names(4))
def test_oracle_world4(name: str) -> None:
    _compare(name, [r[name] for r in _world(4)])


@pytest.mark.parametrize("name", _names(8))
def test_oracle_world8(name: str) -> None:
    _compare(name, [r[name] for r in _world(8)])


def test_layout_free_cases_run_on_the_first_layout_of_each_world_only() -> None:
    for layouts in LAYOUTS.values():
        assert LAYOUT_FREE <= set(subcases(layouts[0]))
        assert all(not LAYOUT_FREE & set(subcases(layout)) for layout in layouts[1:])


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_oracle_cases_are_not_vacuous(world: int) -> None:
    """Each comparison exercises something: megatron-core changed a value (on some rank of
    some layout), or raised where it must; the eval / frozen routers really differ."""
    results = _world(world)
    effect: dict[str, bool] = {}
    raised: dict[str, bool] = {}
    for layout in LAYOUTS[world]:
        for name in subcases(layout):
            for r in results:
                pair = r[f"{layout.name}/{name}"]
                meg = pair["megatron"]
                raised[name] = raised.get(name, False) or meg[0] == "error"
                changed = meg[0] == "ok" and (bool(_diff(pair["inputs"], meg[1][0])) or meg[1][1]["value"] is not None)
                effect[name] = effect.get(name, False) or changed
    assert sorted(n for n in MUST_RAISE if n in raised and not raised[n]) == []
    idle = sorted(n for n in effect if not effect[n] and n not in NO_EFFECT and n not in MUST_RAISE)
    assert idle == [], f"comparisons where megatron-core changed nothing: {idle}"
    assert sorted(n for n in NO_EFFECT if effect.get(n) and n not in ("getters", "getters-mtp-untied", "dtensor-helpers")) == []
    differs = False
    for layout in LAYOUTS[world]:
        for r in results:
            pair = r[f"{layout.name}/expert-bias-eval-frozen"]
            differs = differs or any("router" in d for d in _diff(pair["megatron"][1][0], pair["ours"][1][0]))
    assert differs, "megatron-core now keeps eval / frozen routers' bias: drop SPEC_KEEPS"
