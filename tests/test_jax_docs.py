"""docs/jax.md's optax program runs as written and matches one device."""

from __future__ import annotations

import sys
from pathlib import Path

from test_docs import DOCS, blocks, run


def test_docs_jax_optax_snippet_runs_as_written(tmp_path: Path) -> None:
    (snippet,) = blocks(DOCS / "jax.md", "jax-optax")
    out = run([sys.executable, "-c", snippet], tmp_path).split()
    assert len(out) == 1 and float(out[0]) <= 1e-6
