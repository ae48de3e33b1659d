"""End-to-end: the examples' finalized gradients equal single-device gradients.

``examples/torch_train.py`` is launched with ``torch.distributed.run`` (8 gloo ranks) at a
few (pp, dp, cp, tp, ep) shapes and compared, step by step, with its ``--single`` run:
every full parameter's finalized gradient, the loss and every router's expert bias.
``examples/jax_train.py`` does its own comparison and exits non-zero on a mismatch.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from launch import launch

ROOT = Path(__file__).resolve().parents[1]
TORCH_EXAMPLE = ROOT / "examples" / "torch_train.py"
JAX_EXAMPLE = ROOT / "examples" / "jax_train.py"
STEPS = 2
LAUNCH_TIMEOUT_S = 240

#: float32: rounding of TP/EP partial sums; float64: the only float32 left is the
#: 1 / num_tokens scale (a float32 value, as in Megatron), a uniform relative error < 6e-8.
TOLERANCE = {"float32": 1e-5, "float64": 1e-7}


def run(cmd: list[str], timeout: float = LAUNCH_TIMEOUT_S) -> str:
    """Run ``cmd`` from the checkout (:func:`launch.launch`: its process group killed on
    timeout, one more run after torch's gloo teardown abort only); return its output."""
    return launch(cmd, ROOT, timeout)


def torch_dump(tmp_path: Path, name: str, *args: str) -> dict[str, Any]:
    torch = pytest.importorskip("torch")
    path = tmp_path / f"{name}.pt"
    run([sys.executable, str(TORCH_EXAMPLE), "--steps", str(STEPS), "--dump", str(path), *args])
    return torch.load(path)


def assert_dumps_match(got: dict[str, Any], want: dict[str, Any], tol: float) -> None:
    """Losses, every finalized gradient and every expert bias agree at every step.

    Gradients: ``|got - want| <= tol * |want| + tol * max|want of that step|`` elementwise.
    """
    import torch
    assert len(got["losses"]) == len(want["losses"]) == STEPS
    for step in range(STEPS):
        assert got["losses"][step] == pytest.approx(want["losses"][step], rel=tol), f"loss, step {step}"
        g, w = got["grads"][step], want["grads"][step]
        assert sorted(g) == sorted(w), f"step {step}: parameter names differ: {sorted(set(g) ^ set(w))}"
        scale = max(t.abs().max().item() for t in w.values())
        for name in w:
            torch.testing.assert_close(
                g[name].double(), w[name].double(), rtol=tol, atol=tol * scale,
                msg=lambda m, name=name, step=step: f"step {step}, gradient of {name}: {m}",
            )
        assert got["replica_diff"][step] <= tol * scale, f"step {step}: replicas disagree"
        gb, wb = got["expert_bias"][step], want["expert_bias"][step]
        assert sorted(gb) == sorted(wb) and wb
        for name in wb:
            torch.testing.assert_close(gb[name], wb[name], rtol=0, atol=1e-6, msg=f"step {step}: {name}")


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The one-device reference run, per dtype."""
    tmp = tmp_path_factory.mktemp("single")
    return {dtype: torch_dump(tmp, f"single_{dtype}", "--single", "--dtype", dtype) for dtype in TOLERANCE}


@pytest.mark.parametrize(
    "pp,dp,cp,tp,ep,dtype",
    [
        pytest.param(2, 2, 1, 2, 2, "float32", id="pp2-dp2-tp2-ep2-f32"),
        pytest.param(1, 2, 2, 2, 4, "float64", id="dp2-cp2-tp2-ep4-f64"),
        pytest.param(4, 1, 1, 2, 1, "float32", id="pp4-tp2-f32"),
    ],
)
def test_torch_example_matches_single_device(
    tmp_path: Path, single: dict[str, dict[str, Any]], pp: int, dp: int, cp: int, tp: int, ep: int, dtype: str
) -> None:
    import torch

    path = tmp_path / "dist.pt"
    run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={pp * dp * cp * tp}",
         str(TORCH_EXAMPLE), f"--pp={pp}", f"--dp={dp}", f"--cp={cp}", f"--tp={tp}", f"--ep={ep}",
         f"--dtype={dtype}", f"--steps={STEPS}", f"--dump={path}"]
    )
    assert_dumps_match(torch.load(path), single[dtype], TOLERANCE[dtype])


def test_comparison_catches_a_small_error(single: dict[str, dict[str, Any]]) -> None:
    """The tolerance sees a 0.1% error in one tensor and one wrong expert-bias step."""
    import torch

    want = single["float32"]
    assert_dumps_match(want, want, TOLERANCE["float32"])
    name = "decoder.layers.1.mlp.router.weight"
    grads = [dict(g) for g in want["grads"]]
    grads[1][name] = grads[1][name] * 1.001
    with pytest.raises(AssertionError, match="router.weight"):
        assert_dumps_match({**want, "grads": grads}, want, TOLERANCE["float32"])
    biases = [dict(b) for b in want["expert_bias"]]
    key = next(iter(biases[0]))
    biases[0][key] = biases[0][key] + torch.tensor([0.02, 0, 0, 0])  # one flipped sign step
    with pytest.raises(AssertionError, match="expert_bias"):
        assert_dumps_match({**want, "expert_bias": biases}, want, TOLERANCE["float32"])


@pytest.mark.parametrize(
    "pp,dp,tp,optimizer", [(2, 2, 2, "adamw"), (2, 1, 4, "sgd")], ids=["pp2-dp2-tp2-adamw", "pp2-tp4-sgd"]
)
def test_jax_example_matches_single_device(pp: int, dp: int, tp: int, optimizer: str) -> None:
    """optax.chain(finalize_gradients, optimizer) on 8 devices == the optimizer on one: the
    parameters after every step (sgd: exactly the finalized gradients times lr), loss, bias."""
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    out = run([sys.executable, str(JAX_EXAMPLE), f"--pp={pp}", f"--dp={dp}", f"--tp={tp}", f"--steps={STEPS}",
               f"--optimizer={optimizer}"] + (["--lr=0.1"] if optimizer == "sgd" else []))
    assert out.count(" ok") == STEPS and "MISMATCH" not in out, out
    assert f"finalize_gradients(...), {optimizer})" in out
