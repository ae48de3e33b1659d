"""Gradient access: which tensor is a parameter's gradient, DTensor unshard / reshard,
Megatron-FSDP local shards, and the watches that say whether gradients and model still
are what a cached plan and its bound program were made for.

* :func:`get_grad` / :func:`grad_attr`: ``param.main_grad`` when the parameter has it,
  else ``param.grad``.
* :class:`GradAccess`: per-step access by key; a DTensor gradient is made whole on first
  use and written back into its local shard by :meth:`GradAccess.flush` (with
  ``local_shards``, Megatron FSDP, its local shard is used as is).
* :class:`GradWatch` (parameters' flags and gradient tensors) and :class:`ModelWatch`
  (structure, routers, chunk facts), compared at C speed every step.
"""

from __future__ import annotations

import operator
import sys
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module

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
    DTensor can exist before ``torch.distributed.tensor`` is imported)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


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


class GradAccess:
    """Per-step access to gradients by key.

    Plain tensors are used in place. A DTensor gradient is unsharded on first use and
    written back into its local shard by :meth:`flush`; with ``local_shards`` (Megatron
    FSDP) its local shard is used directly.

    Args:
      params: parameter objects by key.
      local_shards: reduce DTensor local shards instead of whole tensors.
    """

    def __init__(self, params: Mapping[ParamKey, torch.Tensor], local_shards: bool = False) -> None:
        self.params = params
        self.local_shards = local_shards
        self._work: dict[ParamKey, torch.Tensor] = {}
        self._dtensors: dict[ParamKey, torch.Tensor] = {}

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


_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_GRAD = operator.attrgetter("grad")
_SHAPE = operator.attrgetter("shape")  # a little cheaper than Tensor.size()
_MODULES = operator.itemgetter("_modules")
_PARAMETERS = operator.itemgetter("_parameters")
_BUFFERS = operator.itemgetter("_buffers")


#: Attribute values whose ``==`` tells a replacement from the same object: plain values
#: compare by value (an equal replacement reads the same: flags are read by truth value),
#: and a plain tensor that is not of one element (or is on the meta device) raises when
#: compared with any other tensor.
_PLAIN_VALUES = (bool, int, float, str, bytes, type(None))
_PLAIN_TENSORS = (torch.Tensor, nn.Parameter)


def _compares_by_identity(value: Any) -> bool:
    """Whether a changed ``value`` cannot compare equal to its replacement, as far as the
    watches are concerned (see :data:`_PLAIN_VALUES`; a module without its own ``==``
    compares by identity)."""
    kind = type(value)
    if kind in _PLAIN_VALUES:
        return True
    if isinstance(value, nn.Module):
        return kind.__eq__ is object.__eq__
    # A meta or empty tensor's comparison result has no truth value (it raises, like a
    # tensor of two or more elements): only a one-element tensor can compare equal.
    return kind in _PLAIN_TENSORS and (value.device.type == "meta" or value.numel() != 1)


def by_value(mapping: Mapping[str, Any]) -> bool:
    """Whether a copy of ``mapping`` tells every replacement by ``==`` (all its values
    :func:`_compares_by_identity`); else it is compared key by key, by identity
    (:class:`ExactDicts`)."""
    return all(map(_compares_by_identity, mapping.values()))


def differs(live: Any, snapshot: Any) -> bool:
    """``live != snapshot`` (C-level for lists and dicts: identical elements short-cut); a
    comparison that raises (two different tensors) counts as a change."""
    try:
        return live != snapshot
    except Exception:  # noqa: BLE001 -- an elementwise comparison's error: not the same object
        return True


def split(items: Iterable[Any], flags: Iterable[bool]) -> tuple[list[Any], list[Any]]:
    """(the items whose flag is true, the others), each in order."""
    kept: list[Any] = []
    rest: list[Any] = []
    for item, flag in zip(items, flags):
        (kept if flag else rest).append(item)
    return kept, rest


class ExactDicts:
    """Dicts whose values need an identity check (a one-element or meta tensor, a tensor
    subclass): the same keys in the same order, each value the same object.

    Args:
      dicts: the dicts as they are now (their keys and values are held).
    """

    def __init__(self, dicts: Iterable[dict[str, Any]]) -> None:
        dicts = list(dicts)
        self.keys = list(map(tuple, dicts))
        self.values = list(chain.from_iterable(map(dict.values, dicts)))  # held: identity needs live objects

    def same(self, live: Iterable[dict[str, Any]]) -> bool:
        """Whether ``live`` (the dicts now, in construction order) hold what they held."""
        live = list(live)
        return list(map(tuple, live)) == self.keys and all(  # same keys: the values line up
            map(operator.is_, chain.from_iterable(map(dict.values, live)), self.values)
        )


