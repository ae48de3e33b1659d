"""bench.timing: the interleaved rounds' order, what each sample counts (a fake clock: no
timing is asserted), and the paired ratio."""

from __future__ import annotations

import pytest

from bench import timing


class _Clock:
    """perf_counter as a counter that the candidates advance by known amounts."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(timing.time, "perf_counter", fake)
    return fake


def test_rotated_puts_each_name_first_in_turn() -> None:
    names = ["a", "b", "c"]
    assert [timing.rotated(names, r) for r in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def test_samples_are_seconds_per_call_in_round_order(clock: _Clock) -> None:
    costs = {"a": 1.0, "b": 3.0}
    order: list[str] = []

    def call(name: str):
        def run() -> None:
            order.append(name)
            clock.now += costs[name]
        return run

    out = timing.interleaved({n: call(n) for n in costs}, rounds=3, batch=2, warmup=1)
    assert out["a"]["samples"] == [1.0, 1.0, 1.0] and out["b"]["samples"] == [3.0, 3.0, 3.0]
    assert (out["b"]["median"], out["b"]["min"], out["b"]["max"]) == (3.0, 3.0, 3.0)
    # warm-up a, b; then rounds a-first, b-first, a-first, each candidate's batch back to back
    assert order == ["a", "b", *"aa", *"bb", *"bb", *"aa", *"aa", *"bb"]


def test_prepare_runs_before_every_call_and_is_not_timed(clock: _Clock) -> None:
    events: list[str] = []

    def prepare(name: str) -> None:
        events.append(f"prepare {name}")
        clock.now += 1000.0  # a backward, say: never in a sample

    def call(name: str, cost: float):
        def run() -> None:
            events.append(f"call {name}")
            clock.now += cost
        return run

    out = timing.interleaved({"a": call("a", 2.0), "b": call("b", 5.0)}, rounds=2, batch=3, warmup=2,
                             prepare=prepare)
    assert out["a"]["samples"] == [2.0, 2.0] and out["b"]["samples"] == [5.0, 5.0]
    calls = [e for e in events if e.startswith("call")]
    assert len(calls) == 2 * 2 + 2 * 2 * 3  # warm-up, then rounds x batch, each candidate
    assert all(events[i] == f"prepare {events[i + 1].split()[1]}" for i in range(0, len(events), 2))
    assert timing.paired_ratio(out["b"], out["a"]) == 2.5


def test_paired_ratio_is_the_median_of_same_round_ratios() -> None:
    a = {"samples": [2.0, 4.0, 9.0]}
    b = {"samples": [1.0, 1.0, 3.0]}
    assert timing.paired_ratio(a, b) == 3.0  # ratios 2, 4, 3
    assert timing.paired_ratio(a, {"samples": [1.0]}) is None  # rounds do not pair up


def test_the_gloo_rows_ratios_pair_each_round_with_the_floors() -> None:
    from bench.gloo import ratios_to_floor

    # the machine twice as slow in the second round: each pair keeps the candidates' ratio
    times = {"floor": {"median": 2.0, "samples": [1.0, 2.0, 1.0]},
             "meshgrad buffers": {"median": 2.2, "samples": [1.1, 2.2, 1.1]},
             "megatron": {"median": 4.0, "samples": [1.2, 4.0, 1.3]}}
    ratios = ratios_to_floor(times)
    assert ratios["meshgrad buffers"] == pytest.approx(1.1) and ratios["megatron"] == pytest.approx(1.3)
    assert set(ratios) == {"meshgrad buffers", "megatron"}  # the floor is no candidate
