"""Staging copies as a few strided ops: scattered gradients of one storage whose offsets
repeat layer after layer (:func:`find_runs`, :class:`RunCopies`).

A Megatron DDP keeps every ``main_grad`` in one buffer, parameters in reverse order; a
reduction of the layernorm gradients stages them in model order. Each layer's
``input_layernorm.weight`` then sits at the same distance from the next layer's, in the
buffer and in the staging buffer alike: one strided view of each holds all of them, and
one op copies them (``copy_`` where the two run the same way, ``index_select`` with a
reversed row index where they run opposite ways: torch has no negative strides). On CPU
``_foreach_copy_`` copies one tensor at a time (about half a microsecond each on this
project's test machines), so a stage of 12 layers of 8 staged gradients copies in 8 ops
what took 96. On CUDA
``_foreach_copy_`` is a few fused kernels already, and the runs are not used there.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from torch_impl.run.row_gather import RowGather

#: Longest layer period looked for (parameters a layer stages), and how many items from
#: the start show whether the items repeat with a period (:func:`_repeats`).
MAX_PERIOD = 16
_PREFIX = 32


def _runs_with_period(period: int, numels: Sequence[int], sources: Sequence[int], targets: Sequence[int]) -> list[list[int]]:
    """Maximal runs (two items or more) of items ``i, i + period, ...`` of one numel whose
    source and target offsets each step by a constant."""
    runs: list[list[int]] = []
    n = len(numels)
    for first in range(period):
        chain = range(first, n, period)
        start = 0
        while start < len(chain) - 1:
            a, b = chain[start], chain[start + 1]
            step_s, step_t = sources[b] - sources[a], targets[b] - targets[a]
            if abs(step_s) < numels[a] or step_t < numels[a]:  # rows would overlap
                start += 1
                continue
            end = start + 1
            while end < len(chain) and numels[chain[end]] == numels[a] and (
                sources[chain[end]] - sources[chain[end - 1]] == step_s
                and targets[chain[end]] - targets[chain[end - 1]] == step_t
            ):
                end += 1
            if end - start >= 2:
                runs.append(list(chain[start:end]))
                start = end
            else:
                start += 1
    return runs


def find_runs(numels: Sequence[int], sources: Sequence[int], targets: Sequence[int]) -> tuple[list[list[int]], list[int]]:
    """The items grouped into strided runs.

    Args:
      numels: each item's element count.
      sources: each item's offset in its storage (elements).
      targets: each item's offset in the staging buffer (elements, increasing).

    Returns:
      (runs: lists of item indices, each of two or more items of one numel whose source
      and target offsets step by constants; singles: the other items' indices), for the
      smallest period (up to :data:`MAX_PERIOD`) with which the items repeat; no runs
      where none does.
    """
    n = len(numels)
    runs = next((_runs_with_period(p, numels, sources, targets) for p in range(1, min(MAX_PERIOD, n // 2) + 1)
                 if _repeats(p, numels, sources, targets)), [])
    covered = {i for run in runs for i in run}
    return runs, [i for i in range(n) if i not in covered]


def _repeats(period: int, numels: Sequence[int], sources: Sequence[int], targets: Sequence[int]) -> bool:
    """Whether most of the first :data:`_PREFIX` items start a run with this period: item
    ``i + period`` of the same numel, as far from item ``i`` in source and target as item
    ``i + 2 * period`` is from it (the smallest such period is the layer's; its multiples
    would cut each run into several)."""
    checked = min(_PREFIX, len(numels) - 2 * period)
    hits = sum(
        numels[i] == numels[i + period] == numels[i + 2 * period]
        and sources[i + period] - sources[i] == sources[i + 2 * period] - sources[i + period]
        and targets[i + period] - targets[i] == targets[i + 2 * period] - targets[i + period]
        for i in range(checked)
    )
    return checked > 0 and 2 * hits >= checked


@functools.cache
def _index_select_fills_strided_out() -> bool:
    """Whether ``torch.index_select(..., out=view)`` writes a strided view row by row (a
    probe on tiny tensors: a torch that made the copy another way would otherwise move
    gradients to the wrong rows)."""
    source = torch.arange(6.0, device="cpu").view(3, 2)
    target = torch.zeros(9, device="cpu")
    rows = target.as_strided((3, 2), (3, 1), 1)
    torch.index_select(source, 0, torch.tensor([2, 1, 0], device="cpu"), out=rows)
    return torch.equal(target, torch.tensor([0.0, 4, 5, 0, 2, 3, 0, 0, 1], device="cpu"))


class RunCopies:
    """The copies between gradient tensors of one storage and a staging buffer, as strided
    runs (:func:`find_runs`) and one ``_foreach_copy_`` for the rest; the copy in as one
    gather of whole rows where every tensor starts and ends on a long enough row
    (:class:`~torch_impl.run.row_gather.RowGather`).

    Valid while each tensor keeps its data pointer (the runs are views of the storage as
    it was: :class:`~torch_impl.call.watches.GradWatch` checks the pointers every step).

    Args:
      tensors: the gradient tensors (contiguous, of ``buffer``'s dtype, one storage).
      buffer: the staging buffer, the tensors back to back in their order.
      views: the tensors' views of ``buffer``.
      runs, singles: :func:`find_runs`'s answer for them.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], buffer: torch.Tensor, views: Sequence[torch.Tensor],
                 runs: list[list[int]], singles: list[int]) -> None:
        # Copied in by one gather of whole rows where the layout allows it (row_gather).
        self.gather = RowGather.build(tensors, buffer)
        self.forward: list[tuple[torch.Tensor, torch.Tensor]] = []  # (source rows, target rows), same direction
        self.reversed: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (source rows ascending, target rows, row index)
        for run in runs:
            first, second, last = tensors[run[0]], tensors[run[1]], tensors[run[-1]]
            count, numel = len(run), first.numel()
            step_s = second.storage_offset() - first.storage_offset()
            step_t = views[run[1]].storage_offset() - views[run[0]].storage_offset()
            target = buffer.as_strided((count, numel), (step_t, 1), views[run[0]].storage_offset())
            if step_s > 0:
                self.forward.append((first.as_strided((count, numel), (step_s, 1), first.storage_offset()), target))
            else:
                source = last.as_strided((count, numel), (-step_s, 1), last.storage_offset())
                self.reversed.append((source, target, torch.arange(count - 1, -1, -1, device=buffer.device)))
        self.single_tensors = [tensors[i] for i in singles]
        self.single_views = [views[i] for i in singles]

    @staticmethod
    def build(tensors: Sequence[torch.Tensor], buffer: torch.Tensor, views: Sequence[torch.Tensor]) -> RunCopies | None:
        """The run copies of ``tensors``, or None where ``_foreach_copy_`` is as good or
        the runs cannot be used: not on CPU, not all contiguous in ``buffer``'s dtype in
        one storage, or fewer than half the ops saved."""
        if len(tensors) < 4 or buffer.device.type != "cpu" or not _index_select_fills_strided_out():
            return None
        try:
            storage = tensors[0].untyped_storage().data_ptr()
            if not all(t.is_contiguous() and t.dtype == buffer.dtype and t.device == buffer.device
                       and t.untyped_storage().data_ptr() == storage and not t.requires_grad for t in tensors):
                return None
        except (RuntimeError, NotImplementedError):  # a tensor without storage
            return None
        numels = [t.numel() for t in tensors]
        runs, singles = find_runs(numels, [t.storage_offset() for t in tensors], [v.storage_offset() for v in views])
        if not runs or 2 * (len(runs) + bool(singles)) > len(tensors):
            return None
        return RunCopies(tensors, buffer, views, runs, singles)

    def copy_in(self) -> None:
        """The tensors into the staging buffer (one gather of rows where it was built)."""
        if self.gather is not None:
            self.gather.copy_in()
            return
        for source, target in self.forward:
            target.copy_(source)
        for source, target, rows in self.reversed:
            torch.index_select(source, 0, rows, out=target)
        if self.single_views:
            torch._foreach_copy_(self.single_views, self.single_tensors)

    def copy_out(self) -> None:
        """The staging buffer back into the tensors."""
        for source, target in self.forward:
            source.copy_(target)
        for source, target, rows in self.reversed:
            torch.index_select(target, 0, rows, out=source)
        if self.single_views:
            torch._foreach_copy_(self.single_tensors, self.single_views)


__all__ = ["MAX_PERIOD", "RunCopies", "find_runs"]