class DictWatch:
    """Whether some dicts (parameters' or modules' attribute dicts) hold what they held.

    Each dict is compared with a copy, all in one list comparison (identical values
    short-cut; a plain value compares by value, a tensor that is not of one element raises
    against any other tensor: a change), or, when it holds a value that could compare
    equal to its replacement (a one-element tensor, a subclass), key by key and by
    identity (:class:`ExactDicts`).

    Args:
      dicts: the live dicts (held: they are the objects compared each time).
    """

    def __init__(self, dicts: Iterable[dict[str, Any]]) -> None:
        dicts = list(dicts)
        self.plain, self.exact = split(dicts, map(by_value, dicts))
        self.snapshots = list(map(dict.copy, self.plain))
        self.exact_now = ExactDicts(self.exact)

    def same(self) -> bool:
        """Whether every dict holds what it held at construction."""
        return not differs(self.plain, self.snapshots) and self.exact_now.same(self.exact)


class GradWatch:
    """Whether parameters still look as they did at construction, at C speed.

    Per parameter: ``requires_grad``, the ``.grad`` tensor object (where there is no
    ``main_grad``), every attribute set on the parameter (its ``__dict__``: ``main_grad``,
    ``allreduce``, ``sequence_parallel`` and the other flags), and, for each plain
    gradient tensor, its data pointer and size (so ``grad.data = ...`` or ``resize_`` is
    seen too), and the parameter's own shape (``param.data = ...`` of another shape). The attribute dicts are compared with copies in one list comparison: a
    value compares by identity first, a plain flag by value (an equal replacement means
    the same), a gradient tensor raises against any other tensor (a change); a dict
    holding another kind of value (a one-element tensor, a subclass) is compared key by
    key and value by identity. Everything runs as C-level loops over fixed lists: a few
    tens of nanoseconds per parameter and check.

    Args:
      params: the parameters (any order, fixed for this watch).
    """

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.params = tuple(params)
        self.requires = list(map(_REQUIRES_GRAD, self.params))
        dicts = list(map(vars, self.params))
        self.attributes = DictWatch(dicts)
        # .grad matters where main_grad is absent (its appearing changes the dict).
        self.grad_params = [p for p, d in zip(self.params, dicts) if "main_grad" not in d]
        self.grads = list(map(_GRAD, self.grad_params))
        tensors = []
        for p in self.params:
            g = get_grad(p)
            if isinstance(g, torch.Tensor) and g.layout is torch.strided and not is_dtensor(g) and g.device.type != "meta":
                tensors.append(g)
        self.tensors = tensors
        self.ptrs = list(map(torch.Tensor.data_ptr, tensors))
        self.sizes = list(map(_SHAPE, tensors))
        self.param_sizes = list(map(_SHAPE, self.params))  # ``param.data = ...`` of another shape

    def same(self) -> bool:
        """True when nothing a bound program or the plan depends on has changed."""
        return (
            list(map(_REQUIRES_GRAD, self.params)) == self.requires
            and self.attributes.same()
            and all(map(operator.is_, map(_GRAD, self.grad_params), self.grads))
            and list(map(torch.Tensor.data_ptr, self.tensors)) == self.ptrs
            # One torch.Size at a time, compared and let go of: a list of thousands of new
            # tuples would set the cyclic garbage collector off (10x the check itself).
            and all(map(operator.eq, map(_SHAPE, self.tensors), self.sizes))
            and all(map(operator.eq, map(_SHAPE, self.params), self.param_sizes))
        )

    def has_dtensor(self) -> bool:
        return any(is_dtensor(g) for g in map(get_grad, self.params))


