"""``python -m bench.cold_ops``: one cold call of each small step, checked by what each step
computes (never by its time): the candidates give the values they stand for, and a short run
times every one of them."""

from __future__ import annotations

import struct

import pytest

torch = pytest.importorskip("torch")

from bench import cold_ops  # noqa: E402


def test_each_step_computes_what_it_stands_for() -> None:
    memory = bytearray(4)
    steps = cold_ops.candidates(memory)
    full = steps["torch.full((), v, dtype=float32)"]()
    assert full.dtype == torch.float32 and full.shape == () and float(full) == 0.25
    assert float(steps["factor.fill_(v)"]()) == 0.25
    assert float(steps["1.0 / count (megatron-core's factor)"]()) == pytest.approx(0.2)
    assert steps["int(count)"]() == 5
    assert steps["memoryview write of one float32"]() is None and struct.unpack("f", memory) == (0.25,)
    assert steps["nothing"]() is None


def test_a_short_run_times_every_step(capsys: pytest.CaptureFixture[str]) -> None:
    assert cold_ops.main(["--rounds", "3", "--flush-mb", "1", "--junk", "10"]) == 0
    out = capsys.readouterr().out
    for name in cold_ops.candidates():
        line = next(line for line in out.splitlines() if line.strip().startswith(name))
        assert float(line.split()[-1]) > 0, line
