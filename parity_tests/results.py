"""What a backend run returns for one scenario."""

from __future__ import annotations

import dataclasses

from parity_tests.scenarios import RankData


@dataclasses.dataclass
class ScenarioResult:
    """One backend's outcome for one scenario.

    Args:
      outputs: per-rank outputs (index = global rank), or None on error.
      error: the error text when the run raised.
      seconds: wall time of the finalize call (max over ranks for torch; the jitted run
        after compilation for jax).
      compile_seconds: jax only: time to trace and compile.
    """

    outputs: list[RankData] | None
    error: str | None = None
    seconds: float = 0.0
    compile_seconds: float | None = None
