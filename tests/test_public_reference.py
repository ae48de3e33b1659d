"""parity_tests.public: the numpy reference on one's own layout, and check_plan."""

from __future__ import annotations

import dataclasses

import chex
import numpy as np
import pytest

from meshgrad import (
    ExpertBiasUpdate, FinalizeConfig, Group, ParallelDims, ParamSpec, ReduceOp, Reduction, RouterSpec, StageReduction,
    Step, plan_finalize,
)
from meshgrad.errors import FinalizeInputError, MissingInputError, PlanMismatchError
from parity_tests.public import check_plan, reference, run_plan_jax, run_plan_torch

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


# --------------------------------------------------------------------------- both backends, every action type

QB_ROUTER = RouterSpec("decoder.qb_router", num_experts=4, has_qb_beta=True)
QB_CONFIG = CONFIG.replace(moe_router_load_balancing_type="quantile_balancing", moe_router_quantile_balancing_ema=0.5)


def router_inputs(seed: int):
    """Both routers' buffers ([W, E], integer-valued) and per-rank token counts."""
    grads, routers, tokens = inputs(seed)
    rng = np.random.default_rng(seed + 100)
    routers[QB_ROUTER.key] = {"qb_beta": (rng.integers(-4, 5, (8, 4)) / 4).astype(np.float32),
                              "qb_beta_accum": rng.integers(0, 9, (8, 4)).astype(np.float32),
                              "qb_beta_count": rng.integers(0, 4, (8,)).astype(np.float32)}
    return grads, routers, tokens


def assert_matches(got, want, atol: float = 0.0) -> None:
    """Every gradient and every given router field of ``got`` equals ``want`` within ``atol``."""
    chex.assert_trees_all_close(got[0], {k: want[0][k] for k in got[0]}, atol=atol, rtol=0)
    chex.assert_trees_all_close(got[1], {k: {f: want[1][k][f] for f in fields} for k, fields in got[1].items()},
                                atol=atol, rtol=0)


def test_routers_and_num_tokens_in_both_backends():
    """Expert bias, qb_beta, reset, both embedding steps and the token scale (pp
    broadcast, sum over dp): both backends give the reference's values on every rank."""
    grads, routers, tokens = router_inputs(3)
    position = ParamSpec("embedding.position_embeddings.weight", shape=(3,), role="position_embedding")
    grads[position.key] = np.random.default_rng(7).integers(-4, 5, (8, 3)).astype(np.float32)
    specs, config = [*SPECS, position], QB_CONFIG.replace(position_embedding_stages=(0, 1))
    router_specs = [*ROUTERS, QB_ROUTER]
    plan = plan_finalize(specs, config, DIMS, router_specs)
    steps = {a.step for a in plan.actions}
    assert {Step.EXPERT_BIAS, Step.QB_BETA, Step.RESET, Step.WORD_EMBEDDING, Step.POS_EMBEDDING} <= steps, \
        plan.describe()
    want = reference(grads, routers, tokens, specs=specs, config=config, dims=DIMS, router_specs=router_specs)
    for run in (run_plan_jax, run_plan_torch):
        assert_matches(run(plan, DIMS, grads, routers, tokens), want, atol=1e-6)
    check = check_plan(plan, DIMS, grads, routers, tokens, atol=1e-6)
    assert check.ok, check.diffs
    assert set(check.diffs["torch"]) == set(check.diffs["jax"])
    assert "router 0:decoder.qb_router.qb_beta" in check.diffs["torch"]
    # The inputs did change: the bias moved, the counts were reset, the qb mean moved beta,
    # and every gradient was divided by the global token count (the last stage's counts summed over dp: 1 + 2).
    bias, qb = want[1][ROUTERS[0].key], want[1][QB_ROUTER.key]
    assert np.abs(bias["expert_bias"]).max() == 0.25 and not bias["local_tokens_per_expert"].any()
    assert not np.array_equal(qb["qb_beta"], routers[QB_ROUTER.key]["qb_beta"]) and not qb["qb_beta_accum"].any()
    unscaled = reference(grads, specs=specs, config=config.replace(calculate_per_token_loss=False), dims=DIMS)[0]
    linear = SPECS[2].key
    chex.assert_trees_all_close(want[0][linear] * 3, unscaled[linear] * DIMS.dp)  # a mean loss pre-scales by 1/dp


