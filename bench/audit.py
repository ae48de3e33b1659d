"""Overhead of recording a finalize step (``torch_impl.audit``) on the gloo bench layouts.

``python -m bench.audit [--sample 64] [--rounds 7] [--layout NAME]``: in one gloo world per
layout (the layouts of ``bench/gloo.py``: real collectives, one process per rank, real
gradient values, ``num_tokens`` given), every rank times, in rotating order with a barrier
before each round, ``torch_impl.finalize_model_grads`` on plain chunks with meshgrad's own
buffers and the same call through ``audit.record`` (sampling ``--sample`` positions per
gradient, writing one ``.npz`` per rank and call). A call's time is the slowest rank's;
the figure is the ratio of the medians, audited / plain (goal: <= 1.10).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from bench.models import Layout

LAYOUTS = {
    "gloo-24L-h256-tp2dp2": Layout("gloo-24L-h256-tp2dp2", 24, 256, tp=2, pp=1, dp=2, vocab=8192),
    "gloo-24L-h256-tp2pp2": Layout("gloo-24L-h256-tp2pp2", 24, 256, tp=2, pp=2, dp=1, vocab=8192),
}
GOAL = 1.10


def world_main(rank: int, world: int, payload: dict[str, Any], sink: Any) -> None:
    """One rank: time plain and audited finalize calls (``spawn_world`` target)."""
    import torch
    import torch.distributed as dist

    import torch_impl
    from bench.gloo import _fill, _groups
    from bench.models import build_chunk
    from torch_impl import audit
    from torch_impl.buffers import attach_grad_buffers

    torch.set_flush_denormal(True)
    lay: Layout = payload["layout"]
    stage = rank // (lay.tp * lay.dp)
    pgc, _ = _groups(lay, rank)
    model = [build_chunk(lay, stage)]
    bufs = attach_grad_buffers(model, pgc, device="cpu")
    _fill(list(bufs.buffers), rank)
    tokens = torch.tensor(1)
    recorder = audit.Recorder(payload["dir"], sample=payload["sample"])
    cands = {
        "plain": lambda: torch_impl.finalize_model_grads(model, num_tokens=tokens, pg_collection=pgc),
        "audited": lambda: recorder(model, num_tokens=tokens, pg_collection=pgc),
    }
    names = list(cands)
    for fn in cands.values():
        for _ in range(2):
            fn()
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(payload["rounds"]):
        for name in names[r % 2:] + names[: r % 2]:
            dist.barrier()
            start = time.perf_counter()
            cands[name]()
            samples[name].append(time.perf_counter() - start)
    table = torch.tensor([samples[n] for n in names], dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    recorder.flush()
    if rank == 0:
        size = os.path.getsize(recorder.files[-1])
        sink.put("result", {n: row for n, row in zip(names, table.tolist())} | {"file_bytes": size,
                 "grads": sum(1 for p in model[0].parameters() if p.requires_grad)})


def run(layout: Layout, sample: int, rounds: int) -> dict[str, Any]:
    """One layout's world; returns medians, ratio and the file size."""
    from parity_tests.torch_world import spawn_world

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="meshgrad-audit-bench-") as directory:
        payload = {"layout": layout, "sample": sample, "rounds": rounds, "dir": directory}
        outcome = spawn_world(world_main, layout.world, payload, timeout=900)
    fatal = next((f for f in outcome.fatal if f), None)
    if fatal or "result" not in outcome.results[0]:
        raise RuntimeError(f"audit bench world failed: {fatal or 'timed out'}")
    res = outcome.results[0]["result"]
    plain, audited = statistics.median(res["plain"]), statistics.median(res["audited"])
    return {"layout": layout.name, "world": layout.world, "grads_per_rank": res["grads"], "sample": sample,
            "rounds": rounds, "plain_ms": plain * 1e3, "audited_ms": audited * 1e3, "ratio": audited / plain,
            "file_bytes": res["file_bytes"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.audit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sample", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layout", choices=sorted(LAYOUTS), action="append", help="default: all")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    rows = [run(LAYOUTS[n], args.sample, args.rounds) for n in (args.layout or list(LAYOUTS))]
    print(f"{'layout':<24} {'world':>5} {'grads':>6} {'finalize':>10} {'+ audit':>10} {'ratio':>7} {'file':>9}")
    for r in rows:
        print(f"{r['layout']:<24} {r['world']:>5} {r['grads_per_rank']:>6} {r['plain_ms']:>8.2f}ms "
              f"{r['audited_ms']:>8.2f}ms {r['ratio']:>7.3f} {r['file_bytes'] / 1024:>7.1f}KB")
    ok = all(r["ratio"] <= GOAL for r in rows)
    print(f"goal audited/plain <= {GOAL}: {'met' if ok else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
