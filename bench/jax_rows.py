"""JAX rows: jax_impl.finalize against the hand-written psum tree map, in one run.

At about 100, 1,000 and 16,000 gradient leaves on 8 fake CPU devices (dp = 4, tp = 2,
every fourth leaf a sequence-parallel layernorm), inside one ``jax.jit(jax.shard_map)``
step (quick mode: the first two rows), both candidates do the same reductions:

* ``meshgrad``: ``jax_impl.finalize(grads, plan=plan, dims=dims)`` (plan made once,
  outside the step, as a training loop does);
* ``hand``: ``jax.tree.map(lambda g, axes: lax.psum(g * scale, axes), grads, axes)``
  (dp mean of every leaf, then a tp sum of the layernorms: what a researcher writes).

Per row: the jit compile time (trace + lower + XLA compile, the heap collected first; the
fastest of sixteen below 1,000 leaves, of six below 4,000: a compile's first runs in a process
can pay jax's own warm-up, which the smallest row would otherwise count) and the steady
step time (median of paired, alternating calls), the ratios meshgrad / hand (each the
median of the pairs' ratios: compiles alternate round by round), the growth of the times
against the leaf-count growth and of the ratios from row to row, and the HLO's all-reduce
count of each (XLA's combiner decides how many collectives run). The spread behind the medians is printed
too: the step ratio's paired calls (min, quartiles, max) and every compile time taken;
the first line names the machine (CPU cores, jax and jaxlib versions). Run alone (it forces 8 host devices before
jax is imported): ``python -m bench.jax_rows [--quick] [--json PATH]``; ``python -m bench``
runs it in a subprocess.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    from jax_impl.mesh import ensure_host_devices

    ensure_host_devices(8)

import argparse  # noqa: E402
import collections  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from bench.goals import format_goals, goal  # noqa: E402

#: Leaf counts of the rows.
LEAVES = (100, 1_000, 16_000)
#: Goals: meshgrad / hand.
STEP_GOAL, COMPILE_GOAL = 1.1, 1.5


def _tree(n: int) -> tuple[dict[str, Any], list[Any]]:
    """n stacked [8, 16] gradient leaves in layers of four and their ParamSpecs."""
    import numpy as np

    from meshgrad import ParamSpec

    rng = np.random.default_rng(0)
    grads, specs = {}, []
    for i in range(n):
        layer, kind = divmod(i, 4)
        name = f"layers.{layer}.{'ln' if kind == 0 else f'w{kind}'}"
        grads.setdefault(f"layers.{layer}", {})[name.rsplit(".", 1)[1]] = rng.normal(size=(8, 16)).astype(np.float32)
        specs.append(ParamSpec(name, shape=(16,), sequence_parallel=kind == 0))
    return grads, specs


def _steps(n: int) -> dict[str, Any]:
    """The two jitted shard_mapped steps for n leaves and their inputs (placed)."""
    import jax
    from jax import lax
    from jax.sharding import NamedSharding, PartitionSpec

    from jax_impl import make_meshes
    from jax_impl.finalize import finalize
    from meshgrad import FinalizeConfig, ParallelDims, plan_finalize

    dims = ParallelDims(dp=4, tp=2)
    grads, specs = _tree(n)
    plan = plan_finalize(specs, FinalizeConfig(sequence_parallel=True), dims)
    mesh = make_meshes(dims).dense
    ranks = PartitionSpec(mesh.axis_names)
    sp = jax.tree.map(lambda _: False, grads)
    for layer in sp.values():
        layer["ln"] = True

    def hand(g):
        mean = jax.tree.map(lambda x: lax.psum(x * (1 / dims.dp), "dp"), g)
        return jax.tree.map(lambda x, s: lax.psum(x, "tp") if s else x, mean, sp)

    def ours(g):
        return finalize(g, plan=plan, dims=dims)[0]

    def wrap(fn):
        body = lambda g: jax.tree.map(lambda x: x[None], fn(jax.tree.map(lambda x: x[0], g)))  # noqa: E731
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(ranks,), out_specs=ranks, check_vma=False))

    placed = jax.device_put(grads, NamedSharding(mesh, ranks))
    return {"meshgrad": wrap(ours), "hand": wrap(hand), "grads": placed, "check": (ours, hand)}


def _compile(fn: Any, grads: Any) -> tuple[Any, float, collections.Counter]:
    """The compiled step, its compile time and its HLO op counts (op name -> count).

    jax's in-memory caches are cleared first: a second ``lower().compile()`` of the same
    program would otherwise return the cached executable.
    """
    import jax

    jax.clear_caches()
    gc.collect()  # no collection of the previous compile's garbage inside this one
    start = time.perf_counter()
    compiled = fn.lower(grads).compile()
    seconds = time.perf_counter() - start
    return compiled, seconds, collections.Counter(re.findall(r"= (?:\([^)]*\)|\S+) ([a-z][a-z\-]*)\(", compiled.as_text()))


def compiles(n: int) -> int:
    """How many times each candidate is compiled at ``n`` leaves (the fastest counts)."""
    return 16 if n < 1_000 else 6 if n < 4_000 else 1


def measure_row(n: int, rounds: int) -> dict[str, Any]:
    """One row: compile each candidate (alternating, the fastest of :func:`compiles` of
    each), check equal outputs, time paired calls (alternating who goes first)."""
    import jax
    import numpy as np

    steps = _steps(n)
    grads = steps["grads"]
    row: dict[str, Any] = {"leaves": n}
    compiled, ops, seconds = {}, {}, {"meshgrad": [], "hand": []}
    for i in range(compiles(n)):
        for name in sorted(seconds, reverse=bool(i % 2)):
            compiled[name], took, ops[name] = _compile(steps[name], grads)
            seconds[name].append(took)
    for name in seconds:
        row[f"{name}_compile_s"] = min(seconds[name])
        row[f"{name}_all_reduces"] = ops[name]["all-reduce"] + ops[name]["all-reduce-start"]
    row["same_hlo_ops"] = ops["meshgrad"] == ops["hand"]
    outs = {name: jax.block_until_ready(fn(grads)) for name, fn in compiled.items()}
    diff = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
               for a, b in zip(jax.tree.leaves(outs["meshgrad"]), jax.tree.leaves(outs["hand"])))
    row["max_abs_diff"] = diff
    # Paired calls, each waited for (many steps in flight on fake CPU devices can abort
    # XLA's collective rendezvous); the step ratio is the median of the pairs' ratios,
    # which a shared machine's drift affects less than a ratio of medians.
    times: dict[str, list[float]] = {"meshgrad": [], "hand": []}
    for i in range(rounds * max(1, 2_000 // n)):
        for name in sorted(compiled, reverse=bool(i % 2)):
            start = time.perf_counter()
            jax.block_until_ready(compiled[name](grads))
            times[name].append(time.perf_counter() - start)
    for name, values in times.items():
        row[f"{name}_step_ms"] = 1e3 * statistics.median(values)
    ratios = sorted(a / b for a, b in zip(times["meshgrad"], times["hand"]))
    row["step_ratio"] = statistics.median(ratios)
    row["step_ratio_spread"] = _spread(ratios)
    row["step_pairs"] = len(ratios)
    for name in seconds:
        row[f"{name}_compile_runs_s"] = list(seconds[name])
    # the median of the rounds' ratios (each round compiles both, one after the other): a
    # drift of the machine's speed during the row cancels out, as in the step ratio
    row["compile_ratio"] = statistics.median(a / b for a, b in zip(seconds["meshgrad"], seconds["hand"]))
    return row


def _spread(values: list[float]) -> list[float]:
    """[min, first quartile, third quartile, max] of ``values`` (sorted, non-empty)."""
    if len(values) < 2:
        return [values[0]] * 4
    q1, _, q3 = statistics.quantiles(values, n=4)
    return [values[0], q1, q3, values[-1]]


def machine() -> dict[str, Any]:
    """What the rows ran on: CPU cores, Python, jax and jaxlib versions, XLA's devices."""
    import platform

    import jax
    import jaxlib

    return {"cpus": os.cpu_count(), "python": platform.python_version(), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "devices": jax.device_count(), "platform": jax.default_backend()}


