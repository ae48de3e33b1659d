"""plan_finalize: which gradients go over which group with which op and scale."""

import pytest

from meshgrad import (
    ExpertBiasUpdate,
    FinalizeConfig,
    Group,
    ParallelDims,
    ParamSpec,
    QbBetaUpdate,
    Reduction,
    ReduceOp,
    ResetTemporaries,
    RouterSpec,
    StageReduction,
    Step,
    embedding_chunk,
    plan_finalize,
)

DIMS = ParallelDims(pp=2, dp=2, tp=2, etp=1)  # dp_cp = 2, edp = 4


def spec(name, chunk=0, **flags):
    return ParamSpec(name, chunk=chunk, shape=(2,), **flags)


def reductions(plan, step):
    return [a for a in plan.actions if a.step is step]


def test_dp_sync_scaling_regimes():
    params = [spec("w"), spec("e", expert=True)]
    default = plan_finalize(params, FinalizeConfig(), DIMS)
    dense, expert = reductions(default, Step.DP_SYNC)
    assert (dense.group, dense.op, dense.pre_scale, dense.keys) == (Group.DP_CP, ReduceOp.SUM, 0.5, ((0, "w"),))
    assert (expert.group, expert.op, expert.pre_scale) == (Group.EDP, ReduceOp.SUM, 0.5)

    avg = plan_finalize(params, FinalizeConfig(average_in_collective=True), DIMS)
    dense, expert = reductions(avg, Step.DP_SYNC)
    assert (dense.op, dense.pre_scale) == (ReduceOp.AVG, 1.0)
    assert (expert.op, expert.pre_scale) == (ReduceOp.AVG, 4 / 2)  # EDP / DP_CP

    per_token = plan_finalize(params, FinalizeConfig(calculate_per_token_loss=True), DIMS)
    assert [(r.op, r.pre_scale) for r in reductions(per_token, Step.DP_SYNC)] == [(ReduceOp.SUM, 1.0)] * 2


def test_dp_sync_skips_gradless_params_and_splits_dtypes():
    params = [spec("a"), spec("b", has_grad=False), ParamSpec("c", shape=(1,), dtype="bfloat16")]
    plan = plan_finalize(params, FinalizeConfig(), DIMS)
    got = {(r.dtype, r.keys) for r in reductions(plan, Step.DP_SYNC)}
    assert got == {("float32", ((0, "a"),)), ("bfloat16", ((0, "c"),))}


def test_distributed_optimizer_scatters_unless_forced():
    params = [spec("a")]
    config = FinalizeConfig(use_distributed_optimizer=True)
    assert reductions(plan_finalize(params, config, DIMS), Step.DP_SYNC)[0].scatter
    forced = plan_finalize(params, config, DIMS, force_all_reduce=True)
    assert not reductions(forced, Step.DP_SYNC)[0].scatter


def test_non_tp_selection_rules():
    params = [
        spec("ln", sequence_parallel=True),
        spec("attn.q_layernorm.weight"),
        spec("attn.k_layernorm.weight"),
        spec("router", average_gradients_across_tp_domain=True, sequence_parallel=True),
        spec("plain"),
    ]
    plan = plan_finalize(params, FinalizeConfig(sequence_parallel=True, qk_layernorm=True), DIMS)
    total, avg = reductions(plan, Step.NON_TP)
    assert (total.op, [k[1] for k in total.keys]) == (ReduceOp.SUM, ["ln", "attn.q_layernorm.weight", "attn.k_layernorm.weight"])
    assert (avg.op, avg.keys) == (ReduceOp.AVG, ((0, "router"),))
    only_avg = plan_finalize(params, FinalizeConfig(), DIMS)
    assert [r.op for r in reductions(only_avg, Step.NON_TP)] == [ReduceOp.AVG]
    assert reductions(plan_finalize(params, FinalizeConfig(sequence_parallel=True), ParallelDims(dp=2)), Step.NON_TP) == []


