"""Which gradient elements a recording samples, and reading them per step at C speed
(one ``index_select`` per gradient storage)."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from torch_impl.audit.fileformat import ROUTER_FIELDS
from torch_impl.audit.internals import is_dtensor


#: The name an embedding is sampled under: the same on every stage, whatever its name there
#: (``embedding.word_embeddings.weight`` on the first stage, ``output_layer.weight`` on the last).
ROLE_KEYS = {"word_embedding": "[word embedding]", "position_embedding": "[position embedding]"}


def sample_key(name: str, role: str) -> str:
    """What a parameter's sampled positions are drawn from: its role for the embeddings
    finalize sums across pipeline stages, else its name."""
    return ROLE_KEYS.get(role, name)


def sample_positions(name: str, numel: int, sample: int) -> np.ndarray:
    """The flat positions sampled from a gradient: the same on every rank for the same
    parameter name (:func:`sample_key`) and size (all of them when ``numel <= sample``).

    Args:
      name: the parameter's sample key.
      numel: its number of elements.
      sample: how many positions to take.

    Returns:
      Sorted int64 positions, always including the first and the last element.
    """
    if numel <= sample:
        return np.arange(numel, dtype=np.int64)
    digest = hashlib.blake2b(f"{name}|{numel}".encode(), digest_size=8).digest()
    rng = np.random.default_rng(int.from_bytes(digest, "little"))
    inner = rng.choice(numel - 2, size=max(sample - 2, 0), replace=False) + 1
    return np.unique(np.concatenate([[0, numel - 1], inner]).astype(np.int64))


def _grad_tensor(param: torch.Tensor, fsdp: bool) -> torch.Tensor | None:
    """The gradient finalize works on, as a plain tensor (a DTensor made whole, or its
    local shard under Megatron-FSDP)."""
    grad = getattr(param, "main_grad", None) if hasattr(param, "main_grad") else param.grad
    if grad is None or not param.requires_grad:
        return None
    if hasattr(grad, "full_tensor") and hasattr(grad, "to_local"):
        return grad.to_local() if fsdp else grad.full_tensor()
    return grad


@dataclasses.dataclass
class _Entry:
    """One parameter's static facts and its sampled positions."""

    info: dict[str, Any]
    positions: np.ndarray


_MAIN_GRAD = operator.attrgetter("main_grad")
_GRAD = operator.attrgetter("grad")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


