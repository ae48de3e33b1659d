"""A tiny GPT-like flax.nnx model trained with PP x DP x TP(+SP) x EP inside one
``jax.shard_map`` over 8 fake CPU devices with
``optax.chain(jax_impl.finalize_gradients(config=..., dims=...), optax.adamw(...))``, and
checked, step by step, against the same optimizer on the whole model on one device
(parameters after each step, loss, router expert bias).

The parallel step differs from a single-device optax loop only by the chain's first
element and two extra arguments of ``update``: ``num_tokens`` (per-token loss) and
``routers`` (this step's token counts per router; the expert bias lives in the chain's
state, read with ``jax_impl.router_buffers``). The gradients are the ``nnx.State`` that
``jax.grad`` returns; their Param metadata (``nnx.Param(w, sequence_parallel=True)``)
gives finalization its flags.

What is real and what is emulated:

* **Real**: data parallelism (each ``dp`` rank gets its rows of the batch); tensor
  parallelism with sequence parallelism (column / row-parallel linears, vocab-parallel
  embedding, layernorms on sequence shards whose weights carry ``sequence_parallel`` and
  are only partial per rank until finalization sums them over ``tp``); qk layernorm per
  head (partial over ``tp``, summed because of its name); expert parallelism over the
  ``tp`` ranks (``ep = tp``, expert tensor parallelism 1: tokens all-gathered, each rank
  runs its experts, outputs reduce-scattered; expert weights flagged ``allreduce=False``
  are summed over expert-data-parallel ranks); a router expert bias updated from token
  counts summed over ``tp x dp``; per-token loss with ``num_tokens`` scaling.
  Every collective has Megatron's backward (all-gather <-> reduce-scatter, all-reduce <->
  identity) through ``jax.custom_vjp``, so each rank's ``jax.grad`` is exactly the local
  gradient a Megatron rank would hold before ``finalize_model_grads``.
* **Pipeline, emulated in SPMD**: every device runs the same program, so each ``pp`` stage
  holds the same structure (an embedding, ``layers / pp`` layers, a final layernorm).
  The program runs the layers ``pp`` times; after pass k the activations move from stage k
  to stage k+1 with ``lax.ppermute`` (whose transpose carries the gradient back), and only
  pass k on stage k is kept (other passes see zeros, are discarded and get zero
  gradient). Stage 0's word embedding feeds the input, the last stage's copy the output
  layer: the tied pair that finalization sums over the first and last stages. Stage
  copies Megatron would not have (a position embedding after stage 0, a final layernorm
  before the last stage) get zero gradients and are left out of the comparison.
* Not covered here: context parallelism and micro-batching (see ``torch_train.py``).

Run: ``python examples/jax_train.py --pp 2 --dp 2 --tp 2 --steps 3 [--optimizer sgd]`` (exits 1 on a
mismatch; with sgd the parameter check is a check of the finalized gradients times lr).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from jax_impl.mesh import ensure_host_devices  # noqa: E402  (imports no jax)

ensure_host_devices(8)  # sets XLA_FLAGS before jax is imported

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from jax_impl import finalize_gradients, make_meshes, router_buffers  # noqa: E402
from meshgrad import FinalizeConfig, ParallelDims, RouterSpec  # noqa: E402

Array = jax.Array
Flat = dict[str, Array]

# --------------------------------------------------------------------------- sizes


@dataclasses.dataclass(frozen=True)
class Sizes:
    vocab: int = 64
    hidden: int = 16
    heads: int = 4
    ffn: int = 32
    layers: int = 4
    seq: int = 16
    experts: int = 4
    topk: int = 2
    expert_ffn: int = 16
    bias_rate: float = 1e-2
    moe_every: int = 2  # layer i is an MoE layer when i % moe_every == moe_every - 1

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclasses.dataclass(frozen=True)
class Layout:
    """Parallel sizes of the program; all 1 is the single-device model."""

    pp: int = 1
    dp: int = 1
    tp: int = 1

    @property
    def ep(self) -> int:
        return self.tp  # experts are spread over the tp ranks (etp = 1)

    def axis(self, name: str) -> str | None:
        """The mesh axis name, or None when that axis has size 1 (no communication)."""
        return name if getattr(self, name) > 1 else None

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(pp=self.pp, dp=self.dp, tp=self.tp, ep=self.ep, etp=1)


# --------------------------------------------------------------------------- collectives
# Megatron's conjugate pairs; each is the identity when ``axis`` is None.


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather(x: Array, axis: str, dim: int) -> Array:
    return lax.all_gather(x, axis, axis=dim, tiled=True)


_gather.defvjp(
    lambda x, axis, dim: (_gather(x, axis, dim), None),
    lambda axis, dim, _, g: (lax.psum_scatter(g, axis, scatter_dimension=dim, tiled=True),),
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _reduce_scatter(x: Array, axis: str, dim: int) -> Array:
    return lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)


_reduce_scatter.defvjp(
    lambda x, axis, dim: (_reduce_scatter(x, axis, dim), None),
    lambda axis, dim, _, g: (lax.all_gather(g, axis, axis=dim, tiled=True),),
)


def _own_slice(x: Array, axis: str, dim: int) -> Array:
    size = x.shape[dim] // lax.axis_size(axis)
    return lax.dynamic_slice_in_dim(x, lax.axis_index(axis) * size, size, axis=dim)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _split(x: Array, axis: str, dim: int) -> Array:
    return _own_slice(x, axis, dim)


_split.defvjp(
    lambda x, axis, dim: (_split(x, axis, dim), None),
    lambda axis, dim, _, g: (lax.all_gather(g, axis, axis=dim, tiled=True),),
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _all_reduce(x: Array, axis: str) -> Array:
    return lax.psum(x, axis)


_all_reduce.defvjp(lambda x, axis: (_all_reduce(x, axis), None), lambda axis, _, g: (g,))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather_replicated(x: Array, axis: str, dim: int) -> Array:
    return lax.all_gather(x, axis, axis=dim, tiled=True)


# Every rank computes the same function of the gathered value: keep our slice of its grad.
_gather_replicated.defvjp(
    lambda x, axis, dim: (_gather_replicated(x, axis, dim), None),
    lambda axis, dim, _, g: (_own_slice(g, axis, dim),),
)


def _maybe(fn: Callable[..., Array]) -> Callable[..., Array]:
    return lambda x, axis, *rest: x if axis is None else fn(x, axis, *rest)


gather, reduce_scatter, split = _maybe(_gather), _maybe(_reduce_scatter), _maybe(_split)
all_reduce, gather_replicated = _maybe(_all_reduce), _maybe(_gather_replicated)

# --------------------------------------------------------------------------- model


class ExpertBias(nnx.Variable):
    """A router's expert bias: model state, not a trained parameter."""


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], scale: float) -> Array:
    return scale * jax.random.normal(rngs.params(), shape)


