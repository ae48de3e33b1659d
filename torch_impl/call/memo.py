"""Bounded memo primitives of :class:`~torch_impl.call.model_state.ModelState`: whether a
source object still holds what a result was derived from (:class:`Snapshot`), and a
bounded dict insert (:func:`put`)."""

from __future__ import annotations

import operator
from collections.abc import Mapping
from itertools import repeat
from typing import Any

from torch_impl.call.watches import differs

#: Most plans (and helper group sets, embedding discoveries) one model state keeps.
MAX_PLANS = 16
_ABSENT = object()


def _read(source: Any, names: tuple[str, ...]) -> tuple[Any, ...]:
    """The values of ``names`` in ``source`` (absent ones marked)."""
    if source is None:
        return ()
    if isinstance(source, Mapping):
        return tuple([source.get(name, _ABSENT) for name in names])
    return tuple([getattr(source, name, _ABSENT) for name in names])


class Snapshot:
    """Whether an object (a config, a group source) still holds what it held when a
    result was derived from it: its attribute dict against a copy -- one C-level
    comparison -- when reading its attributes is plain (an instance dict, no
    ``__getattr__``); a mapping's items against a copy; else the values of ``names`` read
    again. With ``by_names``, an object that holds more than twice as many attributes as
    ``names`` has its ``names`` read again in one C-level call (``operator.attrgetter``),
    and the absent ones checked still absent: what the result was derived from, and no
    more (a Megatron TransformerConfig holds hundreds of attributes, FinalizeConfig reads
    twenty); a smaller one is compared whole, as without ``by_names``.

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
            self.values: Any = dict(source)
            return
        state = getattr(source, "__dict__", None)
        many = not isinstance(state, dict) or len(state) > 2 * len(names)
        if by_names and source is not None and many and self._read_by_names(source, names):
            return
        if isinstance(state, dict) and (by_vars or not hasattr(type(source), "__getattr__")):
            self.live, self.copy = state, dict(state)
        else:
            self.values = _read(source, names)

    def _read_by_names(self, source: Any, names: tuple[str, ...]) -> bool:
        """Set up the ``by_names`` check: the names ``source`` has, read in one call, and
        those it lacks (each must stay absent). False when reading raised (a property that
        raises: the other checks take over, and the read that follows raises it)."""
        try:
            present = tuple(name for name in names if hasattr(source, name))
            getter = operator.attrgetter(*present) if present else _no_names
            self.values = getter(source)
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


def _no_names(source: Any) -> tuple[()]:
    """The ``by_names`` getter of an object that has none of the names."""
    return ()


def put(cache: dict[Any, Any], key: Any, value: Any, limit: int = MAX_PLANS) -> Any:
    """``cache[key] = value``, first evicting the oldest entry when ``cache`` is full."""
    if key not in cache and len(cache) >= limit:
        cache.pop(next(iter(cache)))
    cache[key] = value
    return value
