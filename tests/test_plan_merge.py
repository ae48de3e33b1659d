"""meshgrad.plan's fusion pass (fewer collectives) and buffer layout (zero-copy order)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from meshgrad import FinalizeConfig, Group, ParallelDims, ParamSpec, Reduction, ReduceOp, Step, plan_finalize
from meshgrad.plan import STAGE_LOCAL_GROUPS, buffer_layout, merge_reductions, promote_dtypes

DIMS = ParallelDims(pp=2, dp=2, tp=2, etp=1)


def spec(name, chunk=0, dtype="float32", **flags):
    return ParamSpec(name, chunk=chunk, shape=(2,), dtype=dtype, **flags)


def reductions(plan):
    return [a for a in plan.actions if isinstance(a, Reduction)]


def test_promotion_follows_torch():
    assert promote_dtypes("bfloat16", "bfloat16") == "bfloat16"
    assert promote_dtypes("bfloat16", "float16") == "float32"
    assert promote_dtypes("bfloat16", "float32") == "float32"
    assert promote_dtypes("float64", "float16") == "float64"


def test_non_tp_dtype_split_is_one_collective_in_the_promoted_dtype():
    params = [spec("ln", sequence_parallel=True), spec("ln16", dtype="bfloat16", sequence_parallel=True), spec("w")]
    config = FinalizeConfig(sequence_parallel=True)
    (fused,) = [a for a in plan_finalize(params, config, DIMS).actions if a.step is Step.NON_TP]
    assert (fused.dtype, fused.keys) == ("float32", ((0, "ln"), (0, "ln16")))
    assert [p.dtype for p in fused.parts] == ["float32", "bfloat16"]
    unmerged = [a for a in plan_finalize(params, config, DIMS, merge=False).actions if a.step is Step.NON_TP]
    assert fused.parts == tuple(unmerged)
    # SUM and AVG stay apart (different ops).
    params.append(spec("avg", average_gradients_across_tp_domain=True))
    ops = [a.op for a in plan_finalize(params, config, DIMS).actions if a.step is Step.NON_TP]
    assert ops == [ReduceOp.SUM, ReduceOp.AVG]


def test_dp_sync_dtype_split_fuses_only_under_grad_reduce_in_fp32():
    params = [spec("a"), spec("b", dtype="bfloat16")]
    plain = [a for a in plan_finalize(params, FinalizeConfig(), DIMS).actions if a.step is Step.DP_SYNC]
    assert [a.dtype for a in plain] == ["float32", "bfloat16"]  # Megatron's DDP: a buffer per dtype
    fp32 = plan_finalize(params, FinalizeConfig(grad_reduce_in_fp32=True), DIMS)
    (dp,) = [a for a in fp32.actions if a.step is Step.DP_SYNC]
    assert dp.reduce_in_fp32 and dp.work_dtype == "float32" and len(dp.keys) == 2
    scatter = plan_finalize(params, FinalizeConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True), DIMS)
    assert len([a for a in scatter.actions if a.step is Step.DP_SYNC]) == 2  # shard layout is per reduction


def test_a_key_in_two_reductions_is_never_fused():
    both = spec("x", pipeline_parallel=True, flextron_router_pp_sync=True)
    plan = plan_finalize([both], FinalizeConfig(has_cond_embedder=True, flextron=True), DIMS)
    pp = [a for a in reductions(plan) if a.group is Group.PP]
    assert [a.steps for a in pp] == [(Step.COND_EMBEDDER,), (Step.ROUTER,)]


def test_merge_is_idempotent_and_keeps_non_adjacent_apart():
    params = [spec("cond", pipeline_parallel=True), spec("ln", sequence_parallel=True), spec("flex", flextron_router_pp_sync=True)]
    plan = plan_finalize(params, FinalizeConfig(has_cond_embedder=True, flextron=True, sequence_parallel=True), DIMS)
    assert merge_reductions(plan.actions) == plan.actions
    pp = [a for a in plan.actions if isinstance(a, Reduction) and a.group is Group.PP]
    assert len(pp) == 1 and pp[0].steps == (Step.COND_EMBEDDER, Step.ROUTER)
    assert plan.for_step(Step.COND_EMBEDDER, Step.ROUTER) == tuple(pp)
    assert [a.keys for a in plan.for_step(Step.COND_EMBEDDER)] == [((0, "cond"),)]


def gpt_like(layers=3, chunks=2, experts=True):
    params = []
    for c in range(chunks):
        if c == 0:
            params.append(spec("emb", c, role="word_embedding"))
        for i in range(layers):
            params += [
                spec(f"l{i}.input_layernorm.weight", c, sequence_parallel=True),
                spec(f"l{i}.qkv.weight", c),
                spec(f"l{i}.attn.q_layernorm.weight", c),
                spec(f"l{i}.proj.bias", c, sequence_parallel=True),
                spec(f"l{i}.fc1.weight", c),
                spec(f"l{i}.avg.weight", c, average_gradients_across_tp_domain=True),
            ]
            if experts:
                params += [spec(f"l{i}.experts.fc1", c, expert=True), spec(f"l{i}.experts.fc2", c, expert=True)]
        params += [spec("cond.weight", c, pipeline_parallel=True), spec("flex.weight", c, flextron_router_pp_sync=True)]
        params.append(spec(f"frozen{c}", c, has_grad=False))
    return params


ALL_ON = FinalizeConfig(sequence_parallel=True, qk_layernorm=True, has_cond_embedder=True, flextron=True)


def contiguous(plan, action):
    (order,) = [keys for dtype, keys in plan.layout if dtype == action.dtype]
    pos = [order.index(k) for k in action.keys]
    return pos == list(range(pos[0], pos[0] + len(pos)))


def test_gpt_layout_makes_every_reduction_a_run_of_one_buffer():
    params = gpt_like()
    plan = plan_finalize(params, ALL_ON, DIMS)
    (dtype, order), = plan.layout
    assert sorted(order) == sorted(p.key for p in params if p.has_grad)
    for action in reductions(plan):
        assert contiguous(plan, action), action.steps
    # Nested: the non-TP keys lie inside the dense DP-sync run.
    dense = next(a for a in reductions(plan) if a.step is Step.DP_SYNC and a.group is Group.DP_CP)
    non_tp = next(a for a in reductions(plan) if a.step is Step.NON_TP and a.op is ReduceOp.SUM)
    assert set(non_tp.keys) < set(dense.keys)


def test_a_reduction_crossing_two_buffers_runs_falls_back_alone():
    # Expert and dense sequence-parallel grads in one non-TP SUM: it straddles the dense
    # and expert DP-sync runs, so it cannot be a run of its own; the others still are.
    params = gpt_like() + [spec("experts.norm", 0, expert=True, sequence_parallel=True)]
    plan = plan_finalize(params, ALL_ON, DIMS)
    non_tp = next(a for a in reductions(plan) if a.step is Step.NON_TP and a.op is ReduceOp.SUM)
    assert not contiguous(plan, non_tp)
    assert all(contiguous(plan, a) for a in reductions(plan) if a is not non_tp)


def scrambled(actions):
    """The actions with the keys (and copies) of every reorderable reduction reversed."""
    out = []
    for a in actions:
        if isinstance(a, Reduction) and a.group in STAGE_LOCAL_GROUPS and not a.scatter:
            a = dataclasses.replace(a, keys=a.keys[::-1], copies=a.copies[::-1])
        out.append(a)
    return tuple(out)


def test_layout_is_idempotent_and_keeps_fixed_orders():
    params = gpt_like()
    plan = plan_finalize(params, ALL_ON, DIMS)
    assert buffer_layout(plan.actions, params) == (plan.layout, plan.actions)
    index = [p.key for p in params].index
    pp = [a for a in reductions(plan) if a.group not in STAGE_LOCAL_GROUPS]
    assert pp and all(list(a.keys) == sorted(a.keys, key=index) for a in pp)
    scatter = [a for a in reductions(plan_finalize(params, ALL_ON.replace(use_distributed_optimizer=True), DIMS)) if a.scatter]
    assert scatter and all(list(a.keys) == sorted(a.keys, key=index) for a in scatter)  # the shard layout
    # Reorderable reductions are put back in buffer order.
    assert buffer_layout(scrambled(plan.actions), params) == (plan.layout, plan.actions)


@pytest.mark.parametrize("seed", range(25))
def test_random_layouts_only_reorder(seed):
    rng = random.Random(seed)
    flags = ["sequence_parallel", "average_gradients_across_tp_domain", "pipeline_parallel", "flextron_router_pp_sync", "expert"]
    params = {}
    for i in range(rng.randint(1, 14)):
        chosen = {f: True for f in flags if rng.random() < 0.25}
        p = spec(f"p{i}", rng.randint(0, 1), dtype=rng.choice(["float32", "float32", "bfloat16"]), has_grad=rng.random() < 0.9, **chosen)
        params[p.key] = p
    params = list(params.values())
    config = FinalizeConfig(
        sequence_parallel=True, has_cond_embedder=True, flextron=True, grad_reduce_in_fp32=rng.random() < 0.3,
        use_distributed_optimizer=rng.random() < 0.3,
    )
    for merge in (False, True):
        plan = plan_finalize(params, config, DIMS, merge=merge)
        by_dtype = {}
        for p in params:
            if p.has_grad:
                by_dtype.setdefault(p.dtype, set()).add(p.key)
        assert {d: set(k) for d, k in plan.layout} == by_dtype
        assert all(len(set(k)) == len(k) for _, k in plan.layout)
        mixed = scrambled(plan.actions)
        layout, again = buffer_layout(mixed, params)
        assert layout == plan.layout
        for a, b in zip(mixed, again):
            if isinstance(a, Reduction):
                assert sorted(zip(a.keys, a.copies or [()] * len(a.keys))) == sorted(zip(b.keys, b.copies or [()] * len(b.keys)))
        # The largest single-dtype reduction always gets its run.
        dtype_of = {p.key: p.dtype for p in params}
        single = [a for a in reductions(plan) if {dtype_of[k] for k in a.keys} == {a.dtype}]
        if single:
            assert contiguous(plan, max(single, key=lambda a: len(a.keys)))
    fused = plan_finalize(params, config, DIMS)
    unfused = plan_finalize(params, config, DIMS, merge=False)
    assert len(reductions(fused)) <= len(reductions(unfused))
    sizes = {p.key: p.numel for p in params}
    total = lambda acts: sorted(k for a in acts if isinstance(a, Reduction) for k in a.all_keys)  # noqa: E731
    assert total(fused.actions) == total(unfused.actions)
    assert sum(sizes[k] for k in total(fused.actions)) == sum(sizes[k] for k in total(unfused.actions))


def test_jax_runs_a_fused_mixed_dtype_reduction_in_float32_and_compiles_once(monkeypatch):
    pytest.importorskip("jax")
    import jax.numpy as jnp
    import numpy as np

    import jax_impl.finalize as jf

    dims = ParallelDims(tp=4)
    params = [
        ParamSpec("ln32", shape=(2,), sequence_parallel=True),
        ParamSpec("ln16", shape=(2,), dtype="bfloat16", sequence_parallel=True),
    ]
    config = FinalizeConfig(sequence_parallel=True)
    (fused,) = reductions(plan_finalize(params, config, dims))
    assert fused.dtype == "float32" and len(fused.parts) == 2
    traces = []
    original = jf.run_stacked

    def counting(*args):
        traces.append(1)
        return original(*args)

    monkeypatch.setattr(jf, "run_stacked", counting)
    # bf16 holds 8 significant bits: 256 + 1 + 1 + 1 stays 256 summed in bf16, 259 in fp32.
    values = np.array([[256.0, 256.0]] + [[1.0, 1.0]] * 3, np.float32)
    for _ in range(2):
        grads = {(0, "ln32"): values, (0, "ln16"): values.astype(jnp.bfloat16)}
        out, _ = jf.finalize_stacked(grads, None, None, params=params, config=config, dims=dims)
    assert len(traces) == 1
    np.testing.assert_array_equal(np.asarray(out[(0, "ln32")]), np.full((4, 2), 259.0, np.float32))
    assert out[(0, "ln16")].dtype == jnp.bfloat16
    want = float(jnp.asarray(259.0, jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(out[(0, "ln16")].astype(jnp.float32)), np.full((4, 2), want))