class _Edges:
    """The module-tree dicts (``_modules`` / ``_parameters``) on the paths from the chunks'
    roots down to some objects, each compared whole with a copy (which also sees a removal
    or a direct dict assignment, which no registration hook reports).

    A copy is compared by ``==`` in one list comparison (identical values short-cut); a
    dict holding a value that could compare equal to its replacement (a one-element or
    meta parameter, a subclass) is compared key by key, by identity (:class:`ExactDicts`).

    Args:
      roots: the unwrapped chunks.
      targets: (chunk, dotted path, leaf kind -- ``_PARAMETERS`` for a parameter, None
        for a module) of each watched object.
    """

    def __init__(self, roots: Sequence[Any], targets: Iterable[tuple[int, str, Any]]) -> None:
        stores: dict[tuple[int, Any], tuple[dict[str, Any], Any]] = {}  # (owner, kind) -> (owner's __dict__, kind)
        modules: dict[tuple[int, str], Any] = {}  # (chunk, module path) -> the module there, or None

        def add(owner: Any, kind: Any) -> None:
            stores.setdefault((id(owner), kind), (vars(owner), kind))

        def module_at(chunk: int, path: str) -> Any:
            """The module at ``path`` (each prefix walked once), adding the edges to it."""
            key = (chunk, path)
            if key not in modules:
                found = roots[chunk] if isinstance(roots[chunk], nn.Module) else None
                if path:
                    head, _, last = path.rpartition(".")
                    parent = module_at(chunk, head)
                    found = parent._modules.get(last) if parent is not None else None
                    if found is not None:
                        add(parent, _MODULES)
                modules[key] = found
            return modules[key]

        for chunk, path, leaf_kind in targets:
            if leaf_kind is None:
                module_at(chunk, path)
            elif path:
                owner = module_at(chunk, path.rpartition(".")[0])
                if owner is not None:
                    add(owner, leaf_kind)
        owners = list(stores.values())
        plain, exact = split(owners, (by_value(kind(owner)) for owner, kind in owners))
        self.plain_owners, self.plain_kinds = [o for o, _ in plain], [k for _, k in plain]
        self.copies = list(map(dict.copy, map(operator.call, self.plain_kinds, self.plain_owners)))
        self.exact_owners, self.exact_kinds = [o for o, _ in exact], [k for _, k in exact]
        self.exact = ExactDicts(map(operator.call, self.exact_kinds, self.exact_owners))

    def same(self) -> bool:
        """Each module's dict (whichever object it now is) holds the same objects under the
        same names."""
        return not differs(list(map(operator.call, self.plain_kinds, self.plain_owners)), self.copies) and (
            self.exact.same(map(operator.call, self.exact_kinds, self.exact_owners))
        )


def _remove_hooks(handles: Sequence[Any]) -> None:
    for handle in handles:
        handle.remove()


