"""Hand-computed checks of the numpy reference (parity_tests.reference), step by step,
plus invariants over every parity scenario."""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import pytest

from parity_tests import scenarios as S
from parity_tests.reference import STEPS, Mesh, reference_finalize
from parity_tests.scenarios import ParamLayout, RankData, RouterLayout, RouterState, Scenario

A = np.array
F32 = np.float32


# --------------------------------------------------------------------------- helpers


def grads_inputs(
    scenario: Scenario,
    value: Callable[[int, int, ParamLayout], object],
    *,
    num_tokens: Callable[[int], int | None] = lambda r: None,
    routers: Callable[[int, int, RouterLayout], RouterState] | None = None,
) -> list[RankData]:
    """Per-rank inputs: grads[(c, name)] = value(rank, chunk, param) (None if frozen)."""
    out = []
    for rank in range(scenario.world_size):
        grads = {}
        for c in range(scenario.num_chunks):
            for p in scenario.params:
                if not p.requires_grad:
                    grads[(c, p.name)] = None
                else:
                    v = np.broadcast_to(np.asarray(value(rank, c, p), dtype=np.float32), p.shape)
                    grads[(c, p.name)] = np.array(v, dtype=np.float32)
        rs = {}
        for c in range(scenario.num_chunks):
            for r in scenario.routers:
                rs[(c, r.name)] = routers(rank, c, r)
        out.append(RankData(grads=grads, routers=rs, num_tokens=num_tokens(rank)))
    return out


def router_state(e: int, *, tokens=None, bias=None, qb=None, accum=None, count=0.0) -> RouterState:
    def arr(v):
        return np.zeros(e, np.float32) if v is None else np.asarray(v, dtype=np.float32)

    return RouterState(
        local_tokens_per_expert=arr(tokens),
        expert_bias=arr(bias),
        qb_beta=arr(qb),
        qb_beta_accum=arr(accum),
        qb_beta_count=np.array(count, dtype=np.float32),
    )


def g(result, rank: int, name: str, chunk: int = 0) -> np.ndarray:
    return result.outputs[rank].grads[(chunk, name)]


def eq(actual, expected) -> None:
    np.testing.assert_array_equal(np.asarray(actual), np.asarray(expected, dtype=np.float32))


# --------------------------------------------------------------------------- mesh


def test_mesh_coordinates_follow_megatron_order():
    s = Scenario("m", pp=2, dp=2, cp=1, gtp=2, tp=2, ep=2, etp=1, egtp=2)
    mesh = Mesh.from_scenario(s)
    assert mesh.world == 16 and mesh.edp == 2
    # dense rank = ((((pp*DP+dp)*CP+cp)*GTP+gtp)*TP+tp)
    assert mesh.coords(13, "dense") == dict(pp=1, dp=1, cp=0, gtp=0, tp=1)
    # expert rank = ((((pp*EDP+edp)*EGTP+egtp)*EP+ep)*ETP+etp)
    assert mesh.coords(13, "expert") == dict(pp=1, edp=1, egtp=0, ep=1, etp=0)
    assert sorted(mesh.groups(("tp",), "dense"))[0] == [0, 1]
    assert sorted(mesh.groups(("dp", "cp"), "dense"))[0] == [0, 4]
    assert sorted(mesh.groups(("edp",), "expert"))[0] == [0, 4]
    assert sorted(mesh.groups(("egtp",), "expert"))[0] == [0, 2]
    assert sorted(mesh.groups(("pp",), "dense"))[0] == [0, 8]


# --------------------------------------------------------------------------- step 4


TP_PARAMS = (
    ParamLayout("ln.weight", (2,), sequence_parallel=True),
    ParamLayout("attn.q_layernorm.weight", (2,)),
    ParamLayout("attn.k_layernorm.weight", (2,)),
    ParamLayout("avg.weight", (2,), average_gradients_across_tp_domain=True),
    ParamLayout("fc.weight", (2,)),
)


def _tp_values(rank, chunk, p):
    return {0: [1, 2], 1: [3, 5]}[rank]


