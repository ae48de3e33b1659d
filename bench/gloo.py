"""End-to-end finalize time in a gloo world (real collectives, one process per rank),
against the floor: exactly the needed collectives on pre-flattened buffers.

Every rank builds the same three models as :mod:`bench.fake` (meshgrad with its own
buffers, meshgrad drop-in on DDP chunks, megatron-core on DDP chunks) with real gradient
values, plus the floor's buffers, and times rounds of ``batch`` calls of each, in a
rotating order, each round started by a barrier. A call's time is the slowest rank's; a
candidate's ratio to the floor is the median of the rounds' ratios (:func:`ratios_to_floor`).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
import types
from typing import Any

from bench.models import Layout
from bench.timing import paired_ratio, rotated

def _groups(lay: Layout, rank: int) -> tuple[Any, Any]:
    """(meshgrad's group namespace, megatron's), created identically on every rank."""
    import torch.distributed as dist

    from meshgrad.axes import Group
    from parity_tests.scenarios import Scenario
    from parity_tests.torch_world import collection

    pgc = collection(Scenario("bench", pp=lay.pp, dp=lay.dp, tp=lay.tp), {})
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
    one = singles[rank]
    mpgc = types.SimpleNamespace(
        tp=pgc.tp or one,
        pp=pgc.pp or one,
        embd=pgc.embd,
        pos_embd=getattr(pgc, Group.POS_EMBD.value),
        dp_cp=pgc.dp_cp or one,
    )
    return pgc, mpgc


def _fill(tensors: list[Any], seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    for t in tensors:
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))


def world_main(rank: int, world: int, payload: Any, sink: Any) -> None:
    """One rank of the benchmark world (``parity_tests.process_world.spawn_world`` target)."""
    import torch
    import torch.distributed as dist

    import torch_impl
    from bench.counting import megatron_finalize_module
    from bench.ddp import MiniDDP
    from bench.models import build_chunk
    from torch_impl.buffers import attach_grad_buffers
    from torch_impl.finalize import execution_stats

    torch.set_flush_denormal(True)
    lay: Layout = payload["layout"]
    rounds, batch = payload["rounds"], payload["batch"]
    stage = rank // (lay.tp * lay.dp)
    pgc, mpgc = _groups(lay, rank)

    def chunk() -> Any:
        return build_chunk(lay, stage)  # sequence parallel, qk-layernorm, per-token loss

    own = [chunk()]
    bufs = attach_grad_buffers(own, pgc, device="cpu")  # parameters are on meta
    _fill(list(bufs.buffers), rank)
    dropin = [MiniDDP(chunk(), pgc.dp_cp, lazy=False)]
    _fill([b for b, _ in dropin[0].grad_buffers], rank)
    fmg = megatron_finalize_module() if payload.get("megatron", True) else None
    mc = []
    if fmg is not None:
        mc = [MiniDDP(chunk(), pgc.dp_cp, lazy=False)]
        _fill([b for b, _ in mc[0].grad_buffers], rank)

    # The floor: the same collectives on buffers flattened beforehand.
    sp = [p for n, p in own[0].named_parameters() if getattr(p, "sequence_parallel", False) or "layernorm" in n]
    floor_tp = torch.randn(sum(p.numel() for p in sp))
    floor_dp = torch.randn(sum(b.numel() for b in bufs.buffers))
    emb = own[0].shared_embedding_or_output_weight()
    floor_embd = torch.randn(emb.numel()) if (emb is not None and pgc.embd is not None) else None
    # One token per rank: the global count is DP, so DP sync (a SUM) and the 1/n scale
    # keep dense gradients bounded over many calls (no overflow, no denormals, whose slow
    # arithmetic inside gloo's reductions would make timings data-dependent).
    tokens = torch.tensor(int(payload.get("tokens", 1)))

    def floor() -> None:
        if pgc.dp_cp is not None:
            dist.all_reduce(floor_dp, group=pgc.dp_cp)
        if pgc.tp is not None:
            dist.all_reduce(floor_tp, group=pgc.tp)
        if floor_embd is not None:
            dist.all_reduce(floor_embd, group=pgc.embd)
        n = tokens.clone()
        if pgc.pp is not None:
            dist.broadcast(n, src=dist.get_process_group_ranks(pgc.pp)[-1], group=pgc.pp)
        if pgc.dp_cp is not None:
            dist.all_reduce(n, group=pgc.dp_cp)
        floor_dp.mul_(1.0 / n.clamp(min=1).float())

    cands = {
        "floor": floor,
        "meshgrad buffers": lambda: torch_impl.finalize_model_grads(own, num_tokens=tokens, pg_collection=pgc),
        "meshgrad drop-in": lambda: torch_impl.finalize_model_grads(dropin, num_tokens=tokens, pg_collection=pgc),
    }
    if fmg is not None:
        cands["megatron"] = lambda: fmg.finalize_model_grads(mc, tokens.clone(), mpgc)
    names = list(cands)
    for fn in cands.values():  # warm up: plans, bindings, gloo connections
        for _ in range(2):
            fn()
    dist.barrier()
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in rotated(names, r):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(batch):
                cands[name]()
            samples[name].append((time.perf_counter() - start) / batch)
    # A call's time is the slowest rank's.
    table = torch.tensor([samples[n] for n in names], dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    copied = execution_stats(own).bytes_copied
    if rank == 0:
        sink.put(
            "result",
            {
                "layout": dataclasses.asdict(lay),
                "rounds": rounds,
                "batch": batch,
                "time": {
                    n: {"median": statistics.median(row), "min": min(row), "max": max(row), "samples": row}
                    for n, row in zip(names, table.tolist())
                },
                "meshgrad_buffers_bytes_copied": copied,
                "grad_bytes": bufs.nbytes,
            },
        )


def run_gloo(lay: Layout, *, rounds: int, batch: int, timeout: float = 900.0, megatron: bool = True) -> dict[str, Any]:
    """Spawn a gloo world of ``lay.world`` ranks and return rank 0's measurements."""
    from parity_tests.megatron_state import preload_megatron_core
    from parity_tests.process_world import spawn_world

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    outcome = spawn_world(
        world_main, lay.world, {"layout": lay, "rounds": rounds, "batch": batch, "megatron": megatron}, timeout,
        prepare=preload_megatron_core if megatron else None,
    )
    fatal = next((f for f in outcome.fatal if f), None)
    if fatal or outcome.timed_out or "result" not in outcome.results[0]:
        raise RuntimeError(f"gloo benchmark world failed ({'timed out' if outcome.timed_out else fatal})")
    result = outcome.results[0]["result"]
    result["vs_floor"] = ratios_to_floor(result["time"])
    return result


def ratios_to_floor(times: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Each candidate's time over the floor's: the median over rounds of the two times in
    the same round (:func:`bench.timing.paired_ratio`; each round runs every candidate in
    turn), so that a slow phase of a shared machine, which a ratio of two medians carries,
    cancels out of each pair."""
    return {n: paired_ratio(t, times["floor"]) for n, t in times.items() if n != "floor"}
