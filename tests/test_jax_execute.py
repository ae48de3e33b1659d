"""jax_impl.execute: each plan action on hand-checked integer values (bit-exact), each run
jitted and not (``chex.variants``)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

from jax_impl.execute import AUX_LOSS
from jax_impl.stacked import execute_stacked, segments
from jax_impl.finalize import finalize
from jax_impl.mesh import make_meshes
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
    TokenScale,
    plan_finalize,
)


def ranks(world, fn, dtype=np.float32):
    return np.asarray([fn(r) for r in range(world)], dtype=dtype)


def equal(got, want, dtype=np.float32):
    """``got`` equals ``want`` exactly (``want``: nested lists, read as ``dtype``)."""
    chex.assert_trees_all_equal(np.asarray(got), np.asarray(want, dtype))


def router_state(world, tokens, bias, *, qb=None, accum=None, count=None):
    state = {
        "local_tokens_per_expert": ranks(world, tokens),
        "expert_bias": ranks(world, bias),
    }
    if qb is not None:
        state.update(qb_beta=ranks(world, qb), qb_beta_accum=ranks(world, accum), qb_beta_count=ranks(world, count))
    return state


class ExecuteTest(chex.TestCase):
    """Each action executed on stacked values, by ``execute_stacked`` under ``self.variant``."""

    def run_actions(self, actions, dims, grads=None, routers=None, num_tokens=None):
        """Execute ``actions`` on stacked numpy inputs (jitted or not); return numpy outputs."""
        meshes = make_meshes(dims)
        fn = self.variant(lambda g, r, n: execute_stacked(tuple(actions), g, r, n, meshes))
        g, r = fn(grads or {}, routers or {}, num_tokens)
        return jax.tree.map(np.asarray, g), jax.tree.map(np.asarray, r)

    @chex.variants(with_jit=True, without_jit=True)
    def test_sum_over_dp_cp_with_pre_scale(self):
        dims = ParallelDims(pp=2, dp=2, tp=2)  # rank = pp*4 + dp*2 + tp
        key = (0, "w")
        action = Reduction(Step.DP_SYNC, Group.DP_CP, ReduceOp.SUM, (key,), "float32", pre_scale=0.5)
        out, _ = self.run_actions([action], dims, {key: ranks(8, lambda r: [r, 1])})
        expected = [[1, 1], [2, 1], [1, 1], [2, 1], [5, 1], [6, 1], [5, 1], [6, 1]]
        equal(out[key], expected)

    @chex.variants(with_jit=True, without_jit=True)
    def test_avg_over_tp_coalesces_keys_of_different_shapes(self):
        dims = ParallelDims(dp=2, tp=2)  # tp pairs {2k, 2k+1}
        a, b, untouched = (0, "a"), (0, "b"), (0, "c")
        action = Reduction(Step.NON_TP, Group.TP, ReduceOp.AVG, (a, b), "float32")
        grads = {
            a: ranks(4, lambda r: [r, 2 * r]),
            b: ranks(4, lambda r: [[10 * r]]),
            untouched: ranks(4, lambda r: r),
        }
        out, _ = self.run_actions([action], dims, grads)
        chex.assert_trees_all_equal(out, {
            a: np.asarray([[0.5, 1], [0.5, 1], [2.5, 5], [2.5, 5]], np.float32),
            b: np.asarray([[[5]], [[5]], [[25]], [[25]]], np.float32),
            untouched: np.asarray([0, 1, 2, 3], np.float32),
        })

    @chex.variants(with_jit=True, without_jit=True)
    def test_copies_summed_in_before_and_written_after(self):
        dims = ParallelDims(pp=2, dp=2)  # rank = pp*2 + dp; pp groups {0,2}, {1,3}
        c0, c1 = (0, "cond"), (1, "cond")
        action = Reduction(Step.COND_EMBEDDER, Group.PP, ReduceOp.SUM, (c0,), "float32", copies=((c1,),))
        out, _ = self.run_actions([action], dims, {c0: ranks(4, lambda r: r), c1: ranks(4, lambda r: 10 * r)})
        chex.assert_trees_all_equal(out, {c: np.asarray([22, 44, 22, 44], np.float32) for c in (c0, c1)})

    @chex.variants(with_jit=True, without_jit=True)
    def test_size_one_group_applies_only_the_pre_scale(self):
        dims = ParallelDims(dp=2, tp=2, ep=2, etp=2)  # edp = 1
        key = (0, "expert")
        reductions = [
            Reduction(Step.DP_SYNC, Group.EDP, ReduceOp.AVG, (key,), "float32", pre_scale=0.5),
            Reduction(Step.NON_TP, Group.TP, ReduceOp.AVG, ((0, "other"),), "float32"),
        ]
        grads = {key: ranks(4, lambda r: 2 * r + 2), (0, "other"): ranks(4, lambda r: r)}
        out, _ = self.run_actions(reductions[:1], dims, grads)
        equal(out[key], [1, 2, 3, 4])
        out, _ = self.run_actions(reductions[1:], ParallelDims(dp=4), grads)  # tp = 1: nothing happens
        equal(out[(0, "other")], [0, 1, 2, 3])

    @chex.variants(with_jit=True, without_jit=True)
    def test_reduce_in_fp32_keeps_bf16_dtype(self):
        dims = ParallelDims(dp=4)
        key = (0, "w")
        values = np.asarray([256, 1, 1, -256], np.float32).astype(jnp.bfloat16)
        action = Reduction(Step.DP_SYNC, Group.DP_CP, ReduceOp.SUM, (key,), "bfloat16", reduce_in_fp32=True)
        out, _ = self.run_actions([action], dims, {key: values})
        assert out[key].dtype == jnp.bfloat16
        equal(out[key].astype(np.float32), [2, 2, 2, 2])

    @chex.variants(with_jit=True, without_jit=True)
    def test_expert_dp_runs_on_the_expert_view(self):
        # Expert rank = edp*4 + ep*2 + etp, so expt_dp groups are {r, r+4}; dense dp_cp
        # groups would be {0, 2, 4, 6} and {1, 3, 5, 7}.
        dims = ParallelDims(dp=4, tp=2, ep=2, etp=2)
        assert dims.edp == 2
        key = (0, "expert")
        action = Reduction(Step.DP_SYNC, Group.EDP, ReduceOp.SUM, (key,), "float32")
        out, _ = self.run_actions([action], dims, {key: ranks(8, lambda r: r)})
        equal(out[key], [4, 6, 8, 10, 4, 6, 8, 10])

    @chex.variants(with_jit=True, without_jit=True)
    def test_expert_gtp_remat_avg(self):
        dims = ParallelDims(dp=2, tp=2, egtp=2, ep=2, etp=1)  # expert rank = egtp*2 + ep
        key = (0, "expert")
        action = Reduction(Step.GTP, Group.EGTP, ReduceOp.AVG, (key,), "float32")
        out, _ = self.run_actions([action], dims, {key: ranks(4, lambda r: r)})
        equal(out[key], [1, 2, 1, 2])

    @chex.variants(with_jit=True, without_jit=True)
    def test_masked_embedding_reduction_with_a_chunk_per_stage(self):
        # pp=4, tp=2: rank = stage*2 + tp. MTP on a middle stage: stages {0, 2, 3}; stage 0
        # contributes chunk 0, stages 2 (MTP) and 3 (last) contribute chunk 1.
        dims = ParallelDims(pp=4, tp=2)
        name = "embedding.word_embeddings.weight"
        specs = [ParamSpec(name, chunk=c, shape=(2,), role="word_embedding") for c in (0, 1)]
        config = FinalizeConfig(mtp_num_layers=1, embedding_stages=(0, 2, 3))
        plan = plan_finalize(specs, config, dims)
        (action,) = plan.actions
        assert isinstance(action, StageReduction)
        assert action.keys_by_stage == ((0, name), None, (1, name), (1, name))
        c0, c1 = (0, name), (1, name)
        grads = {c0: ranks(8, lambda r: [r, -r]), c1: ranks(8, lambda r: [100 * r, 1])}
        out, _ = self.run_actions(plan.actions, dims, grads)
        # tp=0: 0 (rank 0, chunk 0) + 400 (rank 4, chunk 1) + 600 (rank 6, chunk 1) = 1000
        # tp=1: 1 + 500 + 700 = 1201; second column: 0 + 1 + 1 = 2 and -1 + 1 + 1 = 1.
        equal(
            out[c0], [[1000, 2], [1201, 1], [2, -2], [3, -3], [4, -4], [5, -5], [6, -6], [7, -7]]
        )
        equal(
            out[c1], [[0, 1], [100, 1], [200, 1], [300, 1], [1000, 2], [1201, 1], [1000, 2], [1201, 1]]
        )

    @chex.variants(with_jit=True, without_jit=True)
    def test_expert_bias_update_one_collective_for_ragged_routers(self):
        dims = ParallelDims(dp=2, tp=2)  # tp_dp_cp = all 4 ranks
        a, b = (0, "router.a"), (1, "router.b")
        routers = {
            a: router_state(4, lambda r: [r, 0], lambda r: [1, 1]),
            b: router_state(4, lambda r: [r, 2, 0], lambda r: [0, 0, 0]),
        }
        action = ExpertBiasUpdate((a, b), (2, 3), 0.25)
        _, out = self.run_actions([action], dims, routers=routers)
        # a: tokens [6, 0], mean 3 -> sign [-1, +1]; b: [6, 8, 0], mean 14/3 -> [-1, -1, +1]
        chex.assert_trees_all_equal(
            out,
            {a: {**routers[a], "expert_bias": np.asarray([[0.75, 1.25]] * 4, np.float32)},
             b: {**routers[b], "expert_bias": np.asarray([[-0.25, -0.25, 0.25]] * 4, np.float32)}},
        )

    @chex.variants(with_jit=True, without_jit=True)
    def test_qb_beta_update_avg_ema_and_recentre(self):
        dims = ParallelDims(dp=2, tp=2)  # dp_cp groups {0, 2}, {1, 3}
        key = (0, "router")
        routers = {
            key: router_state(
                4, lambda r: [0, 0], lambda r: [0, 0],
                qb=lambda r: [1, -1], accum=lambda r: [4 * r, 2], count=lambda r: 2 if r else 0,
            )
        }
        action = QbBetaUpdate((key,), (2,), 0.5, Group.DP_CP)
        _, out = self.run_actions([action], dims, routers=routers)
        # local: rank0 [0, 2] (count 0 -> 1), rank1 [2, 1], rank2 [4, 1], rank3 [6, 1]
        # {0,2}: mean [2, 1.5] -> 0.5*[1,-1] + 0.5*[2,1.5] = [1.5, 0.25] -> [0.625, -0.625]
        # {1,3}: mean [4, 1]   -> [2.5, 0] -> [1.25, -1.25]
        want_qb = np.asarray([[0.625, -0.625], [1.25, -1.25]] * 2, np.float32)
        chex.assert_trees_all_equal(out, {key: {**routers[key], "qb_beta": want_qb}})

    @chex.variants(with_jit=True, without_jit=True)
    def test_reset_temporaries(self):
        dims = ParallelDims(dp=2)
        a, b = (0, "a"), (0, "b")
        state_a = router_state(2, lambda r: [r + 1, 2], lambda r: [1, 1], qb=lambda r: [1, 1], accum=lambda r: [3, 3], count=lambda r: 2)
        state_a[AUX_LOSS] = ranks(2, lambda r: 5.0)
        state_b = router_state(2, lambda r: [7, 7], lambda r: [2, 2])
        action = ResetTemporaries(zero_tokens=(a,), zero_qb=(a,), reset_aux_loss=(a, b))
        _, out = self.run_actions([action], dims, routers={a: state_a, b: state_b})
        zeroed = ("local_tokens_per_expert", "qb_beta_accum", "qb_beta_count", AUX_LOSS)
        want_a = {f: np.zeros_like(v) if f in zeroed else v for f, v in state_a.items()}
        chex.assert_trees_all_equal(out, {a: want_a, b: state_b})  # b: no tracker, nothing planned

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(jnp.float32, jnp.bfloat16)
    def test_token_scale_broadcasts_from_last_stage_then_sums(self, dtype):
        dims = ParallelDims(pp=2, dp=2)  # rank = pp*2 + dp
        key = (0, "w")
        action = TokenScale((key,), Group.DP_CP)
        tokens = np.asarray([7, 7, 3, 5], np.int32)  # stage 0 holds garbage
        grads = {key: ranks(4, lambda r: [8 * r, 4]).astype(dtype)}
        out, _ = self.run_actions([action], dims, grads, num_tokens=tokens)
        assert out[key].dtype == dtype
        equal(out[key].astype(np.float32), [[0, 0.5], [1, 0.5], [2, 0.5], [3, 0.5]])
        out, _ = self.run_actions([action], dims, grads, num_tokens=np.zeros(4, np.int32))  # max(0, 1) = 1
        chex.assert_trees_all_equal(out, grads)

    @chex.variants(with_jit=True, without_jit=True)
    def test_local_finalize_inside_user_shard_map_matches_stacked(self):
        """Local mode (user's shard_map over the dense mesh, default check_vma): the expert
        group is summed by the gather-and-mask fallback and must equal the expert view."""
        dims = ParallelDims(dp=4, tp=2, ep=2, etp=2)
        specs = [
            ParamSpec("dense", shape=(2,)),
            ParamSpec("expert", shape=(2,), expert=True),
            ParamSpec("norm", shape=(1,), sequence_parallel=True),
        ]
        routers = [RouterSpec("router", num_experts=2, has_expert_bias=True)]
        config = FinalizeConfig(sequence_parallel=True, moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.5)
        plan = plan_finalize(specs, config, dims, routers)
        grads = {
            (0, "dense"): ranks(8, lambda r: [4 * r, 4]),
            (0, "expert"): ranks(8, lambda r: [4 * r, 1]),
            (0, "norm"): ranks(8, lambda r: [r]),
        }
        rstate = {(0, "router"): router_state(8, lambda r: [r, 1], lambda r: [0, 0])}
        tokens = np.full(8, 2, np.int32)
        want_g, want_r = self.variant(lambda g, r, n: finalize(g, r, n, plan=plan, dims=dims))(grads, rstate, tokens)

        meshes = make_meshes(dims)
        spec = meshes.rank_spec("dense")

        def body(g, r, n):
            local = lambda x: x[0]  # noqa: E731
            g, r = finalize(jax.tree.map(local, g), jax.tree.map(local, r), n[0], plan=plan, dims=dims)
            return jax.tree.map(lambda x: x[None], g), jax.tree.map(lambda x: x[None], r)

        mapped = jax.shard_map(body, mesh=meshes.dense, in_specs=(spec, spec, spec), out_specs=(spec, spec))
        got_g, got_r = self.variant(mapped)(grads, rstate, tokens)
        # expert: edp groups {r, r+4}, pre-scale 1/dp_cp = 1/4: (4r + 4(r+4)) / 4 = 2r + 4;
        # then num_tokens 2 summed over dp_cp (4 ranks) = 8: (2r + 4) / 8.
        equal(np.asarray(want_g[(0, "expert")])[:4, 0], [0.5, 0.75, 1, 1.25])
        chex.assert_trees_all_equal((got_g, got_r), (want_g, want_r))


def test_segments_split_dense_and_expert_views():
    dims = ParallelDims(dp=4, tp=2, ep=2, etp=2)
    k = ((0, "w"),)
    dense = Reduction(Step.DP_SYNC, Group.DP_CP, ReduceOp.SUM, k, "float32")
    expert = Reduction(Step.DP_SYNC, Group.EDP, ReduceOp.SUM, k, "float32")
    pp = Reduction(Step.COND_EMBEDDER, Group.PP, ReduceOp.SUM, k, "float32")  # pp = 1: any view
    reset = ResetTemporaries((), (), ())
    got = segments([dense, expert, pp, reset, dense], dims)
    assert [(v, len(a)) for v, a in got] == [("dense", 1), ("expert", 3), ("dense", 1)]
