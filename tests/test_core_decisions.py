"""Decisions the core makes for every backend: which chunks a DDP syncs (``delegated``),
the groups a call needs (meshgrad.requirements) and what each of Megatron's helpers does
on its own (meshgrad.helpers)."""

from meshgrad import FinalizeConfig, Group, ParallelDims, ParamSpec, RouterSpec, Step, plan_finalize
from meshgrad.helpers import HELPER_RULES, helper_config, plan_helper
from meshgrad.plan import GroupSizes, Role, StageReduction
from meshgrad.requirements import ALWAYS_READ, group_requirements

DIMS = ParallelDims(pp=2, dp=2, tp=2, etp=1)  # dp_cp = 2, edp = 4


def spec(name, chunk=0, **flags):
    return ParamSpec(name, chunk=chunk, shape=(2,), **flags)


def dp_keys(plan):
    return [k for a in plan.actions if a.step is Step.DP_SYNC for k in a.keys]


# --------------------------------------------------------------------------- delegated


def test_a_delegated_chunk_is_left_to_its_ddp_and_its_scaling_too():
    params = [spec("a", 0), spec("b", 1), spec("e", 1, expert=True)]
    plan = plan_finalize(params, FinalizeConfig(), DIMS, delegated=frozenset({1}))
    assert dp_keys(plan) == [(0, "a")]
    assert plan.own_scale_keys == ((0, "a"),) and plan.token_scale.keys == ((0, "a"), (1, "b"), (1, "e"))
    # The DP sync planned alone over the chunk meshgrad syncs, before every other step.
    alone = plan_finalize([params[0]], FinalizeConfig(), DIMS)
    assert plan.actions[0] == alone.actions[0]
    whole = plan_finalize(params, FinalizeConfig(), DIMS)
    assert whole.own_scale_keys == whole.token_scale.keys and sorted(dp_keys(whole)) == sorted(p.key for p in params)


def test_every_chunk_delegated_plans_no_dp_sync_and_the_same_other_steps():
    params = [spec("ln", sequence_parallel=True), spec("w")]
    config = FinalizeConfig(sequence_parallel=True)
    plan = plan_finalize(params, config, DIMS, delegated=frozenset({0}))
    assert dp_keys(plan) == [] and plan.own_scale_keys == ()
    assert plan.actions == plan_finalize(params, config, DIMS, dp_sync=False).actions


# --------------------------------------------------------------------------- requirements


def sizes(**given):
    return GroupSizes(sizes={Group.TP: 2, Group.PP: 2, Group.DP_CP: 2, **given}, embd_stages=(0, 1),
                      pos_embd_stages=(0,))


def test_meshgrads_own_sources_must_name_what_megatron_reads():
    plan = plan_finalize([spec("w")], FinalizeConfig(moe_router_enable_expert_bias=True), sizes())
    needs = group_requirements(plan, num_tokens=False, read_by_megatron_rules=False, own_dp_sync=True)
    assert set(needs.required) == {*ALWAYS_READ, Group.TP_DP_CP}
    assert needs.expected == {}


def test_groups_read_by_megatrons_rules_add_only_the_own_dp_sync():
    params = [spec("w"), spec("e", expert=True)]
    plan = plan_finalize(params, FinalizeConfig(), sizes(**{Group.EDP: 4}))
    needs = group_requirements(plan, num_tokens=True, read_by_megatron_rules=True, own_dp_sync=True)
    assert set(needs.required) == {Group.DP_CP, Group.EDP}
    delegated = plan_finalize(params, FinalizeConfig(), sizes(**{Group.EDP: 4}), delegated=frozenset({0}))
    assert group_requirements(delegated, num_tokens=True, read_by_megatron_rules=True, own_dp_sync=False).required == {}


def test_gtp_sizes_the_config_states_are_expected():
    plan = plan_finalize([spec("w")], FinalizeConfig(), sizes(**{Group.GTP: 2}))
    needs = group_requirements(plan, num_tokens=True, read_by_megatron_rules=False, own_dp_sync=True,
                               stated_gtp=2, stated_egtp=4)
    assert needs.expected[Group.GTP][0] == 2 and needs.expected[Group.EGTP][0] == 4
    assert needs.expected[Group.DP_CP_GTP][0] == 2 * 2 and Group.DP_CP_GTP in needs.required


# --------------------------------------------------------------------------- helpers


def test_each_helper_plans_without_the_gate_finalize_checks():
    routers = [RouterSpec("router", chunk=0, num_experts=4, has_expert_bias=True, has_qb_beta=True)]
    params = [spec("r", flextron_router_pp_sync=True),
              ParamSpec("emb", shape=(2,), role=Role.WORD_EMBEDDING)]
    config = FinalizeConfig()  # flextron, expert bias, quantile balancing, tied embeddings: all off
    for step in (Step.ROUTER, Step.EXPERT_BIAS, Step.QB_BETA, Step.WORD_EMBEDDING):
        if step is not Step.WORD_EMBEDDING:  # the embedding's gate is its role, read at discovery
            assert plan_finalize(params, config, DIMS, routers).for_step(step) == ()  # finalize's gate
        own = helper_config(config, (step,))
        planned = plan_helper(params, own, GroupSizes.from_dims(DIMS, own), routers, (step,))
        assert planned.actions and {a.step for a in planned.actions} == {step}, step
        assert all(getattr(own, k) == v for k, v in HELPER_RULES[step].items())
    (embedding,) = plan_helper(params, helper_config(config, (Step.WORD_EMBEDDING,)),
                               GroupSizes.from_dims(DIMS, config), routers, (Step.WORD_EMBEDDING,)).actions
    assert isinstance(embedding, StageReduction) and embedding.group is Group.EMBD


def test_the_gtp_helpers_argument_and_no_configured_stage_sets():
    config = FinalizeConfig(embedding_stages=(0, 1), calculate_per_token_loss=False)
    own = helper_config(config, (Step.GTP,), calculate_per_token_loss=True)
    assert own.calculate_per_token_loss is True and own.embedding_stages is None
    assert helper_config(FinalizeConfig(), (Step.NON_TP,)) == FinalizeConfig()  # nothing to change


# --------------------------------------------------------------------------- what a plan reads


def test_gradient_keys_are_what_the_actions_read_then_the_scaling():
    params = [spec("ln", sequence_parallel=True), spec("w"), ParamSpec("emb", shape=(2,), role=Role.WORD_EMBEDDING),
              spec("frozen", has_grad=False)]
    plan = plan_finalize(params, FinalizeConfig(sequence_parallel=True, share_embeddings_and_output_weights=True),
                         DIMS, delegated=frozenset({0}))
    assert plan.gradient_keys() == ((0, "ln"), (0, "emb"), (0, "w"))  # tp sum, embedding, then the scale
    assert plan.gradient_keys(plan.own_scale_keys) == ((0, "ln"), (0, "emb"))  # the DDP scales chunk 0
