"""The watch that says at C speed whether a cached plan's inputs are unchanged:
:class:`GradWatch` (parameters' flags and gradient tensors, shapes of gradients and
parameters; their attribute dicts through :class:`~torch_impl.call.dict_watch.DictWatch`),
and what a layout reads of a tensor (:func:`tensor_layout`)."""

from __future__ import annotations

import operator
import weakref
from collections.abc import Iterable, Mapping, Sequence
from itertools import repeat
from typing import Any

import torch

from torch_impl.call.checks import disjoint_ranges, extent_bytes
from torch_impl.call.dict_watch import DictWatch, split
from torch_impl.call.tensor_guard import GuardedCheck
from torch_impl.run.grads import LOCAL_SHARD, get_grad, is_dtensor, is_own_view


_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_GRAD = operator.attrgetter("grad")
_SHAPE = operator.attrgetter("shape")  # a little cheaper than Tensor.size()
_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")
_LAYOUT = operator.attrgetter("layout")
#: A DTensor's sharding spec (mesh, placements, global shape and strides).
_SPEC = operator.attrgetter("_spec")
#: What a released :class:`GradWatch` holds in place of each gradient: no tensor is it.
_RELEASED = object()
#: What :meth:`GradWatch.renewal` read: (each gradient parameter's ``.grad``, the tensors
#: among them, their data pointers).
Renewal = tuple[list[Any], list[torch.Tensor], list[int]]