def test_tp_sum_and_avg_by_hand():
    s = Scenario("tp2", tp=2, params=TP_PARAMS, config=dict(sequence_parallel=True, qk_layernorm=True))
    res = reference_finalize(s, grads_inputs(s, _tp_values))
    for r in (0, 1):
        eq(g(res, r, "ln.weight"), [4, 7])
        eq(g(res, r, "attn.q_layernorm.weight"), [4, 7])
        eq(g(res, r, "attn.k_layernorm.weight"), [4, 7])
        eq(g(res, r, "avg.weight"), [2, 3.5])
    eq(g(res, 0, "fc.weight"), [1, 2])
    eq(g(res, 1, "fc.weight"), [3, 5])
    assert {k[1] for _, _, k in res.touched["non_tp"]} == {
        "ln.weight", "attn.q_layernorm.weight", "attn.k_layernorm.weight", "avg.weight"
    }
    assert not res.touched["dp_sync"]  # DP_CP = 1: scale 1, no communication


def test_tp_flags_off_only_avg():
    s = Scenario("tp2-off", tp=2, params=TP_PARAMS, config={})
    res = reference_finalize(s, grads_inputs(s, _tp_values))
    eq(g(res, 1, "ln.weight"), [3, 5])
    eq(g(res, 1, "attn.q_layernorm.weight"), [3, 5])
    eq(g(res, 0, "avg.weight"), [2, 3.5])


def test_tp_one_is_noop():
    s = Scenario("tp1", dp=2, params=TP_PARAMS, config=dict(calculate_per_token_loss=True, sequence_parallel=True))
    res = reference_finalize(s, grads_inputs(s, _tp_values))
    assert not res.touched["non_tp"]
    eq(g(res, 0, "ln.weight"), [4, 7])  # only the DP SUM


# --------------------------------------------------------------------------- step 1


DP_PARAMS = (
    ParamLayout("dense.weight", (1,)),
    ParamLayout("experts.weight", (1,), expert=True),
    ParamLayout("frozen.weight", (1,), requires_grad=False),
)


def test_dp_prescale_then_sum():
    s = Scenario("dp2cp2", dp=2, cp=2, params=DP_PARAMS)
    res = reference_finalize(s, grads_inputs(s, lambda r, c, p: r + 1))
    for r in range(4):
        eq(g(res, r, "dense.weight"), [2.5])  # (1+2+3+4) / 4
        # EP=1, ETP=TP=1: EDP = 4, same ranks, same pre-scale 1/DP_CP.
        eq(g(res, r, "experts.weight"), [2.5])
        assert g(res, r, "frozen.weight") is None
    assert all(k[1] != "frozen.weight" for _, _, k in res.touched["dp_sync"])


def test_dp_bf16_rounds_after_collective():
    s = Scenario("dp2-bf16", dp=2, params=DP_PARAMS[:1], dtype="bfloat16", config=dict(calculate_per_token_loss=True))
    res = reference_finalize(s, grads_inputs(s, lambda r, c, p: [256, 1][r]))
    eq(g(res, 0, "dense.weight"), [256])  # 257 is not a bfloat16: ties to even


def test_dp_bf16_prescale_rounds_before_sum():
    # DP=3: each grad * float32(1/3) is rounded to bf16 (0.33398438) before the SUM;
    # 0.33398438*2 + 1 = 1.66796875 -> bf16 1.671875 (the exact mean 5/3 would give 1.6640625).
    s = Scenario("dp3-bf16-scale", dp=3, params=DP_PARAMS[:1], dtype="bfloat16")
    res = reference_finalize(s, grads_inputs(s, lambda r, c, p: [1, 1, 3][r]))
    eq(g(res, 0, "dense.weight"), [1.671875])


EXPERT_MESH = dict(dp=4, ep=2, etp=1)  # TP=1: EDP = 4 / (EP*ETP) = 2; edp groups {0,2}, {1,3}


@pytest.mark.parametrize(
    "config, dense, expert",
    [
        # average_in_collective: dense AVG; expert pre-scaled EDP/DP_CP = 1/2 then AVG.
        (dict(average_in_collective=True), [2.5] * 4, [1.0, 1.5, 1.0, 1.5]),
        # default: both pre-scaled 1/DP_CP = 1/4, then SUM.
        ({}, [2.5] * 4, [1.0, 1.5, 1.0, 1.5]),
        # per-token: plain SUM.
        (dict(calculate_per_token_loss=True), [10] * 4, [4, 6, 4, 6]),
    ],
)
def test_dp_expert_scaling(config, dense, expert):
    s = Scenario("exp", **EXPERT_MESH, params=DP_PARAMS, config=config)
    assert s.edp == 2
    res = reference_finalize(s, grads_inputs(s, lambda r, c, p: r + 1))
    for r in range(4):
        eq(g(res, r, "dense.weight"), [dense[r]])
        eq(g(res, r, "experts.weight"), [expert[r]])


