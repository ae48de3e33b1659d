"""jax_impl against the numpy reference on every parity scenario (one jax process)."""

from __future__ import annotations

from parity_tests.jax_world import run_jax  # first: sets the fake-device XLA flag

import pytest  # noqa: E402

from parity_tests.compare import check_against_reference  # noqa: E402
from parity_tests.scenarios import all_scenarios  # noqa: E402

SCENARIOS = all_scenarios()


@pytest.fixture(scope="module")
def jax_results():
    return run_jax(list(SCENARIOS))


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_jax_matches_reference(scenario, jax_results):
    check_against_reference(scenario, jax_results[scenario.name], "jax")
