"""Flat staging of a reduction's gradients: the span they already form in one storage,
or a staging buffer they are copied into and back (:class:`_Staging`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from torch_impl.run.strided_runs import RunCopies


def flat_span(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A 1-D view covering ``tensors`` when they lie back to back in one storage."""
    first = tensors[0]
    if not all(t.is_contiguous() for t in tensors):
        return None
    try:
        storage = first.untyped_storage().data_ptr()
        offset = first.storage_offset()
        for t in tensors:
            if t.dtype != first.dtype or t.device != first.device:
                return None
            if t.untyped_storage().data_ptr() != storage or t.storage_offset() != offset:
                return None
            offset += t.numel()
    except (RuntimeError, NotImplementedError):
        return None
    total = offset - first.storage_offset()
    return first.as_strided((total,), (1,), first.storage_offset())


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class _Staging:
    """The copies between a reduction's gradient tensors and a flat staging buffer laid
    out in their order, one op each way (a few with strided runs).

    A buffer kept between calls: ``_foreach_copy_`` over views of it made once (the
    fastest for many small tensors), or, from the second call on, on CPU for tensors of
    one storage laid out layer after layer (a Megatron DDP's buffer), a few strided copies
    (:class:`RunCopies`: looked for after the first call, which then pays neither the
    search nor a first parallel copy's start). A buffer made per call (a large one): when
    every tensor is contiguous and of the buffer's dtype, ``torch.cat`` in and
    ``split_with_sizes_copy`` out over flat views of the tensors made once, so that no
    Python view is made per tensor per call; else ``_foreach_copy_`` over views of the
    buffer made per call (cast and strided as needed).

    Args:
      tensors: the gradient tensors, in buffer order.
      sizes: their numel.
      dtype: the buffer's dtype (the collective's).
      keep: the buffer is kept between calls (then so are its views).
    """

    def __init__(self, tensors: list[torch.Tensor], sizes: list[int], dtype: torch.dtype, keep: bool) -> None:
        self.tensors, self.sizes, self.dtype = tensors, sizes, dtype
        self.shapes = [t.shape for t in tensors]
        plain = not keep and all(t.dtype == dtype and t.is_contiguous() for t in tensors)
        self.flats = [t.view(-1) for t in tensors] if plain else None
        self.kept = self._new() if keep else None
        self.runs: RunCopies | None = None
        self.calls_before_runs = 2 if keep else 0  # the runs are looked for at the second call

    def _new(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A new (uninitialized) buffer and the views the copies use."""
        buffer = torch.empty(sum(self.sizes), dtype=self.dtype, device=self.tensors[0].device)
        if self.flats is not None:
            return buffer, self.flats
        return buffer, [v.view(s) for v, s in zip(torch.split(buffer, self.sizes), self.shapes)]

    def copy_in(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The buffer (the kept one or a new one) filled with the tensors, with the views
        :meth:`copy_out` takes."""
        buffer, views = staged = self.kept or self._new()
        if self.calls_before_runs:
            self.calls_before_runs -= 1
            if not self.calls_before_runs:
                self.runs = RunCopies.build(self.tensors, buffer, views)
        if self.runs is not None:
            self.runs.copy_in()
        elif self.flats is not None:
            torch.cat(self.flats, out=buffer)
        else:
            torch._foreach_copy_(views, self.tensors)
        return staged

    def copy_out(self, staged: tuple[torch.Tensor, list[torch.Tensor]]) -> None:
        """Copy the buffer of :meth:`copy_in` back into the tensors."""
        buffer, views = staged
        if self.runs is not None:
            self.runs.copy_out()
        elif self.flats is not None:
            torch.split_with_sizes_copy(buffer, self.sizes, out=self.flats)
        else:
            torch._foreach_copy_(self.tensors, views)
