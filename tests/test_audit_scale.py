"""The audit's replay at scale: streamed a block of parameters at a time (parity_tests.audit_stream).

Synthetic correct records (parity_tests.audit_synth) of dp x tp worlds: the streamed replay
gives exactly the whole-load replay's result (rows, differences, details, report text),
whatever the block size; a wrong value planted in one rank's record is named by
parameter, rank and step; the memory a replay holds does not grow with the number of
ranks beyond a small per-rank bound (tracemalloc, in-process; no timing).
"""

from __future__ import annotations

import json
import os
import tracemalloc
from typing import Any

import numpy as np
import pytest

from parity_tests import audit_stream
from parity_tests.audit import AuditError, format_report, load, replay, scan
from parity_tests.audit_synth import write_step


def _rewrite(path: str, compressed: bool = False, **changes: Any) -> None:
    """Rewrite one recorded .npz with some arrays changed."""
    with np.load(path, allow_pickle=False) as data:
        arrays = {k: data[k] for k in data.files}
    arrays.update(changes)
    os.remove(path)
    (np.savez_compressed if compressed else np.savez)(path, **arrays)


def _plant(directory: str, step: int, rank: int, index: int, delta: float) -> float:
    """Add ``delta`` to one sampled "after" value of one rank's step file; returns the recorded value."""
    path = os.path.join(directory, f"step{step:08d}.rank{rank:05d}.npz")
    with np.load(path, allow_pickle=False) as data:
        after = data["grads_after"].copy()
    after[index] += delta
    _rewrite(path, grads_after=after)
    return float(after[index])


def _streamed(directory: str, budget: int) -> dict[str, Any]:
    steps = [audit_stream.replay_step(records, budget=budget) for records in scan(directory).values()]
    return {"directory": directory, "steps": steps, "ok": all(s["ok"] for s in steps)}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return json.dumps(a, default=float) == json.dumps(b, default=float)


@pytest.fixture(scope="module")
def run64(tmp_path_factory: Any) -> str:
    """A correct step of 64 ranks (dp 8 x tp 8), 24 parameters of 16 samples, step 5."""
    directory = str(tmp_path_factory.mktemp("scale64"))
    write_step(directory, dp=8, tp=8, params=24, sample=16, step=5, seed=3)
    return directory


def test_streamed_replay_equals_the_whole_load(run64: str) -> None:
    whole = replay(run64, stream=False)
    assert whole["ok"], format_report(whole)
    rows = [r for r in whole["steps"][0]["rows"] if r["kind"] == "param"]
    assert len(rows) == 24 and all(r["ranks"] == 64 and r["status"] == "ok" for r in rows)
    assert all(r["steps"] == (["dp_sync", "non_tp"] if i % 3 == 0 else ["dp_sync"]) for i, r in enumerate(rows))
    # one block, a block per 1 / 7 parameters (grouped or not): the same result, the same text
    for budget in (audit_stream.BLOCK_VALUES, 0, 1, 7 * 64 * 16):
        streamed = _streamed(run64, budget)
        assert _same(streamed, whole), budget
        assert format_report(streamed) == format_report(whole)
    assert _same(replay(run64), whole)


def test_streamed_replay_equals_the_whole_load_on_damaged_records(run64: str, tmp_path: Any) -> None:
    """Wrong values, a gradient gone, a compressed file: the same rows, the same details,
    whatever the blocks; NaN / inf before or after: the same damaged-record error."""
    directory = str(tmp_path / "damaged")
    os.makedirs(directory)
    for name in os.listdir(run64):
        with open(os.path.join(run64, name), "rb") as f, open(os.path.join(directory, name), "wb") as g:
            g.write(f.read())
    _plant(directory, 5, 9, 4 * 16 + 3, 0.5)  # rank 9, parameter 4 (a linear weight)
    _plant(directory, 5, 40, 4 * 16 + 1, -2.0)  # the same parameter, a later rank
    _plant(directory, 5, 17, 9 * 16 + 0, 1e-3)  # a layernorm weight (summed over tp)
    path = os.path.join(directory, "step00000005.rank00033.npz")
    with np.load(path, allow_pickle=False) as data:
        before, after, has = data["grads_before"].copy(), data["grads_after"].copy(), data["has_grad"].copy()
    has[1, 20] = False  # parameter 20's gradient gone after finalize on rank 33
    _rewrite(path, compressed=True, grads_before=before, grads_after=after, has_grad=has)
    whole = replay(directory, stream=False)
    bad = {r["name"]: r["status"] for r in whole["steps"][0]["rows"] if r["status"] != "ok"}
    assert bad == {"layers.4.linear.weight": "MISMATCH", "layers.9.norm.weight": "MISMATCH",
                   "layers.20.linear.weight": "MISMATCH"}, format_report(whole)
    for budget in (audit_stream.BLOCK_VALUES, 1, 5 * 64 * 16):
        streamed = _streamed(directory, budget)
        assert _same(streamed, whole), budget
        assert format_report(streamed) == format_report(whole)
    for member, index, value in (("grads_before", 12 * 16 + 2, np.nan), ("grads_after", 13 * 16 + 5, np.inf)):
        with np.load(path, allow_pickle=False) as data:
            values = data[member].copy()
        kept = float(values[index])
        values[index] = value
        _rewrite(path, compressed=True, **{member: values})
        errors = []
        for stream in (True, False):
            with pytest.raises(AuditError) as err:
                replay(directory, stream=stream)
            errors.append(str(err.value))
        layer = index // 16
        assert errors[0] == errors[1] and errors[0].startswith("step 5: rank 33: the recorded ") and (
            f"layers.{layer}." in errors[0] and "a damaged record" in errors[0]), errors
        values[index] = kept
        _rewrite(path, compressed=True, **{member: values})


