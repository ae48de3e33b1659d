"""Bounded memo primitives of :class:`~torch_impl.call.model_state.ModelState`: whether a
source object still holds what a result was derived from (:class:`Snapshot`), and a
bounded dict insert (:func:`put`)."""

from __future__ import annotations

from collections.abc import Mapping
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
    again.

    Args:
      source: the object (a mapping, any object, or None).
      names: the attributes the result was derived from.
      by_vars: the result was derived from the instance dict alone (a Megatron
        ProcessGroupCollection, read as Megatron reads it), whatever ``__getattr__`` does.
    """

    __slots__ = ("source", "names", "live", "copy", "values")

    def __init__(self, source: Any, names: tuple[str, ...], by_vars: bool = False) -> None:
        self.source, self.names = source, names
        self.live = self.copy = None
        if isinstance(source, Mapping):
            self.values: Any = dict(source)
            return
        state = getattr(source, "__dict__", None)
        if isinstance(state, dict) and (by_vars or not hasattr(type(source), "__getattr__")):
            self.live, self.copy = state, dict(state)
        else:
            self.values = _read(source, names)

    def same(self) -> bool:
        """Whether ``source`` still holds the same values."""
        if self.live is not None:
            return not differs(self.live, self.copy)
        if isinstance(self.source, Mapping):
            return not differs(dict(self.source), self.values)
        return _read(self.source, self.names) == self.values


def put(cache: dict[Any, Any], key: Any, value: Any, limit: int = MAX_PLANS) -> Any:
    """``cache[key] = value``, first evicting the oldest entry when ``cache`` is full."""
    if key not in cache and len(cache) >= limit:
        cache.pop(next(iter(cache)))
    cache[key] = value
    return value
