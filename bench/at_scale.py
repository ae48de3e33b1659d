"""The cost model of ``python -m meshgrad`` against what this machine can measure, and the
planner's own scale.

1. Calibration: all-reduces and reduce-scatters of 256 B to 2 MiB in gloo worlds of 2, 4
   and 8 processes (median of repeats, slowest rank); :func:`meshgrad.cost.fit_link` fits
   one link class, "this machine's gloo", to all of them; each row is printed predicted
   against measured.
2. Finalize: torch_impl's steady-state ``finalize_model_grads`` in a gloo world of 8 on a
   model built from a preset (``bench.explain_world``), measured against the prediction
   for the rank class that explain lists (the fitted link, every rank on one "node").
3. Planning scale: ``explain`` of the 70B preset at 1k, 4k and 16k ranks: wall time and
   peak traced memory (``tracemalloc``): one plan per rank class, so both stay flat.

The GPU figures of docs/performance.md "At scale" stay predictions until a GPU run exists.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import tracemalloc
from typing import Any

from meshgrad.config import FinalizeConfig
from meshgrad.cost import CostModel, class_cost, fit_link
from meshgrad.explain import Explanation, Layout, explain, model_stages
from meshgrad.presets import PRESETS

#: Message sizes (bytes) of the calibration.
SIZES = (256, 16 * 1024, 256 * 1024, 2 * 2**20)
WORLDS = (2, 4, 8)
KINDS = ("all_reduce", "reduce_scatter")
#: The finalize of part 2: a small dense GPT with every step a toy can have.
FINALIZE_MODEL = dataclasses.replace(PRESETS["tiny"], name="gpt-4L-h256", hidden=256, ffn=1024, heads=8, kv_heads=8,
                                     vocab=4096, experts=0, expert_bias=False)
FINALIZE_LAYOUT = Layout(pp=2, dp=2, tp=2)
FINALIZE_CONFIG = dict(sequence_parallel=True, qk_layernorm=True, use_distributed_optimizer=True,
                       calculate_per_token_loss=True)
#: 70B planning-scale worlds: tp 8, pp 8, dp fills.
PLAN_WORLDS = (1024, 4096, 16384)


def _collectives(rank: int, world: int, payload: Any, sink: Any) -> None:
    """Time each kind and size (spawn_world target); emits ``(kind, bytes) -> median s``."""
    import torch
    import torch.distributed as dist

    reps, finalize_reps = payload
    for kind in KINDS:
        for nbytes in SIZES:
            numel = max(world, nbytes // 4 // world * world)
            data = torch.ones(numel)
            out = torch.empty(numel // world)

            # reduce_scatter_single is the newer name of reduce_scatter_tensor (as torch_impl calls it).
            scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

            def op() -> None:
                if kind == "all_reduce":
                    dist.all_reduce(data)
                else:
                    scatter(out, data)

            for _ in range(2):
                op()
            times = []
            for _ in range(reps):
                dist.barrier()
                start = time.perf_counter()
                op()
                times.append(time.perf_counter() - start)
            sink.put(f"{kind}:{numel * 4}", statistics.median(times))
    if world == 8 and finalize_reps:
        sink.put("finalize", _finalize_times(rank, finalize_reps))


def _finalize_times(rank: int, reps: int) -> float:
    """Median steady-state finalize seconds of this rank."""
    import torch
    import torch.distributed as dist

    from bench.explain_world import build_chunks, named_groups
    from meshgrad.axes import Axis
    from torch_impl import finalize_model_grads

    config = FinalizeConfig(**FINALIZE_CONFIG)
    dims = FINALIZE_LAYOUT.dims
    groups = named_groups(dims, config)
    coords = dims.coords(rank)
    chunks = build_chunks(model_stages(FINALIZE_MODEL, FINALIZE_LAYOUT)(coords[Axis.PP]), config, rank)
    tokens = torch.tensor([coords[Axis.DP] + 3])
    times = []
    for index in range(reps + 2):
        dist.barrier()
        start = time.perf_counter()
        finalize_model_grads(chunks, num_tokens=tokens.clone(), pg_collection=groups)
        if index >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def finalize_explanation() -> Explanation:
    """What explain lists for the finalize of part 2."""
    return explain(FINALIZE_MODEL, FINALIZE_LAYOUT, FinalizeConfig(**FINALIZE_CONFIG))


def measure(reps: int = 15, finalize_reps: int = 9) -> dict[str, Any]:
    """Parts 1 and 2: measured rows, the fitted link, predicted against measured."""
    from parity_tests.process_world import spawn_world

    rows: list[tuple[str, int, int, float]] = []
    finalize_measured = None
    for world in WORLDS:
        outcome = spawn_world(_collectives, world, (reps, finalize_reps), timeout=240)
        if any(outcome.fatal) or outcome.timed_out:
            raise RuntimeError(f"gloo world of {world} failed: {next((f for f in outcome.fatal if f), 'timed out')}")
        for key in outcome.results[0]:
            if key == "finalize":
                finalize_measured = max(r["finalize"] for r in outcome.results)
                continue
            kind, nbytes = key.split(":")
            rows.append((kind, world, int(nbytes), max(r[key] for r in outcome.results)))
    rows.sort()
    link, launch = fit_link(rows, "gloo (this machine)")
    model = CostModel(intra=link, inter=link, launch_s=launch, gpus_per_node=max(WORLDS), algorithm="ring")
    # One link class per world size too: how much of the spread is the processes sharing
    # this machine's cores (a ring step waits for the scheduler), which one alpha cannot hold.
    own = {}
    for world in WORLDS:
        link_w, launch_w = fit_link([r for r in rows if r[1] == world], f"gloo, {world} ranks")
        own[world] = CostModel(intra=link_w, inter=link_w, launch_s=launch_w, gpus_per_node=world, algorithm="ring")
    table = [
        {"kind": k, "ranks": p, "bytes": b, "measured_s": s, "predicted_s": model.seconds(k, p, 1, b),
         "predicted_own_world_s": own[p].seconds(k, p, 1, b)}
        for k, p, b, s in rows
    ]
    out: dict[str, Any] = {"link": dataclasses.asdict(link), "launch_s": launch, "rows": table}
    if finalize_measured is not None:
        explained = finalize_explanation()
        costs = [class_cost(c, explained, model) for c in explained.classes]
        costs_8 = [class_cost(c, explained, own[8]) for c in explained.classes]
        out["finalize"] = {
            "model": FINALIZE_MODEL.name, "layout": FINALIZE_LAYOUT.text(), "measured_s": finalize_measured,
            "predicted_s": max(c.seconds for c in costs), "status_predicted_s": max(c.status_seconds for c in costs),
            "predicted_world_fit_s": max(c.seconds for c in costs_8),
            "collectives": len(explained.classes[0].meshgrad),
        }
    return out


def planning_scale(worlds: tuple[int, ...] = PLAN_WORLDS) -> list[dict[str, Any]]:
    """Part 3: explain (every class planned, every collective listed) of the 70B preset."""
    m = PRESETS["gpt-70b"]
    config = FinalizeConfig(sequence_parallel=True, use_distributed_optimizer=True, share_embeddings_and_output_weights=False)
    out = []
    for world in worlds:
        layout = Layout(pp=8, tp=8, dp=world // 64)
        tracemalloc.start()
        start = time.perf_counter()
        explained = explain(m, layout, config)
        seconds = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        out.append({"world": world, "layout": layout.text(), "seconds": seconds, "peak_bytes": peak,
                    "classes": len(explained.classes), "params_per_rank": len(explained.classes[0].plan.params)})
    return out


def format_rows(result: dict[str, Any]) -> str:
    """Calibration, finalize and planning rows as text."""
    link = result["link"]
    lines = [f"  fitted 'gloo (this machine)': launch {1e6 * result['launch_s']:.1f} us, "
             f"{1e6 * link['alpha_s']:.1f} us per step, {link['beta_bytes_s'] / 1e9:.2f} GB/s",
             f"  {'collective':<16}{'ranks':>6}{'bytes':>10}{'measured us':>14}{'predicted us':>14}{'pred/meas':>11}"
             f"{'pred/meas (fit per world)':>27}"]
    for r in result["rows"]:
        lines.append(f"  {r['kind']:<16}{r['ranks']:>6}{r['bytes']:>10}{1e6 * r['measured_s']:>14.1f}"
                     f"{1e6 * r['predicted_s']:>14.1f}{r['predicted_s'] / r['measured_s']:>11.2f}"
                     f"{r['predicted_own_world_s'] / r['measured_s']:>27.2f}")
    fin = result.get("finalize")
    if fin:
        lines.append(f"  finalize {fin['model']} on {fin['layout']} ({fin['collectives']} collectives per rank): "
                     f"measured {1e3 * fin['measured_s']:.2f} ms, predicted {1e3 * fin['predicted_s']:.2f} ms "
                     f"(the 8-rank fit: {1e3 * fin['predicted_world_fit_s']:.2f} ms; communication only; "
                     f"status round {1e6 * fin['status_predicted_s']:.0f} us)")
    for r in result.get("planning", []):
        lines.append(f"  plan gpt-70b at {r['world']:>6} ranks ({r['layout']}): {1e3 * r['seconds']:.1f} ms, "
                     f"peak {r['peak_bytes'] / 2**20:.2f} MiB, {r['classes']} rank classes")
    return "\n".join(lines)


def run(quick: bool = False) -> dict[str, Any]:
    """Every part (``python -m bench`` row)."""
    result = measure(reps=7 if quick else 15, finalize_reps=5 if quick else 9)
    result["planning"] = planning_scale()
    return result


def at_scale_goals(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Planning 70B at 16k ranks takes under a second."""
    from bench.goals import goal

    worst = max(result.get("planning", []), key=lambda r: r["world"], default=None)
    if worst is None:
        return []
    return [goal(f"plan gpt-70b at {worst['world']} ranks: seconds <= 1", worst["seconds"], 1.0)]


__all__ = ["at_scale_goals", "finalize_explanation", "format_rows", "measure", "planning_scale", "run"]
