"""bench.jax_rows: both candidates compute the same values, and the goals read the rows."""

from __future__ import annotations

from bench import jax_rows


def test_row_compares_equal_outputs_and_counts_collectives():
    row = jax_rows.measure_row(8, rounds=1)
    assert row["max_abs_diff"] == 0.0  # finalize == the hand-written psum tree map
    assert row["meshgrad_all_reduces"] >= 1 and row["same_hlo_ops"] in (True, False)
    assert row["step_ratio"] > 0 and row["compile_ratio"] > 0
    lo, q1, q3, hi = row["step_ratio_spread"]  # the spread behind the median of the pairs
    assert lo <= q1 <= row["step_ratio"] <= q3 <= hi and row["step_pairs"] == 250
    assert [jax_rows.compiles(n) for n in (8, 999, 1_000, 3_999, 4_000)] == [16, 16, 6, 6, 1]
    for name in ("meshgrad", "hand"):  # the fastest of the compiles is the row's
        assert len(row[f"{name}_compile_runs_s"]) == 16 and min(row[f"{name}_compile_runs_s"]) == row[f"{name}_compile_s"]
    pairs = sorted(a / b for a, b in zip(row["meshgrad_compile_runs_s"], row["hand_compile_runs_s"]))
    assert row["compile_ratio"] == (pairs[7] + pairs[8]) / 2  # the median of the rounds' ratios
    assert jax_rows.format_spread([row]).splitlines()[1].startswith("      8 leaves: step ratio ")


def test_goals_from_rows():
    rows = [{"leaves": 10, "step_ratio": 1.0, "compile_ratio": 2.0, "meshgrad_step_ms": 1.0, "hand_step_ms": 1.0,
             "meshgrad_compile_s": 2.0, "hand_compile_s": 1.0},
            {"leaves": 100, "step_ratio": 1.2, "compile_ratio": 80 / 30, "meshgrad_step_ms": 10.0, "hand_step_ms": 10.0,
             "meshgrad_compile_s": 80.0, "hand_compile_s": 30.0}]
    from bench.goals import split_goals

    kept, bound, stretch = split_goals(jax_rows.goals(rows))
    assert stretch == []
    goals = {g["goal"]: g["ok"] for g in kept}
    assert goals["jax 10 leaves: step <= 1.1x hand-written psum"] is True
    assert goals["jax 10 leaves: compile <= 1.5x hand-written psum"] is False
    assert goals["jax 100 leaves: step <= 1.1x hand-written psum"] is False
    assert goals["jax step grows no faster than the leaves (10 -> 100 leaves; per-leaf growth)"] is True
    # XLA's own compile grows 3x per leaf here: growing no faster than the leaves is no goal
    # (printed apart with its floor); growing no faster than the hand-written one's is.
    assert [g["goal"] for g in bound] == ["jax compile grows no faster than the leaves (10 -> 100 leaves; per-leaf growth)"]
    assert bound[0]["floor"] == 3.0 and bound[0]["value"] == 4.0
    assert goals["jax compile grows no faster than the hand-written one's (10 -> 100 leaves; ours / theirs)"] is False
    # ours / theirs is how much the rows' paired ratios grew: 1.2 / 1.0 for the step (missed)
    assert [g["value"] for g in kept if "ours / theirs" in g["goal"]] == [1.2, 80 / 30 / 2.0]
    assert goals["jax step grows no faster than the hand-written one's (10 -> 100 leaves; ours / theirs)"] is False
