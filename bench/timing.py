"""Interleaved timing: robust medians on a shared, noisy machine.

Each round runs every candidate once as a batch of calls (in a rotating order), so slow
phases of the machine hit all candidates alike; the per-call time of a candidate is the
median over rounds of batch time / batch size.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Mapping, Sequence


def rotated(names: Sequence[str], start: int) -> list[str]:
    """``names`` rotated to begin at index ``start`` (modulo their count): round ``r`` of an
    interleaved run takes them in ``rotated(names, r)`` order, so each name is first in turn."""
    shift = start % len(names)
    return [*names[shift:], *names[:shift]]


def interleaved(
    candidates: Mapping[str, Callable[[], object]],
    *,
    rounds: int = 15,
    batch: int | Mapping[str, int] = 20,
    warmup: int = 3,
    sync: Callable[[], object] | None = None,
    prepare: Callable[[str], object] | None = None,
) -> dict[str, dict[str, float]]:
    """Median / min / max seconds per call of each candidate.

    Args:
      candidates: name -> zero-argument callable.
      rounds: timed rounds.
      batch: calls per round (one count for all, or one per candidate name).
      warmup: untimed calls of each candidate first (plans, caches).
      sync: called before reading the clock (e.g. ``torch.cuda.synchronize``).
      prepare: called with the candidate's name before each of its calls, warm-up calls
        too, untimed (a training step's backward before its finalize, say); then each call
        is timed alone and a round's time is their sum.

    Returns:
      name -> {"median", "min", "max"} in seconds per call, and "samples" (one per round,
      in round order: see :func:`paired_ratio`).
    """
    for name, fn in candidates.items():
        for _ in range(warmup):
            if prepare is not None:
                prepare(name)
            fn()
    if sync is not None:
        sync()
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    calls = {name: batch if isinstance(batch, int) else batch[name] for name in candidates}
    names = list(candidates)
    enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(rounds):
            for name in rotated(names, r):
                fn, n = candidates[name], calls[name]
                per_call = _batched(fn, n, sync) if prepare is None else _prepared(fn, n, sync, name, prepare)
                samples[name].append(per_call)
    finally:
        if enabled:
            gc.enable()
    return {
        name: {"median": statistics.median(s), "min": min(s), "max": max(s), "samples": s} for name, s in samples.items()
    }


def _batched(fn: Callable[[], object], calls: int, sync: Callable[[], object] | None) -> float:
    """Seconds per call of ``calls`` calls of ``fn`` back to back, timed as one batch."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if sync is not None:
        sync()
    return (time.perf_counter() - start) / calls


def _prepared(fn: Callable[[], object], calls: int, sync: Callable[[], object] | None, name: str,
              prepare: Callable[[str], object]) -> float:
    """Seconds per call of ``calls`` calls of ``fn``, each after an untimed ``prepare(name)``
    and timed alone."""
    spent = 0.0
    for _ in range(calls):
        prepare(name)
        if sync is not None:
            sync()
        start = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        spent += time.perf_counter() - start
    return spent / calls


def paired_ratio(a: Mapping[str, object], b: Mapping[str, object]) -> float | None:
    """Median over rounds of ``a``'s time / ``b``'s time in the same round (two results of
    one :func:`interleaved` run): a slow phase of the machine cancels out of each pair."""
    sa, sb = a.get("samples"), b.get("samples")
    if not isinstance(sa, list) or not isinstance(sb, list) or len(sa) != len(sb) or not sa:
        return None
    return statistics.median(x / y for x, y in zip(sa, sb) if y)