class ModelWatch:
    """Whether a model still is what its cached plan was made for.

    Structure -- parameters, buffers or submodules registered, replaced or removed
    anywhere in the chunks -- is seen without visiting the parameters: torch's module
    registration hooks (filtered to this model's modules) set a dirty flag, and the
    module dicts on the paths to the watched parameters and routers are compared with
    copies (:class:`_Edges`: this also sees removals and direct dict edits, which no hook
    reports). Per step, then, the cost
    is that of the watched parameters' :class:`GradWatch`, the routers' attributes and
    buffers, and a few calls per chunk (wrapper chain, DDP object, embedding getters).

    Watched parameters: every parameter of a plain chunk (meshgrad reads every gradient
    for the DP sync), and of a Megatron-DDP chunk those a step of meshgrad may touch: a
    flag set (sequence_parallel, average_gradients_across_tp_domain, pipeline_parallel,
    flextron_router_pp_sync, is_gtp_weight_remat), an embedding role or a q/k layernorm
    name, plus whatever the bound plan reads (:meth:`cover`). Flags and requires_grad of
    the other parameters of a DDP chunk are read once per discovery
    (``torch_impl.invalidate_plans(model)`` forces a re-read). A seed helper checks less
    (:meth:`touched_same`: in full only what its plan may read), the router helpers only
    the routers (:meth:`routers_same`).

    Args:
      found: the discovered model.
      chunks: the chunks as given (wrappers included).
      facts: per chunk, the facts that decide discovery (:func:`chunk_facts`).
      watched: the keys of the parameters to watch.
      touched: the keys of the parameters a step besides the DP sync may touch (what a
        seed helper's plan may read: :meth:`touched_same`); None: all watched ones.
    """

    def __init__(
        self,
        found: Any,
        chunks: Sequence[Any],
        facts: Callable[[], tuple[Any, ...]],
        watched: Iterable[ParamKey],
        touched: Iterable[ParamKey] | None = None,
    ) -> None:
        self.found = found
        self.facts = facts
        self.chunk_facts = facts()  # held: their ids cannot be reused while watched
        self.fact_ids = tuple(map(id, self.chunk_facts))
        self.keys = set(watched)
        self.touched = self.keys if touched is None else set(touched) & self.keys
        self.grads = self._grad_watch(self.keys)
        self._helper: tuple[GradWatch, DictWatch] | None = None  # made on a helper's first check
        routers = list(found.router_modules.values())
        # A router's attributes against a copy (its containers, _buffers among them, are the
        # same objects, so they compare by identity); its buffers key by key, by identity
        # (a one-element buffer replaced by an equal one is still seen).
        self.router_dicts = list(map(vars, routers))
        self.router_snapshots = list(map(dict.copy, self.router_dicts))
        self.router_buffers = ExactDicts(map(_BUFFERS, self.router_dicts))
        self._edges(chunks, found)
        self.dirty = [False]
        ids = set(self.module_ids)

        def hook(kind: str) -> Callable[[Any, str, Any], None]:
            def seen(module: Any, name: str, value: Any) -> None:
                if id(module) in ids and not self_dirty[0]:
                    store = module.__dict__.get(kind)
                    if store is None or store.get(name) is not value:
                        self_dirty[0] = True

            return seen

        self_dirty = self.dirty
        handles = [
            torch_module.register_module_parameter_registration_hook(hook("_parameters")),
            torch_module.register_module_buffer_registration_hook(hook("_buffers")),
            torch_module.register_module_module_registration_hook(hook("_modules")),
        ]
        self._finalizer = weakref.finalize(self, _remove_hooks, handles)

    def _edges(self, chunks: Sequence[Any], found: Any) -> None:
        """The modules the hooks watch, and the module-tree edges down to the watched
        parameters and, apart, to the routers."""
        self.module_ids: list[int] = []
        for chunk in chunks:  # the wrapper chain
            self.module_ids.append(id(chunk))
            inner = chunk
            for _ in range(64):
                inner = getattr(inner, "module", None)
                if not isinstance(inner, nn.Module):
                    break
                self.module_ids.append(id(inner))
        for root in found.chunks:
            if isinstance(root, nn.Module):
                self.module_ids.extend(id(m) for m in root.modules())
        self.param_edges = self._parameter_edges()
        self.router_edges = _Edges(found.chunks, [(k[0], k[1], None) for k in found.router_modules])

    def _parameter_edges(self) -> _Edges:
        """The module-tree edges to the watched parameters."""
        return _Edges(self.found.chunks, [(k[0], k[1], _PARAMETERS) for k in self.keys])

    def structure_same(self) -> bool:
        """No registration in the model since construction, the same module-tree edges to
        the watched objects, and the same per-chunk facts."""
        return (
            not self.dirty[0]
            and self.param_edges.same()
            and self.router_edges.same()
            and tuple(map(id, self.facts())) == self.fact_ids
        )

    def routers_same(self) -> bool:
        """What a plan of router steps only (expert bias, qb_beta, reset) depends on: no
        registration in the model, the same edges to the routers, chunk facts, router
        attributes and buffers (not the parameters)."""
        return (
            not self.dirty[0]
            and self.router_edges.same()
            and tuple(map(id, self.facts())) == self.fact_ids
            and self._routers_unchanged()
        )

    def _routers_unchanged(self) -> bool:
        return not differs(self.router_dicts, self.router_snapshots) and self.router_buffers.same(
            map(_BUFFERS, self.router_dicts)  # whichever dict each router holds now
        )

    def same(self) -> bool:
        """True when the cached discovery (and every plan made from it) still holds."""
        return self.structure_same() and self._routers_unchanged() and self.grads.same()

    def touched_same(self) -> bool:
        """What a seed helper's plan depends on (it does no DP sync): structure, chunk
        facts and routers as :meth:`same`, the parameters a step besides the DP sync may
        touch (and what bound plans read) in full, and of the other watched parameters
        their attributes only (a flag set later makes one a candidate); their gradients
        and requires_grad are the DP sync's, which :meth:`same` checks."""
        if self._helper is None:
            if not self.same():  # the helper's snapshot starts from the discovered state
                return False
            rest = [self.found.tensors[k] for k in self.found.tensors if k in self.keys and k not in self.touched]
            full = self.grads if not rest else self._grad_watch(self.touched)
            self._helper = (full, DictWatch(map(vars, rest)))
        full, rest = self._helper
        return self.structure_same() and self._routers_unchanged() and full.same() and rest.same()

    def _grad_watch(self, keys: set[ParamKey]) -> GradWatch:
        return GradWatch(self.found.tensors[k] for k in self.found.tensors if k in keys)

    def cover(self, keys: Iterable[ParamKey], helper: bool = False) -> None:
        """Also watch ``keys`` (what a bound plan reads or writes; a seed helper's plan:
        also in :meth:`touched_same`): their flags and gradient tensors, and the module
        dicts on their paths."""
        keys = set(keys)
        if keys - self.keys:
            self.keys |= keys
            self.grads = self._grad_watch(self.keys)
            self.param_edges = self._parameter_edges()
            self._helper = None
        if helper and keys - self.touched:
            self.touched = self.touched | keys
            self._helper = None

    def has_dtensor(self) -> bool:
        return self.grads.has_dtensor()

    def close(self) -> None:
        """Remove the registration hooks now (they also go when the watch is collected)."""
        self._finalizer()


__all__ = ["GradAccess", "GradWatch", "ModelWatch", "differs", "get_grad", "grad_attr", "is_dtensor", "reshard", "unshard"]
