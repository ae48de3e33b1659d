"""Counting the calls that go through the read stage (``torch_impl.call.pipeline.read``):
a call that takes the steady path or the replay does not. Shared by the steady-path tests,
in one process and inside the spawned worlds."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def counted_reads() -> Iterator[list[int]]:
    """Within the block, each call through the read stage appends 1 to the list yielded."""
    pipeline = importlib.import_module("torch_impl.call.pipeline")
    original, seen = pipeline.read, []

    def counted(*args: Any, **kwargs: Any) -> Any:
        seen.append(1)
        return original(*args, **kwargs)

    pipeline.read = counted
    try:
        yield seen
    finally:
        pipeline.read = original
