"""``python -m bench.cold_calls``: cold and warm non-TP steps against megatron-core's,
checked by value (no timing is asserted)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
_NUMBER = r"[0-9]+(?:\.[0-9]+)"

_RUN = """
import json
from bench import cold_calls
from bench.run import FAKE_LAYOUTS
lay = FAKE_LAYOUTS["gpt-24L-h1024"]
result = cold_calls.measure(lay, rounds=3, flush_mb=1)
out = {"grads": result["non_tp_grads"], "ratios": result["ratios"], "text": cold_calls.report(result),
       "samples": {k: {n: len(v) for n, v in result[k].items()} for k in ("cold", "warm")},
       "positive": all(x > 0 for k in ("cold", "warm") for v in result[k].values() for x in v)}

made = cold_calls._models
def corrupting(lay):  # the drop-in step also moves one value: the run must refuse it
    steps, grads = made(lay)
    step, grad = steps["meshgrad drop-in"], grads["meshgrad drop-in"][5]
    steps["meshgrad drop-in"] = lambda: (step(), grad.add_(1))
    return steps, grads
cold_calls._models = corrupting
try:
    cold_calls.measure(lay, rounds=1, flush_mb=1)
    out["refused"] = None
except RuntimeError as err:
    out["refused"] = str(err)
print("RESULT" + json.dumps(out))
"""


def test_cold_calls_time_each_step_cold_and_warm_and_keep_the_values():
    """Each candidate is timed once cold and once warm per round; the ratios are to
    megatron-core's step; every model's non-TP gradients keep the values they were given
    (checked in the run), and a step that moves a value is refused by name."""
    pytest.importorskip("megatron.core")
    proc = subprocess.run([sys.executable, "-c", _RUN], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))[len("RESULT"):])
    assert got["grads"] == 96
    names = ["megatron-core", "meshgrad buffers", "meshgrad drop-in"]
    assert got["samples"] == {"cold": dict.fromkeys(names, 3), "warm": dict.fromkeys(names, 3)}
    assert got["positive"]
    assert sorted(got["ratios"]) == sorted(f"{n} / megatron-core, {k}" for n in names[1:] for k in ("cold", "warm"))
    assert all(r > 0 for r in got["ratios"].values())
    for name in names:
        ratios = r"\s+-\s+-" if name == "megatron-core" else rf"\s+{_NUMBER}\s+{_NUMBER}"
        assert re.search(rf"^  {name}\s+{_NUMBER}\s+{_NUMBER}{ratios}$", got["text"], flags=re.M), got["text"]
    assert got["refused"] == "gpt-24L-h1024: non-TP gradients changed in ['meshgrad drop-in']"
