"""jax_impl.finalize on pytrees (nested dicts, nnx.State, per-chunk lists, spec trees),
num_tokens forms, mode-naming errors and the optax transformation; chex variants run each
body with and without jax.jit."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jax_impl
from jax_impl import finalize_gradients, make_meshes, router_buffers
from jax_impl.finalize import finalize
from meshgrad import FinalizeConfig, Group, ParallelDims, ParamSpec, ReduceOp, RouterSpec, StageReduction, Step
from meshgrad import plan_finalize
from meshgrad.errors import FinalizeInputError, FinalizeTypeError

DIMS = ParallelDims(dp=2, tp=2)  # rank = dp * 2 + tp
CONFIG = FinalizeConfig(sequence_parallel=True)
SPECS = [
    ParamSpec("decoder.ln.weight", shape=(3,), sequence_parallel=True),
    ParamSpec("decoder.fc.weight", shape=(2, 3)),
]


def stacked_tree(seed: int = 0) -> dict:
    """Every rank's gradients stacked on dim 0, as a nested dict (small integers)."""
    rng = np.random.default_rng(seed)
    draw = lambda shape: rng.integers(-4, 5, (4, *shape)).astype(np.float32)  # noqa: E731
    return {"decoder": {"ln": {"weight": draw((3,))}, "fc": {"weight": draw((2, 3))}}}


def expected(tree: dict) -> dict:
    """docs/semantics.md in numpy: mean over dp, then the layernorm summed over tp."""
    def dp_mean(g):
        g = g.reshape(2, 2, *g.shape[1:])
        return np.broadcast_to(g.mean(0, keepdims=True), g.shape)
    ln = dp_mean(tree["decoder"]["ln"]["weight"])
    ln = np.broadcast_to(ln.sum(1, keepdims=True), ln.shape).reshape(4, 3)
    fc = np.ascontiguousarray(dp_mean(tree["decoder"]["fc"]["weight"])).reshape(4, 2, 3)
    return {"decoder": {"ln": {"weight": ln}, "fc": {"weight": fc}}}


def shard_mapped(fn):
    """``fn`` on each rank's block (leading [1] dropped) of stacked inputs, in a shard_map."""
    mesh = make_meshes(DIMS).dense
    ranks = P(mesh.axis_names)
    local = lambda t: jax.tree.map(lambda x: x[0], t)  # noqa: E731
    lead = lambda t: jax.tree.map(lambda x: x[None], t)  # noqa: E731
    return jax.shard_map(lambda *a: lead(fn(*local(a))), mesh=mesh, in_specs=ranks, out_specs=ranks,
                         check_vma=False)


class PytreeFinalizeTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_nested_dict_in_and_out_inside_shard_map(self):
        plan = plan_finalize(SPECS, CONFIG, DIMS)
        body = self.variant(shard_mapped(lambda g: finalize(g, plan=plan, dims=DIMS)[0]))
        tree = stacked_tree()
        out = body(tree)
        chex.assert_trees_all_equal_structs(out, jax.tree.map(jnp.asarray, tree))
        chex.assert_trees_all_equal(out, expected(tree))

    @chex.variants(with_jit=True, without_jit=True)
    def test_stacked_pytree_equals_keyed_dict(self):
        tree = stacked_tree(1)
        keyed = {(0, "decoder.ln.weight"): tree["decoder"]["ln"]["weight"],
                 (0, "decoder.fc.weight"): tree["decoder"]["fc"]["weight"]}
        fn = self.variant(lambda t: finalize(t, specs=SPECS, config=CONFIG, dims=DIMS, stacked=True)[0])
        out = fn(tree)
        by_key = finalize(keyed, specs=SPECS, config=CONFIG, dims=DIMS)[0]
        chex.assert_trees_all_equal(out["decoder"]["ln"]["weight"], by_key[(0, "decoder.ln.weight")])
        chex.assert_trees_all_equal(out, expected(tree))

    @chex.variants(with_jit=True, without_jit=True)
    def test_num_tokens_scalar_or_one_element_array(self):
        config = dataclasses.replace(CONFIG, calculate_per_token_loss=True)
        plan = plan_finalize(SPECS, config, DIMS)
        tree = stacked_tree(2)
        tokens = np.asarray([3, 1, 2, 2], np.int32)  # dp sums: tp0 3+2, tp1 1+2 -> total per dp group
        outs = []
        for shape in ((), (1,)):
            body = shard_mapped(lambda g, n: finalize(g, None, n.reshape(shape), plan=plan, dims=DIMS)[0])
            outs.append(self.variant(body)(tree, tokens))
        chex.assert_trees_all_equal(outs[0], outs[1])
        total = np.asarray([5, 3, 5, 3], np.float32)  # global count of each rank's dp_cp group
        # per-token loss: the dp sync sums (no 1/dp), then every gradient is divided by the count
        want = jax.tree.map(lambda e: 2 * e / total.reshape(4, *([1] * (e.ndim - 1))), expected(tree))
        chex.assert_trees_all_close(outs[0], want, rtol=1e-6)
        stacked = finalize(tree, None, tokens[:, None], plan=plan, dims=DIMS)[0]  # [W, 1] stacked
        chex.assert_trees_all_close(stacked, want, rtol=1e-6)


