"""Bounded memo primitives of :class:`~torch_impl.call.model_state.ModelState`: whether a
source object still holds what a result was derived from (:class:`Snapshot`), and a
bounded dict insert (:func:`put`)."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from functools import partial
from itertools import repeat
from typing import Any

from torch_impl.call.probes import Probes
from torch_impl.call.dict_watch import differs

#: Most plans (and helper group sets, embedding discoveries) one model state keeps.
MAX_PLANS = 16
_ABSENT = object()
#: Values a snapshot keeps a copy of: the same object changed in place (a config's
#: ``moe_router_load_balancing_type`` list appended to) must read as a change.
_MUTABLE = (list, dict, set, bytearray)


def _frozen(value: Any) -> Any:
    """A copy of a mutable container (one level deep), else the value itself."""
    return value.copy() if type(value) in _MUTABLE else value


def _frozen_dict(state: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``state`` whose container values are copies too (:func:`_frozen`)."""
    return {key: _frozen(value) for key, value in state.items()}


def _read(source: Any, names: tuple[str, ...]) -> tuple[Any, ...]:
    """The values of ``names`` in ``source`` (absent ones marked; containers copied)."""
    if source is None:
        return ()
    if isinstance(source, Mapping):
        return tuple([_frozen(source.get(name, _ABSENT)) for name in names])
    return tuple([_frozen(getattr(source, name, _ABSENT)) for name in names])


class Snapshot:
    """Whether an object (a config, a group source) still holds what it held when a
    result was derived from it: its attribute dict against a copy -- one C-level
    comparison -- when reading its attributes is plain (an instance dict, no
    ``__getattr__``); a mapping's items against a copy; else the values of ``names`` read
    again. A value that is a list, dict, set or bytearray is kept as a copy (one level
    deep), so the same container changed in place reads as a change. With ``by_names``,
    an object that holds more than twice as many attributes as ``names`` has its ``names``
    read again in one C-level call (``operator.attrgetter``), and the absent ones checked
    still absent: what the result was derived from, and no more (a Megatron
    TransformerConfig holds hundreds of attributes, FinalizeConfig reads twenty); a
    smaller one is compared whole, as without ``by_names``.

    Args:
      source: the object (a mapping, any object, or None).
      names: the attributes the result was derived from.
      by_vars: the result was derived from the instance dict alone (a Megatron
        ProcessGroupCollection, read as Megatron reads it), whatever ``__getattr__`` does.
      by_names: the result was derived from ``names`` alone, read with ``getattr`` (a
        change of any other attribute cannot change it).
    """

    __slots__ = ("source", "names", "live", "copy", "values", "getter", "absent")

    def __init__(self, source: Any, names: tuple[str, ...], by_vars: bool = False, by_names: bool = False) -> None:
        self.source, self.names = source, names
        self.live = self.copy = self.getter = None
        self.absent: tuple[str, ...] = ()
        if isinstance(source, Mapping):
            self.values: Any = _frozen_dict(source)
            return
        state = getattr(source, "__dict__", None)
        many = not isinstance(state, dict) or len(state) > 2 * len(names)
        if by_names and source is not None and many and self._read_by_names(source, names):
            return
        if isinstance(state, dict) and (by_vars or not hasattr(type(source), "__getattr__")):
            self.live, self.copy = state, _frozen_dict(state)
        else:
            self.values = _read(source, names)

    def _read_by_names(self, source: Any, names: tuple[str, ...]) -> bool:
        """Set up the ``by_names`` check: the names ``source`` has, read in one call, and
        those it lacks (each must stay absent). False when reading raised (a property that
        raises: the other checks take over, and the read that follows raises it)."""
        try:
            present = tuple(name for name in names if hasattr(source, name))
            getter = operator.attrgetter(*present) if present else _no_names
            values = getter(source)
            self.values = _frozen(values) if len(present) == 1 else tuple(map(_frozen, values))
        except Exception:  # noqa: BLE001 -- see above
            return False
        self.getter, self.absent = getter, tuple(name for name in names if name not in present)
        return True

    def same(self) -> bool:
        """Whether ``source`` still holds the same values."""
        if self.getter is not None:
            try:
                values = self.getter(self.source)
                added = any(map(hasattr, repeat(self.source), self.absent))
            except Exception:  # noqa: BLE001 -- an attribute gone or a property that raises: read it again
                return False
            return not added and not differs(values, self.values)
        if self.live is not None:
            return not differs(self.live, self.copy)
        if isinstance(self.source, Mapping):
            return not differs(dict(self.source), self.values)
        return _read(self.source, self.names) == self.values

    def probe(self, probes: Probes, absent: bool = True) -> None:
        """Write :meth:`same` down as probes (:class:`~torch_impl.call.probes.Probes`):
        the same reads, compared the same way (a None source always holds).

        Args:
          probes: where to write them.
          absent: also the names that must stay absent (else they are the caller's:
            :func:`probe_snapshots`).
        """
        if self.source is None:
            return
        if self.getter is not None:
            if self.getter is not _no_names:
                probes.equal(partial(self.getter, self.source), self.values)
            if absent and self.absent:
                probe_absent(probes, self.source, self.absent)
        elif self.live is not None:
            probes.live(self.live, self.copy)
        elif isinstance(self.source, Mapping):
            probes.equal(partial(dict, self.source), self.values)
        else:
            probes.equal(partial(_read, self.source, self.names), self.values)


#: What would make a missing attribute readable besides defining it.
_LOOKUP_HOOKS = ("__getattr__", "__getattribute__")


def probe_absent(probes: Probes, source: Any, names: tuple[str, ...]) -> None:
    """Write down as probes that ``source`` still has none of ``names`` (``hasattr``
    false for each). For an object whose attribute look-up is plain (an instance dict,
    no ``__getattr__`` / ``__getattribute__`` of its own), that is a few probes in all:
    its class, its instance dict, and that dict's and each class's keys disjoint from
    ``names`` (and from those look-up hooks); else one ``hasattr`` per name."""
    kind, state = type(source), getattr(source, "__dict__", None)
    classes = [c for c in kind.__mro__ if c is not object]
    if not isinstance(state, dict) or any(hook in vars(c) for c in classes for hook in _LOOKUP_HOOKS):
        for name in names:
            probes.same(partial(hasattr, source, name), False)
        return
    probes.same(partial(type, source), kind)
    probes.same(partial(getattr, source, "__dict__"), state)
    probes.same(partial(state.keys().isdisjoint, names), True)
    hidden = (*names, *_LOOKUP_HOOKS)
    for c in classes:
        probes.same(partial(vars(c).keys().isdisjoint, hidden), True)


def probe_snapshots(probes: Probes, snapshots: Iterable[Snapshot]) -> None:
    """Each snapshot's :meth:`Snapshot.probe`, with the absent names of snapshots of one
    source written down together."""
    missing: dict[int, tuple[Any, set[str]]] = {}
    for snapshot in snapshots:
        snapshot.probe(probes, absent=False)
        if snapshot.absent:
            missing.setdefault(id(snapshot.source), (snapshot.source, set()))[1].update(snapshot.absent)
    for source, names in missing.values():
        probe_absent(probes, source, tuple(sorted(names)))


def _no_names(source: Any) -> tuple[()]:
    """The ``by_names`` getter of an object that has none of the names."""
    return ()


def put(cache: dict[Any, Any], key: Any, value: Any, limit: int = MAX_PLANS) -> Any:
    """``cache[key] = value``, first evicting the oldest entry when ``cache`` is full."""
    if key not in cache and len(cache) >= limit:
        cache.pop(next(iter(cache)))
    cache[key] = value
    return value
