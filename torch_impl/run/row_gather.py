"""The staging copy-in of gradients of one storage as one gather of rows (:class:`RowGather`).

A Megatron DDP's buffer lays parameters out back to back, so every staged gradient starts
and ends on a multiple of the largest row length ``row`` that divides every offset and
size (the hidden size's divisors, in a transformer). The storage viewed as rows of
``row`` elements then holds each staged gradient as whole rows, and one ``index_select``
of those rows fills the staging buffer in order: one op where the strided runs take one
per position in the layer (:mod:`torch_impl.run.strided_runs`; on CPU each op costs a
couple of microseconds besides its bytes). The way back stays with the runs: torch's
row scatters (``index_copy_``, ``index_put_``) copy slower than they do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

#: The shortest row worth a gather (elements): the row index grows as the rows shrink.
MIN_ROW = 64
#: The most elements one gather copies: torch splits a larger CPU copy over its intra-op
#: threads (its grain size), whose wake-up costs more than copying these few hundred KiB.
_SERIAL_ELEMENTS = 32768


class RowGather:
    """``buffer`` filled from ``tensors`` in one ``index_select`` of whole rows of their
    storage.

    Valid while each tensor keeps its data pointer (the rows are a view of the storage as
    it was: :class:`~torch_impl.call.watches.GradWatch` checks the pointers every step).

    Args:
      source: the tensors' storage viewed as rows.
      index: the rows of each tensor, the tensors in buffer order.
      target: the staging buffer viewed as rows (copied in parts of at most
        ``_SERIAL_ELEMENTS`` elements).
    """

    __slots__ = ("source", "parts")

    def __init__(self, source: torch.Tensor, index: torch.Tensor, target: torch.Tensor) -> None:
        self.source = source
        per = max(1, _SERIAL_ELEMENTS // source.shape[1])
        self.parts = [(index[i:i + per], target[i:i + per]) for i in range(0, index.numel(), per)]

    @staticmethod
    def build(tensors: Sequence[torch.Tensor], buffer: torch.Tensor) -> RowGather | None:
        """The gather of ``tensors`` (contiguous, of ``buffer``'s dtype and device, one
        storage: :meth:`~torch_impl.run.strided_runs.RunCopies.build` checked) into
        ``buffer`` (contiguous, the tensors back to back in their order), or None where the
        rows would be shorter than :data:`MIN_ROW`."""
        offsets = [t.storage_offset() for t in tensors]
        numels = [t.numel() for t in tensors]
        row = math.gcd(*offsets, *numels)
        if row < MIN_ROW or not buffer.is_contiguous() or buffer.numel() != sum(numels):
            return None
        end = max(o + n for o, n in zip(offsets, numels))
        source = tensors[0].as_strided((end // row, row), (row, 1), 0)
        rows = [o // row + i for o, n in zip(offsets, numels) for i in range(n // row)]
        index = torch.tensor(rows, dtype=torch.int64, device=buffer.device)
        return RowGather(source, index, buffer.view(-1, row))

    def copy_in(self) -> None:
        """The tensors into the staging buffer."""
        for index, target in self.parts:
            torch.index_select(self.source, 0, index, out=target)


__all__ = ["MIN_ROW", "RowGather"]
