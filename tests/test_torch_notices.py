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
