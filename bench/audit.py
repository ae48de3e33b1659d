"""Overhead of recording a finalize step (``torch_impl.audit``) on the gloo bench layouts.

``python -m bench.audit [--sample 64] [--rounds 15] [--layout NAME]``: in one gloo world per
layout (the layouts of ``bench/gloo.py``: real collectives, one process per rank, real
gradient values, ``num_tokens`` given), every rank times, in rotating order with a barrier
before each call, ``torch_impl.finalize_model_grads`` on plain chunks with meshgrad's own
buffers and the same call through an ``audit.Recorder`` (sampling ``--sample`` positions
per gradient, one step file per rank and call, written by its background thread). A
call's time is the slowest rank's; the figure is the ratio of the medians, audited /
plain (goal: <= 1.10), printed with "goal met" or "goal MISSED". ``paired`` is the median
of the per-round ratios (each round runs both calls back to back, which cancels slow
changes of the machine's load).

``python -m bench.audit --scale [--ranks 1024] [--params 500] [--sample 64] [--profile]``:
the replay at scale instead: a synthetic correct step (``parity_tests.audit_synth``)
replayed by ``python -m parity_tests audit``'s code in a fresh process; its time and peak
resident memory, each next to its goal (<= 60 s, <= 2 GB), "met" or "MISSED".

Also printed, as a figure that depends less on the machine's load: the recorder's CPU
time per call on the slowest rank (the calling thread's extra CPU time, median over
rounds, plus the writer thread's CPU time per file) relative to the plain call's time.
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
    writer_cpu: list[float] = []

    class TimedRecorder(audit.Recorder):
        def _write(self, *args: Any) -> None:
            start = time.thread_time()
            super()._write(*args)
            writer_cpu.append(time.thread_time() - start)

    recorder = TimedRecorder(payload["dir"], sample=payload["sample"])
    cands = {
        "plain": lambda: torch_impl.finalize_model_grads(model, num_tokens=tokens, pg_collection=pgc),
        "audited": lambda: recorder(model, num_tokens=tokens, pg_collection=pgc),
    }
    names = list(cands)
    for fn in cands.values():
        for _ in range(2):
            fn()
    samples: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for r in range(payload["rounds"]):
        for name in names[r % 2:] + names[: r % 2]:
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.thread_time()
            cands[name]()
            samples[name].append(time.perf_counter() - start)
            cpu[name].append(time.thread_time() - start_cpu)
    recorder.close()
    table = torch.tensor([samples[n] for n in names], dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    calling = statistics.median(cpu["audited"]) - statistics.median(cpu["plain"])
    extra_t = torch.tensor([calling + statistics.median(writer_cpu), calling, statistics.median(writer_cpu)],
                           dtype=torch.float64)
    dist.all_reduce(extra_t, op=dist.ReduceOp.MAX)
    if rank == 0:
        step_bytes = os.path.getsize(recorder.files[-1])
        plan_bytes = sum(os.path.getsize(os.path.join(payload["dir"], n)) for n in os.listdir(payload["dir"])
                         if n.startswith("plan.rank00000."))
        sink.put("result", {n: row for n, row in zip(names, table.tolist())} | {
            "step_bytes": step_bytes, "plan_bytes": plan_bytes, "recorder_cpu": float(extra_t[0]),
            "calling_cpu": float(extra_t[1]), "writer_cpu": float(extra_t[2]),
            "plans": recorder.plans_made, "grads": sum(1 for p in model[0].parameters() if p.requires_grad)})


def run(layout: Layout, sample: int, rounds: int) -> dict[str, Any]:
    """One layout's world; returns medians, ratio and the file size."""
    from parity_tests.process_world import spawn_world

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="meshgrad-audit-bench-") as directory:
        payload = {"layout": layout, "sample": sample, "rounds": rounds, "dir": directory}
        outcome = spawn_world(world_main, layout.world, payload, timeout=900)
    fatal = next((f for f in outcome.fatal if f), None)
    if fatal or "result" not in outcome.results[0]:
        raise RuntimeError(f"audit bench world failed: {fatal or 'timed out'}")
    res = outcome.results[0]["result"]
    plain, audited = statistics.median(res["plain"]), statistics.median(res["audited"])
    paired = statistics.median(a / p for a, p in zip(res["audited"], res["plain"]))
    return {"layout": layout.name, "world": layout.world, "grads_per_rank": res["grads"], "sample": sample,
            "rounds": rounds, "plain_ms": plain * 1e3, "audited_ms": audited * 1e3, "ratio": audited / plain,
            "paired_ratio": paired, "recorder_cpu_ms": res["recorder_cpu"] * 1e3, "cpu_ratio": res["recorder_cpu"] / plain,
            "calling_thread_cpu_ms": res["calling_cpu"] * 1e3, "writer_cpu_ms": res["writer_cpu"] * 1e3,
            "step_file_bytes": res["step_bytes"], "plan_file_bytes": res["plan_bytes"], "plans_made": res["plans"]}


SCALE_GOAL_S, SCALE_GOAL_MB = 60.0, 2048.0
#: The replay, run in a fresh process: its own time, its peak resident memory (VmHWM: the
#: process since its exec, not the parent's pages a fork copied), a profile if asked.
_REPLAY_CHILD = """
import cProfile, io, json, pstats, resource, sys, time
from parity_tests.audit import replay
prof = cProfile.Profile() if sys.argv[2] == "1" else None
start = time.perf_counter()
if prof: prof.enable()
ok = replay(sys.argv[1])["ok"]
if prof: prof.disable()
seconds = time.perf_counter() - start
try:
    with open("/proc/self/status") as f:
        peak_kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
except (OSError, StopIteration):
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
top = ""
if prof:
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(25)
    top = out.getvalue()
print(json.dumps({"ok": ok, "seconds": seconds, "peak_kb": peak_kb, "profile": top}))
"""


