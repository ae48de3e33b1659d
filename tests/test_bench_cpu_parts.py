"""``bench.cpu_parts``: the CPU of named parts of a call, counted for the outermost part only
and for a candidate's call only, the wrapped functions restored afterwards. Checked by what
is counted where (calls, which parts have time, the parts never more than the call), not by
how long anything took."""

from __future__ import annotations

import functools
import sys
import types

from bench.cpu_parts import CpuParts


class _Base:
    def inherited(self, n: int) -> int:
        return sum(range(n))


class _Thing(_Base):
    def own(self, n: int) -> int:
        return self.inherited(n) + 1


def test_outermost_part_only_and_only_in_a_candidates_call() -> None:
    module = types.SimpleNamespace(work=lambda n: sum(i * i for i in range(n)))
    parts = CpuParts([("own", _Thing, "own"), ("inherited", _Base, "inherited"), ("work", module, "work")])
    thing = _Thing()
    with parts.installed():
        assert thing.own(10) == 46 and module.work(4) == 14  # outside a call: values as before, nothing counted
        assert parts.seconds == {}
        for _ in range(3):
            parts.counted("a", thing.own)(200_000)  # "inherited" runs inside "own": own's time only
            parts.counted("b", lambda: (thing.inherited(200_000), module.work(50_000)))()
    rows = parts.per_call()
    assert parts.calls == {"a": 3, "b": 3}
    assert set(rows["a"]) == {"own", "call", "rest"} and rows["a"]["own"] > 0
    assert set(rows["b"]) == {"inherited", "work", "call", "rest"} and rows["b"]["inherited"] > 0 < rows["b"]["work"]
    for row in rows.values():
        assert abs(sum(v for k, v in row.items() if k != "call") - row["call"]) < 1e-12  # parts + rest == call
        assert row["rest"] >= -1e-9


def test_wrapped_functions_restored() -> None:
    module = types.SimpleNamespace(work=len)
    own, work = _Thing.__dict__["own"], module.work
    parts = CpuParts([("own", _Thing, "own"), ("inherited", _Thing, "inherited"), ("work", module, "work")])
    with parts.installed():
        assert _Thing.__dict__["own"] is not own and "inherited" in _Thing.__dict__ and module.work is not work
    assert _Thing.__dict__["own"] is own and module.work is work
    assert "inherited" not in _Thing.__dict__ and _Thing().inherited(5) == 10  # found on the base class again


def test_a_part_that_cannot_be_wrapped_leaves_the_others_restored() -> None:
    """A part whose function cannot be replaced (a built-in type's method) raises on entry,
    and the parts wrapped before it are restored."""
    module = types.SimpleNamespace(work=len)
    parts = CpuParts([("work", module, "work"), ("own", _Thing, "own"), ("builtin", int, "bit_length")])
    try:
        with parts.installed():
            raise AssertionError("entered")  # pragma: no cover -- int cannot take the wrapper
    except TypeError:
        pass
    assert module.work is len and _Thing().own(4) == 7 and _Thing.__dict__["own"].__name__ == "own"


def _leaf(n: int) -> int:
    return n + 1


def _twice(n: int) -> int:
    return _leaf(_leaf(n)) + len(str(n))  # len and str are C functions: no frame


def test_functions_entered_counts_distinct_python_functions_and_calls() -> None:
    """Each Python function by its code (two calls of one: one function, two calls), C
    functions not at all, the function given not itself; the profile that was set is
    set again afterwards."""
    from bench.cpu_parts import functions_entered

    results: list[int] = []
    assert functions_entered(lambda: results.append(_twice(3))) == (2, 3)  # _twice, and _leaf twice
    assert results == [6]
    # a partial has no code of its own to leave out: the function it calls counts
    assert functions_entered(functools.partial(_twice, 3)) == (2, 3)

    assert sys.getprofile() is None
