"""Shared test setup: 8 fake CPU devices for the jax tests, set before jax is imported."""

from jax_impl.mesh import ensure_host_devices

ensure_host_devices(8)

import pytest  # noqa: E402

# --------------------------------------------------------------------------- reliability table
# The reliability tests (tests/test_reliability_*.py, tests/test_properties.py) record one
# row per bad input tried, fault injected or property batch run; the terminal summary
# prints them as docs/reliability.md's table, and the session fails when a recorded row is
# missing from that table (tests/doc_table.py): the page names what the tests measure.

_ROWS = pytest.StashKey[list]()
_UNDOCUMENTED = pytest.StashKey[list]()


@pytest.fixture
def reliability(request):
    """``reliability(kind, case, outcome)`` adds a row to the printed reliability table."""
    rows = request.config.stash.setdefault(_ROWS, [])

    def record(kind: str, case: str, outcome: str) -> None:
        rows.append((kind, case, outcome))

    return record


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    from doc_table import as_markdown

    order = {"bad input": 0, "check cost": 1, "fault": 2, "concurrency": 3, "soak": 4, "property": 5}
    rows = sorted(config.stash.get(_ROWS, []), key=lambda r: order.get(r[0], 5))  # stable: run order within a kind
    if not rows:
        return
    widths = [max(len(r[i]) for r in rows + [("kind", "case", "outcome")]) for i in range(3)]
    widths[2] = min(widths[2], 110)
    terminalreporter.section("Reliability: bad inputs, faults, properties")
    line = " | ".join(h.ljust(w) for h, w in zip(("kind", "case", "outcome"), widths))
    terminalreporter.write_line(line)
    terminalreporter.write_line("-+-".join("-" * w for w in widths))
    for kind, case, outcome in rows:
        terminalreporter.write_line(" | ".join(v.ljust(w) for v, w in zip((kind, case, outcome), widths)))
    missing = config.stash.get(_UNDOCUMENTED, [])
    if missing:
        terminalreporter.section("docs/reliability.md lacks rows the tests recorded (session failed)", red=True)
        for row in missing:
            terminalreporter.write_line(as_markdown(row))


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    from doc_table import DOC, undocumented

    rows = session.config.stash.get(_ROWS, [])
    missing = undocumented(rows, DOC.read_text()) if rows else []
    session.config.stash[_UNDOCUMENTED] = missing
    if missing and session.exitstatus == 0:
        session.exitstatus = 1


