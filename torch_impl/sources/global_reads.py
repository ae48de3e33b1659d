"""Whether a module's functions would read the same globals again (:class:`GlobalReads`).

``finalize_model_grads(pg_collection=None)`` reads Megatron's groups through
``parallel_state``'s getters, and keeps what they returned while the globals they read are
what they were. Those globals are found in the getters' code: every name a function's
code (its nested code objects included) looks up, followed into each function of the
same module that it names -- about twenty names in Megatron-Core, checked every step
instead of the whole module dict (over 160 entries). A global that no getter reads cannot
change what they return, so it no longer makes a step read the groups again.
"""

from __future__ import annotations

import operator
import types
from collections.abc import Iterable, Mapping
from functools import partial
from typing import Any

from torch_impl.call.probes import Probes


def _code_names(code: types.CodeType) -> set[str]:
    """Every name ``code`` and its nested code objects look up (globals, builtins and
    attribute names alike: an attribute name only adds a name to compare)."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _reached(module_dict: Mapping[str, Any], entries: Iterable[str]) -> set[str] | None:
    """The names ``entries`` reach in ``module_dict`` through the code of the module's own
    functions, or None where some reached object's reads cannot be told from its code (a
    decorated function, a class or another callable defined in the module)."""
    todo, seen = list(entries), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        value = module_dict.get(name)
        if isinstance(value, types.FunctionType) and value.__globals__ is module_dict:
            if hasattr(value, "__wrapped__"):
                return None
            todo.extend(_code_names(value.__code__))
        elif callable(value) and getattr(value, "__module__", None) == module_dict.get("__name__"):
            return None
    return seen


class GlobalReads:
    """What some functions of a module read from its globals, as they were.

    Args:
      module: the module (its ``__dict__`` is read).
      entries: the names of the functions (or globals) the caller uses.
    """

    __slots__ = ("names", "values", "absent", "whole")

    def __init__(self, module: Any, entries: Iterable[str]) -> None:
        module_dict = vars(module)
        reached = _reached(module_dict, entries)
        self.whole: dict[str, Any] | None = None
        if reached is None or not reached & module_dict.keys():
            self.whole = dict(module_dict)  # reads unknown: every global is compared
            return
        self.names = tuple(sorted(reached & module_dict.keys()))
        self.absent = tuple(sorted(reached - module_dict.keys()))
        self.values = tuple(map(module_dict.__getitem__, self.names))

    def same(self, module: Any) -> bool:
        """Whether ``module``'s globals still hold what the functions read: each read
        name the same value, each name absent then still absent (a value whose ``==``
        raises counts as changed)."""
        module_dict = vars(module)
        try:
            if self.whole is not None:
                return module_dict == self.whole
            values = tuple(map(module_dict.__getitem__, self.names))
            return values == self.values and not any(map(module_dict.__contains__, self.absent))
        except Exception:  # noqa: BLE001 -- a name gone, or an elementwise comparison's error
            return False

    def probe(self, module: Any, probes: Probes) -> None:
        """Write :meth:`same` for ``module`` down as probes (for a module it holds for):
        the read names in one ``itemgetter`` call, the absent ones in one ``isdisjoint``
        over the live keys."""
        module_dict = vars(module)
        if self.whole is not None:
            probes.live(module_dict, self.whole)
            return
        getter = operator.itemgetter(*self.names)
        probes.equal(partial(getter, module_dict), getter(module_dict))
        if self.absent:
            probes.same(partial(module_dict.keys().isdisjoint, self.absent), True)


__all__ = ["GlobalReads"]