def test_cond_embedder_and_router_sum_chunk_copies_over_pp():
    params = [spec("cond", 0, pipeline_parallel=True), spec("cond", 1, pipeline_parallel=True), spec("flex", 1, flextron_router_pp_sync=True)]
    plan = plan_finalize(params, FinalizeConfig(has_cond_embedder=True, flextron=True), DIMS, merge=False)
    (cond,) = reductions(plan, Step.COND_EMBEDDER)
    assert (cond.group, cond.keys, cond.copies) == (Group.PP, ((0, "cond"),), (((1, "cond"),),))
    (router,) = reductions(plan, Step.ROUTER)
    assert (router.keys, router.copies) == (((1, "flex"),), ((),))
    # Merged (the default): one pp collective for both steps; for_step splits it again.
    merged = plan_finalize(params, FinalizeConfig(has_cond_embedder=True, flextron=True), DIMS)
    (both,) = [a for a in merged.actions if a.group is Group.PP]
    assert both.steps == (Step.COND_EMBEDDER, Step.ROUTER) and both.parts == (cond, router)
    assert (both.keys, both.copies) == (((0, "cond"), (1, "flex")), (((1, "cond"),), ()))
    assert merged.for_step(Step.ROUTER) == (router,)
    assert reductions(plan_finalize(params, FinalizeConfig(has_cond_embedder=True), ParallelDims(dp=2)), Step.COND_EMBEDDER) == []


@pytest.mark.parametrize(
    "stage, pp, chunks, mtp, want",
    [(0, 4, 2, False, 0), (3, 4, 2, False, 1), (1, 4, 2, False, 0), (1, 4, 2, True, 1), (0, 1, 2, True, 0)],
)
def test_embedding_chunk_choice(stage, pp, chunks, mtp, want):
    assert embedding_chunk(stage, pp, chunks, mtp) == want


def test_word_embedding_keys_per_stage():
    params = [spec("emb", 0, role="word_embedding"), spec("emb", 1, role="word_embedding")]
    dims = ParallelDims(pp=4)
    config = FinalizeConfig(mtp_num_layers=1, embedding_stages=(0, 2, 3))
    (step,) = reductions(plan_finalize(params, config, dims), Step.WORD_EMBEDDING)
    assert isinstance(step, StageReduction) and step.stages == (0, 2, 3)
    assert step.keys_by_stage == ((0, "emb"), None, (1, "emb"), (1, "emb"))
    untied = FinalizeConfig(share_embeddings_and_output_weights=False)
    assert reductions(plan_finalize(params, untied, dims), Step.WORD_EMBEDDING) == []
    frozen = [spec("emb", 0, role="word_embedding", has_grad=False)]
    assert reductions(plan_finalize(frozen, FinalizeConfig(), dims), Step.WORD_EMBEDDING) == []


def test_position_embedding_without_grad_is_an_error():
    params = [spec("pos", 0, role="position_embedding", has_grad=False)]
    config = FinalizeConfig(position_embedding_stages=(0, 1))
    with pytest.raises(ValueError, match="position embedding 'pos'.*no gradient"):
        plan_finalize(params, config, ParallelDims(pp=2))
    # Default pos_embd group is the first stage alone: nothing to do, no error.
    assert reductions(plan_finalize(params, FinalizeConfig(), ParallelDims(pp=2)), Step.POS_EMBEDDING) == []


def test_gtp_step_ops_and_remat_skip():
    dims = ParallelDims(dp=2, gtp=2, tp=2, ep=2, etp=1, egtp=2)
    params = [spec("d"), spec("r", is_gtp_weight_remat=True), spec("e", expert=True), spec("er", expert=True, is_gtp_weight_remat=True)]
    dense, expert = reductions(plan_finalize(params, FinalizeConfig(), dims), Step.GTP)
    assert (dense.group, dense.op, dense.keys) == (Group.GTP, ReduceOp.AVG, ((0, "d"),))
    assert (expert.group, expert.keys) == (Group.EGTP, ((0, "e"),))
    summed = reductions(plan_finalize(params, FinalizeConfig(calculate_per_token_loss=True), dims), Step.GTP)
    assert [r.op for r in summed] == [ReduceOp.SUM, ReduceOp.SUM]
    plan = plan_finalize(params, FinalizeConfig(calculate_per_token_loss=True), dims)
    assert plan.token_scale.group is Group.DP_CP_GTP