def test_dp_expert_prescale_applies_on_size_one_group():
    s = Scenario("edp1", dp=4, ep=4, etp=1, params=DP_PARAMS, config=dict(average_in_collective=True))
    assert s.edp == 1
    res = reference_finalize(s, grads_inputs(s, lambda r, c, p: r + 1))
    for r in range(4):
        eq(g(res, r, "experts.weight"), [(r + 1) / 4])  # EDP/DP_CP = 1/4, AVG over 1 rank
        eq(g(res, r, "dense.weight"), [2.5])
        assert (r, "grad", (0, "experts.weight")) in res.touched["dp_sync"]


# --------------------------------------------------------------------------- steps 2, 3


PP_PARAMS = (
    ParamLayout("cond.weight", (1,), pipeline_parallel=True),
    ParamLayout("flex.weight", (1,), flextron_router_pp_sync=True),
    ParamLayout("plain.weight", (1,)),
)


def _chunked(rank, chunk, p):
    return 10 * rank + chunk + 1


@pytest.mark.parametrize(
    "config, cond, flex",
    [
        (dict(has_cond_embedder=True, flextron=True), True, True),
        (dict(has_cond_embedder=True), True, False),
        (dict(flextron=True), False, True),
        ({}, False, False),
    ],
)
def test_pp_chunk_sync(config, cond, flex):
    s = Scenario("pp2-vpp2", pp=2, num_chunks=2, params=PP_PARAMS, config=config)
    res = reference_finalize(s, grads_inputs(s, _chunked))
    for r in (0, 1):
        for c in (0, 1):
            eq(g(res, r, "cond.weight", c), [26 if cond else _chunked(r, c, None)])  # 1+2+11+12
            eq(g(res, r, "flex.weight", c), [26 if flex else _chunked(r, c, None)])
            eq(g(res, r, "plain.weight", c), [_chunked(r, c, None)])
    assert len(res.touched["cond_embedder"]) == (4 if cond else 0)
    assert len(res.touched["router"]) == (4 if flex else 0)


def test_pp_chunk_sync_needs_pp():
    s = Scenario("pp1-vpp2", pp=1, num_chunks=2, params=PP_PARAMS, config=dict(has_cond_embedder=True, flextron=True))
    res = reference_finalize(s, grads_inputs(s, _chunked))
    eq(g(res, 0, "cond.weight", 1), [2])
    assert not res.touched["cond_embedder"] and not res.touched["router"]


# --------------------------------------------------------------------------- steps 6, 7


W, P = S.WORD_EMB, S.POS_EMB
EMB_PARAMS = (
    ParamLayout(W, (1,), role="word_embedding"),
    ParamLayout(P, (1,), role="position_embedding"),
)


def _emb(config, params=EMB_PARAMS):
    s = Scenario("pp4-vpp2", pp=4, num_chunks=2, params=params, config=config)
    return reference_finalize(s, grads_inputs(s, _chunked))  # value = 10*stage + chunk + 1


def _word_values(res):
    return {(r, c): float(g(res, r, W, c)[0]) for r in range(4) for c in range(2)}


def _expect(changes):
    base = {(r, c): float(10 * r + c + 1) for r in range(4) for c in range(2)}
    base.update(changes)
    return base


@pytest.mark.parametrize(
    "config, changes",
    [
        # default first + last: stage 0 chunk 0 (1) + stage 3 last chunk (32)
        ({}, {(0, 0): 33, (3, 1): 33}),
        # middle stage without MTP uses chunk 0: 1 + 11 + 32
        (dict(embedding_stages=(0, 1, 3)), {(0, 0): 44, (1, 0): 44, (3, 1): 44}),
        # middle stage with MTP uses the last chunk: 1 + 22 + 32
        (dict(embedding_stages=(0, 2, 3), mtp_num_layers=1), {(0, 0): 55, (2, 1): 55, (3, 1): 55}),
        # untied: nothing
        (dict(share_embeddings_and_output_weights=False), {}),
        # untied but MTP: the weight is still shared
        (dict(share_embeddings_and_output_weights=False, mtp_num_layers=1), {(0, 0): 33, (3, 1): 33}),
        # mtp_num_layers=0 is falsy
        (dict(share_embeddings_and_output_weights=False, mtp_num_layers=0), {}),
        # a single stage is a size-1 group
        (dict(embedding_stages=(2, 2)), {}),
    ],
)
def test_word_embedding_chunk_choice(config, changes):
    res = _emb(config)
    assert _word_values(res) == _expect(changes)
    assert {(r, k) for r, _, k in res.touched["word_embedding"]} == {(r, (c, W)) for r, c in changes}


