"""Try a semantics variant: change one reduction of a plan, run it in both backends.

meshgrad decides every reduction in one place, :func:`meshgrad.plan_finalize`; both
backends execute the resulting :class:`meshgrad.FinalizePlan` and never re-derive it. To
test a variant of the semantics, edit the plan (it is a frozen dataclass: use
``dataclasses.replace``) and hand the edited plan to either backend.

This script plans a world of 4 ranks (dp = 2, tp = 2) with one sequence-parallel layernorm
weight and one linear weight, then builds the variant "average, rather than sum, the
sequence-parallel gradients over tp" by changing the op of the ``non_tp`` reduction from
SUM to AVG. It runs the unchanged plan and the variant

* in ``jax_impl`` (4 fake CPU devices, per-rank values stacked along dim 0), and
* in ``torch_impl`` (a gloo world of 4 processes on this machine),

and compares every rank's gradients with a numpy expectation written from
docs/semantics.md (``dp_sync``: mean over dp; ``non_tp``: sum over tp, or for the variant
the mean). The data are small integers, so every figure must be exactly 0.

Run::

    .venv/bin/python examples/semantics_variant.py

It prints the changed plan line, a table of max abs differences (backend x plan) and a
verdict; the exit status is 1 when any difference is not 0.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import numpy as np  # noqa: E402

from meshgrad import FinalizeConfig, FinalizePlan, ParallelDims, ParamSpec, ReduceOp, Reduction, Step  # noqa: E402
from meshgrad import plan_finalize  # noqa: E402

DIMS = ParallelDims(dp=2, tp=2)  # rank = dp_index * 2 + tp_index
SPECS = (
    ParamSpec("decoder.final_layernorm.weight", shape=(4,), sequence_parallel=True),
    ParamSpec("decoder.layers.0.mlp.linear_fc1.weight", shape=(3, 4)),
)
CONFIG = FinalizeConfig(sequence_parallel=True)


def with_op(plan: FinalizePlan, step: Step, op: ReduceOp) -> FinalizePlan:
    """A copy of ``plan`` whose reductions of ``step`` use ``op``.

    Args:
      plan: from :func:`meshgrad.plan_finalize`.
      step: the step to change.
      op: the new reduction op.

    Returns:
      The edited plan; every other action is unchanged.

    Raises:
      ValueError: the plan has no reduction of ``step`` (nothing would change).
    """
    changed = 0

    def edit(action: Any) -> Any:
        nonlocal changed
        if isinstance(action, Reduction) and action.step is step and not action.parts:
            changed += 1
            return dataclasses.replace(action, op=op)
        if isinstance(action, Reduction) and action.parts:
            return dataclasses.replace(action, parts=tuple(edit(p) for p in action.parts))
        return action

    actions = tuple(edit(a) for a in plan.actions)
    if not changed:
        raise ValueError(f"the plan has no {step} reduction to change:\n{plan.describe()}")
    return dataclasses.replace(plan, actions=actions)


def rank_grads() -> dict[tuple[int, str], np.ndarray]:
    """Every rank's gradients, stacked along dim 0 (rank order): small integers."""
    rng = np.random.default_rng(0)
    return {s.key: rng.integers(-8, 9, size=(DIMS.world_size, *s.shape)).astype(np.float32) for s in SPECS}


def expected(grads: dict[tuple[int, str], np.ndarray], variant: bool) -> dict[tuple[int, str], np.ndarray]:
    """What docs/semantics.md says each rank holds afterwards (numpy, no meshgrad).

    ``dp_sync``: every gradient becomes the mean over the dp ranks with the same tp index.
    ``non_tp``: the sequence-parallel layernorm becomes the sum over tp (the variant: the
    mean over tp); the linear weight is tp-sharded and left alone.
    """
    out = {}
    for spec in SPECS:
        g = grads[spec.key].reshape(DIMS.dp, DIMS.tp, *spec.shape)
        g = np.broadcast_to(g.mean(axis=0, keepdims=True), g.shape)
        if spec.sequence_parallel:
            tp = g.mean(axis=1, keepdims=True) if variant else g.sum(axis=1, keepdims=True)
            g = np.broadcast_to(tp, g.shape)
        out[spec.key] = np.ascontiguousarray(g).reshape(DIMS.world_size, *spec.shape)
    return out


