"""``python -m bench.cold_ops``: what one small step of a finalize costs when it comes back
cold, as it does inside a training step: a torch operation on a one-element tensor against
a write through a memoryview (what the kept token factor and the status round's wire do).

Each round, for each candidate in turn (rotating), writes a buffer larger than a core's
private caches (``--flush-mb``) and runs a Python workload over other code (a JSON round
trip of ``--junk`` entries), then times one call of the candidate. Prints the median over
rounds in microseconds; ``nothing`` (an empty call) is the timer's own floor. One process,
no world: the numbers are this machine's, read against each other.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from bench.timing import rotated


def candidates(memory: bytearray | None = None) -> dict[str, Callable[[], object]]:
    """Each small step timed, by name; the memoryview writes into ``memory`` (4 bytes; None:
    a buffer of its own)."""
    count = torch.tensor(5)
    factor = torch.full((), 0.5)
    view = memoryview(memory if memory is not None else bytearray(4)).cast("f")

    def write() -> None:
        view[0] = 0.25

    return {
        "nothing": lambda: None,
        "torch.full((), v, dtype=float32)": lambda: torch.full((), 0.25, dtype=torch.float32, device="cpu"),
        "factor.fill_(v)": lambda: factor.fill_(0.25),
        "1.0 / count (megatron-core's factor)": lambda: 1.0 / count,
        "int(count)": lambda: int(count),
        "memoryview write of one float32": write,
    }


def measure(*, rounds: int, flush_mb: int, junk: int) -> dict[str, float]:
    """The median microseconds of one cold call of each candidate."""
    torch.set_num_threads(1)
    flush = torch.zeros(flush_mb << 20, dtype=torch.uint8)
    other = {str(i): [i, str(i), float(i)] for i in range(junk)}
    steps = candidates()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for index in range(rounds):
        for name in rotated(list(steps), index):
            flush.add_(1)
            json.loads(json.dumps(other))
            start = time.perf_counter_ns()
            steps[name]()
            times[name].append((time.perf_counter_ns() - start) / 1000)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--flush-mb", type=int, default=32, help="bytes written before each call (MiB)")
    parser.add_argument("--junk", type=int, default=20000, help="entries of the JSON round trip before each call")
    args = parser.parse_args(argv)
    result = measure(rounds=args.rounds, flush_mb=args.flush_mb, junk=args.junk)
    print(f"one cold call each (median us of {args.rounds} rounds, caches flushed before each call):")
    for name, us in result.items():
        print(f"  {name:<40}{us:>8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
