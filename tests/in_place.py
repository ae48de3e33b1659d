"""Changes of a gradient tensor in place, each keeping the tensor object (and, but for the
swap and the resize, its data pointer): what the fast path's watch must see. Shared by the
tests that make them (steady path, embedding helpers, one-rank and grid reliability)."""

from __future__ import annotations

from typing import Any

import torch


def swap_storage(grad: Any) -> None:
    """Another storage with the same layout (values changed: a stale program would miss them)."""
    grad.data = grad.data.clone() * 3 + 1


def alias_rows(grad: Any) -> None:
    """The same storage and pointer, every row aliased (the first stride 0)."""
    grad.set_(grad.untyped_storage(), grad.storage_offset(), grad.shape, (0,) + grad.stride()[1:])


def view_as_int32(grad: Any) -> None:
    """The same storage, pointer and shape, another dtype."""
    grad.data = grad.data.view(torch.int32)


def resize(grad: Any) -> None:
    """Another storage and shape (one row more)."""
    grad.data = torch.zeros(grad.shape[0] + 1, *grad.shape[1:])


def pad_strides(grad: Any) -> None:
    """The same values in every other element of a new storage (strides doubled)."""
    padded = torch.zeros(2 * grad.numel(), dtype=grad.dtype)
    padded[::2] = grad.reshape(-1)
    grad.set_(padded.untyped_storage(), 0, grad.shape, tuple(2 * s for s in grad.contiguous().stride()))