def run_jax(plan: FinalizePlan, grads: dict[tuple[int, str], np.ndarray]) -> dict[tuple[int, str], np.ndarray]:
    """Execute ``plan`` with jax_impl on stacked per-rank values (4 fake CPU devices)."""
    from jax_impl.finalize import finalize

    out, _ = finalize(grads, None, None, plan=plan, dims=DIMS)
    return {k: np.asarray(v) for k, v in out.items()}


def _torch_rank(rank: int, plan: FinalizePlan, grads: dict[tuple[int, str], np.ndarray], folder: str) -> None:
    """One gloo rank: this rank's gradients as ``param.grad``, the plan's actions, save."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from torch_impl.execute import execute_local
    from torch_impl.grads import GradAccess
    from torch_impl.groups import MeshGroups

    dist.init_process_group(
        "gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=DIMS.world_size
    )
    try:
        mesh = init_device_mesh("cpu", (DIMS.dp, DIMS.tp), mesh_dim_names=("dp", "tp"))
        params = {}
        for key, stacked in grads.items():
            param = torch.nn.Parameter(torch.zeros(stacked.shape[1:]))
            param.grad = torch.from_numpy(stacked[rank].copy())
            params[key] = param
        execute_local(plan.actions, GradAccess(params), {}, MeshGroups(mesh).resolve())
        torch.save({k: p.grad.numpy() for k, p in params.items()}, f"{folder}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_torch(plan: FinalizePlan, grads: dict[tuple[int, str], np.ndarray]) -> dict[tuple[int, str], np.ndarray]:
    """Execute ``plan`` with torch_impl in a gloo world of 4 processes; stack the results."""
    import torch
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_torch_rank, args=(plan, grads, folder), nprocs=DIMS.world_size, join=True)
        ranks = [torch.load(f"{folder}/rank{r}.pt", weights_only=False) for r in range(DIMS.world_size)]
    return {k: np.stack([r[k] for r in ranks]) for k in grads}


def max_diff(got: dict[tuple[int, str], np.ndarray], want: dict[tuple[int, str], np.ndarray]) -> float:
    """Largest absolute difference over every gradient of every rank."""
    return max(float(np.abs(got[k] - want[k]).max()) for k in want)


def main() -> int:
    """Run both plans in both backends; print the table and the verdict.

    Returns:
      0 when every difference is 0, else 1.
    """
    from jax_impl.mesh import ensure_host_devices

    ensure_host_devices(DIMS.world_size)  # before jax is first imported
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    plan = plan_finalize(list(SPECS), CONFIG, DIMS)
    variant = with_op(plan, Step.NON_TP, ReduceOp.AVG)
    line = lambda p: next(x for x in p.describe().splitlines() if x.startswith("non_tp"))  # noqa: E731
    print(f"world of {DIMS.world_size} ranks (dp={DIMS.dp}, tp={DIMS.tp}); the plan's non_tp action:")
    print(f"  planned: {line(plan)}")
    print(f"  variant: {line(variant)}")
    grads = rank_grads()
    rows = []
    for name, p, is_variant in (("planned", plan, False), ("variant", variant, True)):
        want = expected(grads, is_variant)
        rows.append((name, max_diff(run_jax(p, grads), want), max_diff(run_torch(p, grads), want)))
    print()
    print("max abs difference from the numpy expectation, over every gradient of every rank")
    print(f"{'plan':<10}{'jax':>8}{'torch':>8}")
    for name, j, t in rows:
        print(f"{name:<10}{j:>8.3g}{t:>8.3g}")
    ok = all(j == 0 and t == 0 for _, j, t in rows)
    layernorm = (0, SPECS[0].name)
    change = float(np.abs(expected(grads, True)[layernorm] - expected(grads, False)[layernorm]).max())
    print()
    print(f"the variant changes the layernorm gradient by up to {change:g} (so the comparison can tell the two plans apart)")
    print("VERDICT: " + ("both backends execute both plans exactly" if ok and change > 0 else "MISMATCH"))
    return 0 if ok and change > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
