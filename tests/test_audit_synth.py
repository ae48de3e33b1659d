"""The synthetic-record generator (parity_tests.audit_synth) and the replay on its records."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from parity_tests.audit import format_report, load, replay
from parity_tests.audit_synth import write_step


def test_generated_records_hold_the_reference_values_and_pass(tmp_path: Any) -> None:
    write_step(str(tmp_path), dp=4, tp=2, params=6, sample=8)
    files = load(str(tmp_path))[0]
    before = np.stack([f.arrays["grad_before"].reshape(6, 8) for f in files])  # [rank, param, sample]
    after = np.stack([f.arrays["grad_after"].reshape(6, 8) for f in files])
    ranks = np.arange(8).reshape(4, 2)  # rank = dp * 2 + tp
    for t in range(2):  # a plain weight: the mean over its dp group
        group = ranks[:, t]
        np.testing.assert_allclose(after[group, 1], np.broadcast_to(before[group, 1].mean(0), (4, 8)), rtol=1e-6, atol=1e-6)
    # a sequence-parallel layernorm weight: summed over tp, then the mean over dp
    want = before[:, 0].reshape(4, 2, 8).sum(1).mean(0)
    np.testing.assert_allclose(after[:, 0], np.broadcast_to(want, (8, 8)), rtol=1e-5, atol=1e-6)
    result = replay(str(tmp_path))
    rows = [r for r in result["steps"][0]["rows"] if r["kind"] == "param"]
    assert result["ok"] and len(rows) == 6 and all(r["ranks"] == 8 and r["status"] == "ok" for r in rows), format_report(result)


def test_a_wrong_value_in_generated_records_is_named(tmp_path: Any) -> None:
    write_step(str(tmp_path), dp=2, tp=2, params=4, sample=8)
    path = os.path.join(tmp_path, "step00000000.rank00003.npz")
    with np.load(path, allow_pickle=False) as data:
        arrays = {k: data[k] for k in data.files}
    arrays["grads_after"][2 * 8 + 5] += 1.0  # rank 3, parameter 2, element 5
    np.savez(path, **arrays)
    result = replay(str(tmp_path))
    bad = [r for r in result["steps"][0]["rows"] if r["status"] == "MISMATCH"]
    assert [r["name"] for r in bad] == ["layers.2.linear.weight"], format_report(result)
    assert "rank 3, flat index 5" in bad[0]["detail"]