def machine() -> dict[str, Any]:
    """The machine a figure was measured on: CPU count, load, Python, numpy and torch versions."""
    import importlib.metadata
    import platform

    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "absent"

    return {"cpus": os.cpu_count(), "load": [round(x, 1) for x in os.getloadavg()], "python": platform.python_version(),
            "numpy": version("numpy"), "torch": version("torch")}


def scale(ranks: int, params: int, sample: int, tp: int = 8, profile: bool = False) -> dict[str, Any]:
    """The replay at scale: a synthetic correct step of ``ranks`` ranks (``parity_tests.audit_synth``,
    ``dp = ranks / tp``), replayed in a fresh process.

    Args:
      ranks, params, sample: the step's size (ranks a multiple of ``tp``).
      tp: tensor-parallel size of the synthetic world.
      profile: run the replay under cProfile and return its top functions.

    Returns:
      The replay process's wall time (``replay_s``, start-up included) and the replay's own
      (``replay_inner_s``), its peak resident memory (``replay_peak_mb``), whether it passed.
    """
    import subprocess

    from parity_tests.audit_synth import write_step

    if ranks % tp:
        raise ValueError(f"--ranks {ranks}: not a multiple of tp={tp}")
    with tempfile.TemporaryDirectory(prefix="meshgrad-audit-scale-") as directory:
        start = time.perf_counter()
        write_step(directory, dp=ranks // tp, tp=tp, params=params, sample=sample)
        generated = time.perf_counter() - start
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", _REPLAY_CHILD, directory, "1" if profile else "0"],
                              env=dict(os.environ, PYTHONPATH=os.getcwd()), stdout=subprocess.PIPE, text=True)
        wall = time.perf_counter() - start
    if done.returncode != 0 or not done.stdout.strip():
        raise RuntimeError(f"the replay process failed (exit status {done.returncode})")
    child = json.loads(done.stdout.strip().splitlines()[-1])
    return {"ranks": ranks, "params": params, "sample": sample, "generate_s": generated, "replay_s": wall,
            "replay_inner_s": child["seconds"], "replay_peak_mb": child["peak_kb"] / 1024, "passed": child["ok"],
            "profile": child["profile"], "machine": machine()}


def scale_main(args: argparse.Namespace) -> int:
    """Print the scale figure next to its goals (<= 60 s, <= 2 GB), met or missed."""
    r = scale(args.ranks, args.params, args.sample, profile=args.profile)
    m = r["machine"]
    time_ok, mem_ok = r["replay_s"] <= SCALE_GOAL_S, r["replay_peak_mb"] <= SCALE_GOAL_MB
    print(f"machine: {m['cpus']} CPUs (load average {m['load'][0]}), Python {m['python']}, numpy {m['numpy']}, "
          f"torch {m['torch']}")
    print(f"replay of a synthetic step: {r['ranks']} ranks x {r['params']} parameters x {r['sample']} samples "
          f"({'passed' if r['passed'] else 'FAILED'}; records generated in {r['generate_s']:.1f} s)")
    print(f"  time  {r['replay_s']:6.1f} s  (fresh process; the replay itself {r['replay_inner_s']:.1f} s)  "
          f"goal <= {SCALE_GOAL_S:.0f} s: {'met' if time_ok else 'MISSED'}")
    print(f"  peak  {r['replay_peak_mb']:6.0f} MB (resident, the replay process)  goal <= {SCALE_GOAL_MB:.0f} MB: "
          f"{'met' if mem_ok else 'MISSED'}")
    ok = r["passed"] and time_ok and mem_ok
    print(f"replay <= {SCALE_GOAL_S:.0f} s and <= {SCALE_GOAL_MB / 1024:.0f} GB: goal {'met' if ok else 'MISSED'}")
    if r["profile"]:
        print(r["profile"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.audit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", action="store_true", help="time the replay of a synthetic step instead")
    parser.add_argument("--ranks", type=int, default=1024, help="--scale: ranks (a multiple of 8)")
    parser.add_argument("--params", type=int, default=500, help="--scale: parameters per rank")
    parser.add_argument("--sample", type=int, default=64)
    parser.add_argument("--profile", action="store_true", help="--scale: print the replay's cProfile top functions")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--layout", choices=sorted(LAYOUTS), action="append", help="default: all")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    if args.scale:
        return scale_main(args)
    rows = [run(LAYOUTS[n], args.sample, args.rounds) for n in (args.layout or list(LAYOUTS))]
    print(f"{'layout':<24} {'world':>5} {'grads':>6} {'finalize':>10} {'+ audit':>10} {'ratio':>7} {'paired':>7} "
          f"{'rec. CPU':>9} {'CPU/call':>8} {'step file':>10} {'plan file':>10}")
    for r in rows:
        print(f"{r['layout']:<24} {r['world']:>5} {r['grads_per_rank']:>6} {r['plain_ms']:>8.2f}ms "
              f"{r['audited_ms']:>8.2f}ms {r['ratio']:>7.3f} {r['paired_ratio']:>7.3f} {r['recorder_cpu_ms']:>7.2f}ms "
              f"{r['cpu_ratio']:>8.3f} {r['step_file_bytes'] / 1024:>8.1f}KB {r['plan_file_bytes'] / 1024:>8.1f}KB")
    ok = all(r["ratio"] <= GOAL for r in rows)
    print(f"audited/plain (medians) <= {GOAL} on every layout: goal {'met' if ok else 'MISSED'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
