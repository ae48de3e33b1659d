"""torch_impl (gloo worlds) under the reduce-scatter layout's invariants, every scenario.

Each scenario runs once in a gloo world with ``use_distributed_optimizer=True`` (its
reduce-scatter); what each rank owns must equal the all-reduce, and the tied copies must
agree (tests/test_layout_invariants.py: the checks). The all-reduce side is the numpy
reference's run with ``force_all_reduce=True``: under that flag a distributed optimizer's
plan is the plan without one (checked below, every scenario and stage), which torch_impl
runs against the same reference in parity_tests/test_torch_parity.py -- a forced torch
run per scenario would repeat that world's work.
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("torch")

from meshgrad import FinalizeConfig, plan_finalize  # noqa: E402
from parity_tests.invariants import scatter_pair  # noqa: E402
from parity_tests.scenarios import all_scenarios, by_world_size  # noqa: E402
from parity_tests.specs import scenario_dims, scenario_specs  # noqa: E402
from parity_tests.torch_world import run_torch_world  # noqa: E402
from tests.test_layout_invariants import check_invariants, reference_outputs  # noqa: E402

SCENARIOS = all_scenarios()
#: One world of 8 runs 116 cases (every scenario's reduce-scatter): about 2 minutes on 2
#: cores, setup included in the first test's time; the limits leave room for a loaded machine.
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def torch_results():
    cases = tuple(scatter_pair(s)[0] for s in SCENARIOS)
    results = {}
    for world_size, scenarios in sorted(by_world_size(cases).items()):
        results.update(run_torch_world(scenarios, world_size, timeout=1500.0))
    return results


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_torch_invariants(scenario, torch_results):
    scatter_case, forced_case = scatter_pair(scenario)
    scatter = torch_results[scatter_case.name]
    assert scatter.error is None, scatter.error
    check_invariants(scenario, scatter.outputs, reference_outputs(forced_case))


def _plans(scenario, stage: int):
    params, routers = scenario_specs(scenario)
    return plan_finalize(params, FinalizeConfig.from_mapping(scenario.config), scenario_dims(scenario), routers,
                         force_all_reduce=scenario.force_all_reduce, stage=stage).actions


def test_forced_distributed_optimizer_plan_is_the_plain_plan():
    """Why the invariants need no forced torch run: with ``force_all_reduce=True`` the
    distributed optimizer's plan equals the plan of the same scenario without one (and
    without the flag), on every scenario and pipeline stage."""
    checked = scattering = 0
    for scenario in SCENARIOS:
        scatter, forced = scatter_pair(scenario)
        config = {k: v for k, v in scenario.config.items() if k != "use_distributed_optimizer"}
        plain = dataclasses.replace(scenario, config=config, force_all_reduce=False)
        for stage in range(scenario.pp):
            assert _plans(forced, stage) == _plans(plain, stage), f"{scenario.name} stage {stage}"
            scattering += _plans(scatter, stage) != _plans(plain, stage)
            checked += 1
    assert checked == sum(s.pp for s in SCENARIOS) > len(SCENARIOS)
    assert scattering > checked // 2  # the scatter runs do run another plan