class _Watch:
    """Whether the parameters still have the same gradient tensors, at C speed (a few
    ``map`` calls over fixed lists, no per-parameter Python): ``requires_grad``, which of
    ``main_grad`` / ``grad`` is read, the gradient objects and their data pointers.

    Args:
      params: the parameters, in a fixed order.
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        self.requires = list(map(_REQUIRES_GRAD, self.params))
        self.main = [p for p in self.params if hasattr(p, "main_grad")]
        self.plain = [p for p in self.params if not hasattr(p, "main_grad")]
        self.grads = list(map(_MAIN_GRAD, self.main)) + list(map(_GRAD, self.plain))
        self.tensors = [g for g in self.grads if isinstance(g, torch.Tensor)]
        self.ptrs = list(map(torch.Tensor.data_ptr, self.tensors))

    def same(self) -> bool:
        """True while every parameter reads the same gradient tensor, at the same address."""
        try:
            grads = list(map(_MAIN_GRAD, self.main)) + list(map(_GRAD, self.plain))
        except AttributeError:  # a main_grad was deleted
            return False
        return (
            all(map(operator.is_, grads, self.grads))
            and not any(map(hasattr, self.plain, itertools.repeat("main_grad")))
            and list(map(_REQUIRES_GRAD, self.params)) == self.requires
            and list(map(torch.Tensor.data_ptr, self.tensors)) == self.ptrs
        )

    def same_tensors(self) -> bool:
        """True while every parameter holds the same gradient tensor at the same address
        (what reading the values with the sampler needs; after the call)."""
        try:
            grads = list(map(_MAIN_GRAD, self.main)) + list(map(_GRAD, self.plain))
        except AttributeError:
            return False
        return all(map(operator.is_, grads, self.grads)) and list(map(torch.Tensor.data_ptr, self.tensors)) == self.ptrs


#: How a sampling op reads: from a storage's flat view, from a tensor, from a DTensor's parameter.
_STORAGE, _TENSOR, _DTENSOR = 0, 1, 2


@dataclasses.dataclass
class _Sampler:
    """How to read every sampled value of one set of gradient tensors, in slot order.

    Args:
      watch: tells whether the parameters still have these gradient tensors.
      ops: (kind, source, flat indices, dtype to cast to or None) per storage or tensor.
      perm: slot -> index into the concatenated op results (+ one NaN at the end), or None
        where they already are in slot order.
      present: per parameter, whether it had a gradient of its recorded size.
      dtype: the dtype the values are kept in (float64 only for float64 gradients).
    """

    watch: Any
    ops: list[tuple[int, Any, torch.Tensor, torch.dtype | None]]
    perm: torch.Tensor | None
    present: np.ndarray
    dtype: torch.dtype
    total: int

    def read(self, fsdp: bool) -> torch.Tensor:
        """The sampled values (a new tensor: later changes of the gradients do not show)."""
        pieces = []
        for kind, source, index, cast in self.ops:
            if kind == _STORAGE:
                piece = source.index_select(0, index)
            elif kind == _TENSOR:
                piece = torch.take(source, index)
            else:
                piece = torch.take(_grad_tensor(source, fsdp), index)
            pieces.append(piece if cast is None else piece.to(cast))
        if self.perm is None:
            if len(pieces) == 1:
                return pieces[0]
            return torch.cat(pieces) if pieces else torch.zeros(0, dtype=self.dtype)
        device = self.perm.device
        pieces.append(torch.full((1,), float("nan"), dtype=self.dtype, device=device))
        return torch.cat(pieces).index_select(0, self.perm)


def _sampler(entries: list[_Entry], params: list[torch.Tensor], fsdp: bool) -> _Sampler:
    """Group the sampled positions by gradient storage (one ``index_select`` each)."""
    dtype = torch.float64 if any(e.info["dtype"] == "float64" for e in entries) else torch.float32
    watch = _Watch(params)
    groups: dict[Any, tuple[torch.Tensor, list[np.ndarray], list[np.ndarray]]] = {}
    ops: list[tuple[int, Any, torch.Tensor, torch.dtype | None]] = []
    order: list[np.ndarray] = []
    present: list[bool] = []
    start = 0
    device = None
    for entry, param in zip(entries, params):
        n = entry.positions.size
        slots = np.arange(start, start + n, dtype=np.int64)
        start += n
        raw = getattr(param, "main_grad", None) if hasattr(param, "main_grad") else param.grad
        grad = _grad_tensor(param, fsdp)
        ok = grad is not None and grad.numel() == entry.info["numel"]
        present.append(ok)
        if not ok:
            continue
        device = grad.device if device is None else device
        cast = None if grad.dtype == dtype else dtype
        if is_dtensor(raw):
            ops.append((_DTENSOR, param, torch.from_numpy(entry.positions).to(grad.device), cast))
            order.append(slots)
            continue
        key = None
        if grad.is_contiguous() and grad.layout is torch.strided:
            try:
                key = (grad.untyped_storage().data_ptr(), grad.dtype, grad.device)
            except (RuntimeError, NotImplementedError):
                key = None
        if key is None:
            ops.append((_TENSOR, grad, torch.from_numpy(entry.positions).to(grad.device), cast))
            order.append(slots)
            continue
        if key not in groups:
            base = torch.empty(0, dtype=grad.dtype, device=grad.device).set_(grad.untyped_storage())
            groups[key] = (base, [], [])
        groups[key][1].append(entry.positions + grad.storage_offset())
        groups[key][2].append(slots)
    for base, index, slots in groups.values():
        cast = None if base.dtype == dtype else dtype
        ops.append((_STORAGE, base, torch.from_numpy(np.concatenate(index)).to(base.device), cast))
        order.append(np.concatenate(slots))
    flat = np.concatenate(order) if order else np.zeros(0, np.int64)
    perm = None
    if flat.size != start or not np.array_equal(flat, np.arange(start)):
        inverse = np.full(start, flat.size, dtype=np.int64)  # absent: the NaN after the values
        inverse[flat] = np.arange(flat.size)
        perm = torch.from_numpy(inverse).to(device if device is not None else "cpu")
    return _Sampler(watch, ops, perm, np.asarray(present, dtype=bool), dtype, start)


def _router_values(routers: list[nn.Module]) -> tuple[list[list[Any]], list[torch.Tensor]]:
    """(fields: [router index, field, shape] of every buffer present, their tensors)."""
    fields: list[list[Any]] = []
    tensors: list[torch.Tensor] = []
    for i, module in enumerate(routers):
        for field in ROUTER_FIELDS:
            buffer = getattr(module, field, None)
            if isinstance(buffer, torch.Tensor):
                fields.append([i, field, list(buffer.shape)])
                tensors.append(buffer)
    return fields, tensors


def _concat64(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensors flattened into one new float64 tensor (None when there are none)."""
    if not tensors:
        return None
    return torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])


def _scalar(t: torch.Tensor) -> float:
    """A one-element tensor's value (the first element of a larger one)."""
    return float(t) if t.numel() == 1 else float(t.reshape(-1)[0])


def _host(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` on the host, copied in this thread (in stream order) when it is on a device."""
    return t if t is None or t.device.type == "cpu" else t.cpu()


def _numpy(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.detach().cpu().numpy()


