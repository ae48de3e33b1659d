"""The reliability table of docs/reliability.md against the rows the tests record.

Every row a test run records (``reliability(kind, case, outcome)`` in tests/conftest.py)
must be in the documented table, so the page names the behaviour the tests measure (which
error or warning, raised where). Numbers (times, counts) may differ between runs: both
sides compare with every number replaced by ``#``.
"""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "reliability.md"
HEADER = "| kind | case | outcome |"


def normalize(row: tuple[str, str, str]) -> tuple[str, ...]:
    """The row with numbers as ``#`` and runs of spaces as one."""
    return tuple(re.sub(r"\s+", " ", re.sub(r"\d+(?:\.\d+)?", "#", cell)).strip() for cell in row)


def documented_rows(text: str) -> list[tuple[str, str, str]]:
    """The rows of the table under :data:`HEADER` in ``text`` (cells unescaped: ``\\|``)."""
    lines = text.splitlines()
    start = lines.index(HEADER) + 2  # the header, then |---|
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        rows.append(tuple(cells))
    return rows


def undocumented(recorded: list[tuple[str, str, str]], text: str) -> list[tuple[str, str, str]]:
    """The recorded rows that the documented table lacks (after :func:`normalize`)."""
    known = {normalize(r) for r in documented_rows(text)}
    return [r for r in recorded if normalize(r) not in known]


def as_markdown(row: tuple[str, str, str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in row) + " |"
