"""jax_impl.finalize: stacked layouts, compile-once caching, validation before running;
the value tests run jitted and not (``chex.variants``)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_impl.finalize as jf
from jax_impl.finalize import finalize, finalize_stacked
from meshgrad import FinalizeConfig, ParallelDims, ParamSpec, RouterSpec, plan_finalize

DIMS = ParallelDims(pp=2, dp=2, tp=2)  # rank = pp*4 + dp*2 + tp


def specs(shape=(3,)):
    return [
        ParamSpec("w", shape=shape),
        ParamSpec("ln", shape=(2,), sequence_parallel=True),
        ParamSpec("frozen", shape=(2,), has_grad=False),
    ]


def inputs(shape=(3,), scale=1.0):
    return {
        (0, "w"): np.stack([np.full(shape, 2 * r * scale, np.float32) for r in range(8)]),
        (0, "ln"): np.stack([np.asarray([r, 1], np.float32) for r in range(8)]),
    }


CONFIG = FinalizeConfig(sequence_parallel=True)


class FinalizeValuesTest(chex.TestCase):
    """``finalize`` on stacked values: called as it is (its own compiled program) and
    under the caller's ``jax.jit`` (the collectives traced into that program)."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_values_and_untouched_frozen(self):
        g, r = self.variant(lambda x: finalize(x, specs=specs(), config=CONFIG, dims=DIMS, stacked=True))(inputs())
        assert r == {}
        # w: 1/dp_cp pre-scale, SUM over dp ({r, r^2}): (2r + 2(r^2)) / 2
        want_w = np.asarray([[r + (r ^ 2)] * 3 for r in range(8)], np.float32)
        # ln: dp sync as w, then SUM over tp ({r, r^1}) -> tp pair sum of dp means
        dp = [(r + (r ^ 2)) / 2 for r in range(8)]
        want_ln = np.asarray([[dp[r] + dp[r ^ 1], 2] for r in range(8)], np.float32)
        chex.assert_trees_all_equal(g, {(0, "w"): want_w, (0, "ln"): want_ln})

    @chex.variants(with_jit=True, without_jit=True)
    def test_leading_mesh_dims_match_world_dim(self):
        flat, _ = finalize(inputs(), specs=specs(), config=CONFIG, dims=DIMS, stacked=True)
        dense = {k: v.reshape(DIMS.dense_shape() + v.shape[1:]) for k, v in inputs().items()}
        got, _ = self.variant(lambda x: finalize(x, specs=specs(), config=CONFIG, dims=DIMS))(dense)
        chex.assert_trees_all_equal_shapes(got, dense)
        chex.assert_trees_all_equal({k: np.asarray(v).reshape(flat[k].shape) for k, v in got.items()}, flat)

    @chex.variants(with_jit=True, without_jit=True)
    def test_finalize_with_num_tokens_and_routers(self):
        dims = ParallelDims(dp=2)
        params = [ParamSpec("w", shape=(2,))]
        routers = [RouterSpec("r", num_experts=2, has_expert_bias=True)]
        config = FinalizeConfig(calculate_per_token_loss=True, moe_router_enable_expert_bias=True,
                                moe_router_bias_update_rate=1.0)
        plan = plan_finalize(params, config, dims, routers)
        grads = {(0, "w"): jnp.asarray([[1.0, 2.0], [3.0, 6.0]])}
        rstate = {(0, "r"): {"local_tokens_per_expert": jnp.asarray([[3.0, 0.0], [1.0, 0.0]]),
                             "expert_bias": jnp.zeros((2, 2))}}
        fn = self.variant(lambda g, r, n: finalize(g, r, n, plan=plan, dims=dims))
        g, r = fn(grads, rstate, jnp.asarray([1, 3]))
        # SUM over dp: [4, 8]; num_tokens 1 + 3 = 4 -> [1, 2]; bias: tokens [4, 0], mean 2 -> [-1, +1]
        chex.assert_trees_all_equal(
            (g, r),
            ({(0, "w"): np.asarray([[1, 2], [1, 2]], np.float32)},
             {(0, "r"): {"local_tokens_per_expert": np.zeros((2, 2), np.float32),
                         "expert_bias": np.asarray([[-1, 1], [-1, 1]], np.float32)}}),
        )