def test_nnx_state_gradients_carry_their_specs():
    nnx = pytest.importorskip("flax.nnx")

    class Block(nnx.Module):
        def __init__(self):
            self.ln = nnx.Param(jnp.ones(3), sequence_parallel=True)
            self.fc = nnx.Param(jnp.ones((2, 3)))

    model = nnx.eval_shape(Block)
    tree = stacked_tree(3)["decoder"]
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, {"ln": jnp.asarray(tree["ln"]["weight"]), "fc": jnp.asarray(tree["fc"]["weight"])})
    grads = state  # stacked [4, ...] gradients in the model's structure, with its Param metadata
    want = expected({"decoder": tree})["decoder"]
    want = {"ln": want["ln"]["weight"], "fc": want["fc"]["weight"]}
    # stacked: the specs (local shapes, flags) from the module; the module is callable
    out, _ = jax_impl.finalize(grads, specs=model, config=CONFIG, dims=DIMS)
    assert isinstance(out, nnx.State) and out["ln"].get_metadata()["sequence_parallel"]
    chex.assert_trees_all_equal(nnx.to_pure_dict(out), want)
    # local, inside shard_map: the gradient State's own metadata is the specs
    out = jax.jit(shard_mapped(lambda g: jax_impl.finalize(g, config=CONFIG, dims=DIMS)[0]))(grads)
    chex.assert_trees_all_equal(nnx.to_pure_dict(out), want)


def test_spec_pytree_and_chunk_list():
    tree = stacked_tree(4)["decoder"]
    spec_tree = {"ln": {"weight": ParamSpec("x", shape=(3,), sequence_parallel=True)},
                 "fc": {"weight": ParamSpec("x", shape=(2, 3))}}
    out, _ = finalize(tree, specs=spec_tree, config=CONFIG, dims=DIMS)
    chex.assert_trees_all_equal(out, expected({"decoder": tree})["decoder"])
    chunks = [tree, stacked_tree(5)["decoder"]]
    specs = [dataclasses.replace(s, chunk=c, name=n) for c in (0, 1)
             for n, s in (("ln.weight", SPECS[0]), ("fc.weight", SPECS[1]))]
    out, _ = finalize(chunks, specs=specs, config=CONFIG, dims=DIMS)
    assert isinstance(out, list) and len(out) == 2
    chex.assert_trees_all_equal(out[1], expected({"decoder": chunks[1]})["decoder"])
    with pytest.raises(FinalizeInputError, match="one tree per chunk"):
        finalize({"ln": tree["ln"]}, specs=specs, config=CONFIG, dims=DIMS)


def test_errors_name_the_path_and_the_mode():
    plan = plan_finalize(SPECS, CONFIG, DIMS)
    tree = stacked_tree()
    with pytest.raises(FinalizeInputError, match="'decoder.extra.weight' .* not in the plan"):
        finalize({**tree, "decoder": {**tree["decoder"], "extra": {"weight": np.zeros((4, 1), np.float32)}}},
                 plan=plan, dims=DIMS)
    local = jax.tree.map(lambda x: x[0], tree)
    with pytest.raises(FinalizeInputError, match=r"stacked=True \(stacked mode"):
        finalize(local, plan=plan, dims=DIMS, stacked=True)
    with pytest.raises(FinalizeInputError, match=r"stacked=False \(local mode"):
        finalize(tree, plan=plan, dims=DIMS, stacked=False)
    config = dataclasses.replace(CONFIG, calculate_per_token_loss=True)
    plan = plan_finalize(SPECS, config, DIMS)
    with pytest.raises(FinalizeInputError, match="in local mode .* scalar or a one-element array"):
        finalize(local, None, np.asarray([1, 2], np.int32), plan=plan, dims=DIMS)
    with pytest.raises(FinalizeInputError, match=r"in stacked mode .* shape \(4,\)"):
        finalize(tree, None, np.asarray([1, 2], np.int32), plan=plan, dims=DIMS)
    with pytest.raises(FinalizeTypeError, match="integers"):
        finalize(tree, None, np.ones(4, np.float32), plan=plan, dims=DIMS)
    with pytest.raises(FinalizeInputError, match="needs plan="):
        finalize(tree, dims=DIMS)


class OptaxTransformTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_chain_finalizes_then_updates_and_keeps_router_state(self):
        config = FinalizeConfig(sequence_parallel=True, calculate_per_token_loss=True,
                                moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.5)
        routers = [RouterSpec("router", num_experts=2, has_expert_bias=True)]
        tx = optax.chain(finalize_gradients(specs=SPECS, config=config, dims=DIMS, router_specs=routers),
                         optax.sgd(1.0))
        tree = stacked_tree(6)
        params = jax.tree.map(jnp.zeros_like, tree)
        counts = np.asarray([[3, 0], [1, 1], [0, 2], [0, 0]], np.float32)
        tokens = np.asarray([1, 1, 1, 1], np.int32)

        def step(p, g, c, n):
            state = tx.init(p)
            updates, state = tx.update(g, state, p, num_tokens=n, routers={"router": {"local_tokens_per_expert": c}})
            buffers = router_buffers(state)["router"]
            return optax.apply_updates(p, updates), buffers["expert_bias"], buffers["local_tokens_per_expert"]

        new_params, bias, left = self.variant(shard_mapped(step))(params, tree, counts, tokens)
        want = jax.tree.map(lambda e: -e, expected(tree))  # -lr * (dp sum / 2 tokens) = -dp mean
        chex.assert_trees_all_close(new_params, want, rtol=1e-6)
        # totals over tp_dp_cp: [4, 3]; mean 3.5: bias += 0.5 * sign(mean - total)
        chex.assert_trees_all_equal(bias, np.tile(np.asarray([-0.5, 0.5], np.float32), (4, 1)))
        chex.assert_trees_all_equal(left, np.zeros((4, 2), np.float32))  # reset step


def test_group_names_match_values_and_old_names_alias():
    assert all(g.name == g.value.upper() for g in Group)
    assert Group.EDP is Group.EXPT_DP and Group.GTP is Group.GTP_REMAT
    assert Group.EGTP is Group.EXPT_GTP_REMAT and Group.DP_CP_GTP is Group.DP_CP_GTP_REMAT


def test_stage_reduction_op_is_editable():
    dims = ParallelDims(pp=2, dp=2)
    specs = [ParamSpec("emb", shape=(2,), role="word_embedding")]
    plan = plan_finalize(specs, FinalizeConfig(), dims, dp_sync=False)
    edited = dataclasses.replace(plan, actions=tuple(
        dataclasses.replace(a, op=ReduceOp.AVG) if isinstance(a, StageReduction) else a for a in plan.actions))
    assert [a.op for a in edited.actions if isinstance(a, StageReduction)] == [ReduceOp.AVG]
    assert "word_embedding: avg over embd" in edited.describe()
    grads = {(0, "emb"): np.arange(8, dtype=np.float32).reshape(4, 2)}  # rank = pp * 2 + dp
    total = grads[(0, "emb")].reshape(2, 2, 2).sum(0)
    out = {name: np.asarray(finalize(grads, plan=p, dims=dims)[0][(0, "emb")]) for name, p in
           (("sum", plan), ("avg", edited))}
    chex.assert_trees_all_equal(out["sum"], np.tile(total, (2, 1)))
    chex.assert_trees_all_equal(out["avg"], np.tile(total / 2, (2, 1)))
    assert Step.WORD_EMBEDDING in [a.step for a in edited.actions]


def test_nnx_optimizer_with_specs_from_the_module():
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self):
            self.ln = nnx.Param(jnp.ones(3), sequence_parallel=True)
            self.w = nnx.Param(jnp.ones((3, 2)))

        def __call__(self, x):
            return (x * self.ln[...]) @ self.w[...]

    config = FinalizeConfig(sequence_parallel=True)
    # nnx.Optimizer hands optax a pure State (no metadata): the flags come from specs=
    tx = optax.chain(finalize_gradients(specs=nnx.eval_shape(Model), config=config, dims=DIMS), optax.sgd(1.0))

    def step_with(tx):
        def step(x):
            model = Model()
            optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
            optimizer.update(model, nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model))
            return model.ln[...]
        return jax.jit(shard_mapped(step))

    x = np.arange(12, dtype=np.float32).reshape(4, 3)  # rank r's row
    got = step_with(tx)(x)
    g = 4 * x.sum(1, keepdims=True) * x  # d/d ln of sum(((x * ln) @ 1) ** 2) at ln = 1, w = 1
    g = g.reshape(2, 2, 3).mean(0).sum(0)  # dp mean, then the SP layernorm's tp sum
    chex.assert_trees_all_close(got, np.tile(1 - g, (4, 1)), rtol=1e-6)
    bare = optax.chain(finalize_gradients(config=config, dims=DIMS), optax.sgd(1.0))  # no specs
    with pytest.raises(FinalizeInputError, match="pure nnx.State"):
        step_with(bare)(x)
