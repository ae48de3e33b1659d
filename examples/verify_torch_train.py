"""Run examples/torch_train.py distributed and on one process, compare, give a verdict.

The distributed run (``torch.distributed.run``, gloo on CPU) finalizes every rank's
gradients with ``torch_impl.finalize_model_grads``; the single run is plain autograd of the
same model on the whole batch, without meshgrad. If finalization is right, both give the
same gradients, losses and router expert biases, step by step, up to float rounding.

Run (8 ranks: pp 2 x dp 2 x tp 2, experts over ep 2)::

    .venv/bin/python examples/verify_torch_train.py --pp 2 --dp 2 --tp 2 --ep 2 --steps 3

It prints one row per step and a verdict line; the exit status is 0 when every step
matches, 1 otherwise. The figures are explained above the table when it runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "torch_train.py"

#: Default relative tolerance per model dtype. float32: rounding of the TP / EP partial
#: sums; float64: only the float32 1 / num_tokens factor is left (as in Megatron).
TOLERANCE = {"float32": 1e-5, "float64": 1e-7}

EXPLANATION = """\
What the columns mean (one row per training step; both runs start from the same weights
and see the same global batch):
  loss dist / loss single   mean token loss of the global batch in each run
  grad rel. diff            max over parameters and elements of |dist - single|, divided by
                            the largest |single gradient| of that step (the full, unsharded
                            gradient, gathered from every rank's shard after finalization)
  worst parameter           where that maximum is
  bias diff                 max |dist - single| of every router's expert bias after the
                            expert-bias update (absolute; one update moves a bias by the
                            update rate, 0.01)
  replica spread            max difference between copies of one tensor held by several
                            ranks (dp replicas, tp-replicated layernorms, the two tied
                            embedding copies): finalization must make them equal, so 0
A step matches when grad rel. diff <= tolerance, |loss dist - loss single| <= tolerance x
|loss single|, bias diff <= 1e-6 and replica spread <= tolerance x the largest gradient."""


@dataclasses.dataclass(frozen=True)
class StepComparison:
    """How one step of the distributed run compares with the single-process run.

    Args:
      step: the step index.
      loss_dist: the distributed run's loss.
      loss_single: the single run's loss.
      grad_rel_diff: max |dist - single| over every gradient element / max |single|.
      worst_param: the parameter holding that maximum.
      bias_diff: max |dist - single| over every router's expert bias.
      replica_spread: the distributed run's max difference between replicas.
      grad_scale: max |single gradient| of the step.
    """

    step: int
    loss_dist: float
    loss_single: float
    grad_rel_diff: float
    worst_param: str
    bias_diff: float
    replica_spread: float
    grad_scale: float

    def ok(self, tol: float) -> bool:
        """Whether the step matches within relative tolerance ``tol``."""
        return (
            self.grad_rel_diff <= tol
            and abs(self.loss_dist - self.loss_single) <= tol * abs(self.loss_single)
            and self.bias_diff <= 1e-6
            and self.replica_spread <= tol * self.grad_scale
        )


def compare(dist: Mapping[str, Any], single: Mapping[str, Any]) -> list[StepComparison]:
    """Compare two dumps of examples/torch_train.py, step by step.

    Args:
      dist: the distributed run's dump (``--dump``).
      single: the single run's dump (``--single --dump``).

    Returns:
      One :class:`StepComparison` per step.

    Raises:
      ValueError: the dumps have different step counts, parameters or routers.
    """
    if len(dist["losses"]) != len(single["losses"]):
        raise ValueError(f"{len(dist['losses'])} distributed steps vs {len(single['losses'])} single steps")
    out = []
    for step, (dg, sg) in enumerate(zip(dist["grads"], single["grads"])):
        if sorted(dg) != sorted(sg):
            raise ValueError(f"step {step}: parameter names differ: {sorted(set(dg) ^ set(sg))}")
        scale = max(float(t.abs().max()) for t in sg.values()) or 1.0
        diffs = {n: float((dg[n].double() - sg[n].double()).abs().max()) for n in sg}
        worst = max(diffs, key=diffs.__getitem__)
        db, sb = dist["expert_bias"][step], single["expert_bias"][step]
        if sorted(db) != sorted(sb):
            raise ValueError(f"step {step}: routers differ: {sorted(set(db) ^ set(sb))}")
        bias = max((float((db[n].double() - sb[n].double()).abs().max()) for n in sb), default=0.0)
        out.append(
            StepComparison(
                step=step,
                loss_dist=float(dist["losses"][step]),
                loss_single=float(single["losses"][step]),
                grad_rel_diff=diffs[worst] / scale,
                worst_param=worst,
                bias_diff=bias,
                replica_spread=float(dist["replica_diff"][step]),
                grad_scale=scale,
            )
        )
    return out


def format_table(rows: Sequence[StepComparison], tol: float) -> str:
    """The per-step table and the verdict line."""
    name_w = max([len(r.worst_param) for r in rows] + [len("worst parameter")])
    header = (
        f"{'step':>4}  {'loss dist':>10}  {'loss single':>11}  {'grad rel. diff':>14}  "
        f"{'worst parameter':<{name_w}}  {'bias diff':>9}  {'replica spread':>14}  match"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.step:>4}  {r.loss_dist:>10.6f}  {r.loss_single:>11.6f}  {r.grad_rel_diff:>14.2e}  "
            f"{r.worst_param:<{name_w}}  {r.bias_diff:>9.2e}  {r.replica_spread:>14.2e}  "
            + ("yes" if r.ok(tol) else "NO")
        )
    bad = [r.step for r in rows if not r.ok(tol)]
    if bad:
        lines.append(f"VERDICT: MISMATCH at step(s) {bad} (tolerance {tol:g}): finalized gradients differ")
    else:
        lines.append(
            f"VERDICT: OK: all {len(rows)} steps of the distributed run match the single-process run "
            f"(tolerance {tol:g})"
        )
    return "\n".join(lines)


def _run(cmd: list[str]) -> None:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        sys.stdout.write(proc.stdout[-6000:])
        raise SystemExit(f"exit {proc.returncode}: {' '.join(cmd)}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for axis, default in (("pp", 2), ("dp", 2), ("cp", 1), ("tp", 2), ("ep", 2)):
        parser.add_argument(f"--{axis}", type=int, default=default, help=f"{axis} size (default {default})")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dtype", choices=sorted(TOLERANCE), default="float32", help="model dtype")
    parser.add_argument("--tolerance", type=float, help="relative tolerance (default: by dtype, 1e-5 / 1e-7)")
    parser.add_argument("--keep", type=Path, metavar="DIR", help="keep the two dumps (dist.pt, single.pt) in DIR")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run both versions, print the comparison and the verdict.

    Returns:
      0 when every step matches, else 1.
    """
    import torch

    args = parse_args(argv)
    tol = args.tolerance if args.tolerance is not None else TOLERANCE[args.dtype]
    world = args.pp * args.dp * args.cp * args.tp
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        common = [f"--steps={args.steps}", f"--dtype={args.dtype}"]
        sizes = [f"--{a}={getattr(args, a)}" for a in ("pp", "dp", "cp", "tp", "ep")]
        _run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
              str(TRAIN), *sizes, *common, f"--dump={folder / 'dist.pt'}"])
        _run([sys.executable, str(TRAIN), "--single", *common, f"--dump={folder / 'single.pt'}"])
        dist = torch.load(folder / "dist.pt", weights_only=False)
        single = torch.load(folder / "single.pt", weights_only=False)
    rows = compare(dist, single)
    print()
    print(f"{world} ranks (pp {args.pp}, dp {args.dp}, cp {args.cp}, tp {args.tp}, ep {args.ep}) vs one process, "
          f"{args.dtype}")
    print(EXPLANATION)
    print()
    print(format_table(rows, tol))
    return 0 if all(r.ok(tol) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