def test_word_embedding_groups_keep_other_coords():
    s = Scenario("pp2tp2", pp=2, tp=2, params=EMB_PARAMS)
    res = reference_finalize(s, grads_inputs(s, lambda r, c, p: 10 * r + 1))
    eq(g(res, 0, W), [22])  # (pp0, tp0) + (pp1, tp0) = 1 + 21
    eq(g(res, 2, W), [22])
    eq(g(res, 1, W), [42])  # 11 + 31
    eq(g(res, 3, W), [42])


def test_frozen_word_embedding_is_skipped():
    params = (ParamLayout(W, (1,), role="word_embedding", requires_grad=False),) + EMB_PARAMS[1:]
    res = _emb({}, params)
    assert all(g(res, r, W, c) is None for r in range(4) for c in range(2))
    assert not res.touched["word_embedding"]


@pytest.mark.parametrize(
    "config, total, chunks",
    [
        (dict(position_embedding_stages=(0, 1, 2, 3)), 1 + 11 + 21 + 32, [0, 0, 0, 1]),
        # megatron-core 0.16.1: the MTP chunk rule does not apply to the position embedding
        (dict(position_embedding_stages=(0, 1, 2, 3), mtp_num_layers=1), 1 + 11 + 21 + 32, [0, 0, 0, 1]),
    ],
)
def test_position_embedding_stages(config, total, chunks):
    res = _emb(config)
    for r in range(4):
        eq(g(res, r, P, chunks[r]), [total])
        eq(g(res, r, P, 1 - chunks[r]), [10 * r + (1 - chunks[r]) + 1])


def test_position_embedding_default_is_noop_and_frozen_is_error():
    res = _emb({})
    assert not res.touched["pos_embedding"]
    eq(g(res, 0, P, 0), [1])
    params = EMB_PARAMS[:1] + (ParamLayout(P, (1,), role="position_embedding", requires_grad=False),)
    with pytest.raises(ValueError, match="position_embedding"):
        _emb(dict(position_embedding_stages=(0, 1)), params)


# --------------------------------------------------------------------------- step 8


BIAS_ROUTERS = (
    RouterLayout("r3", 3),
    RouterLayout("r4", 4),
    RouterLayout("frozen", 3, frozen_expert_bias=True),
    RouterLayout("eval", 3, training=False),
    RouterLayout("nobias", 3, has_expert_bias=False),
)

# (stage, tp) -> tokens; pp=2, tp=2: rank = 2*stage + tp
TOKENS = {
    "r3": {0: [[1, 2, 3], [1, 2, 3]], 1: [[3, 0, 0], [0, 0, 0]]},
    "r4": {0: [[0, 0, 4, 0], [2, 0, 0, 2]], 1: [[0, 0, 0, 0], [0, 0, 0, 0]]},
}


def _bias_state(rank, chunk, layout):
    stage, tp = divmod(rank, 2)
    tokens = TOKENS.get(layout.name, {0: [[1, 0, 0]] * 2, 1: [[1, 0, 0]] * 2})[stage][tp]
    return router_state(layout.num_experts, tokens=tokens, bias=[0.5] * layout.num_experts)


def _bias_run(config):
    s = Scenario("pp2tp2-bias", pp=2, tp=2, params=DP_PARAMS[:1], routers=BIAS_ROUTERS, config=config)
    return reference_finalize(s, grads_inputs(s, lambda r, c, p: 1, routers=_bias_state))