def test_compiles_once_for_repeated_calls(monkeypatch):
    traces = []
    original = jf.run_stacked

    def counting(*args):
        traces.append(1)
        return original(*args)

    monkeypatch.setattr(jf, "run_stacked", counting)
    shape = (7, 5)  # a program no other test builds
    outs = [
        finalize(inputs(shape, s), specs=specs(shape), config=CONFIG, dims=DIMS)[0]
        for s in (1.0, 2.0, 3.0)
    ]
    assert len(traces) == 1
    w, ln = (0, "w"), (0, "ln")  # inputs(shape, s) scales w alone
    chex.assert_trees_all_equal(outs[2], {w: 3 * np.asarray(outs[0][w]), ln: outs[0][ln]})
    finalize(inputs((7, 6)), specs=specs((7, 6)), config=CONFIG, dims=DIMS)
    assert len(traces) == 2  # new shapes: one more compile


def test_errors_before_running():
    plan = plan_finalize(specs(), CONFIG, DIMS)
    with pytest.raises(ValueError, match="plan was made for"):
        finalize(inputs(), plan=plan, dims=ParallelDims(pp=2, dp=4))
    with pytest.raises(ValueError, match="leading"):
        finalize({k: v[:4] for k, v in inputs().items()}, plan=plan, dims=DIMS)
    with pytest.raises(ValueError, match="not in the plan"):
        finalize({**inputs(), (3, "x"): np.zeros((8, 1))}, plan=plan, dims=DIMS)
    with pytest.raises(KeyError, match="'w'"):
        finalize({(0, "ln"): inputs()[(0, "ln")]}, plan=plan, dims=DIMS)
    with pytest.raises(KeyError, match="'w'"):  # local mode runs the same presence check
        finalize({(0, "ln"): inputs()[(0, "ln")][0]}, plan=plan, dims=DIMS)
    with pytest.warns(DeprecationWarning), pytest.raises(KeyError, match="'w'"):
        finalize_stacked({(0, "ln"): inputs()[(0, "ln")]}, None, None, params=specs(), config=CONFIG, dims=DIMS)
    with pytest.raises(ValueError, match="devices"):
        finalize(inputs(), plan=plan, dims=DIMS, devices=jax.devices("cpu")[:4])


def test_expert_mesh_leading_dims_and_untouched_router_fields():
    dims = ParallelDims(dp=4, tp=2, ep=2, etp=2)  # expert shape (1, 2, 1, 2, 2)
    params = [ParamSpec("e", shape=(1,), expert=True)]
    routers = [RouterSpec("r", num_experts=2, has_expert_bias=True)]
    config = FinalizeConfig(calculate_per_token_loss=True)  # no bias update, nothing reset
    grads = {(0, "e"): np.arange(8, dtype=np.float32).reshape(dims.expert_shape() + (1,))}
    extra = np.ones((8, 2), np.float32).reshape(dims.expert_shape() + (2,))
    rstate = {(0, "r"): {"expert_bias": extra}}
    g, r = finalize(grads, rstate, None, specs=params, router_specs=routers, config=config, dims=dims)
    # expert rank = edp*4 + ep*2 + etp: expt_dp groups {r, r+4} summed.
    want = np.asarray([4, 6, 8, 10, 4, 6, 8, 10], np.float32).reshape(dims.expert_shape() + (1,))
    chex.assert_trees_all_equal(g, {(0, "e"): want})
    assert r[(0, "r")]["expert_bias"] is extra


def test_jax_world_records_errors_per_scenario():
    from parity_tests.jax_world import run_jax
    from parity_tests.scenarios import ParamLayout, Scenario

    layout = (ParamLayout("w", (2,)),)
    results = run_jax([Scenario("too-big", dp=16, params=layout), Scenario("ok", dp=2, params=layout)])
    assert results["too-big"].outputs is None and "16 CPU devices" in results["too-big"].error
    ok = results["ok"]
    assert ok.error is None and len(ok.outputs) == 2 and ok.compile_seconds is not None
