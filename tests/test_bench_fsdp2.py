"""bench.fsdp2 inside ``python -m bench``: torch_impl's finalize of an FSDP2 model against
the floor, steady and after each training step, in a gloo world of 2, its gradients
bit-identical to the floor's (no timing threshold is asserted)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from launch import launch

from bench.fsdp2 import format_fsdp2

ROOT = Path(__file__).resolve().parents[1]
ONLY_FSDP2 = ["--no-fake", "--no-scale", "--no-gloo", "--no-jax", "--no-at-scale", "--no-real-ddp"]


def test_fsdp2_row_runs_in_the_bench_with_identical_gradients(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    text = launch([sys.executable, "-m", "bench", *ONLY_FSDP2, "--rounds", "2", "--json", str(out)])
    row = json.loads(out.read_text())["fsdp2"]
    hidden, layers = 256, 24  # the bench's model: each block a layernorm and two linears
    assert (row["world"], row["layers"], row["hidden"], row["gradients"]) == (2, layers, hidden, 6 * layers)
    assert row["parameters"] == layers * (2 * hidden + 2 * (hidden * hidden + hidden))
    assert row["identical"] is True  # torch_impl's gradients equal the floor's, bit for bit
    for measure in (row, row["training steps"]):
        assert measure["torch_impl / floor"] > 0 and all(v > 0 for v in measure["seconds per call"].values())
        assert all(v > 0 for v in measure["cpu seconds per call"].values())
    distinct, calls = row["python functions per call"]
    assert 0 < distinct <= calls
    trained = row["python functions per training-step call"]  # FSDP2 binds its new shards on every call
    assert distinct <= trained[0] <= trained[1]
    assert (f"torch_impl enters {distinct} Python functions ({calls} calls) per steady call, "
            f"{trained[0]} ({trained[1]}) per call after a training step") in text
    assert ("gradients: bit-identical (torch_impl vs floor, after the first call, after the steady calls and "
            "after the training steps)") in text
    assert "  steady call (the same gradients):" in text
    assert "  after each training step (zero_grad(set_to_none=True), forward, backward: new gradients):" in text
    assert len(re.findall(r"torch_impl / floor \d+\.\d{3} \(median of same-round ratios", text)) == 2


def test_a_failed_world_is_reported_as_such() -> None:
    assert format_fsdp2({"error": "timed out"}) == "fsdp2: failed: timed out"


def test_the_ddp_wrap_times_torch_ddp_with_identical_gradients() -> None:
    """``--wrap ddp``: the same model under torch's DistributedDataParallel (gradients new
    every training step), small, in a gloo world of 2: both measures, bit-identical twins."""
    from bench.fsdp2 import run_fsdp2

    row = run_fsdp2(wrap="ddp", layers=2, hidden=16, rounds=2, batch=2, training_batch=1, timeout=240)
    assert (row["wrap"], row["world"], row["layers"], row["hidden"], row["gradients"]) == ("ddp", 2, 2, 16, 12)
    assert row["parameters"] == 2 * (2 * 16 + 2 * (16 * 16 + 16))
    assert row["identical"] is True
    for measure in (row, row["training steps"]):
        assert measure["torch_impl / floor"] > 0 and all(v > 0 for v in measure["cpu seconds per call"].values())
    text = format_fsdp2(row)
    assert text.startswith("ddp-2L-h16-dp2  (torch DDP, gradients not bucket views, ddp_sum_hook, 12 gradients")
    assert "gradients: bit-identical" in text
