"""parity_tests.public: the numpy reference on one's own layout, and check_plan."""

from __future__ import annotations

import dataclasses

import chex
import numpy as np
import pytest

from meshgrad import FinalizeConfig, ParallelDims, ParamSpec, ReduceOp, Reduction, RouterSpec, StageReduction, Step, plan_finalize
from parity_tests.public import check_plan, reference, run_plan_jax

DIMS = ParallelDims(pp=2, dp=2, tp=2)
SPECS = [
    ParamSpec("embedding.word_embeddings.weight", shape=(4, 2), role="word_embedding"),
    ParamSpec("decoder.final_layernorm.weight", shape=(2,), sequence_parallel=True),
    ParamSpec("decoder.linear.weight", shape=(3,)),
]
ROUTERS = [RouterSpec("decoder.router", num_experts=2, has_expert_bias=True, has_aux_loss_tracker=False)]
CONFIG = FinalizeConfig(sequence_parallel=True, calculate_per_token_loss=True, moe_router_enable_expert_bias=True,
                        moe_router_bias_update_rate=0.25)


def inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    grads = {s.key: rng.integers(-4, 5, (8, *s.shape)).astype(np.float32) for s in SPECS}
    routers = {ROUTERS[0].key: {"local_tokens_per_expert": rng.integers(0, 5, (8, 2)).astype(np.float32),
                                "expert_bias": np.zeros((8, 2), np.float32)}}
    return grads, routers, np.asarray([1, 2, 3, 4, 1, 1, 2, 2], np.int32)


def test_reference_matches_jax_on_own_layout():
    grads, routers, tokens = inputs()
    want = reference(grads, routers, tokens, specs=SPECS, config=CONFIG, dims=DIMS, router_specs=ROUTERS)
    plan = plan_finalize(SPECS, CONFIG, DIMS, ROUTERS)
    got = run_plan_jax(plan, DIMS, grads, routers, tokens)
    chex.assert_trees_all_close(got[0], want[0], rtol=1e-6)
    for field in ("local_tokens_per_expert", "expert_bias"):
        chex.assert_trees_all_close(got[1][ROUTERS[0].key][field], want[1][ROUTERS[0].key][field])
    assert np.abs(want[1][ROUTERS[0].key]["expert_bias"]).max() == 0.25  # the bias did move
    check = check_plan(plan, DIMS, grads, routers, tokens, backends=("jax",), atol=1e-6)
    assert check.ok and check.worst("jax") <= 1e-6 and "router 0:decoder.router.expert_bias" in check.diffs["jax"]


def test_an_edited_plan_is_told_apart_and_checked_against_its_own_expectation():
    config = FinalizeConfig(sequence_parallel=True)
    grads, _, _ = inputs(1)
    plan = plan_finalize(SPECS, config, DIMS)
    edited = dataclasses.replace(plan, actions=tuple(
        dataclasses.replace(a, op=ReduceOp.AVG) if isinstance(a, Reduction) and a.step is Step.NON_TP else a
        for a in plan.actions))
    assert not check_plan(edited, DIMS, grads, backends=("jax",)).ok  # differs from the reference

    def variant(g, routers, num_tokens):
        out, _ = reference(g, specs=SPECS, config=config, dims=DIMS)
        key = SPECS[1].key
        return {**out, key: out[key] / DIMS.tp}, {}  # the layernorm: mean over tp, not sum

    assert check_plan(edited, DIMS, grads, expected=variant, backends=("jax",)).ok
    assert check_plan(plan, DIMS, grads, backends=("jax",)).ok


def test_layouts_the_reference_cannot_describe_are_refused():
    with pytest.raises(ValueError, match="same parameters"):
        reference({}, specs=[ParamSpec("a", chunk=0), ParamSpec("b", chunk=1)], config=FinalizeConfig(), dims=DIMS)


def test_an_embedding_step_edited_to_avg_runs_alike_in_both_backends():
    config = FinalizeConfig(sequence_parallel=True)
    grads, _, _ = inputs(2)
    plan = plan_finalize(SPECS, config, DIMS)
    stage_steps = [a for a in plan.actions if isinstance(a, StageReduction)]
    assert stage_steps, plan.describe()
    edited = dataclasses.replace(plan, actions=tuple(
        dataclasses.replace(a, op=ReduceOp.AVG) if isinstance(a, StageReduction) else a for a in plan.actions))

    def variant(g, routers, num_tokens):
        out, _ = reference(g, specs=SPECS, config=config, dims=DIMS)
        key = SPECS[0].key
        return {**out, key: out[key] / DIMS.pp}, {}  # the tied embedding: mean over its 2 stages, not sum

    assert not check_plan(edited, DIMS, grads, backends=("jax", "torch")).ok
    check = check_plan(edited, DIMS, grads, expected=variant, backends=("jax", "torch"))
    assert check.ok, check.diffs
