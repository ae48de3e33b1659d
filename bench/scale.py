"""MoE scale rows: how a finalize step grows with the parameter count, meshgrad against
megatron-core, every row and model timed in one interleaved run (fake backend).

Rows are ``layers x experts`` of :class:`bench.models.MoEStack` (GPT layers reduced to
two SP layernorms and an MoE block: a router and ``experts`` local experts of two
``allreduce=False`` weights each; pp = 1, TP=8 DP=2, every expert local so expert DP =
DP). The number of collectives is the same in every row; only the parameters no step
touches (the experts) grow. Models per row:

* ``megatron``: megatron-core's finalize on :class:`bench.ddp.MiniDDP` chunks whose
  ``finish_grad_sync`` is a no-op (no DP group: the DDP's sync is not what is measured).
* ``DDP chunks``: meshgrad on the same kind of chunks (it copies the non-TP grads).
* ``buffers``: meshgrad on plain chunks after ``attach_grad_buffers`` (meshgrad's DP sync,
  in place).
* ``user grads``: meshgrad on plain chunks whose ``main_grad`` is one tensor per
  parameter (meshgrad's DP sync stages every gradient: per-step work proportional to
  the parameters is inherent there).

Per model: the first ``finalize_model_grads`` call (plan, checks, binding; for the DDP
chunks and megatron-core also the Python functions one more fresh model's first call
enters, counted, not timed: exact whatever the machine's load) and the steady-state step, as ratios to megatron-core and to the same model at the reference row
(32 x 8, 673 parameters). The DDP chunks' rows also time their **copy floor** in the
same run: the non-TP gradients staged into one buffer and back (``_foreach_copy_``) around
one collective, which any drop-in step pays; the router weights (experts x hidden each)
make its bytes grow with the experts.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import statistics
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from bench.counting import megatron_finalize_module
from bench.cpu_parts import functions_entered
from bench.ddp import MiniDDP
from bench.goals import goal
from bench.fake import _GROUPS, _per_call, copy_floor, fake_groups, init_fake
from bench.models import Layout, build_moe_stack, count_non_tp, non_tp_params
from bench.timing import interleaved, paired_ratio, rotated

ROWS: tuple[tuple[int, int], ...] = ((8, 8), (32, 8), (32, 64), (64, 128))
REFERENCE = (32, 8)  # the growth ratios' denominator (673 parameters)
HIDDEN = 32  # tiny tensors: the rows measure per-tensor work, not bandwidth
MODELS = ("DDP chunks", "buffers", "user grads")
LABELS = types.MappingProxyType({
    "DDP chunks": "Megatron-DDP chunks (finish_grad_sync a no-op on both sides)",
    "buffers": "plain chunks, meshgrad's buffers (attach_grad_buffers; meshgrad's DP sync)",
    "user grads": "plain chunks, user-owned main_grad per parameter (meshgrad's DP sync, staged)",
})


def row_name(layers: int, experts: int) -> str:
    return f"{layers}x{experts}"


def parse_rows(names: Sequence[str]) -> list[tuple[int, int]]:
    """``["8x8", "64x128"]`` -> ``[(8, 8), (64, 128)]``."""
    out = []
    for name in names:
        layers, _, experts = name.partition("x")
        out.append((int(layers), int(experts)))
    return out


def scale_layout(layers: int, experts: int) -> Layout:
    return Layout(f"moe-{row_name(layers, experts)}", layers, HIDDEN, tp=8, pp=1, dp=2, vocab=1024, moe_experts=experts)


def _groups(lay: Layout) -> types.SimpleNamespace:
    pgc = fake_groups(lay)
    pgc.expt_dp = pgc.dp_cp  # expert parallelism 1: the expert-DP group is the DP group
    return pgc


def _megatron_groups(pgc: types.SimpleNamespace) -> types.SimpleNamespace:
    # megatron-core needs a pipeline group object even for PP = 1 (it calls .size()).
    if (0,) not in _GROUPS:
        _GROUPS[(0,)] = dist.new_group([0])
    return types.SimpleNamespace(tp=pgc.tp, pp=_GROUPS[(0,)], embd=pgc.embd, pos_embd=None, dp_cp=pgc.dp_cp)


def _user_grads(chunk: torch.nn.Module) -> None:
    for p in chunk.parameters():
        p.main_grad = torch.empty(p.shape, dtype=p.dtype, device="cpu")


def _timed_first(fn: Callable[[], object]) -> float:
    gc.collect()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@dataclasses.dataclass
class _Row:
    """One row's models and their finalize calls."""

    lay: Layout
    pgc: Any
    models: dict[str, list[Any]]
    steps: dict[str, Callable[[], object]]
    first: dict[str, list[float]]
    keep: dict[str, Any]
    attach: float | None = None
    first_functions: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)


