"""Gradient access: which tensor is a parameter's gradient, DTensor unshard / reshard,
Megatron-FSDP local shards.

* :func:`get_grad` / :func:`grad_attr`: ``param.main_grad`` when the parameter has it,
  else ``param.grad``.
* :class:`GradAccess`: per-step access by key; a DTensor gradient is made whole on first
  use and written back into its local shard by :meth:`GradAccess.flush` (with
  ``local_shards``, Megatron FSDP, its local shard is used as is).

The watches that say whether gradients and model still are what a cached plan was made
for are in :mod:`torch_impl.call.watches` and :mod:`torch_impl.call.model_watch`.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Iterable, Mapping, Sequence
from itertools import repeat
from typing import Any, NamedTuple

import torch

from meshgrad.params import ParamKey
from meshgrad.errors import FinalizeInputError


def grad_attr(param: torch.Tensor) -> str:
    """``"main_grad"`` when the parameter has that attribute, else ``"grad"``."""
    return "main_grad" if hasattr(param, "main_grad") else "grad"


def get_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient finalization works on (``main_grad`` or ``grad``)."""
    return getattr(param, grad_attr(param))


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor (without importing the slow DTensor package: no
    DTensor can exist before ``torch.distributed.tensor`` is imported; while another
    thread is still importing it, the module lacks ``DTensor`` and no DTensor exists yet)."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return dtensor is not None and isinstance(tensor, dtensor)


_GRAD = operator.attrgetter("grad")
#: A DTensor's local shard as ``to_local()`` gives it with grad mode off (the identity
#: ``to_local() is self._local_tensor``, which torch's own code keeps there on purpose).
LOCAL_SHARD = operator.attrgetter("_local_tensor")


def local_shard_grads(params: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
    """Each parameter's ``.grad`` local shard, in order, as :class:`GradAccess` with
    ``local_shards`` gives it, in a few C-level passes instead of a few calls per parameter
    (a step of an FSDP2 model binds its gradients anew: FSDP2 makes them anew each step).

    None where that shortcut does not apply: grad mode on, a parameter with ``main_grad``,
    a gradient that is not a DTensor (None included), or a torch whose DTensor keeps its
    shard elsewhere; the caller then reads them through :class:`GradAccess`.
    """
    # grad_attr's rule: a parameter with main_grad is read through it
    if any(map(hasattr, params, repeat("main_grad"))):
        return None
    return _local_shards(list(map(_GRAD, params)))


def _local_shards(grads: list[Any]) -> list[torch.Tensor] | None:
    """:func:`local_shard_grads` of parameters without ``main_grad``, from their ``.grad``s."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)  # as is_dtensor finds it
    if dtensor is None or torch.is_grad_enabled() or not all(map(isinstance, grads, repeat(dtensor))):
        return None
    try:
        return list(map(LOCAL_SHARD, grads))
    except AttributeError:
        return None


def unshard(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor made whole (``full_tensor()``); any other tensor unchanged."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


def reshard(tensor: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``tensor`` sharded like the DTensor ``reference`` (no communication: every rank
    holds the whole tensor), keeping the attributes set on ``reference``."""
    from torch.distributed.tensor import distribute_tensor  # late: a slow import, needed only with DTensors

    out = distribute_tensor(tensor, reference.device_mesh, reference.placements, src_data_rank=None)
    for name, value in vars(reference).items():
        if not name.startswith("_"):
            setattr(out, name, value)
    return out


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every element of ``tensors`` (non-empty) is finite: one fused max-norm per
    device (NaN and Inf propagate through it, it cannot overflow, and it allocates one
    scalar per tensor, not a mask of its size), one host sync."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    return all(
        bool(torch.isfinite(torch.stack(torch._foreach_norm(group, float("inf")))).all())
        for group in by_device.values()
    )


class GradRead(NamedTuple):
    """One parameter's gradient as the check stage reads it.

    Args:
      key: the parameter's key.
      param: the parameter.
      grad: its gradient (``main_grad`` or ``grad``), None when it has none.
      attr: the attribute it was read from.
      dtensor: the gradient or the parameter is a DTensor.
      local: the gradient's local shard (the gradient itself unless a DTensor).
    """

    key: ParamKey
    param: torch.Tensor
    grad: Any
    attr: str
    dtensor: bool
    local: Any