def test_a_parameter_held_twice_is_replayed_whole(run64: str, tmp_path: Any) -> None:
    """A plan naming two parameters of one chunk alike cannot be streamed: that step is
    replayed from whole-loaded files, with the same result."""
    directory = str(tmp_path / "twice")
    os.makedirs(directory)
    for name in os.listdir(run64):
        src = os.path.join(run64, name)
        with np.load(src, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
        if name.startswith("plan."):
            plan = json.loads(arrays["plan"].tobytes().decode())
            plan["params"][2]["name"] = plan["params"][1]["name"]
            arrays["plan"] = np.frombuffer(json.dumps(plan).encode(), np.uint8)
        np.savez(os.path.join(directory, name), **arrays)
    records = next(iter(scan(directory).values()))
    from parity_tests.audit_blocks import StepTables
    from parity_tests.audit_view import build_view, global_params

    vparams, per_rank = global_params(records)
    assert not StepTables(records, build_view(records), vparams, per_rank, 1).streamable
    assert _same(replay(directory), replay(directory, stream=False))


def test_a_planted_value_is_named_at_scale(tmp_path: Any) -> None:
    """256 ranks (dp 32 x tp 8) x 40 parameters: one wrong value on rank 173, parameter 28:
    the only MISMATCH, named by parameter, rank, flat index and step, in blocks of a few
    parameters."""
    directory = str(tmp_path / "scale256")
    write_step(directory, dp=32, tp=8, params=40, sample=16, step=11, seed=1)
    recorded = _plant(directory, 11, 173, 28 * 16 + 6, 0.25)
    result = _streamed(directory, 4 * 256 * 16)
    report = format_report(result)
    (s,) = result["steps"]
    bad = [r for r in s["rows"] if r["status"] != "ok"]
    assert not result["ok"] and [r["name"] for r in bad] == ["layers.28.linear.weight"], report
    assert bad[0]["detail"].startswith(f"rank 173, flat index 6: recorded {recorded!r}, expected ")
    assert bad[0]["max_abs_diff"] == pytest.approx(0.25, rel=1e-3)
    assert "MISMATCH step 11 param 0/layers.28.linear.weight" in report
    assert all(r["ranks"] == 256 for r in s["rows"] if r["kind"] == "param")
    assert s["world_size"] == 256 and s["layout"]["dp"] == 32 and s["layout"]["tp"] == 8


def _peak(directory: str, budget: int) -> int:
    """tracemalloc's peak of a streamed replay (index and replay), in bytes."""
    tracemalloc.start()
    try:
        result = _streamed(directory, budget)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert result["ok"], format_report(result)
    return peak


def test_memory_does_not_grow_with_the_values_of_all_ranks(tmp_path: Any) -> None:
    """Between 16 and 64 ranks of 48 parameters x 512 samples (24576 values per rank), the
    streamed replay's peak grows by some KB of metadata per rank (its record, its inputs
    to the reference per block), far less than the values of the added ranks (which the
    whole load holds several times over)."""
    budget = 1 << 16
    peaks = {}
    for ranks in (16, 64):
        directory = str(tmp_path / f"r{ranks}")
        write_step(directory, dp=ranks // 8, tp=8, params=48, sample=512)
        peaks[ranks] = _peak(directory, budget)
    added = 48
    values = added * 48 * 512 * 8  # the added ranks' "after" values alone, as float64
    assert (peaks[64] - peaks[16]) / added < 48 * 1024, peaks
    assert peaks[64] - peaks[16] < values / 4, peaks
    # the same budget bounds a block: the peak of 16 ranks is about a few blocks' arrays
    assert peaks[16] < 40 * budget * 8, peaks
    # the whole load, for comparison, holds every value in memory
    files = load(str(tmp_path / "r16"))[0]
    assert sum(f.arrays["grad_after"].nbytes for f in files) == 16 * 48 * 512 * 8
