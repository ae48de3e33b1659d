"""A steady check recorded as probes and replayed in one pass (:class:`Probes`).

A memo's check reads some objects and compares what it reads with what it kept. The
same check can be written down once as probes: zero-argument callables (``partial`` of a
C function, of ``getattr``, of a dict's ``get``) each with the value it gave when the
check passed. Replaying them is a few C-level loops over fixed lists, with no Python
frame per check: see :mod:`torch_impl.call.steady` for why that is what a step inside
a distributed world pays for. A ``partial`` probe is kept as its function and arguments
and called as ``function(*arguments)``: the same call, without the ``partial`` object
between (half the time of a probe, and one object less to bring back into the cache).

Four kinds of entries, each at least as strict as the check it stands for:

* ``same``: the probe gives the very object it gave (identity; a new object that
  compares equal counts as a change).
* ``equal``: the probe gives a value equal to the one it gave (``==``, identical values
  short-cut; a comparison that raises counts as a change), for checks that compare by
  value (a config's attribute values, a bound method read again).
* ``live``: a container compared with a copy of it (``==``), for checks that compare a
  dict with its copy.
* ``check``: a watch's own bulk check (a bound method that must answer True), for what
  is compared element by element over fixed lists already (a
  :class:`~torch_impl.call.watches.GradWatch` over many parameters): the check itself,
  with the layers of calls above it left out.
"""

from __future__ import annotations

import operator
import types
from collections.abc import Callable
from functools import partial
from itertools import starmap
from typing import Any

#: ``f()`` for each check ``f``, in C.
_CALL = operator.methodcaller("__call__")
#: ``f(*args)``, in C where Python has it (``operator.call``: 3.11+).
_APPLY: Callable[..., Any] = getattr(operator, "call", lambda function, *args: function(*args))
#: What an attribute read makes anew each time: a method bound to the object read from.
_BOUND = (types.MethodType, types.BuiltinMethodType, types.MethodWrapperType)


class Probes:
    """Probes and the values they gave, replayed by :meth:`hold`."""

    __slots__ = ("same_probes", "same_values", "equal_probes", "equal_values", "lives", "copies", "checks")

    def __init__(self) -> None:
        self.same_probes: list[tuple[Any, ...]] = []  # each (function, *arguments): :func:`_call_of`
        self.same_values: list[Any] = []
        self.equal_probes: list[tuple[Any, ...]] = []  # each (function, *arguments), as same_probes
        self.equal_values: list[Any] = []
        self.lives: list[Any] = []
        self.copies: list[Any] = []
        self.checks: list[Callable[[], bool]] = []

    def same(self, probe: Callable[[], Any], value: Any) -> None:
        """``probe()`` must give ``value`` itself."""
        self.same_probes.append(_call_of(probe))
        self.same_values.append(value)

    def equal(self, probe: Callable[[], Any], value: Any) -> None:
        """``probe()`` must give a value equal to ``value``."""
        self.equal_probes.append(_call_of(probe))
        self.equal_values.append(value)

    def read(self, probe: Callable[[], Any], value: Any) -> None:
        """An attribute read: the same object, or, for a bound method (a new object per
        read), an equal one (the same function of the same object)."""
        (self.equal if isinstance(value, _BOUND) else self.same)(probe, value)

    def live(self, container: Any, copy: Any) -> None:
        """``container`` (held) must compare equal to ``copy``."""
        self.lives.append(container)
        self.copies.append(copy)

    def check(self, check: Callable[[], bool]) -> None:
        """``check()`` must answer True (it reads only objects it holds, or ones the other
        probes reach)."""
        self.checks.append(check)

    def hold(self) -> bool:
        """Whether every probe gives what it gave (False when one raises)."""
        try:
            return (
                all(map(operator.is_, starmap(_APPLY, self.same_probes), self.same_values))
                and list(starmap(_APPLY, self.equal_probes)) == self.equal_values
                and self.lives == self.copies
                and all(map(_CALL, self.checks))
            )
        except Exception:  # noqa: BLE001 -- a read that raises, or an elementwise comparison's error: a change
            return False

    def __len__(self) -> int:
        return len(self.same_probes) + len(self.equal_probes) + len(self.lives) + len(self.checks)


def _call_of(probe: Callable[[], Any]) -> tuple[Any, ...]:
    """``probe`` as (function, *arguments), the call it makes: a ``partial`` without
    keywords by its function and arguments, any other callable alone."""
    if type(probe) is partial and not probe.keywords:
        return (probe.func, *probe.args)
    return (probe,)


__all__ = ["Probes"]