class LayerNorm(nnx.Module):
    def __init__(self, size: int, rngs: nnx.Rngs, *, sequence_parallel: bool = False) -> None:
        self.weight = nnx.Param(1.0 + _normal(rngs, (size,), 0.1), sequence_parallel=sequence_parallel)
        self.bias = nnx.Param(_normal(rngs, (size,), 0.1), sequence_parallel=sequence_parallel)

    def __call__(self, x: Array) -> Array:
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) * lax.rsqrt(var + 1e-5) * self.weight[...] + self.bias[...]


class ColumnParallelLinear(nnx.Module):
    """Output features split over tp; the sequence-sharded input is all-gathered (SP)."""

    def __init__(self, n_in: int, n_out: int, layout: Layout, rngs: nnx.Rngs) -> None:
        self.tp = layout.axis("tp")
        self.weight = nnx.Param(_normal(rngs, (n_in, n_out // layout.tp), 1 / math.sqrt(n_in)))
        self.bias = nnx.Param(_normal(rngs, (n_out // layout.tp,), 0.1))

    def __call__(self, x: Array) -> Array:
        return gather(x, self.tp, 1) @ self.weight[...] + self.bias[...]


class RowParallelLinear(nnx.Module):
    """Input features split over tp; outputs reduce-scattered over the sequence, then the
    bias (flagged ``sequence_parallel``) is added."""

    def __init__(self, n_in: int, n_out: int, layout: Layout, rngs: nnx.Rngs) -> None:
        self.tp = layout.axis("tp")
        self.weight = nnx.Param(_normal(rngs, (n_in // layout.tp, n_out), 1 / math.sqrt(n_in)))
        self.bias = nnx.Param(_normal(rngs, (n_out,), 0.1), sequence_parallel=True)

    def __call__(self, x: Array) -> Array:
        return reduce_scatter(x @ self.weight[...], self.tp, 1) + self.bias[...]


class Embedding(nnx.Module):
    """Vocab-parallel word embedding + learned position embedding, split over the sequence."""

    def __init__(self, sizes: Sizes, layout: Layout, rngs: nnx.Rngs) -> None:
        self.tp = layout.axis("tp")
        self.word_embeddings = nnx.Param(
            _normal(rngs, (sizes.vocab // layout.tp, sizes.hidden), 1 / math.sqrt(sizes.hidden)),
            role="word_embedding",
        )
        self.position_embeddings = nnx.Param(
            _normal(rngs, (sizes.seq, sizes.hidden), 1 / math.sqrt(sizes.hidden)), role="position_embedding"
        )

    def __call__(self, ids: Array) -> Array:
        table = self.word_embeddings[...]
        start = 0 if self.tp is None else lax.axis_index(self.tp) * table.shape[0]
        local = ids - start
        inside = (local >= 0) & (local < table.shape[0])
        words = jnp.where(inside[..., None], table[jnp.clip(local, 0, table.shape[0] - 1)], 0.0)
        out = all_reduce(words, self.tp) + self.position_embeddings[...][None, : ids.shape[1]]
        return split(out, self.tp, 1)

    def logits(self, x: Array) -> Array:
        """Output layer tied to the word embedding: full-vocabulary logits on every tp rank."""
        local = gather(x, self.tp, 1) @ self.word_embeddings[...].T
        return gather_replicated(local, self.tp, 2)


class SelfAttention(nnx.Module):
    """Causal attention, heads split over tp; full weight columns are [head, (q,k,v), d]."""

    def __init__(self, sizes: Sizes, layout: Layout, rngs: nnx.Rngs) -> None:
        self.head_dim = sizes.head_dim
        self.linear_qkv = ColumnParallelLinear(sizes.hidden, 3 * sizes.hidden, layout, rngs)
        self.q_layernorm = LayerNorm(sizes.head_dim, rngs)
        self.k_layernorm = LayerNorm(sizes.head_dim, rngs)
        self.linear_proj = RowParallelLinear(sizes.hidden, sizes.hidden, layout, rngs)

    def __call__(self, x: Array) -> Array:
        qkv = self.linear_qkv(x)
        b, s, _ = qkv.shape
        qkv = qkv.reshape(b, s, -1, 3, self.head_dim)
        q, k, v = self.q_layernorm(qkv[..., 0, :]), self.k_layernorm(qkv[..., 1, :]), qkv[..., 2, :]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(self.head_dim)
        scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -jnp.inf)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v)
        return self.linear_proj(out.reshape(b, s, -1))


class MLP(nnx.Module):
    def __init__(self, sizes: Sizes, layout: Layout, rngs: nnx.Rngs) -> None:
        self.linear_fc1 = ColumnParallelLinear(sizes.hidden, sizes.ffn, layout, rngs)
        self.linear_fc2 = RowParallelLinear(sizes.ffn, sizes.hidden, layout, rngs)

    def __call__(self, x: Array) -> tuple[Array, Array | None]:
        return self.linear_fc2(jax.nn.gelu(self.linear_fc1(x), approximate=False)), None


class Router(nnx.Module):
    """Sigmoid top-k router; the expert bias only shifts which experts are chosen."""

    def __init__(self, sizes: Sizes, rngs: nnx.Rngs) -> None:
        self.topk = sizes.topk
        self.weight = nnx.Param(_normal(rngs, (sizes.hidden, sizes.experts), 1 / math.sqrt(sizes.hidden)),
                                sequence_parallel=True)
        self.expert_bias = ExpertBias(jnp.zeros(sizes.experts))

    def __call__(self, tokens: Array) -> tuple[Array, Array]:
        """Returns (probs [T, E] with zeros off the top-k, tokens routed per expert [E])."""
        scores = jax.nn.sigmoid(tokens @ self.weight[...])
        _, top = lax.top_k(scores + self.expert_bias[...], self.topk)
        chosen = jnp.take_along_axis(scores, top, axis=-1)
        chosen = chosen / (chosen.sum(-1, keepdims=True) + 1e-20)
        one_hot = jax.nn.one_hot(top, scores.shape[-1], dtype=scores.dtype)
        return jnp.einsum("tk,tke->te", chosen, one_hot), one_hot.sum((0, 1))


class MoE(nnx.Module):
    """Router + experts spread over the ep (= tp) ranks with an all-gather dispatcher."""

    def __init__(self, sizes: Sizes, layout: Layout, rngs: nnx.Rngs) -> None:
        self.ep = layout.axis("tp")
        self.local = sizes.experts // layout.ep
        self.router = Router(sizes, rngs)
        h, f = sizes.hidden, sizes.expert_ffn
        self.experts = Experts(self.local, h, f, rngs)

    def __call__(self, x: Array) -> tuple[Array, Array]:
        tokens = x.reshape(-1, x.shape[-1])
        probs, counts = self.router(tokens)
        tokens, probs = gather(tokens, self.ep, 0), gather(probs, self.ep, 0)
        first = 0 if self.ep is None else lax.axis_index(self.ep) * self.local
        mine = lax.dynamic_slice_in_dim(probs, first, self.local, axis=1)
        out = jnp.einsum("eth,te->th", self.experts(tokens), mine)  # dense: zero prob = no grad
        return reduce_scatter(out, self.ep, 0).reshape(x.shape), counts


class Experts(nnx.Module):
    def __init__(self, count: int, hidden: int, ffn: int, rngs: nnx.Rngs) -> None:
        self.linear_fc1 = nnx.Param(_normal(rngs, (count, hidden, ffn), 1 / math.sqrt(hidden)), allreduce=False)
        self.linear_fc2 = nnx.Param(_normal(rngs, (count, ffn, hidden), 1 / math.sqrt(ffn)), allreduce=False)

    def __call__(self, tokens: Array) -> Array:
        h = jax.nn.gelu(jnp.einsum("th,ehf->etf", tokens, self.linear_fc1[...]), approximate=False)
        return jnp.einsum("etf,efh->eth", h, self.linear_fc2[...])


class TransformerLayer(nnx.Module):
    def __init__(self, sizes: Sizes, layout: Layout, rngs: nnx.Rngs, moe: bool) -> None:
        sp = layout.tp > 1
        self.input_layernorm = LayerNorm(sizes.hidden, rngs, sequence_parallel=sp)
        self.self_attention = SelfAttention(sizes, layout, rngs)
        self.pre_mlp_layernorm = LayerNorm(sizes.hidden, rngs, sequence_parallel=sp)
        self.mlp = MoE(sizes, layout, rngs) if moe else MLP(sizes, layout, rngs)

    def __call__(self, x: Array) -> tuple[Array, Array | None]:
        x = x + self.self_attention(self.input_layernorm(x))
        y, counts = self.mlp(self.pre_mlp_layernorm(x))
        return x + y, counts


class GPT(nnx.Module):
    """One pipeline stage (the whole model when pp == 1); every stage has this structure."""

    def __init__(self, sizes: Sizes, layout: Layout, rngs: nnx.Rngs) -> None:
        per_stage = sizes.layers // layout.pp
        self.embedding = Embedding(sizes, layout, rngs)
        self.layers = nnx.List(
            TransformerLayer(sizes, layout, rngs, i % sizes.moe_every == sizes.moe_every - 1) for i in range(per_stage)
        )
        self.final_layernorm = LayerNorm(sizes.hidden, rngs, sequence_parallel=layout.tp > 1)

    def run_layers(self, x: Array) -> tuple[Array, dict[str, Array]]:
        counts = {}
        for i, layer in enumerate(self.layers):
            x, c = layer(x)
            if c is not None:
                counts[f"layers.{i}.mlp.router"] = c
        return x, counts


def rank_loss(model: GPT, layout: Layout, ids: Array, labels: Array, mask: Array) -> tuple[Array, dict[str, Array]]:
    """This rank's sum of masked token losses (zero off the last stage) and its routers'
    token counts, through a ``pp``-stage pipeline (see the module docstring)."""
    stage = lax.axis_index("pp") if layout.pp > 1 else 0
    x = model.embedding(ids)
    counts: dict[str, Array] = {}
    for k in range(layout.pp):
        out, c = model.run_layers(x)
        for name, value in c.items():
            counts[name] = counts.get(name, 0.0) + jnp.where(stage == k, value, 0.0)
        x = lax.ppermute(out, "pp", [(k, k + 1)]) if k < layout.pp - 1 else out
    logits = model.embedding.logits(model.final_layernorm(x))
    token_loss = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, labels[..., None], -1)[..., 0]
    return jnp.where(stage == layout.pp - 1, (token_loss * mask).sum(), 0.0), counts


# --------------------------------------------------------------------------- state


def flat_names(state: nnx.State) -> dict[str, tuple[Any, ...]]:
    """Dotted name -> nnx path of every variable in ``state``."""
    return {".".join(str(p) for p in path): tuple(path) for path, _ in nnx.to_flat_state(state)}


def to_flat(state: nnx.State) -> Flat:
    return {".".join(str(p) for p in path): var.get_value() for path, var in nnx.to_flat_state(state)}


def from_flat(template: nnx.State, flat: Flat) -> nnx.State:
    """A copy of ``template`` holding the arrays of ``flat``."""
    paths = flat_names(template)
    nested: dict[Any, Any] = {}
    for name, value in flat.items():
        node = nested
        *head, last = paths[name]
        for part in head:
            node = node.setdefault(part, {})
        node[last] = value
    state = jax.tree.map(lambda x: x, template)
    nnx.replace_by_pure_dict(state, nested)
    return state


@dataclasses.dataclass(frozen=True)
class Shard:
    """Where a rank's tensor sits in the single-device model (``dim`` None: whole)."""

    full_name: str
    dim: int | None = None
    parts: int = 1
    index: int = 0

    def take(self, full: np.ndarray) -> np.ndarray:
        return full if self.dim is None else np.split(full, self.parts, self.dim)[self.index]


_TP_DIM = {"linear_qkv.weight": 1, "linear_qkv.bias": 0, "linear_fc1.weight": 1, "linear_fc1.bias": 0,
           "linear_proj.weight": 0, "linear_fc2.weight": 0}


def shard_of(name: str, coords: dict[str, int], sizes: Sizes, layout: Layout) -> Shard | None:
    """The single-device tensor a rank's ``name`` holds a slice of; None for stage copies
    Megatron would not have (their gradient is zero)."""
    stage, tp = coords["pp"], coords["tp"]
    last = layout.pp - 1
    if name == "embedding.word_embeddings":
        if stage not in (0, last):
            return None
        return Shard("embedding.word_embeddings" if stage == 0 else "output_layer.weight", 0, layout.tp, tp)
    if name == "embedding.position_embeddings":
        return Shard(name) if stage == 0 else None
    if name.startswith("final_layernorm"):
        return Shard(name) if stage == last else None
    parts = name.split(".")
    parts[1] = str(stage * (sizes.layers // layout.pp) + int(parts[1]))
    full = ".".join(parts)
    if ".experts." in name:
        return Shard(full, 0, layout.ep, tp)
    for suffix, dim in _TP_DIM.items():
        if name.endswith(suffix):
            return Shard(full, dim, layout.tp, tp)
    return Shard(full)


def rank_states(full: Flat, template: Flat, sizes: Sizes, layout: Layout) -> Flat:
    """Per-rank values stacked on a leading rank dim, sliced from the single-device state."""
    dims = layout.dims
    out: dict[str, list[np.ndarray]] = {name: [] for name in template}
    for rank in range(dims.world_size):
        coords = {str(a): v for a, v in dims.coords(rank).items()}
        for name, spec in template.items():
            shard = shard_of(name, coords, sizes, layout)
            if shard is None:  # a copy this stage never uses: any value of the right shape
                shard = shard_of(name, {**coords, "pp": 0}, sizes, layout) or shard_of(
                    name, {**coords, "pp": layout.pp - 1}, sizes, layout)
            source = "embedding.word_embeddings" if shard.full_name == "output_layer.weight" else shard.full_name
            value = shard.take(np.asarray(full[source]))
            if value.shape != spec.shape:
                raise ValueError(f"{name}: slice {value.shape} of {source} does not fit {spec.shape}")
            out[name].append(value)
    return {name: jnp.asarray(np.stack(values)) for name, values in out.items()}


# --------------------------------------------------------------------------- steps


def global_batch(sizes: Sizes, batch: int, seed: int, step: int) -> tuple[Array, Array, Array]:
    rng = np.random.default_rng(seed * 1_000_003 + step)
    tokens = rng.integers(0, sizes.vocab, (batch, sizes.seq + 1))
    mask = (rng.random((batch, sizes.seq)) < 0.8).astype(np.float32)
    return jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:]), jnp.asarray(mask)


def make_optimizer(name: str, lr: float) -> optax.GradientTransformation:
    """The optimizer both runs use: ``adamw`` or plain ``sgd``."""
    # eps: the k layernorm bias has an exactly-zero gradient (softmax ignores a per-row shift),
    # so both runs hold only round-off there; a tiny eps would turn it into +-lr steps.
    return optax.adamw(lr, eps=1e-4, weight_decay=1e-2) if name == "adamw" else optax.sgd(lr)


def single_step(sizes: Sizes, optimizer: optax.GradientTransformation) -> Callable[..., Any]:
    """One jitted optimizer step of the single-device model: (params, opt_state, biases,
    batch) -> (params, opt_state, biases, loss); the loss is sum(token losses) / tokens."""

    @jax.jit
    def step(model_def: Any, params: nnx.State, opt_state: Any, biases: nnx.State, ids: Array, labels: Array,
             mask: Array) -> Any:
        def loss_fn(p: nnx.State) -> tuple[Array, dict[str, Array]]:
            loss_sum, counts = rank_loss(nnx.merge(model_def, p, biases), Layout(), ids, labels, mask)
            return loss_sum / mask.sum(), counts

        (loss, counts), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        flat_b = to_flat(biases)
        for router, tokens in counts.items():  # the expert_bias step (docs/semantics.md) on one device
            key = f"{router}.expert_bias"
            flat_b[key] = flat_b[key] + sizes.bias_rate * jnp.sign(tokens.mean() - tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, from_flat(biases, flat_b), loss

    return step


def sharded_step(sizes: Sizes, layout: Layout, optimizer: optax.GradientTransformation, model_def: Any,
                 templates: tuple[nnx.State, nnx.State]) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(init, step) of the parallel model, both jitted shard_maps over the dense mesh.

    The optimizer is ``optax.chain(jax_impl.finalize_gradients(...), optimizer)``: every
    rank computes its local gradients (an nnx.State whose Param metadata carries the
    flags), the chain finalizes them and updates; the router buffers live in the chain's
    state (``jax_impl.router_buffers``).
    """
    dims = layout.dims
    params_t, biases_t = templates
    config = FinalizeConfig(
        sequence_parallel=layout.tp > 1,
        qk_layernorm=True,
        calculate_per_token_loss=True,
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=sizes.bias_rate,
        moe_router_load_balancing_type="none",
    )
    router_names = [n.rsplit(".", 1)[0] for n in flat_names(biases_t)]
    routers = [RouterSpec(n, num_experts=sizes.experts, has_expert_bias=True) for n in router_names]
    tx = optax.chain(finalize_gradients(config=config, dims=dims, router_specs=routers), optimizer)
    mesh = make_meshes(dims).dense
    ranks = PartitionSpec(tuple(mesh.axis_names))
    local = lambda tree: jax.tree.map(lambda x: x[0], tree)  # noqa: E731  (this rank's [1, ...] block)
    lead = lambda tree: jax.tree.map(lambda x: x[None], tree)  # noqa: E731

    def init_body(params: Flat) -> Any:
        return lead(tx.init(from_flat(params_t, local(params))))

    def body(params: Flat, opt_state: Any, ids: Array, labels: Array, mask: Array) -> Any:
        params, opt_state, ids, labels, mask = local((params, opt_state, ids, labels, mask))
        state = from_flat(params_t, params)
        buffers = router_buffers(opt_state)
        biases = from_flat(biases_t, {f"{r}.expert_bias": buffers[r]["expert_bias"] for r in router_names})

        def loss_fn(p: nnx.State) -> tuple[Array, dict[str, Array]]:
            return rank_loss(nnx.merge(model_def, p, biases), layout, ids, labels, mask)

        (loss_sum, counts), grads = jax.value_and_grad(loss_fn, has_aux=True)(state)
        updates, opt_state = tx.update(
            grads, opt_state, state, num_tokens=mask.sum().astype(jnp.int32),
            routers={r: {"local_tokens_per_expert": counts[r]} for r in router_names},
        )
        new_biases = {f"{r}.expert_bias": router_buffers(opt_state)[r]["expert_bias"] for r in router_names}
        return lead((to_flat(optax.apply_updates(state, updates)), opt_state, new_biases, loss_sum))

    data = PartitionSpec("dp")
    init = jax.jit(jax.shard_map(init_body, mesh=mesh, in_specs=(ranks,), out_specs=ranks, check_vma=False))
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(ranks, ranks, data, data, data),
                                 out_specs=(ranks, ranks, ranks, ranks), check_vma=False))

    def run(params: Flat, opt_state: Any, ids: Array, labels: Array, mask: Array) -> Any:
        # Place the inputs as the outputs are placed, so every step reuses one executable.
        on = lambda tree, spec: jax.device_put(tree, NamedSharding(mesh, spec))  # noqa: E731
        return step(on(params, ranks), on(opt_state, ranks), on(ids, data), on(labels, data), on(mask, data))

    return (lambda params: init(jax.device_put(params, NamedSharding(mesh, ranks)))), run


# --------------------------------------------------------------------------- main


def compare(got: Flat, want: Flat, layout: Layout, sizes: Sizes) -> float:
    """Largest |rank value - slice of the single-device value| / max|single value| over
    every rank's every tensor (replicas included)."""
    dims = layout.dims
    scale = max([float(np.abs(np.asarray(v)).max()) for v in want.values()] + [1e-30])
    worst = 0.0
    for rank in range(dims.world_size):
        coords = {str(a): v for a, v in dims.coords(rank).items()}
        for name, stacked in got.items():
            shard = shard_of(name, coords, sizes, layout)
            if shard is None:
                continue
            source = "embedding.word_embeddings" if shard.full_name == "output_layer.weight" else shard.full_name
            ref = shard.take(np.asarray(want[source]))
            worst = max(worst, float(np.abs(np.asarray(stacked[rank]) - ref).max()) / scale)
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for axis in ("pp", "dp", "tp"):
        parser.add_argument(f"--{axis}", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--tol", type=float, default=1e-5, help="allowed difference / max |single param|")
    args = parser.parse_args(argv)
    sizes, layout = Sizes(), Layout(args.pp, args.dp, args.tp)
    if sizes.layers % layout.pp or (sizes.layers // layout.pp) % sizes.moe_every or sizes.heads % layout.tp \
            or sizes.seq % layout.tp or sizes.experts % layout.ep or args.batch % layout.dp:
        parser.error(f"sizes do not divide for {layout}")

    single = GPT(sizes, Layout(), nnx.Rngs(args.seed))
    single_def, s_params, s_biases = nnx.split(single, nnx.Param, ExpertBias)
    rank_model = nnx.eval_shape(lambda: GPT(sizes, layout, nnx.Rngs(0)))
    rank_def, r_params_t, r_biases_t = nnx.split(rank_model, nnx.Param, ExpertBias)
    r_params = rank_states(to_flat(s_params), to_flat(r_params_t), sizes, layout)
    optimizer = make_optimizer(args.optimizer, args.lr)
    s_step = single_step(sizes, optimizer)
    d_init, d_step = sharded_step(sizes, layout, optimizer, rank_def, (r_params_t, r_biases_t))
    s_opt, r_opt = optimizer.init(s_params), d_init(r_params)

    dims, failed = layout.dims, False
    counted = np.array([dims.coords(r)["pp"] == layout.pp - 1 and dims.coords(r)["tp"] == 0
                        for r in range(dims.world_size)])
    print(f"mesh {dict(zip(make_meshes(dims).dense.axis_names, dims.dense_shape()))}, ep={layout.ep}, "
          f"optax.chain(jax_impl.finalize_gradients(...), {args.optimizer})")
    for step in range(args.steps):
        ids, labels, mask = global_batch(sizes, args.batch, args.seed, step)
        s_params, s_opt, s_biases, s_loss = s_step(single_def, s_params, s_opt, s_biases, ids, labels, mask)
        split_rows = lambda x: x.reshape(layout.dp, -1, *x.shape[1:])  # noqa: E731
        r_params, r_opt, r_biases, loss_sums = d_step(r_params, r_opt, split_rows(ids), split_rows(labels),
                                                      split_rows(mask))
        loss = float(np.asarray(loss_sums)[counted].sum() / mask.sum())
        param_err = compare(r_params, to_flat(s_params), layout, sizes)
        bias_err = compare(r_biases, to_flat(s_biases), layout, sizes)
        loss_err = abs(loss - float(s_loss)) / abs(float(s_loss))
        ok = param_err <= args.tol and bias_err == 0.0 and loss_err <= args.tol
        failed |= not ok
        print(f"step {step}: loss {loss:.6f} (single {float(s_loss):.6f}), param diff {param_err:.2e}, "
              f"expert bias diff {bias_err:.2e} {'ok' if ok else 'MISMATCH'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