def goals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The JAX goals of the rows (ratios in this run; growth against the leaf count), each
    with its floor: the hand-written version's own value of the same measure."""
    out = []
    for row in rows:
        n = row["leaves"]
        out.append(goal(f"jax {n} leaves: step <= {STEP_GOAL}x hand-written psum", row["step_ratio"], STEP_GOAL,
                        floor=1.0))
        out.append(goal(f"jax {n} leaves: compile <= {COMPILE_GOAL}x hand-written psum", row["compile_ratio"],
                        COMPILE_GOAL, floor=1.0))
    if len(rows) > 1:
        # Growth: meshgrad's time at the last row over the first, per leaf-count growth. The
        # floor is the hand-written step's own growth (XLA's compile alone can grow faster than
        # the leaves): where it misses 1.1 the goal is printed apart, as a measure.
        first, last = rows[0], rows[-1]
        growth = last["leaves"] / first["leaves"]
        span = f"{first['leaves']} -> {last['leaves']} leaves"
        for what, unit in (("step", "step_ms"), ("compile", "compile_s")):
            ours = (last[f"meshgrad_{unit}"] / first[f"meshgrad_{unit}"]) / growth
            floor = (last[f"hand_{unit}"] / first[f"hand_{unit}"]) / growth
            out.append(goal(f"jax {what} grows no faster than the leaves ({span}; per-leaf growth)", ours, 1.1,
                            floor=floor))
            # ours / theirs from the rows' paired ratios (how much meshgrad's ratio grew)
            out.append(goal(f"jax {what} grows no faster than the hand-written one's ({span}; ours / theirs)",
                            last[f"{what}_ratio"] / first[f"{what}_ratio"], 1.1, floor=1.0))
    return out


