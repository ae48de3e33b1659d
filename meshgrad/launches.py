"""The collectives a rank launches for a plan, as data: :class:`Launch` and
:func:`launches` (torch_impl's execution of each action: one collective per reduction over
a group of size > 1, as :mod:`torch_impl.run.execute` runs it), and the status round
torch_impl adds to every call (:func:`status_round`, the one place that models it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from meshgrad.actions import ExpertBiasUpdate, QbBetaUpdate, Reduction, StageReduction, TokenScale
from meshgrad.axes import GROUP_AXES, Group
from meshgrad.plan import FinalizePlan, GroupSizes
from meshgrad.status_wire import ELEMENTS, status_elements

#: Bytes per element of the dtypes a finalize collective carries.
ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8}

#: The status round's int64 elements beyond a one-word round (the wire format:
#: :mod:`meshgrad.status_wire`, which torch_impl's rounds encode by).
STATUS_INT64 = ELEMENTS["packed"]


@dataclasses.dataclass(frozen=True)
class Launch:
    """One collective a rank launches.

    Args:
      step: the plan step(s) (``"+"``-joined when fused), ``"status"`` for the status round.
      kind: ``all_reduce``, ``reduce_scatter`` or ``broadcast``.
      op: ``sum``, ``avg``, ``max`` (``-`` for a broadcast).
      group: the named group (:class:`~meshgrad.axes.Group` value) or ``"world"``.
      axes: the mesh axes the group varies.
      size: ranks in the group.
      dtype: the element type on the wire.
      numel: elements of the tensor launched (a reduce-scatter's padded input).
      overlapped: launched during backward (a DDP bucket with ``overlap_grad_reduce``);
        finalize only waits for it.
    """

    step: str
    kind: str
    op: str
    group: str
    axes: tuple[str, ...]
    size: int
    dtype: str
    numel: int
    overlapped: bool = False

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]

    def line(self) -> str:
        tail = "  (overlapped with backward)" if self.overlapped else ""
        return (f"{self.step:<22} {self.kind:<14} {self.op:<4} {self.group:<16} "
                f"{'x'.join(self.axes):<14} {self.size:>6} {self.dtype:<9} {self.numel:>14,} "
                f"{human_bytes(self.nbytes):>10}{tail}")


def human_bytes(n: float) -> str:
    """``n`` bytes as ``56 B``, ``4.3 KiB``, ``1.2 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"  # pragma: no cover


def launch(step: str, kind: str, op: str, group: Group, sizes: GroupSizes, dtype: str, numel: int,
           overlapped: bool = False) -> Launch | None:
    """The :class:`Launch` over a named group, or None when the group has one rank (no
    collective: torch_impl and Megatron skip it)."""
    size = sizes[group]
    if size <= 1:
        return None
    axes = tuple(a.value for a in GROUP_AXES[group])
    return Launch(step, kind, op, group.value, axes, size, dtype, int(numel), overlapped)


def _scatter_numel(numel: int, size: int) -> int:
    """The padded input of a reduce-scatter (torch_impl pads to a multiple of the group)."""
    return -(-numel // size) * size


def launches(plan: FinalizePlan, stage: int, num_tokens: bool, actions: Sequence[Any] | None = None,
             world: int = 0) -> tuple[Launch, ...]:
    """The collectives a torch_impl rank of pp ``stage`` launches for ``plan``, in order.

    Args:
      plan: the rank's plan.
      stage: its pp stage (a stage reduction launches only on member stages with a key).
      num_tokens: num_tokens is given (per-token loss): the token scale runs.
      actions: the actions to list (default: ``plan.actions_with(num_tokens)``).
      world: the world size (0: unknown); where the status round carries the token count
        (:func:`tokens_in_round`) the token scale launches nothing of its own.
    """
    shapes = {p.key: p.numel for p in plan.params}
    sizes = plan.sizes
    out: list[Launch | None] = []
    for a in plan.actions_with(num_tokens) if actions is None else actions:
        if isinstance(a, Reduction):
            numel = sum(shapes[k] for k in a.keys)
            size = sizes[a.group]
            if a.scatter:
                out.append(launch(a.step_text, "reduce_scatter", str(a.op), a.group, sizes, a.work_dtype,
                                   _scatter_numel(numel, size)))
            else:
                out.append(launch(a.step_text, "all_reduce", str(a.op), a.group, sizes, a.work_dtype, numel))
        elif isinstance(a, StageReduction):
            key = a.key_for(stage)
            if key is not None:
                out.append(launch(str(a.step), "all_reduce", str(a.op), a.group, sizes, a.dtype, shapes[key]))
        elif isinstance(a, ExpertBiasUpdate):
            out.append(launch(str(a.step), "all_reduce", "sum", a.group, sizes, "float32", sum(a.num_experts)))
        elif isinstance(a, QbBetaUpdate):
            out.append(launch(str(a.step), "all_reduce", "avg", a.group, sizes, "float32", sum(a.num_experts)))
        elif isinstance(a, TokenScale):
            if tokens_in_round(sizes, a.group, world):
                continue  # the status round carries the count
            out.append(launch(str(a.step), "broadcast", "-", Group.PP, sizes, "int64", 1))
            out.append(launch(str(a.step), "all_reduce", "sum", a.group, sizes, "int64", 1))
    return tuple(x for x in out if x is not None)


def tokens_in_round(sizes: GroupSizes, group: Group, world: int) -> bool:
    """Whether the status round carries the token count (torch_impl's
    ``torch_impl.run.status.fused_tokens``): pp = 1 and the token group is the whole world,
    so the round's one hop is that group (an integer ``num_tokens`` assumed, as Megatron's
    training loop passes it)."""
    return world > 1 and sizes[Group.PP] == 1 and sizes[group] == world


def status_round(world: int) -> tuple[Launch, ...]:
    """The status round torch_impl runs once per call before any data moves: one SUM
    all-reduce of :func:`status_elements` int64 over the world (a DeviceMesh, or spanning
    groups that reach every rank), which also carries the token count where
    :func:`tokens_in_round` holds. The comparison of signatures (small all-gathers) runs
    only when a plan is new, so it is not a per-step cost. Change the round here alone."""
    if world <= 1:
        return ()
    return (Launch("status", "all_reduce", "sum", "world", ("world",), world, "int64", status_elements(world)),)


__all__ = [
    "ITEMSIZE", "Launch", "STATUS_INT64", "human_bytes", "launch", "launches", "status_elements",
    "status_round", "tokens_in_round",
]
