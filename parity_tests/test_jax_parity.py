"""jax_impl against the numpy reference on every parity scenario (one jax process).

Each scenario is held to the reference twice: by ``check_against_reference`` (per rank
and entry, with its messages; a scenario the reference rejects must be rejected) and as
whole trees with chex (every rank's gradients and router buffers, structure included).
"""

from __future__ import annotations

from parity_tests.jax_world import run_jax  # first: sets the fake-device XLA flag

import dataclasses  # noqa: E402

import chex  # noqa: E402
import pytest  # noqa: E402

from parity_tests.compare import ROUTER_FIELDS, check_against_reference, tolerance  # noqa: E402
from parity_tests.reference import reference_finalize  # noqa: E402
from parity_tests.scenarios import RankData, Scenario, all_scenarios, make_rank_inputs  # noqa: E402

SCENARIOS = all_scenarios()


@pytest.fixture(scope="module")
def jax_results():
    return run_jax(list(SCENARIOS))


def assert_trees_match(scenario: Scenario, got: list[RankData], want: list[RankData]) -> None:
    """Every rank's gradients within the scenario's tolerance (0 in exact mode), router
    buffers exact in exact mode but for the qb_beta EMA (as ``compare_ranks``)."""
    rtol, atol = tolerance(scenario)
    chex.assert_trees_all_close([r.grads for r in got], [r.grads for r in want], rtol=rtol, atol=atol)
    routers = lambda ranks, fields: [{k: {f: getattr(s, f) for f in fields} for k, s in r.routers.items()}  # noqa: E731
                                     for r in ranks]
    loose = 1e-6 * scenario.world_size
    exact = [f for f in ROUTER_FIELDS if f != "qb_beta"] if scenario.mode == "exact" else []
    chex.assert_trees_all_equal(routers(got, exact), routers(want, exact))
    rest = [f for f in ROUTER_FIELDS if f not in exact]
    chex.assert_trees_all_close(routers(got, rest), routers(want, rest), rtol=loose, atol=loose)
    resets = lambda ranks: [{k: s.aux_loss_resets for k, s in r.routers.items()} for r in ranks]  # noqa: E731
    assert resets(got) == resets(want)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_jax_matches_reference(scenario, jax_results):
    result = jax_results[scenario.name]
    check_against_reference(scenario, result, "jax")
    if result.error is None:
        inputs = [make_rank_inputs(scenario, rank) for rank in range(scenario.world_size)]
        assert_trees_match(scenario, result.outputs, reference_finalize(scenario, inputs).outputs)


def test_the_tree_comparison_tells_a_wrong_value_apart(jax_results):
    """The chex comparison fails on one changed gradient value (exact mode)."""
    scenario = next(s for s in SCENARIOS if s.mode == "exact" and jax_results[s.name].error is None)
    got = jax_results[scenario.name].outputs
    inputs = [make_rank_inputs(scenario, rank) for rank in range(scenario.world_size)]
    want = reference_finalize(scenario, inputs).outputs
    assert_trees_match(scenario, got, want)
    key, value = next((k, v) for k, v in want[0].grads.items() if v is not None and v.size)
    changed = value.copy()
    changed.flat[0] += 1.0
    wrong = [dataclasses.replace(want[0], grads={**want[0].grads, key: changed}), *want[1:]]
    with pytest.raises(AssertionError):
        assert_trees_match(scenario, got, wrong)