def format_rows(rows: list[dict[str, Any]]) -> str:
    """The rows as a table."""
    lines = [f"{'leaves':>7} {'compile s (ours/hand)':>24} {'ratio':>6} {'step ms (ours/hand)':>22} {'ratio':>6} "
             f"{'all-reduces (ours/hand)':>24} {'same HLO ops':>12} {'max diff':>9}"]
    for r in rows:
        lines.append(
            f"{r['leaves']:>7} {r['meshgrad_compile_s']:>11.2f} / {r['hand_compile_s']:<10.2f} {r['compile_ratio']:>6.2f} "
            f"{r['meshgrad_step_ms']:>10.3f} / {r['hand_step_ms']:<9.3f} {r['step_ratio']:>6.2f} "
            f"{r['meshgrad_all_reduces']:>11} / {r['hand_all_reduces']:<11} {str(r['same_hlo_ops']):>12} "
            f"{r['max_abs_diff']:>9.1e}"
        )
    return "\n".join(lines)


def format_spread(rows: list[dict[str, Any]]) -> str:
    """Per row, the spread behind the medians: the step ratio's paired calls (min, quartiles,
    max) and every compile time measured (the row keeps the faster of each)."""
    lines = ["spread (step ratio over the paired calls: min [q1, q3] max; every compile, s):"]
    for r in rows:
        if "step_ratio_spread" not in r:
            continue
        lo, q1, q3, hi = r["step_ratio_spread"]
        runs = "; ".join(f"{name} " + ", ".join(f"{s:.2f}" for s in r[f"{name}_compile_runs_s"])
                         for name in ("meshgrad", "hand"))
        lines.append(f"{r['leaves']:>7} leaves: step ratio {lo:.2f} [{q1:.2f}, {q3:.2f}] {hi:.2f} "
                     f"over {r['step_pairs']} pairs; compile {runs}")
    return "\n".join(lines)


def run_subprocess(quick: bool) -> dict[str, Any]:
    """Run the rows in a fresh interpreter (8 host devices) and return its JSON."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "bench.jax_rows", "--print-json"] + (["--quick"] if quick else [])
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.jax_rows", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer timed rounds, the 100 and 1,000 leaf rows")
    parser.add_argument("--leaves", type=int, nargs="+", help=f"leaf counts of the rows (default {list(LEAVES)})")
    parser.add_argument("--json", metavar="PATH", help="also write the rows here")
    parser.add_argument("--print-json", action="store_true", help="print only the JSON (for python -m bench)")
    args = parser.parse_args(argv)
    leaves = args.leaves or (list(LEAVES[:2]) if args.quick else list(LEAVES))
    env = machine()
    if not args.print_json:
        print(f"machine: {env['cpus']} CPU cores, {env['devices']} {env['platform']} devices, Python {env['python']}, "
              f"jax {env['jax']}, jaxlib {env['jaxlib']}", flush=True)
    rows = []
    for n in leaves:
        start = time.perf_counter()
        rows.append(measure_row(n, rounds=5 if args.quick else 11))
        rows[-1]["row_s"] = time.perf_counter() - start
        if not args.print_json:
            print(format_rows(rows[-1:]).splitlines()[-1] + f"   ({rows[-1]['row_s']:.0f} s)", flush=True)
    result = {"machine": env, "rows": rows, "goals": goals(rows)}
    if args.print_json:
        print(json.dumps(result))
        return 0
    print(format_rows(rows))  # the table again, with its header
    print(format_spread(rows))
    print(format_goals(result["goals"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