def _has_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has a plain data pointer: strided, not a DTensor, not on meta."""
    return tensor.layout is torch.strided and not is_dtensor(tensor) and tensor.device.type != "meta"


def tensor_layout(value: Any) -> tuple[Any, ...]:
    """What an in-place change can alter under the same tensor object and a plan depends
    on: shape, dtype, strides and data pointer (``.data = ...``, ``set_``, ``resize_``, a
    view as another dtype; 0 for a tensor without storage: a DTensor, meta); shape and
    dtype alone where torch has no strides (sparse); () for anything else."""
    if not isinstance(value, torch.Tensor):
        return ()
    try:
        return (value.shape, value.dtype, value.stride(), value.data_ptr())
    except (RuntimeError, NotImplementedError):  # a layout without strides
        return (value.shape, value.dtype)


def _by_pointer(param: torch.Tensor) -> bool:
    """Whether a replacement of ``param.data`` shows in its data pointer: it has storage
    and elements (every empty tensor's pointer is 0)."""
    return _has_storage(param) and param.numel() != 0


def _sizes_same(tensors: Sequence[torch.Tensor], sizes: Sequence[torch.Size]) -> bool:
    """Each tensor's shape equals its recorded one: one torch.Size at a time, compared and
    let go of (a list of thousands of new tuples would set the cyclic garbage collector
    off: 10x the check itself)."""
    return all(map(operator.eq, map(_SHAPE, tensors), sizes))


def _layouts_same(tensors: Sequence[torch.Tensor], sizes: Sequence[torch.Size], strides: Sequence[tuple[int, ...]],
                  dtypes: Sequence[torch.dtype]) -> bool:
    """Each tensor's shape, strides and dtype equal its recorded ones: what the full check
    judged that an in-place change keeps the data pointer through (``set_`` with other
    strides over the same storage, ``.data = t.view(other dtype)``)."""
    return (
        _sizes_same(tensors, sizes)
        and all(map(operator.eq, map(torch.Tensor.stride, tensors), strides))
        and all(map(operator.is_, map(_DTYPE, tensors), dtypes))
    )


class GradWatch:
    """Whether parameters still look as they did at construction, at C speed.

    Per parameter: ``requires_grad``, the ``.grad`` tensor object (where there is no
    ``main_grad``), every attribute set on the parameter (its ``__dict__``: ``main_grad``,
    ``allreduce``, ``sequence_parallel`` and the other flags), and, for each plain
    gradient tensor, its data pointer, size, strides and dtype (so ``grad.data = ...``,
    ``resize_``, ``set_`` or a view as another dtype is seen too), and the parameter's
    shape and own data pointer (``param.data = ...``: another tensor; a DTensor, meta or
    empty parameter has no pointer to compare). The attribute
    dicts are compared with copies in one list comparison: a value compares by identity
    first, a plain flag by value (an equal replacement means the same), a gradient tensor
    raises against any other tensor (a change); a dict holding another kind of value (a
    one-element tensor, a subclass) is compared key by key and value by identity.
    Everything runs as C-level loops over fixed lists: a few tens of nanoseconds per
    parameter and check; the parameters' ``requires_grad``, shapes and dtypes, the gradient
    tensors' shapes, strides and dtypes, and the facts of new ones (DTensor shards, renewed
    gradients), in one C++ call each where torch has its compiled tensor guard
    (:func:`~torch_impl.call.tensor_guard.metadata_guard`).

    A DTensor gradient (FSDP2 makes one anew on every step after
    ``zero_grad(set_to_none=True)``) is not held: no bound program uses it (a step binds
    its DTensor gradients' local shards anew), and holding it would keep a step's
    gradients alive past ``zero_grad``. It is watched by what the plan and the checks
    read of it (:meth:`_sharded_same`): its class, its sharding spec object (FSDP2 keeps
    one per parameter: the mesh, placements and global shape), and its local shard's
    dtype, device, layout, shape and inference flag.

    Plain ``.grad`` gradients renewed every step (``zero_grad(set_to_none=True)`` without
    bucket views: torch DDP's default) make :meth:`same` answer False; :meth:`renewed`
    then tells whether the new ones read as the old (facts, inference flags, memory ranges
    that overlap nowhere), :meth:`renew` watches them, and :meth:`release` lets them go
    after the call, keeping weak references (:meth:`returned`: the same tensors again).

    A gradient that is one of meshgrad's own buffer views (``own_views``, made by
    :func:`torch_impl.buffers.attach_grad_buffers`) is watched by identity only: the
    parameter still holding that view is what the bound program depends on; the view's
    own storage and shape are meshgrad's, and the program reads them through a private
    alias (:class:`~torch_impl.run.grads.GradAccess`), which no in-place change of the
    view reaches.

    Args:
      params: the parameters (any order, fixed for this watch).
      own_views: meshgrad's buffer views by id (None: none).
    """

    def __init__(self, params: Iterable[torch.Tensor], own_views: Mapping[int, torch.Tensor] | None = None) -> None:
        self.params = tuple(params)
        self.requires = list(map(_REQUIRES_GRAD, self.params))
        dicts = list(map(vars, self.params))
        self.attributes = DictWatch(dicts)
        # .grad matters where main_grad is absent (its appearing changes the dict): held
        # and compared by identity, but a DTensor gradient, watched by its facts.
        grad_params = [p for p, d in zip(self.params, dicts) if "main_grad" not in d]
        grads = list(map(_GRAD, grad_params))
        sharded = list(map(is_dtensor, grads))
        self.sharded_params, self.grad_params = split(grad_params, sharded)
        sharded_grads, self.grads = split(grads, sharded)
        shards = list(map(LOCAL_SHARD, sharded_grads))
        self.sharded_types = list(map(type, sharded_grads))
        self.specs = list(map(_SPEC, sharded_grads))
        # the local shard's dtype, device and layout: a DTensor takes its own from it when
        # made, and they are read without the subclass's dispatch
        self.shard_dtypes = list(map(_DTYPE, shards))
        self.shard_devices = list(map(_DEVICE, shards))
        self.shard_layouts = list(map(_LAYOUT, shards))
        self.shard_sizes = list(map(_SHAPE, shards))
        self.shard_inference = list(map(torch.Tensor.is_inference, shards))
        own = own_views if own_views is not None else {}
        self.tensors = [
            g for g in map(get_grad, self.params)
            if isinstance(g, torch.Tensor) and _has_storage(g) and not is_own_view(g, own)
        ]
        self.ptrs = list(map(torch.Tensor.data_ptr, self.tensors))
        self.sizes = list(map(_SHAPE, self.tensors))
        self.strides = list(map(torch.Tensor.stride, self.tensors))
        self.dtypes = list(map(_DTYPE, self.tensors))
        # Renewable (:meth:`renewed`): every gradient is a plain ``.grad`` tensor of its own
        # (or None): no main_grad, DTensor or meshgrad buffer view among them.
        self.grad_types = list(map(type, self.grads))
        self.renewable = (
            bool(self.grads) and len(self.grad_params) == len(self.params)
            and len(self.tensors) == len(self.grads) - self.grad_types.count(type(None))
            and all(kind is torch.Tensor or kind is type(None) for kind in self.grad_types)
        )
        self.devices = list(map(_DEVICE, self.tensors)) if self.renewable else []
        self.inference = list(map(torch.Tensor.is_inference, self.tensors)) if self.renewable else []
        self.extents = list(map(extent_bytes, self.tensors)) if self.renewable else []
        self.weak: list[weakref.ref[torch.Tensor]] | None = None  # set by release()
        # ``param.data = ...``: every parameter by its shape, a plain one also by its data
        # pointer (another tensor of any dtype or device; the shape as well, because a
        # storage freed by an earlier replacement can come back at the same address).
        self.plain_params = [p for p in self.params if _by_pointer(p)]
        self.param_ptrs = list(map(torch.Tensor.data_ptr, self.plain_params))
        self.param_sizes = list(map(_SHAPE, self.params))
        # a parameter without a gradient is described by its own dtype (``param_spec``)
        self.param_dtypes = list(map(_DTYPE, self.params))
        # its class may define flags (read once per discovery: ``_class_flags``)
        self.param_types = list(map(type, self.params))
        # requires_grad, shapes and dtypes in one C++ call where torch has the guard (the
        # parameters' strides are no question of the watch; the gradients' are); the facts
        # of new tensors (DTensor gradients' shards, renewed gradients) in one call as well.
        self.param_check, self.grad_check = GuardedCheck(strides=False), GuardedCheck()
        self.shard_check, self.renewal_check = GuardedCheck(strides=False, kinds=True), GuardedCheck(kinds=True)

    def __len__(self) -> int:
        return len(self.params)

    def same(self) -> bool:
        """True when nothing a bound program or the plan depends on has changed (at once
        for a watch of no parameters: a Megatron DDP chunk without flagged ones). The
        armed guards are asked here, each in one C++ call: a steady step's answer without
        a function more (:meth:`_params_same` / :meth:`_grad_layouts_same` where one is
        not armed or does not pass)."""
        params, tensors = self.params, self.tensors
        guard, grad_guard = self.param_check.guard, self.grad_check.guard
        return not params or (
            ((guard is not None and guard.check(*params)) or self._params_same())
            and self.attributes.same()
            and all(map(operator.is_, map(_GRAD, self.grad_params), self.grads))
            and (not self.sharded_params or self._sharded_same())
            and list(map(torch.Tensor.data_ptr, tensors)) == self.ptrs
            and (not tensors or (grad_guard is not None and grad_guard.check(*tensors)) or self._grad_layouts_same())
            and list(map(torch.Tensor.data_ptr, self.plain_params)) == self.param_ptrs
        )

    def renewed(self) -> bool:
        """Whether the parameters are as at construction (:meth:`same`) but for new
        ``.grad`` tensors of the same presence, class, dtype, device, layout, shape,
        strides and inference flag, whose memory ranges overlap nowhere: a training step
        after ``zero_grad(set_to_none=True)`` where the gradients are not views of one
        buffer (torch DDP's default). What the plan, the specs and the once-per-binding
        checks read of them is then what they read of the old ones (internal overlap is a
        matter of shape and strides; no two share an element); a bound program holds the
        old ones, and the NaN scan's spans are theirs: the caller redoes those. Only for a
        watch of plain ``.grad`` gradients (:attr:`renewable`)."""
        return self.renewal() is not None

    def renewal(self) -> Renewal | None:
        """:meth:`renewed`'s answer as what it read -- (the ``.grad`` of each gradient
        parameter, the tensors among them, their data pointers) for :meth:`renew` and
        :meth:`returned`, asked at once after it -- or None where it answers False."""
        if not self.renewable:
            return None
        params = self.params
        guard = self.param_check.guard
        grads, tensors = self._read_grads()
        if list(map(type, grads)) != self.grad_types:
            return None
        if not (
            ((guard is not None and guard.check(*params)) or self._params_same())
            and self.attributes.same()
            and list(map(torch.Tensor.data_ptr, self.plain_params)) == self.param_ptrs
            and self.renewal_check.same(tensors, lambda: (
                list(map(_DEVICE, tensors)) == self.devices
                and all(map(operator.is_, map(_LAYOUT, tensors), repeat(torch.strided)))
                and _layouts_same(tensors, self.sizes, self.strides, self.dtypes)
                and list(map(torch.Tensor.is_inference, tensors)) == self.inference
            ))
        ):
            return None
        ptrs = list(map(torch.Tensor.data_ptr, tensors))  # strided tensors: each has one
        return (grads, tensors, ptrs) if disjoint_ranges(ptrs, self.extents) else None

    def renew(self, renewal: Renewal | None = None) -> None:
        """Watch (and hold) the gradients :meth:`renewed` has just accepted: their facts
        are the recorded ones, the objects and data pointers new (``renewal``: what
        :meth:`renewal` read of them just now; None: read again)."""
        if renewal is None:
            grads, tensors = self._read_grads()
            renewal = grads, tensors, list(map(torch.Tensor.data_ptr, tensors))
        self.grads, self.tensors, self.ptrs = renewal
        self.weak = None

    def release(self) -> None:
        """Hold no gradient tensor, only weak references (a model whose gradients are
        renewed every step: the last step's would stay alive past ``zero_grad`` through
        forward and backward). :meth:`same` then answers False; :meth:`returned` tells
        whether a call finds the released tensors themselves."""
        self.weak = list(map(weakref.ref, self.tensors))
        self.grads = [_RELEASED] * len(self.grads)
        self.tensors = []

    def returned(self, renewal: Renewal | None = None) -> bool:
        """Whether the watch was released and the parameters hold the released gradient
        tensors, at their data pointers (asked after :meth:`renewed` answered True: with
        it, what :meth:`same` would have answered for them; ``renewal``: what
        :meth:`renewal` read just now, else read again)."""
        if self.weak is None:
            return False
        if renewal is None:
            (_, tensors), ptrs = self._read_grads(), None
        else:
            _, tensors, ptrs = renewal
        return (
            len(tensors) == len(self.weak)
            and all(map(operator.is_, tensors, map(operator.call, self.weak)))
            and (ptrs if ptrs is not None else list(map(torch.Tensor.data_ptr, tensors))) == self.ptrs
        )

    def _read_grads(self) -> tuple[list[Any], list[torch.Tensor]]:
        """(each gradient parameter's ``.grad`` now, the tensors among them)."""
        grads = list(map(_GRAD, self.grad_params))
        return grads, [g for g in grads if g is not None]

    def _sharded_same(self) -> bool:
        """The DTensor gradients' facts (class docstring) as at construction: the same
        classes (a gradient gone, or now a plain tensor, differs), each sharding spec the
        same object, and local shards of the same dtypes, devices, layouts, shapes and
        inference flags (a DTensor's dtype, device and layout are its local shard's when
        it is made; a shard changed in place since, ``.data = ...``, is seen on the shard)."""
        grads = list(map(_GRAD, self.sharded_params))
        if list(map(type, grads)) != self.sharded_types:
            return False
        shards = list(map(LOCAL_SHARD, grads))
        return all(map(operator.is_, map(_SPEC, grads), self.specs)) and self.shard_check.same(shards, lambda: (
            all(map(operator.is_, map(_DTYPE, shards), self.shard_dtypes))
            and list(map(_DEVICE, shards)) == self.shard_devices
            and all(map(operator.is_, map(_LAYOUT, shards), self.shard_layouts))
            and _sizes_same(shards, self.shard_sizes)
            and list(map(torch.Tensor.is_inference, shards)) == self.shard_inference
        ))

    def _params_same(self) -> bool:
        """The parameters' requires_grad, classes, shapes and dtypes, attribute by attribute
        (the guard, asked by :meth:`same`, was not armed or did not pass; re-armed here)."""
        return self.param_check.same(self.params, lambda: (
            list(map(_REQUIRES_GRAD, self.params)) == self.requires
            and all(map(operator.is_, map(type, self.params), self.param_types))
            and _sizes_same(self.params, self.param_sizes)
            and all(map(operator.is_, map(_DTYPE, self.params), self.param_dtypes))
        ), asked=True)

    def _grad_layouts_same(self) -> bool:
        """The plain gradient tensors' shapes, strides and dtypes, attribute by attribute
        (as :meth:`_params_same`)."""
        return self.grad_check.same(
            self.tensors, lambda: _layouts_same(self.tensors, self.sizes, self.strides, self.dtypes), asked=True
        )

    def has_dtensor(self) -> bool:
        """Whether a watched gradient is a DTensor (asked after :meth:`same` or
        :meth:`renewed` answered True: a renewable watch's gradients are plain)."""
        return not self.renewable and any(is_dtensor(g) for g in map(get_grad, self.params))
