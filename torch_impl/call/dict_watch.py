"""Dicts compared with copies at C speed (:class:`DictWatch`, :class:`ExactDicts`), the
comparison they share (:func:`differs`), and the module dicts' getters: what the watches
of :mod:`torch_impl.call.watches` and :mod:`torch_impl.call.model_watch` compare a
parameter's or module's attributes with."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from itertools import chain
from typing import Any

import torch
from torch import nn

MODULES = operator.itemgetter("_modules")
PARAMETERS = operator.itemgetter("_parameters")
BUFFERS = operator.itemgetter("_buffers")


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

    def __len__(self) -> int:
        return len(self.plain) + len(self.exact)

    def same(self) -> bool:
        """Whether every dict holds what it held at construction."""
        return not differs(self.plain, self.snapshots) and (not self.exact or self.exact_now.same(self.exact))