EXPERT_DIMS = {
    "dp4-tp2-ep2": ParallelDims(dp=4, tp=2, ep=2),                 # edp 2, etp 2
    "pp2-dp2-tp2-ep2-etp1": ParallelDims(pp=2, dp=2, tp=2, ep=2, etp=1),  # edp 2 per stage
}
EXPERT_SPECS = [
    ParamSpec("decoder.final_layernorm.weight", shape=(2,), sequence_parallel=True),
    ParamSpec("decoder.linear.weight", shape=(3,)),
    ParamSpec("decoder.experts.fc1.weight", shape=(2, 3), expert=True),
    ParamSpec("decoder.experts.fc2.weight", shape=(5,), expert=True),
]


@pytest.mark.parametrize("name", sorted(EXPERT_DIMS))
def test_expert_parameters_in_both_backends(name):
    """Expert gradients reduce over the expert data-parallel group (edp = W / (pp ep etp)),
    dense ones over dp: both backends give the reference's values, bit for bit."""
    dims = EXPERT_DIMS[name]
    config = FinalizeConfig(sequence_parallel=True)
    rng = np.random.default_rng(4)
    grads = {s.key: rng.integers(-4, 5, (8, *s.shape)).astype(np.float32) for s in EXPERT_SPECS}
    plan = plan_finalize(EXPERT_SPECS, config, dims)
    assert any(a.group is Group.EXPT_DP for a in plan.actions), plan.describe()
    want, _ = reference(grads, specs=EXPERT_SPECS, config=config, dims=dims)
    # An oracle for the expert weight: the sum over edp (the expert mesh is (pp, edp,
    # egtp, ep, etp) in rank order) pre-scaled, as Megatron's DDP does, by 1 / (dp x cp).
    key = EXPERT_SPECS[2].key
    g = grads[key].reshape(dims.pp, -1, dims.ep * dims.etp, *EXPERT_SPECS[2].shape)
    oracle = np.broadcast_to((g / dims.dp).sum(1, keepdims=True), g.shape).reshape(8, 2, 3)
    chex.assert_trees_all_equal(want[key], oracle)
    for run in (run_plan_jax, run_plan_torch):
        assert_matches(run(plan, dims, grads), (want, {}))
    check = check_plan(plan, dims, grads)
    assert check.ok and check.worst("torch") == 0.0, check.diffs


def test_an_edited_plan_in_both_backends():
    """A plan edited with dataclasses.replace (the expert-bias rate, the non_tp op) runs
    alike in both backends and matches its own expectation, not the reference's."""
    grads, routers, tokens = inputs(5)
    plan = plan_finalize(SPECS, CONFIG, DIMS, ROUTERS)

    def edit(action):
        if isinstance(action, ExpertBiasUpdate):
            return dataclasses.replace(action, rate=0.5)
        if isinstance(action, Reduction) and action.step is Step.NON_TP:
            return dataclasses.replace(action, op=ReduceOp.AVG)
        return action

    edited = dataclasses.replace(plan, actions=tuple(edit(a) for a in plan.actions))
    assert edited.actions != plan.actions

    def variant(g, r, n):
        out, new = reference(g, r, n, specs=SPECS, config=CONFIG.replace(moe_router_bias_update_rate=0.5), dims=DIMS,
                             router_specs=ROUTERS)
        key = SPECS[1].key
        return {**out, key: out[key] / DIMS.tp}, new  # the layernorm: mean over tp, not sum

    want = variant(grads, routers, tokens)
    assert np.abs(want[1][ROUTERS[0].key]["expert_bias"]).max() == 0.5
    for run in (run_plan_jax, run_plan_torch):
        assert_matches(run(edited, DIMS, grads, routers, tokens), want)
    told_apart = check_plan(edited, DIMS, grads, routers, tokens)
    assert not told_apart.ok and told_apart.worst("torch") > 0 and told_apart.worst("jax") > 0
    check = check_plan(edited, DIMS, grads, routers, tokens, expected=variant)
    assert check.ok and check.worst("torch") == 0.0, check.diffs


def test_torch_inputs_that_do_not_fit_the_plan_are_refused_before_any_process_starts():
    grads, routers, tokens = inputs(6)
    plan = plan_finalize(SPECS, CONFIG, DIMS, ROUTERS)
    with pytest.raises(MissingInputError, match="expert_bias"):
        run_plan_torch(plan, DIMS, grads, {ROUTERS[0].key: {"local_tokens_per_expert": np.zeros((8, 2))}}, tokens)
    with pytest.raises(FinalizeInputError, match="num_tokens"):
        run_plan_torch(plan, DIMS, grads, routers, tokens[:4])
    with pytest.raises(PlanMismatchError):
        run_plan_torch(plan, ParallelDims(dp=4, tp=2), grads, routers, tokens)
