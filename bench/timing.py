"""Interleaved timing: robust medians on a shared, noisy machine.

Each round runs every candidate once as a batch of calls (in a rotating order), so slow
phases of the machine hit all candidates alike; the per-call time of a candidate is the
median over rounds of batch time / batch size.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Mapping


def interleaved(
    candidates: Mapping[str, Callable[[], object]],
    *,
    rounds: int = 15,
    batch: int = 20,
    warmup: int = 3,
    sync: Callable[[], object] | None = None,
) -> dict[str, dict[str, float]]:
    """Median / min / max seconds per call of each candidate.

    Args:
      candidates: name -> zero-argument callable.
      rounds: timed rounds.
      batch: calls per round.
      warmup: untimed calls of each candidate first (plans, caches).
      sync: called before reading the clock (e.g. ``torch.cuda.synchronize``).

    Returns:
      name -> {"median", "min", "max"} in seconds per call.
    """
    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    if sync is not None:
        sync()
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    names = list(candidates)
    enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                fn = candidates[name]
                start = time.perf_counter()
                for _ in range(batch):
                    fn()
                if sync is not None:
                    sync()
                samples[name].append((time.perf_counter() - start) / batch)
    finally:
        if enabled:
            gc.enable()
    return {
        name: {"median": statistics.median(s), "min": min(s), "max": max(s)} for name, s in samples.items()
    }