def test_router_steps():
    routers = [
        RouterSpec("r0", num_experts=4, has_expert_bias=True, has_qb_beta=True, has_aux_loss_tracker=True),
        RouterSpec("r1", num_experts=8, has_expert_bias=True, has_qb_beta=True),
        RouterSpec("eval", num_experts=4, training=False, has_expert_bias=True, has_qb_beta=True),
        RouterSpec("frozen", num_experts=4, has_expert_bias=True, frozen_expert_bias=True),
    ]
    config = FinalizeConfig(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.25)
    plan = plan_finalize([], config, DIMS, routers)
    (bias,) = reductions(plan, Step.EXPERT_BIAS)
    assert isinstance(bias, ExpertBiasUpdate)
    assert (bias.routers, bias.num_experts, bias.rate, bias.group) == (((0, "r0"), (0, "r1")), (4, 8), 0.25, Group.TP_DP_CP)
    (reset,) = reductions(plan, Step.RESET)
    assert isinstance(reset, ResetTemporaries)
    assert len(reset.zero_tokens) == 4 and reset.reset_aux_loss == ()
    # What the plan updates in place (the check stage refuses an inference tensor there):
    # the trained, unfrozen biases; every router's counts, and the qb accumulators of those
    # that have them.
    qb_accumulators = [((0, n), attr) for n in ("r0", "r1", "eval") for attr in ("qb_beta_accum", "qb_beta_count")]
    assert plan.router_writes() == (
        ((0, "r0"), "expert_bias"), ((0, "r1"), "expert_bias"),
        *(((0, n), "local_tokens_per_expert") for n in ("r0", "r1", "eval", "frozen")), *qb_accumulators,
    )

    qb = FinalizeConfig(moe_router_load_balancing_type="quantile_balancing", moe_router_quantile_balancing_ema=0.0)
    plan = plan_finalize([], qb, DIMS, routers)
    (update,) = reductions(plan, Step.QB_BETA)
    assert isinstance(update, QbBetaUpdate)
    assert (update.routers, update.ema, update.group) == (((0, "r0"), (0, "r1")), 0.0, Group.DP_CP_GTP)
    (reset,) = reductions(plan, Step.RESET)
    assert reset.zero_qb == ((0, "r0"), (0, "r1"), (0, "eval")) and reset.zero_tokens == ()
    assert plan.router_writes() == (((0, "r0"), "qb_beta"), ((0, "r1"), "qb_beta"), *qb_accumulators)

    aux = plan_finalize([], FinalizeConfig(moe_router_load_balancing_type="global_aux_loss"), DIMS, routers)
    assert reductions(aux, Step.RESET)[0].reset_aux_loss == ((0, "r0"),)


def test_actions_follow_spec_order_and_duplicates_fail():
    params = [spec("ln", sequence_parallel=True), spec("emb", role="word_embedding")]
    plan = plan_finalize(params, FinalizeConfig(sequence_parallel=True), DIMS)
    assert [a.step for a in plan.actions] == [Step.DP_SYNC, Step.NON_TP, Step.WORD_EMBEDDING]
    assert all(isinstance(a, (Reduction, StageReduction)) for a in plan.actions)
    with pytest.raises(ValueError, match="duplicate parameter 'ln' in chunk 0"):
        plan_finalize(params + [spec("ln")], FinalizeConfig(), DIMS)


def test_size_one_world_plans_no_collectives_but_keeps_scales():
    plan = plan_finalize([spec("w"), spec("e", expert=True)], FinalizeConfig(), ParallelDims())
    assert plan.actions == ()
    assert plan.token_scale.keys == ((0, "w"), (0, "e"))


def test_group_signatures_expose_mismatched_collectives():
    config = FinalizeConfig(sequence_parallel=True)
    a = plan_finalize([spec("ln", sequence_parallel=True), spec("w")], config, DIMS)
    b = plan_finalize([ParamSpec("ln", shape=(3,), sequence_parallel=True), spec("w")], config, DIMS)
    sa, sb = a.group_signatures(), b.group_signatures()
    assert sa[Group.DP_CP] != sb[Group.DP_CP] and sa[Group.TP] != sb[Group.TP]
    assert "ln[2]" in sa[Group.TP][0] and "ln[3]" in sb[Group.TP][0]
    same = plan_finalize([spec("ln", sequence_parallel=True), spec("w")], config, DIMS)
    assert same.group_signatures() == sa


@pytest.mark.parametrize(
    "total, size, want",
    [(8, 2, [(0, 4), (4, 8)]), (7, 2, [(0, 4), (4, 7)]), (3, 4, [(0, 1), (1, 2), (2, 3), (3, 3)]), (5, 1, [(0, 5)])],
)
def test_scatter_shard_layout(total, size, want):
    from meshgrad import scatter_shard

    assert [scatter_shard(total, size, i) for i in range(size)] == want
    with pytest.raises(ValueError, match="outside a group"):
        scatter_shard(total, size, size)


def test_position_embedding_check_is_for_own_stage_only():
    params = [spec("pos", 0, role="position_embedding", has_grad=False)]
    config = FinalizeConfig(position_embedding_stages=(0, 1))
    dims = ParallelDims(pp=4)
    # A rank of stage 2 (not a member) holding a frozen position embedding plans fine.
    assert reductions(plan_finalize(params, config, dims, stage=2), Step.POS_EMBEDDING) == []
    with pytest.raises(ValueError, match="pp stage 1"):
        plan_finalize(params, config, dims, stage=1)