def _build_row(layers: int, experts: int, fmg: Any, repeats: int) -> _Row:
    """Builds every model of a row and times each one's first finalize call: ``repeats``
    rounds, each building one fresh model of every kind (megatron-core's too) in a rotating
    order, so a first call and megatron-core's are timed next to each other whatever the
    machine's load does meanwhile; the last model of each kind is kept for the steady
    state. Then one more fresh model of the DDP chunks and of megatron-core each has its
    first call's Python functions counted (:func:`bench.cpu_parts.functions_entered`)."""
    import torch_impl
    from torch_impl.buffers import attach_grad_buffers

    lay = scale_layout(layers, experts)
    pgc = _groups(lay)
    mpgc = _megatron_groups(pgc) if fmg is not None else None
    first: dict[str, list[float]] = {}
    models: dict[str, list[Any]] = {}
    steps: dict[str, Callable[[], object]] = {}
    attach: list[float] = []
    keep: dict[str, Any] = {}  # the GradBuffers of the kept model

    def make(kind: str) -> list[Any]:
        chunk = build_moe_stack(lay)
        if kind in ("megatron", "DDP chunks"):
            return [MiniDDP(chunk, None)]
        if kind == "user grads":
            _user_grads(chunk)
        return [chunk]

    def finalize(kind: str, model: list[Any]) -> Callable[[], object]:
        if kind == "megatron":
            return lambda: fmg.finalize_model_grads(model, None, mpgc)
        return lambda: torch_impl.finalize_model_grads(model, pg_collection=pgc)

    kinds = [*MODELS, "megatron"] if fmg is not None else list(MODELS)
    for repeat in range(repeats):
        for kind in rotated(kinds, repeat):
            model = make(kind)
            if kind == "buffers":
                start = time.perf_counter()
                keep[kind] = attach_grad_buffers(model, pgc, lazy=True, device="cpu")
                attach.append(time.perf_counter() - start)
            fn = finalize(kind, model)
            first.setdefault(kind, []).append(_timed_first(fn))
            models[kind], steps[kind] = model, fn
    steps["floor"] = copy_floor([p.main_grad for p in non_tp_params(models["DDP chunks"][0].module)], pgc.tp)
    # What a first call runs, counted (not timed) on one more fresh model: exact, whatever the load.
    counted = {kind: functions_entered(finalize(kind, make(kind))) for kind in ("DDP chunks", "megatron") if kind in kinds}
    gc.collect()  # those models now, not inside the timed rounds
    return _Row(lay, pgc, models, steps, first, keep, statistics.median(attach) if attach else None, counted)


