"""Layout invariants of the distributed optimizer's reduce-scatter, checked on outputs.

Two properties that parity between backends cannot see (every backend shares the layout):

- **owned == all-reduce**: after a reduce-scatter step, every element a rank owns (the
  only ones its optimizer reads) equals the same element of the same scenario run with
  ``force_all_reduce=True``;
- **tied copies agree**: for every parameter a later step sums across pipeline stages
  (tied word embedding, position embedding, conditional embedder, flextron router),
  the values the optimizers read -- each element taken from the rank that owns it in its
  stage's dp_cp group -- are the same on every stage and chunk copy.

Ownership is read from the meshgrad plan each rank executes (its ``scatter`` reductions
and :func:`meshgrad.layout.scatter_shard`).
"""

from __future__ import annotations

import dataclasses
import numpy as np

from meshgrad import FinalizeConfig, plan_finalize
from meshgrad.actions import Reduction, StageReduction, Step
from meshgrad.axes import Group
from meshgrad.layout import scatter_shard
from parity_tests.compare import tolerance
from parity_tests.scenarios import Key, RankData, Scenario
from parity_tests.specs import scenario_dims, scenario_specs

#: A rank's owned elements: key -> flat boolean mask (keys not listed: every element).
Owned = dict[Key, np.ndarray]


def scatter_pair(scenario: Scenario) -> tuple[Scenario, Scenario]:
    """The scenario under a distributed optimizer: (reduce-scatter, forced all-reduce)."""
    config = dict(scenario.config, use_distributed_optimizer=True)
    scatter = dataclasses.replace(scenario, name=f"{scenario.name}~scatter", config=config, force_all_reduce=False)
    forced = dataclasses.replace(scenario, name=f"{scenario.name}~forced", config=config, force_all_reduce=True)
    return scatter, forced


def _coords(scenario: Scenario, rank: int) -> tuple[int, int, int]:
    """(pp stage, dp_cp index, edp index) of a global rank."""
    per_stage = scenario.world_size // scenario.pp
    inner = rank % per_stage
    dp_cp_index = inner // (scenario.gtp * scenario.tp)
    edp_index = inner // (scenario.egtp * scenario.ep * scenario.expert_tp)
    return rank // per_stage, dp_cp_index, edp_index


def _plan(scenario: Scenario, stage: int):
    params, routers = scenario_specs(scenario)
    config = FinalizeConfig.from_mapping(scenario.config)
    plan = plan_finalize(
        params, config, scenario_dims(scenario), routers, force_all_reduce=scenario.force_all_reduce, stage=stage
    )
    return plan, {p.key: p.numel for p in params}


def owned_elements(scenario: Scenario, rank: int) -> Owned:
    """The elements ``rank`` owns after the DP sync, per key (from its plan).

    Returns:
      key -> flat mask for every key of a reduce-scatter over a group of size > 1.
    """
    stage, dp_cp_index, edp_index = _coords(scenario, rank)
    plan, numel = _plan(scenario, stage)
    sizes = {Group.DP_CP: scenario.dp * scenario.cp, Group.EDP: scenario.edp}
    owned: Owned = {}
    for action in plan.actions:
        if not (isinstance(action, Reduction) and action.scatter and sizes.get(action.group, 1) > 1):
            continue
        index = dp_cp_index if action.group is Group.DP_CP else edp_index
        total = sum(numel[k] for k in action.keys)
        start, stop = scatter_shard(total, sizes[action.group], index)
        offset = 0
        for key in action.keys:
            mask = np.zeros(numel[key], dtype=bool)
            lo, hi = max(start - offset, 0), min(stop - offset, numel[key])
            if lo < hi:
                mask[lo:hi] = True
            owned[key] = mask
            offset += numel[key]
    return owned


def cross_stage_copies(scenario: Scenario) -> list[list[tuple[int, Key]]]:
    """Per parameter a later step sums across pp stages: its (stage, key) copies."""
    found: dict[tuple[int, int], list[tuple[int, Key]]] = {}
    for stage in range(scenario.pp):
        plan, _ = _plan(scenario, stage)
        for where, action in enumerate(plan.actions):
            if isinstance(action, StageReduction):
                key = action.key_for(stage)
                if key is not None:
                    found.setdefault((where, 0), []).append((stage, key))
            elif isinstance(action, Reduction) and (set(action.steps) & {Step.COND_EMBEDDER, Step.ROUTER}):
                for j, (key, copies) in enumerate(zip(action.keys, action.copies or ((),) * len(action.keys))):
                    found.setdefault((where, j), []).extend((stage, k) for k in (key, *copies))
    return [copies for copies in found.values() if len(copies) > 1]


def _close(a: np.ndarray, b: np.ndarray, scenario: Scenario) -> bool:
    rtol, atol = tolerance(scenario)
    return bool(np.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True))


def owned_mismatches(scenario: Scenario, scattered: list[RankData], forced: list[RankData]) -> list[str]:
    """Where an owned element of the scatter run differs from the forced all-reduce run."""
    bad = []
    for rank in range(scenario.world_size):
        owned = owned_elements(scenario, rank)
        for key, got in scattered[rank].grads.items():
            if got is None:
                continue
            mask = owned.get(key, np.ones(got.size, dtype=bool))
            a, b = np.ravel(got)[mask], np.ravel(forced[rank].grads[key])[mask]
            if not _close(a, b, scenario):
                where = np.flatnonzero(mask)[~np.isclose(a, b)][:4]
                bad.append(f"rank {rank} {key}: owned elements {where.tolist()} differ from the all-reduce")
    return bad


def tied_mismatches(scenario: Scenario, outputs: list[RankData]) -> list[str]:
    """Where the copies of a cross-stage-summed parameter give their optimizers different values.

    A copy's optimizer view takes each element from the rank of its stage's dp_cp group
    that owns it.
    """
    per_stage = scenario.world_size // scenario.pp
    inner = scenario.gtp * scenario.tp
    owned = [owned_elements(scenario, rank) for rank in range(scenario.world_size)]
    bad = []
    for copies in cross_stage_copies(scenario):
        for replica in range(inner):  # one (gtp, tp) coordinate: one dp_cp group per stage
            views = []
            for stage, key in copies:
                ranks = [stage * per_stage + i * inner + replica for i in range(per_stage // inner)]
                if outputs[ranks[0]].grads[key] is None:
                    continue
                view = np.full(outputs[ranks[0]].grads[key].size, np.nan)
                for rank in ranks:
                    grad = np.ravel(outputs[rank].grads[key])
                    mask = owned[rank].get(key, np.ones(grad.size, dtype=bool))
                    view[mask] = grad[mask]
                views.append(((stage, key), view))
            for where, view in views[1:]:
                if not _close(view, views[0][1], scenario):
                    bad.append(f"replica {replica}: copy {where} disagrees with {views[0][0]}")
    return bad


__all__ = ["cross_stage_copies", "owned_elements", "owned_mismatches", "scatter_pair", "tied_mismatches"]
