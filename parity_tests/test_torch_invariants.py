"""torch_impl (gloo worlds) under the reduce-scatter layout's invariants, every scenario.

Each scenario runs with ``use_distributed_optimizer=True``, once reduce-scattering and
once with ``force_all_reduce=True`` (tests/test_layout_invariants.py: the checks).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from parity_tests.invariants import scatter_pair  # noqa: E402
from parity_tests.scenarios import all_scenarios, by_world_size  # noqa: E402
from parity_tests.torch_world import run_torch_world  # noqa: E402
from tests.test_layout_invariants import check_invariants  # noqa: E402

SCENARIOS = all_scenarios()
#: One world of 8 runs 232 cases (every scenario twice): about 4 minutes on 2 cores,
#: setup included in the first test's time; the limits leave room for a loaded machine.
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def torch_results():
    cases = tuple(case for s in SCENARIOS for case in scatter_pair(s))
    results = {}
    for world_size, scenarios in sorted(by_world_size(cases).items()):
        results.update(run_torch_world(scenarios, world_size, timeout=1500.0))
    return results


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_torch_invariants(scenario, torch_results):
    scatter, forced = (torch_results[c.name] for c in scatter_pair(scenario))
    assert scatter.error is None and forced.error is None, scatter.error or forced.error
    check_invariants(scenario, scatter.outputs, forced.outputs)
