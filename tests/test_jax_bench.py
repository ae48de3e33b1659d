"""bench.jax_rows: both candidates compute the same values, and the goals read the rows."""

from __future__ import annotations

from bench import jax_rows


def test_row_compares_equal_outputs_and_counts_collectives():
    row = jax_rows.measure_row(8, rounds=1)
    assert row["max_abs_diff"] == 0.0  # finalize == the hand-written psum tree map
    assert row["meshgrad_all_reduces"] >= 1 and row["same_hlo_ops"] in (True, False)
    assert row["step_ratio"] > 0 and row["compile_ratio"] > 0


def test_goals_from_rows():
    rows = [{"leaves": 10, "step_ratio": 1.0, "compile_ratio": 2.0, "meshgrad_step_ms": 1.0, "hand_step_ms": 1.0,
             "meshgrad_compile_s": 1.0, "hand_compile_s": 1.0},
            {"leaves": 100, "step_ratio": 1.2, "compile_ratio": 1.0, "meshgrad_step_ms": 10.0, "hand_step_ms": 10.0,
             "meshgrad_compile_s": 40.0, "hand_compile_s": 30.0}]
    goals = {g["goal"]: g["ok"] for g in jax_rows.goals(rows)}
    assert goals["jax 10 leaves: step <= 1.1x hand-written psum"] is True
    assert goals["jax 10 leaves: compile <= 1.5x hand-written psum"] is False
    assert goals["jax 100 leaves: step <= 1.1x hand-written psum"] is False
    step_growth = next(k for k in goals if k.startswith("jax step grows"))
    compile_growth = next(k for k in goals if k.startswith("jax compile grows"))
    assert goals[step_growth] is True and "hand-written one's" in compile_growth  # its floor grows 3x per leaf
    assert goals[compile_growth] is False  # 4x / 3x > 1.1
