"""The plan stage's likely-mistake warning in torch_impl: given once per plan, at the
user's line, silenceable, with Megatron's numbers kept (a world of one rank)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from meshgrad import FinalizeConfig  # noqa: E402
from meshgrad.errors import LikelyMistakeWarning  # noqa: E402
from parity_tests.scenarios import ParamLayout, Scenario, make_rank_inputs  # noqa: E402
from parity_tests.torch_world import build_model, load_inputs, read_outputs  # noqa: E402
from torch_impl import finalize_model_grads  # noqa: E402

PARAMS = (
    ParamLayout("layer.norm.weight", (2,), sequence_parallel=True),
    ParamLayout("layer.linear.weight", (2, 2)),
)


def _setup(config: dict):
    scenario = Scenario("notices", params=PARAMS, config=config)
    model = build_model(scenario, 0, FinalizeConfig.from_mapping(scenario.config))
    data = make_rank_inputs(scenario, 0)
    load_inputs(model, scenario, data)
    return scenario, model, data


def _mistakes(caught) -> list[warnings.WarningMessage]:
    return [w for w in caught if issubclass(w.category, LikelyMistakeWarning)]


def test_num_tokens_without_per_token_loss_warns_once_at_the_users_line_and_keeps_megatrons_numbers():
    scenario, model, data = _setup({"calculate_per_token_loss": False})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        finalize_model_grads(model, num_tokens=torch.tensor(4))
    (warning,) = _mistakes(caught)
    assert warning.filename == __file__, warning.filename
    assert "calculate_per_token_loss" in str(warning.message)
    out = read_outputs(model, scenario, data)
    for key, g in data.grads.items():  # Megatron's numbers: divided by the count all the same
        np.testing.assert_array_equal(out.grads[key], g / 4)
    load_inputs(model, scenario, data)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        finalize_model_grads(model, num_tokens=torch.tensor(4))  # the same plan: no second warning
    assert not _mistakes(caught)
    out = read_outputs(model, scenario, data)
    for key, g in data.grads.items():
        np.testing.assert_array_equal(out.grads[key], g / 4)


def test_the_warning_is_silenced_by_its_category_and_absent_without_the_mistake():
    scenario, model, data = _setup({"calculate_per_token_loss": False})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=LikelyMistakeWarning)
        finalize_model_grads(model, num_tokens=torch.tensor(2))
    assert not _mistakes(caught)
    scenario, model, data = _setup({"calculate_per_token_loss": True})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        finalize_model_grads(model, num_tokens=torch.tensor(2))
    assert not _mistakes(caught)
    out = read_outputs(model, scenario, data)
    for key, g in data.grads.items():
        np.testing.assert_array_equal(out.grads[key], g / 2)


# --------------------------------------------------------------------------- tp = 2


def sequence_parallel_world(rank: int, world: int) -> dict:
    """Two tp ranks, a layernorm flagged sequence_parallel, config.sequence_parallel off
    then on: the warnings given and the gradients after each call."""
    import torch.distributed as dist

    tp = dist.new_group([0, 1])
    singles = [dist.new_group([r]) for r in range(world)]
    groups = {"tp": tp, "pp": singles[rank], "embd": singles[rank], "pos_embd": singles[rank], "dp_cp": singles[rank]}
    out = {}
    for sequence_parallel in (False, True):
        norm = torch.nn.LayerNorm(2)
        norm.weight.sequence_parallel = True
        norm.config = {"sequence_parallel": sequence_parallel}
        warned, grads = [], []
        for _ in range(2):  # one plan, two calls
            norm.weight.grad = torch.full((2,), float(rank + 1))
            norm.bias.grad = torch.full((2,), float(10 * (rank + 1)))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                finalize_model_grads([norm], pg_collection=groups)
            warned += [(str(w.message), w.filename) for w in _mistakes(caught)]
            grads.append((norm.weight.grad.tolist(), norm.bias.grad.tolist()))
        out[str(sequence_parallel)] = {"warned": warned, "grads": grads}
    return out


def test_sequence_parallel_flags_without_config_warn_at_tp2_and_keep_megatrons_numbers():
    from parity_tests.world_cases import case_values, run_cases

    results = case_values(run_cases(__name__, ["sequence_parallel_world"], 2, timeout=120), "sequence_parallel_world")
    for rank, result in enumerate(results):
        off, on = result["False"], result["True"]
        (warning,) = off["warned"]  # once per plan, though called twice
        text, filename = warning
        assert filename == __file__ and "'weight'" in text and "sequence_parallel" in text, warning
        assert off["grads"] == [([rank + 1.0] * 2, [10.0 * (rank + 1)] * 2)] * 2  # Megatron: no tp sum
        assert on["warned"] == []
        assert on["grads"] == [([3.0] * 2, [10.0 * (rank + 1)] * 2)] * 2  # summed over tp: 1 + 2


def test_a_warning_inside_a_compiled_step_points_at_the_users_line():
    """Under torch.compile finalize runs eagerly (a graph break); its warning still names
    the user's line, not dynamo's frames, and the numbers are Megatron's."""
    scenario, model, data = _setup({"calculate_per_token_loss": False})

    def step(tokens):
        finalize_model_grads(model, num_tokens=tokens)
        return tokens + 0

    compiled = torch.compile(step, backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(torch.tensor(4))
    (warning,) = _mistakes(caught)
    assert warning.filename == __file__, warning.filename
    out = read_outputs(model, scenario, data)
    for key, g in data.grads.items():
        np.testing.assert_array_equal(out.grads[key], g / 4)