def measure_scale(
    rows: Sequence[tuple[int, int]] = ROWS,
    *,
    rounds: int = 9,
    target_s: float = 0.01,
    repeats: int = 1,
    with_megatron: bool = True,
) -> dict[str, Any]:
    """First call and steady-state step of every model of every row, all steady states
    timed in one interleaved run (each candidate batched to about ``target_s`` a round).

    Returns:
      A JSON-able dict: per row, params, non-TP grads, first-call and step seconds per
      model, collectives / bytes copied per call, ratios to megatron-core and growth
      ratios to the reference row.
    """
    from torch_impl.finalize import execution_stats

    init_fake(16)
    fmg = megatron_finalize_module() if with_megatron else None
    built = [_build_row(layers, experts, fmg, repeats) for layers, experts in rows]
    cands: dict[str, Callable[[], object]] = {}
    for row in built:
        for kind, fn in row.steps.items():
            cands[f"{row.lay.name}/{kind}"] = fn
    estimate: dict[str, int] = {}
    for name, fn in cands.items():
        for _ in range(2):
            fn()
        start = time.perf_counter()
        fn()
        per_call = max(time.perf_counter() - start, 1e-6)
        estimate[name] = max(1, min(50, math.ceil(target_s / per_call)))
    timed = interleaved(cands, rounds=rounds, batch=estimate, warmup=0)
    out_rows = []
    for row in built:
        chunk = row.models["DDP chunks"][0].module
        res: dict[str, Any] = {
            "row": row_name(row.lay.layers, row.lay.moe_experts),
            "layout": dataclasses.asdict(row.lay),
            "params": sum(1 for _ in chunk.parameters()),
            "non_tp_tensors": count_non_tp(chunk),
            "first_call": {k: statistics.median(v) for k, v in row.first.items()},
            "first_call_samples": dict(row.first),  # seconds, one per round and kind
            # each round's DDP-chunk first call / megatron-core's of the same round, their median
            "first_call_vs_megatron": paired_ratio({"samples": row.first["DDP chunks"]},
                                                   {"samples": row.first.get("megatron")}),
            "attach_grad_buffers": row.attach,
            # Python functions one first call enters: (distinct, calls), per kind
            "first_call_functions": dict(row.first_functions),
            "step": {k: timed[f"{row.lay.name}/{k}"] for k in row.steps},
            "batch": {k: estimate[f"{row.lay.name}/{k}"] for k in row.steps},
            "collectives": {},
            "bytes_copied": {},
        }
        for kind, fn in row.steps.items():
            if kind == "floor":
                continue
            model = row.models[kind]
            counter = (lambda model=model: execution_stats(model).bytes_copied) if kind != "megatron" else None
            res["collectives"][kind], res["bytes_copied"][kind] = _per_call(fn, calls=2, copied=counter)
        out_rows.append(res)
    _ratios(out_rows)
    del built
    gc.collect()
    return {"hidden": HIDDEN, "reference_row": row_name(*REFERENCE), "rows": out_rows}


def _ratios(rows: list[dict[str, Any]]) -> None:
    """Ratios to megatron-core and to the reference row, paired per round (one run)."""
    ref = next((r for r in rows if r["row"] == row_name(*REFERENCE)), None)
    for r in rows:
        mc = r["step"].get("megatron")
        r["vs_megatron"] = {k: (paired_ratio(r["step"][k], mc) if mc else None) for k in MODELS}
        r["vs_reference"] = {k: (paired_ratio(r["step"][k], ref["step"][k]) if ref else None) for k in (*MODELS, "floor")}
        r["vs_floor"] = paired_ratio(r["step"]["DDP chunks"], r["step"]["floor"])
    if ref is not None:
        for r in rows:
            dp = r["params"] - ref["params"]
            r["us_per_param_over_reference"] = {
                k: (1e6 * (r["step"][k]["median"] - ref["step"][k]["median"]) / dp if dp else None)
                for k in (*MODELS, "megatron") if k in r["step"]
            }


def format_scale(result: dict[str, Any]) -> str:
    """The rows as one table per meshgrad model, megatron-core side by side."""
    rows = result["rows"]
    have_mc = any("megatron" in r["step"] for r in rows)
    ref = result["reference_row"]
    lines = []
    if not have_mc:
        lines.append("  (megatron-core not installed or --no-megatron: its column is skipped)")
    for kind in MODELS:
        lines.append(f"  meshgrad on {LABELS[kind]}")
        columns = _columns(kind, ref, have_mc)
        lines.append("    " + "".join(_cell(title, width) for title, width, _ in columns))
        lines += ["    " + "".join(_cell(value(r), width) for _, width, value in columns) for r in rows]
        big = max(rows, key=lambda r: r["params"])
        slope = big.get("us_per_param_over_reference", {}).get(kind)
        if slope is not None and big["row"] != ref:
            extra = f"    growth {ref} -> {big['row']}: {slope:.4f} us per added parameter"
            mslope = big["us_per_param_over_reference"].get("megatron")
            if mslope is not None:
                extra += f" (megatron-core {mslope:.4f})"
            if kind == "buffers" and big.get("attach_grad_buffers") is not None:
                extra += f"; attach_grad_buffers at {big['row']}: {1e3 * big['attach_grad_buffers']:.1f} ms"
            lines.append(extra)
        counted = big.get("first_call_functions", {})
        if kind in counted:
            distinct, calls = counted[kind]
            line = f"    first call at {big['row']}: enters {distinct} Python functions ({calls} calls)"
            if "megatron" in counted:
                line += " (megatron-core's first call: {} ({} calls))".format(*counted["megatron"])
            lines.append(line)
    return "\n".join(lines)


