"""jax_impl against the numpy reference on every parity scenario (one jax process)."""

from __future__ import annotations

from parity_tests.jax_world import run_jax  # first: sets the fake-device XLA flag

import pytest  # noqa: E402

from parity_tests.compare import compare_ranks  # noqa: E402
from parity_tests.scenarios import all_scenarios, make_rank_inputs  # noqa: E402

reference = pytest.importorskip("parity_tests.reference")

SCENARIOS = all_scenarios()


@pytest.fixture(scope="module")
def jax_results():
    return run_jax(list(SCENARIOS))


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_jax_matches_reference(scenario, jax_results):
    result = jax_results[scenario.name]
    inputs = [make_rank_inputs(scenario, rank) for rank in range(scenario.world_size)]
    try:
        want = reference.reference_finalize(scenario, inputs)
    except Exception as exc:  # the reference rejects the scenario: jax must too
        assert result.error is not None, f"reference raised {exc!r}; jax returned outputs"
        return
    assert result.error is None, result.error
    comparison = compare_ranks(scenario, result.outputs, want.outputs)
    assert comparison.ok, "\n".join(comparison.failures[:20])
