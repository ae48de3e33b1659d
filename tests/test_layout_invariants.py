"""The reduce-scatter layout's invariants over every parity scenario, run under a
distributed optimizer: the reference on every scenario, jax_impl where a reduce-scatter precedes a
cross-stage sum (torch_impl, every scenario: parity_tests/test_torch_invariants.py).

Every scenario runs twice with ``use_distributed_optimizer=True``: with its reduce-scatter
and with ``force_all_reduce=True``. What each rank owns must equal the all-reduce, and the
copies of every cross-stage-summed parameter (tied word embedding, position embedding,
conditional embedder, flextron router) must give their optimizers the same values.
"""

from __future__ import annotations

from parity_tests.jax_world import run_jax  # first: sets the fake-device XLA flag

import pytest  # noqa: E402

from parity_tests.invariants import owned_mismatches, scatter_pair, tied_mismatches  # noqa: E402
from parity_tests.reference import reference_finalize  # noqa: E402
from parity_tests.scenarios import all_scenarios, make_rank_inputs  # noqa: E402

SCENARIOS = all_scenarios()
IDS = [s.name for s in SCENARIOS]
# jax_impl runs the scenarios where a reduce-scatter precedes a cross-stage sum (pp >= 2,
# dp * cp >= 2); its parity with the reference on every scenario is parity_tests' job, and
# torch_impl runs every scenario here (parity_tests/test_torch_invariants.py).
CROSS_STAGE = [s for s in SCENARIOS if s.pp > 1 and s.dp * s.cp > 1]


def reference_outputs(scenario):
    """The reference's per-rank outputs of ``scenario``."""
    inputs = [make_rank_inputs(scenario, rank) for rank in range(scenario.world_size)]
    return reference_finalize(scenario, inputs).outputs


def check_invariants(scenario, scattered, forced) -> None:
    """Owned == all-reduce after the scatter; tied copies agree after both runs."""
    scatter, forced_case = scatter_pair(scenario)
    problems = owned_mismatches(scatter, scattered, forced)
    problems += [f"scatter: {p}" for p in tied_mismatches(scatter, scattered)]
    problems += [f"forced: {p}" for p in tied_mismatches(forced_case, forced)]
    assert not problems, f"{scenario.name}:\n" + "\n".join(problems[:12])


@pytest.mark.parametrize("scenario", SCENARIOS, ids=IDS)
def test_reference_invariants(scenario):
    scatter, forced = scatter_pair(scenario)
    check_invariants(scenario, reference_outputs(scatter), reference_outputs(forced))


@pytest.fixture(scope="module")
def jax_results():
    cases = [case for s in CROSS_STAGE for case in scatter_pair(s)]
    return run_jax(cases)


@pytest.mark.parametrize("scenario", CROSS_STAGE, ids=[s.name for s in CROSS_STAGE])
def test_jax_invariants(scenario, jax_results):
    scatter, forced = (jax_results[c.name] for c in scatter_pair(scenario))
    assert scatter.error is None and forced.error is None, scatter.error or forced.error
    check_invariants(scenario, scatter.outputs, forced.outputs)
