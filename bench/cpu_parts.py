"""The calling thread's CPU time in named parts of a call (:class:`CpuParts`), for the
real-DDP rows' profile (``python -m bench.real_ddp --parts``): where a finalize spends its
CPU, part by part, for each candidate alike.

A part is a function looked up on an object (a module, a class) and wrapped there for the
duration of a ``with`` block (restored afterwards, bench only). Time is counted with
``time.thread_time`` (a thread waiting in a collective spends none) and only for the
outermost active part, so a part inside another (an all-reduce inside a DDP's own sync) is
the outer part's time, and the parts of one call never add up to more than the call.

Also the Python functions one call enters (:func:`functions_entered`): inside a distributed
world each comes back cold from memory on every step, a few microseconds apiece at four
ranks on two cores, and unlike a time their count is exact and the same in every run.
And the torch operations it dispatches (:func:`operations_run`), exact too.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

#: Marks a function found on a base class (restored by deleting the wrapper).
_INHERITED = object()
#: A part: (its name, the object the function is looked up on, the function's attribute name).
Part = tuple[str, Any, str]


class CpuParts:
    """Per candidate and part, the CPU seconds of the calling thread, and the calls counted.

    Args:
      parts: the parts to time.
    """

    def __init__(self, parts: Sequence[Part]) -> None:
        self.parts = list(parts)
        self.seconds: dict[str, dict[str, float]] = {}
        self.calls: dict[str, int] = {}
        self.current: str | None = None  # the candidate whose call runs now
        self._depth = 0

    @contextmanager
    def installed(self) -> Iterator[None]:
        """Every part's function wrapped where it is looked up, restored on exit."""
        saved: list[tuple[Any, str, Any]] = []  # what was wrapped so far, to restore
        try:
            for name, owner, attr in self.parts:
                original = vars(owner).get(attr, _INHERITED)
                setattr(owner, attr, self._timed(name, getattr(owner, attr)))
                saved.append((owner, attr, original))
            yield
        finally:
            for owner, attr, original in reversed(saved):
                if original is _INHERITED:
                    delattr(owner, attr)
                else:
                    setattr(owner, attr, original)

    def _timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock = time.thread_time

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth or self.current is None:  # inside another part, or no candidate's call
                return fn(*args, **kwargs)
            self._depth += 1
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                self._add(self.current, name, clock() - start)

        return timed

    def counted(self, candidate: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` with each call counted as a call of ``candidate``: its whole CPU time as
        "call", and each part's within it."""

        def call(*args: Any, **kwargs: Any) -> Any:
            self.current = candidate
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current = None
                self._add(candidate, "call", time.thread_time() - start)
                self.calls[candidate] = self.calls.get(candidate, 0) + 1

        return call

    def _add(self, candidate: str, name: str, seconds: float) -> None:
        """Count ``seconds`` for ``candidate``'s part ``name``."""
        spent = self.seconds.setdefault(candidate, {})
        spent[name] = spent.get(name, 0.0) + seconds

    def per_call(self) -> dict[str, dict[str, float]]:
        """Per candidate, seconds per call of each part, of the whole call ("call") and of
        what no part covers ("rest")."""
        out: dict[str, dict[str, float]] = {}
        for candidate, spent in self.seconds.items():
            calls = self.calls.get(candidate, 0)
            if not calls:
                continue
            row = {name: seconds / calls for name, seconds in spent.items()}
            row["rest"] = row.get("call", 0.0) - sum(v for k, v in row.items() if k != "call")
            out[candidate] = row
        return out

    def ranks_mean(self, candidates: Sequence[str], names: Sequence[str]) -> dict[str, dict[str, float]]:
        """Per candidate, the mean over the world's ranks of :meth:`per_call` for each part
        of ``names`` (one all-reduce: every rank sends every entry, 0 for a part its calls
        never ran)."""
        import torch
        import torch.distributed as dist

        mine = self.per_call()
        flat = torch.tensor([mine.get(c, {}).get(p, 0.0) for c in candidates for p in names], dtype=torch.float64)
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        values = iter(flat.tolist())
        return {c: {p: next(values) for p in names} for c in candidates}


def functions_entered(fn: Callable[[], Any]) -> tuple[int, int]:
    """Run ``fn()`` once and count the Python functions it enters (``sys.setprofile``: a
    C function is no frame; ``fn`` itself is not counted).

    Returns:
      (distinct functions, by code object; calls).
    """
    entered: dict[Any, int] = {}

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            entered[frame.f_code] = entered.get(frame.f_code, 0) + 1

    before = sys.getprofile()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(before)
    entered.pop(getattr(fn, "__code__", None), None)
    return len(entered), sum(entered.values())


def operations_run(fn: Callable[[], Any]) -> list[str]:
    """Run ``fn()`` once; the torch operations it dispatches, in order (``aten`` and
    ``c10d`` ops, by name: a ``TorchDispatchMode``). Inside a step each comes back cold as
    a Python function does, through the dispatcher's longer path.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    names: list[str] = []

    class _Named(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            names.append(str(func))
            return func(*args, **(kwargs or {}))

    with _Named():
        fn()
    return names


__all__ = ["CpuParts", "Part", "functions_entered", "operations_run"]