def read_grads(params: Mapping[ParamKey, torch.Tensor], keys: Iterable[ParamKey]) -> list[GradRead]:
    """The gradients of ``keys`` (those of ``params``), read once for the checks."""
    out = []
    for key in keys:
        param = params.get(key)
        if param is None:
            continue
        attr = grad_attr(param)
        grad = getattr(param, attr)
        dtensor = isinstance(grad, torch.Tensor) and (is_dtensor(grad) or is_dtensor(param))
        local = grad.to_local() if dtensor and is_dtensor(grad) else grad
        out.append(GradRead(key, param, grad, attr, dtensor, local))
    return out


def is_own_view(tensor: Any, own_views: Mapping[int, torch.Tensor]) -> bool:
    """Whether ``tensor`` is one of meshgrad's own buffer views (``own_views``: by id, the
    views themselves held so that an id is not reused while it is there)."""
    return own_views.get(id(tensor)) is tensor


class GradAccess:
    """Per-step access to gradients by key.

    Plain tensors are used in place. A DTensor gradient is unsharded on first use and
    written back into its local shard by :meth:`flush`; with ``local_shards`` (Megatron
    FSDP) its local shard is used directly.

    A gradient that is one of meshgrad's own buffer views (``own_views``) is used through
    a private alias of the same memory: a program bound to it depends on the buffer alone,
    not on the view object a user could change in place (``view.set_(...)``,
    ``view.data = ...``: unsupported, and then that parameter's gradient is not what is
    reduced, but no copy or collective changes under the program).

    Args:
      params: parameter objects by key.
      local_shards: reduce DTensor local shards instead of whole tensors.
      own_views: meshgrad's own buffer views by id (None: none).
    """

    def __init__(self, params: Mapping[ParamKey, torch.Tensor], local_shards: bool = False,
                 own_views: Mapping[int, torch.Tensor] | None = None) -> None:
        self.params = params
        self.local_shards = local_shards
        self.own_views = own_views or {}
        self._work: dict[ParamKey, torch.Tensor] = {}
        self._dtensors: dict[ParamKey, torch.Tensor] = {}

    def read(self, keys: Sequence[ParamKey]) -> list[torch.Tensor]:
        """``[self[key] for key in keys]``, in a few C-level passes where each is a plain
        ``.grad`` tensor (of class ``torch.Tensor`` itself: no ``main_grad``, DTensor or
        own view; a torch DDP step's new gradients) or, with ``local_shards``, a DTensor's
        local shard (:func:`local_shard_grads`: an FSDP2 step's), both bound on every step;
        else key by key (which raises for a gradient lost after planning)."""
        params = list(map(self.params.__getitem__, keys))
        if not any(map(hasattr, params, repeat("main_grad"))):  # grad_attr's rule: each one's .grad
            grads = list(map(_GRAD, params))
            if all(map(operator.is_, map(type, grads), repeat(torch.Tensor))) and not (
                    self.own_views and any(map(self.own_views.__contains__, map(id, grads)))):
                return grads
            shards = _local_shards(grads) if self.local_shards else None
            if shards is not None:
                return shards
        return [self[key] for key in keys]

    def __getitem__(self, key: ParamKey) -> torch.Tensor:
        work = self._work.get(key)
        if work is None:
            grad = get_grad(self.params[key])
            if grad is None:
                raise FinalizeInputError(f"parameter {key[1]!r} (chunk {key[0]}) lost its gradient after planning")
            if is_dtensor(grad):
                if self.local_shards:
                    work = grad.to_local()
                else:
                    work = grad.full_tensor()
                    self._dtensors[key] = grad
            elif is_own_view(grad, self.own_views):
                work = grad.as_strided(grad.shape, grad.stride(), grad.storage_offset())
            else:
                work = grad
            self._work[key] = work
        return work

    def flush(self) -> None:
        """Write unsharded DTensor gradients back into their local shards."""
        for key, grad in self._dtensors.items():
            grad.to_local().copy_(reshard(self._work[key], grad).to_local())
        self._dtensors.clear()
        self._work.clear()


__all__ = [
    "LOCAL_SHARD", "GradAccess", "GradRead", "all_finite", "get_grad", "grad_attr", "is_dtensor", "is_own_view",
    "local_shard_grads", "read_grads", "reshard",
    "unshard",
]
