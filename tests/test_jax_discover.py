"""jax_impl.discover: ParamSpecs from explicit trees and flax.nnx Variable metadata."""

from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from jax_impl.discover import keyed, router_specs, specs_from_nnx, specs_from_tree, tree_keys
from meshgrad import ParamSpec, Role


def test_specs_from_tree():
    arrays = {
        "embedding": {"word_embeddings": {"weight": jnp.zeros((8, 4), jnp.bfloat16)}},
        "mlp": {"experts": {"w": np.zeros((2, 3), np.float32)}, "norm": np.zeros(4, np.float32)},
    }
    flags = {
        "embedding.word_embeddings.weight": {"role": "word_embedding"},
        "mlp": {"experts": {"w": {"allreduce": False, "requires_grad": False}}, "norm": ParamSpec("x", sequence_parallel=True)},
    }
    specs = {s.name: s for s in specs_from_tree(arrays, flags, chunk=1)}
    assert list(specs) == ["embedding.word_embeddings.weight", "mlp.experts.w", "mlp.norm"]
    emb, w, norm = specs.values()
    assert (emb.chunk, emb.shape, emb.dtype, emb.role) == (1, (8, 4), "bfloat16", Role.WORD_EMBEDDING)
    assert w.expert and not w.has_grad and w.shape == (2, 3)
    assert norm.sequence_parallel and not norm.expert
    assert all(s.dtype == "float32" for s in specs_from_tree(arrays, dtype="float32"))
    leaves = (arrays["embedding"]["word_embeddings"]["weight"], arrays["mlp"]["experts"]["w"], arrays["mlp"]["norm"])
    chex.assert_trees_all_equal(keyed(arrays, chunk=1), {(1, n): leaf for n, leaf in zip(specs, leaves)})
    layout = tree_keys(arrays)  # the leaves' dotted names, and back to the user's structure
    assert layout.keys == tuple((0, n) for n in specs)
    chex.assert_trees_all_equal(layout.unkeyed(layout.keyed(arrays)), arrays)


def test_specs_from_tree_errors():
    with pytest.raises(ValueError, match="unknown parameter"):
        specs_from_tree({"a": np.zeros(2)}, {"b": {"expert": True}})
    with pytest.raises(ValueError, match="contradicts"):
        specs_from_tree({"a": np.zeros(2)}, {"a": {"expert": False, "allreduce": False}})


def test_specs_from_nnx_metadata():
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self):
            self.norm = nnx.Param(jnp.ones((4,)), sequence_parallel=True)
            self.experts = nnx.Param(jnp.ones((2, 4)), allreduce=False)
            self.dense = nnx.Param(jnp.ones((3,), jnp.bfloat16))
            self.cond = nnx.Param(jnp.ones((2,)), pipeline_parallel=True, average_gradients_across_tp_domain=True)

    specs = {s.name: s for s in specs_from_nnx(Block(), chunk=2)}
    assert set(specs) == {"norm", "experts", "dense", "cond"}
    assert specs["norm"].sequence_parallel and specs["norm"].chunk == 2
    assert specs["experts"].expert and specs["experts"].shape == (2, 4)
    assert specs["dense"].dtype == "bfloat16" and not specs["dense"].expert
    assert specs["cond"].pipeline_parallel and specs["cond"].average_gradients_across_tp_domain
    state_specs = specs_from_nnx(nnx.state(Block(), nnx.Param))
    assert {s.name for s in state_specs} == set(specs)


def test_router_specs():
    states = {
        "r0": {"expert_bias": np.zeros(4), "local_tokens_per_expert": np.zeros(4)},
        "r1": {"qb_beta": np.zeros(8), "qb_beta_accum": None, "qb_beta_count": np.zeros(())},
    }
    r0, r1 = router_specs(states, chunk=1, frozen_expert_bias=["r0"])
    assert (r0.num_experts, r0.has_expert_bias, r0.frozen_expert_bias, r0.has_qb_beta) == (4, True, True, False)
    assert (r1.num_experts, r1.has_qb_beta, r1.qb_accum_present, r1.chunk) == (8, True, False, 1)
    with pytest.raises(ValueError, match="neither"):
        router_specs({"r": {}})