def _columns(kind: str, ref: str, have_mc: bool) -> list[tuple[str, int, Callable[[dict[str, Any]], Any]]]:
    """The scale table's columns for one meshgrad model: title, width (negative: left
    aligned) and the cell of a row."""
    def collectives(r: dict[str, Any]) -> str:
        coll = f"{r['collectives'][kind]:g}"
        return coll + (f" ({r['collectives']['megatron']:g})" if "megatron" in r["collectives"] else "")

    mc = [("mcore ms/step", 15, lambda r: _ms(r["step"].get("megatron", {}).get("median")))] if have_mc else []
    vs_mc = [("/mcore", 8, lambda r: _r(r["vs_megatron"][kind]))] if have_mc else []
    floor = [
        ("floor ms", 10, lambda r: _ms(r["step"]["floor"]["median"])),
        ("/floor", 8, lambda r: _r(r["vs_floor"])),
        ("floor /" + ref, 12, lambda r: _r(r["vs_reference"]["floor"])),
    ] if kind == "DDP chunks" else []
    return [
        ("layers x experts", -17, lambda r: r["row"]),
        ("params", 7, lambda r: r["params"]),
        ("non-TP", 7, lambda r: r["non_tp_tensors"]),
        *mc,
        ("first call ms", 15, lambda r: _ms(r["first_call"][kind], 1)),
        ("ms/step", 10, lambda r: _ms(r["step"][kind]["median"])),
        *vs_mc,
        ("/" + ref, 8, lambda r: _r(r["vs_reference"][kind])),
        *floor,
        ("coll/call" + (" (mcore)" if have_mc else ""), 18, collectives),
        ("copied/call", 13, lambda r: int(r["bytes_copied"][kind])),
    ]


def _cell(value: Any, width: int) -> str:
    return f"{value!s:<{-width}}" if width < 0 else f"{value!s:>{width}}"


def _ms(seconds: float | None, digits: int = 4) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.{digits}f}"


def _r(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


STEP_VS_MEGATRON = 0.1  # DDP chunks at the largest row: step / megatron-core
GROWTH = 1.5  # DDP chunks: step at the largest row / step at the reference row
FIRST_CALL_VS_MEGATRON = 2.0  # DDP chunks: first call at the largest row / megatron-core's first call, and its step


def scale_goals(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The goals at the largest row (16,705 params with the default rows), each with its
    floor: the copy floor's own value of the same ratio."""
    rows = result["rows"]
    if not rows:
        return []
    big = max(rows, key=lambda r: r["params"])
    name = f"moe-{big['row']} ({big['params']} params) DDP chunks"
    vs_mc = big["vs_megatron"]["DDP chunks"]
    growth = big["vs_reference"]["DDP chunks"] if big["row"] != result["reference_row"] else None
    floor_growth = big["vs_reference"]["floor"] if growth is not None else None
    first = big["first_call"]["DDP chunks"]
    mc = big["step"].get("megatron")
    floor_vs_mc = big["step"]["floor"]["median"] / mc["median"] if mc else None
    return [
        goal(f"{name}: step / megatron-core <= {STEP_VS_MEGATRON:g}", vs_mc, STEP_VS_MEGATRON, floor=floor_vs_mc),
        goal(f"{name}: step / step at {result['reference_row']} <= {GROWTH:g}", growth, GROWTH, floor=floor_growth),
        goal(f"{name}: first call / megatron-core's first call <= {FIRST_CALL_VS_MEGATRON:g}",
             big["first_call_vs_megatron"], FIRST_CALL_VS_MEGATRON),
        # The same first call against megatron-core's steady step (its median): the stricter of the two.
        goal(f"{name}: first call / megatron-core's step <= {FIRST_CALL_VS_MEGATRON:g}",
             first / mc["median"] if mc else None, FIRST_CALL_VS_MEGATRON),
    ]