def test_expert_bias_ragged_with_sign_zero():
    res = _bias_run(dict(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.25))
    want = {
        # stage 0: r3 tokens [2,4,6], mean 4 -> sign [1,0,-1]; r4 [2,0,4,2], mean 2 -> [0,1,-1,0]
        0: {"r3": [0.75, 0.5, 0.25], "r4": [0.5, 0.75, 0.25, 0.5]},
        # stage 1: r3 [3,0,0], mean 1 -> [-1,1,1]; r4 all zero -> sign 0 everywhere
        1: {"r3": [0.25, 0.75, 0.75], "r4": [0.5] * 4},
    }
    for rank in range(4):
        routers = res.outputs[rank].routers
        for name, bias in want[rank // 2].items():
            eq(routers[(0, name)].expert_bias, bias)
        for name in ("frozen", "eval", "nobias"):
            eq(routers[(0, name)].expert_bias, [0.5] * 3)
        # reset: zeroed wherever the module has expert_bias (training or not, frozen or not)
        for name in ("r3", "r4", "frozen", "eval"):
            assert not routers[(0, name)].local_tokens_per_expert.any()
        eq(routers[(0, "nobias")].local_tokens_per_expert, [1, 0, 0])
    assert res.touched["expert_bias"] == {(r, "router", (0, n)) for r in range(4) for n in ("r3", "r4")}


def test_expert_bias_float32_rate():
    res = _bias_run(dict(moe_router_enable_expert_bias=True))  # rate 1e-3
    bias = res.outputs[0].routers[(0, "r3")].expert_bias
    assert bias.dtype == np.float32
    eq(bias, [F32(0.5) + F32(1e-3), 0.5, F32(0.5) - F32(1e-3)])


def test_expert_bias_disabled():
    res = _bias_run({})
    eq(res.outputs[0].routers[(0, "r3")].expert_bias, [0.5] * 3)
    eq(res.outputs[0].routers[(0, "r3")].local_tokens_per_expert, [1, 2, 3])
    assert not res.touched["expert_bias"] and not res.touched["reset"]


# --------------------------------------------------------------------------- steps 9, 10


QB_ROUTERS = (
    RouterLayout("q", 2, has_qb_beta=True, has_expert_bias=False),
    RouterLayout("qeval", 2, has_qb_beta=True, has_expert_bias=False, training=False),
    RouterLayout("noqb", 2, has_expert_bias=False, has_aux_loss_tracker=False),
)


def _qb_state(rank, chunk, layout):
    accum, count, qb = {0: ([4, 2], 0.0, [1, -1]), 1: ([2, 6], 2.0, [0, 0])}[rank]
    return router_state(2, qb=qb, accum=accum, count=count)


def _qb_run(ema, **mesh):
    config = dict(moe_router_load_balancing_type="quantile_balancing", moe_router_quantile_balancing_ema=ema)
    s = Scenario("qb", **mesh, params=DP_PARAMS[:1], routers=QB_ROUTERS, config=config)
    return reference_finalize(s, grads_inputs(s, lambda r, c, p: 1, routers=_qb_state))


@pytest.mark.parametrize("mesh", [dict(dp=2), dict(gtp=2), dict(cp=2)])
def test_qb_beta_ema_with_zero_count(mesh):
    # local: rank0 [4,2]/max(0,1) = [4,2]; rank1 [2,6]/2 = [1,3]; AVG -> [2.5, 2.5]
    res = _qb_run(0.5, **mesh)
    q0, q1 = (res.outputs[r].routers[(0, "q")] for r in (0, 1))
    eq(q0.qb_beta, [0.5, -0.5])  # 0.5*[1,-1] + 0.5*[2.5,2.5] = [1.75, 0.75]; minus 1.25
    eq(q1.qb_beta, [0.0, 0.0])  # [1.25, 1.25] minus its mean
    for r in (0, 1):
        routers = res.outputs[r].routers
        eq(routers[(0, "qeval")].qb_beta, [[1, -1], [0, 0]][r])  # eval mode: no update
        for name in ("q", "qeval"):  # reset zeroes accum and count, training or not
            assert not routers[(0, name)].qb_beta_accum.any()
            assert float(routers[(0, name)].qb_beta_count) == 0.0
        eq(routers[(0, "noqb")].qb_beta_accum, [[4, 2], [2, 6]][r])  # no qb_beta: untouched
        eq(routers[(0, "noqb")].qb_beta, [[1, -1], [0, 0]][r])
    assert res.touched["qb_beta"] == {(r, "router", (0, "q")) for r in (0, 1)}


def test_qb_beta_without_group_uses_own_average():
    res = _qb_run(0.5, tp=2)  # dp_cp of size 1
    eq(res.outputs[0].routers[(0, "q")].qb_beta, [1.0, -1.0])  # 0.5*[1,-1]+0.5*[4,2] = [2.5,0.5]


def test_qb_beta_float32_ema():
    res = _qb_run(0.9, dp=2)
    new = F32(0.9) * A([1, -1], F32) + F32(1 - 0.9) * A([2.5, 2.5], F32)
    eq(res.outputs[0].routers[(0, "q")].qb_beta, new - F32(new.astype(np.float64).mean()))


def test_qb_beta_other_balancing_type_only_resets():
    s = Scenario("qb-off", dp=2, params=DP_PARAMS[:1], routers=QB_ROUTERS, config={})
    res = reference_finalize(s, grads_inputs(s, lambda r, c, p: 1, routers=_qb_state))
    eq(res.outputs[0].routers[(0, "q")].qb_beta, [1, -1])
    assert not res.outputs[0].routers[(0, "q")].qb_beta_accum.any()
    assert not res.touched["qb_beta"]


@pytest.mark.parametrize("kind, resets", [("global_aux_loss", 1), ("aux_loss", 0), ("seq_aux_loss", 0)])
def test_reset_global_aux_loss(kind, resets):
    s = Scenario("aux", tp=2, params=DP_PARAMS[:1], routers=QB_ROUTERS, config=dict(moe_router_load_balancing_type=kind))
    res = reference_finalize(s, grads_inputs(s, lambda r, c, p: 1, routers=_qb_state))
    for r in (0, 1):
        assert res.outputs[r].routers[(0, "q")].aux_loss_resets == resets
        assert res.outputs[r].routers[(0, "qeval")].aux_loss_resets == resets
        assert res.outputs[r].routers[(0, "noqb")].aux_loss_resets == 0  # no tracker


# --------------------------------------------------------------------------- step 5


GTP_PARAMS = (
    ParamLayout("dense.weight", (1,)),
    ParamLayout("dense_remat.weight", (1,), is_gtp_weight_remat=True),
    ParamLayout("experts.weight", (1,), expert=True),
    ParamLayout("experts_remat.weight", (1,), expert=True, is_gtp_weight_remat=True),
)


@pytest.mark.parametrize("per_token, reduced", [(False, 1.5), (True, 3.0)])
def test_gtp_avg_or_sum(per_token, reduced):
    s = Scenario("gtp2", gtp=2, egtp=2, ep=1, etp=1, params=GTP_PARAMS, config=dict(calculate_per_token_loss=per_token))
    assert s.edp == 1
    res = reference_finalize(s, grads_inputs(s, lambda r, c, p: r + 1))
    for r in (0, 1):
        eq(g(res, r, "dense.weight"), [reduced])
        eq(g(res, r, "experts.weight"), [reduced])
        eq(g(res, r, "dense_remat.weight"), [r + 1])
        eq(g(res, r, "experts_remat.weight"), [r + 1])
    assert not res.touched["dp_sync"]
    assert {k[1] for _, _, k in res.touched["gtp"]} == {"dense.weight", "experts.weight"}


def test_gtp_without_egtp_leaves_experts():
    s = Scenario("gtp2-egtp1", gtp=2, ep=2, etp=1, params=GTP_PARAMS)
    assert s.edp == 1
    res = reference_finalize(s, grads_inputs(s, lambda r, c, p: r + 1))
    eq(g(res, 1, "dense.weight"), [1.5])
    eq(g(res, 1, "experts.weight"), [2])


# --------------------------------------------------------------------------- step 11


def _tokens_run(last_stage_tokens, **extra):
    s = Scenario("pp2dp2-tok", pp=2, dp=2, params=DP_PARAMS, config=dict(calculate_per_token_loss=True), **extra)
    tokens = lambda r: 7 if r < 2 else last_stage_tokens[r - 2]  # noqa: E731 (stage 0 must be ignored)
    return reference_finalize(s, grads_inputs(s, lambda r, c, p: r + 1, num_tokens=tokens))


def test_num_tokens_broadcast_from_last_stage_and_summed():
    res = _tokens_run([1, 3])  # global 4 on every rank
    # DP SUM first: stage 0 -> 1+2 = 3, stage 1 -> 3+4 = 7; then * 1/4
    for r, want in enumerate([0.75, 0.75, 1.75, 1.75]):
        eq(g(res, r, "dense.weight"), [want])
        assert g(res, r, "frozen.weight") is None
    assert len(res.touched["token_scale"]) == 8  # every non-None grad


def test_num_tokens_zero_scales_by_one():
    res = _tokens_run([0, 0])
    for r, want in enumerate([3, 3, 7, 7]):
        eq(g(res, r, "dense.weight"), [want])
    assert len(res.touched["token_scale"]) == 8


def test_num_tokens_float32_reciprocal_then_product():
    res = _tokens_run([1, 2])
    scale = F32(1) / F32(3)
    eq(g(res, 0, "dense.weight"), [F32(3) * scale])
    eq(g(res, 2, "dense.weight"), [F32(7) * scale])


def test_num_tokens_bf16_rounds_product():
    res = _tokens_run([1, 2], dtype="bfloat16")
    eq(g(res, 2, "dense.weight"), S.to_dtype(A([F32(7) * (F32(1) / F32(3))]), "bfloat16"))


def test_num_tokens_sum_over_gtp():
    s = Scenario("gtp-tok", gtp=2, params=GTP_PARAMS[:2], config=dict(calculate_per_token_loss=True))
    res = reference_finalize(s, grads_inputs(s, lambda r, c, p: r + 1, num_tokens=lambda r: [2, 6][r]))
    eq(g(res, 0, "dense.weight"), [3 / 8])  # GTP SUM 1+2, then / (2+6)
    eq(g(res, 1, "dense_remat.weight"), [2 / 8])


def test_num_tokens_missing_on_some_ranks_is_error():
    s = Scenario("dp2", dp=2, params=DP_PARAMS)
    with pytest.raises(ValueError, match="num_tokens"):
        reference_finalize(s, grads_inputs(s, lambda r, c, p: 1, num_tokens=lambda r: [None, 3][r]))


# --------------------------------------------------------------------------- validation


def test_input_validation():
    s = Scenario("dp2", dp=2, params=DP_PARAMS)
    inputs = grads_inputs(s, lambda r, c, p: 1)
    with pytest.raises(ValueError, match="ranks"):
        reference_finalize(s, inputs[:1])
    bad = copy.deepcopy(inputs)
    del bad[1].grads[(0, "dense.weight")]
    with pytest.raises(ValueError, match="keys"):
        reference_finalize(s, bad)
    with pytest.raises(ValueError, match="unknown config"):
        reference_finalize(Scenario("x", dp=2, params=DP_PARAMS, config=dict(sequence_paralel=True)), inputs)
    with pytest.raises(ValueError, match="divide"):
        reference_finalize(Scenario("x", dp=2, ep=3, params=DP_PARAMS), inputs)
    with pytest.raises(ValueError, match="stages"):
        _emb(dict(embedding_stages=(0, 4)))


def test_nan_check():
    s = Scenario("nan", dp=2, params=DP_PARAMS, config=dict(check_for_nan_in_grad=True))
    with pytest.raises(RuntimeError, match="NaN"):
        reference_finalize(s, grads_inputs(s, lambda r, c, p: [1.0, np.nan][r]))


# --------------------------------------------------------------------------- every scenario


def _snapshot(data: list[RankData]) -> list[RankData]:
    return copy.deepcopy(data)


def _same_rank_data(a: RankData, b: RankData) -> bool:
    if set(a.grads) != set(b.grads) or set(a.routers) != set(b.routers) or a.num_tokens != b.num_tokens:
        return False
    for k in a.grads:
        x, y = a.grads[k], b.grads[k]
        if (x is None) != (y is None) or (x is not None and not np.array_equal(x, y)):
            return False
    for k in a.routers:
        if not _same_router(a.routers[k], b.routers[k]):
            return False
    return True


def _same_router(x: RouterState, y: RouterState) -> bool:
    return x.aux_loss_resets == y.aux_loss_resets and all(
        np.array_equal(getattr(x, f), getattr(y, f))
        for f in ("local_tokens_per_expert", "expert_bias", "qb_beta", "qb_beta_accum", "qb_beta_count")
    )


@pytest.mark.parametrize("scenario", S.all_scenarios(), ids=lambda s: s.name)
def test_every_scenario_invariants(scenario):
    inputs = [S.make_rank_inputs(scenario, r) for r in range(scenario.world_size)]
    before = _snapshot(inputs)
    res = reference_finalize(scenario, inputs)
    mesh = Mesh.from_scenario(scenario)

    # inputs untouched; structure preserved; values representable in the dtype
    assert all(_same_rank_data(a, b) for a, b in zip(inputs, before))
    assert len(res.outputs) == scenario.world_size
    assert set(res.touched) == set(STEPS)
    for r, (out, inp) in enumerate(zip(res.outputs, inputs)):
        assert set(out.grads) == set(inp.grads) and set(out.routers) == set(inp.routers)
        for key, v in out.grads.items():
            if inp.grads[key] is None:
                assert v is None
                continue
            assert v.shape == inp.grads[key].shape and v.dtype == np.float32
            np.testing.assert_array_equal(S.to_dtype(v, scenario.dtype), v)
        for key, st in out.routers.items():
            for f in ("local_tokens_per_expert", "expert_bias", "qb_beta", "qb_beta_accum", "qb_beta_count"):
                assert getattr(st, f).dtype == np.float32
                assert getattr(st, f).shape == getattr(inp.routers[key], f).shape

    # what no step touched is unchanged; touched entries exist
    all_touched = set().union(*res.touched.values())
    for r, (out, inp) in enumerate(zip(res.outputs, inputs)):
        for key, v in out.grads.items():
            if (r, "grad", key) not in all_touched and v is not None:
                np.testing.assert_array_equal(v, inp.grads[key])
        for key, st in out.routers.items():
            if (r, "router", key) not in all_touched:
                assert _same_router(st, inp.routers[key])
    for r, kind, key in all_touched:
        assert key in (res.outputs[r].grads if kind == "grad" else res.outputs[r].routers)

    # dense grads agree across every dp_cp group (expert ones across edp groups), unless a
    # distributed optimizer's reduce-scatter left each rank with its own shard only
    expert_ok = scenario.num_tokens is None  # per-rank token counts may differ across tp
    scattered = scenario.config.get("use_distributed_optimizer") and not scenario.force_all_reduce
    for p in () if scattered else scenario.params:
        if not p.requires_grad or (p.expert and not expert_ok):
            continue
        groups = mesh.groups(("edp",), "expert") if p.expert else mesh.groups(("dp", "cp"), "dense")
        for c in range(scenario.num_chunks):
            for group in groups:
                ref = res.outputs[group[0]].grads[(c, p.name)]
                for r in group[1:]:
                    np.testing.assert_array_equal(res.outputs[r].grads[(c, p.name)], ref, err_msg=f"{p.name} r{r}")

    # the per-token scale runs exactly when num_tokens is given
    assert bool(res.touched["token_scale"]) == (scenario.num_tokens is not None)
    layouts = {r.name: r for r in scenario.routers}
    for out in res.outputs:
        for (_, name), st in out.routers.items():
            assert st.aux_loss_resets in (0, 1)
            if layouts[name].has_qb_beta:  # reset clears qb buffers, training or not
                assert not st.qb_beta_accum.any() and float(st.qb_beta_count) == 0.0


def test_distributed_optimizer_reduce_scatter_keeps_own_shard():
    # dp=2, two params of 3 and 2 elements: buffer of 5, padded to 6, shards [0,3) and [3,5).
    params = (ParamLayout("a", (3,)), ParamLayout("b", (2,)))
    s = Scenario("rs", dp=2, params=params, config=dict(use_distributed_optimizer=True))
    inputs = grads_inputs(s, lambda rank, c, p: (rank + 1) * (2 if p.name == "a" else 4))
    out = reference_finalize(s, inputs)
    # pre-scale 1/2, then SUM: reduced a = (2+4)/2 = 3, reduced b = (4+8)/2 = 6.
    eq(g(out, 0, "a"), [3, 3, 3])  # rank 0 owns a
    eq(g(out, 0, "b"), [2, 2])  # local b (4) pre-scaled by 1/2
    eq(g(out, 1, "a"), [2, 2, 2])  # local a (4) pre-scaled
    eq(g(out, 1, "b"), [6, 6])  # rank 1 owns b
    forced = reference_finalize(s, inputs, force_all_reduce=True)
    for rank in range(2):
        eq(g(forced, rank, "a"), [3, 3, 3])
        eq(g(forced, rank, "b"), [6, 6])
