"""torch_impl against the numpy reference on every parity scenario.

One gloo world per world size runs all scenarios of that size (spawning is the slow
part); each scenario is then one test.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from parity_tests.compare import check_against_reference  # noqa: E402
from parity_tests.scenarios import all_scenarios, by_world_size  # noqa: E402
from parity_tests.torch_world import run_torch_world  # noqa: E402

SCENARIOS = all_scenarios()
#: The world of 8 runs 116 scenarios; on 2 shared cores that can take many minutes.
pytestmark = pytest.mark.timeout(2400)


@pytest.fixture(scope="module")
def torch_results():
    results = {}
    for world_size, scenarios in sorted(by_world_size(SCENARIOS).items()):
        results.update(run_torch_world(scenarios, world_size, timeout=1800.0))
    return results


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_torch_matches_reference(scenario, torch_results):
    check_against_reference(scenario, torch_results[scenario.name], "torch")
