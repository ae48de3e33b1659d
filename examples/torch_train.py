"""Train a tiny GPT-like model with PP x DP x CP x TP(+SP) x EP on torch.distributed and
show that gradients finalized by ``torch_impl.finalize_model_grads`` equal the gradients
of the same model on one device.

The model is written with plain ``torch.distributed`` (no Megatron import) but follows
Megatron-Core's conventions, so that ``finalize_model_grads`` finds everything by the
same names and flags it would find in a Megatron ``GPTModel``:

* vocab-parallel word embedding, learned position embedding (``embedding.position_embeddings``,
  also reachable as ``chunk.position_embeddings``), tied with the output layer: the first
  stage's ``embedding.word_embeddings.weight`` and the last stage's ``output_layer.weight``
  are the two copies returned by ``shared_embedding_or_output_weight()``;
* column / row-parallel linears; with TP > 1 sequence parallelism is on: layernorm
  weights, row-parallel biases and the router weight carry ``sequence_parallel = True``;
* ``self_attention.q_layernorm`` / ``k_layernorm`` (qk_layernorm), applied per head;
* context parallelism by all-gathering keys and values over ``cp`` (contiguous chunks);
* every second layer is an MoE layer: a sigmoid top-k router with an ``expert_bias`` and a
  ``local_tokens_per_expert`` buffer (Megatron router conventions), experts spread over
  ``ep`` ranks (expert tensor parallelism 1, ``param.allreduce = False``) with an
  all-gather token dispatcher;
* a GPipe schedule (all forwards, then all backwards) over ``pp`` stages with send/recv;
* per-token loss (``calculate_per_token_loss``): each rank back-propagates the *sum* of
  its masked token losses; ``finalize_model_grads(..., num_tokens=...)`` divides by the
  global token count.

Launch (gloo on CPU, NCCL when CUDA is available)::

    torchrun --nproc-per-node 8 examples/torch_train.py --pp 2 --dp 2 --cp 1 --tp 2 --ep 2 \\
        --steps 3 --dump dist.pt
    python examples/torch_train.py --single --steps 3 --dump single.pt

Both dumps hold, per step, the (finalized) gradient of every full, unsharded parameter, the
loss and every router's expert bias after the step; ``tests/test_examples.py`` compares them.
In ``--single`` mode nothing from ``torch_impl`` is used: the reference is plain autograd on
``sum(token losses) / total tokens`` and a hand-written expert-bias update.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from meshgrad import ParallelDims  # noqa: E402

Group = dist.ProcessGroup | None

# --------------------------------------------------------------------------- config


@dataclasses.dataclass
class TransformerConfig:
    """Model sizes plus the Megatron ``TransformerConfig`` fields finalization reads."""

    vocab_size: int = 64
    hidden_size: int = 16
    num_attention_heads: int = 4
    ffn_hidden_size: int = 32
    num_layers: int = 4
    seq_length: int = 16
    num_moe_experts: int = 4
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 16
    moe_layer_freq: int = 2  # layers with index % freq == freq - 1 are MoE layers
    # finalization options (Megatron names)
    sequence_parallel: bool = False
    qk_layernorm: bool = True
    calculate_per_token_loss: bool = True
    moe_router_enable_expert_bias: bool = True
    moe_router_bias_update_rate: float = 1e-2
    moe_router_load_balancing_type: str = "none"
    moe_router_score_function: str = "sigmoid"
    share_embeddings_and_output_weights: bool = True
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def is_moe_layer(self, layer: int) -> bool:
        return layer % self.moe_layer_freq == self.moe_layer_freq - 1


@dataclasses.dataclass
class Parallel:
    """This rank's place in the grid and the groups the model itself communicates over.

    All sizes 1 and all groups None is the single-device model.
    """

    dims: ParallelDims = dataclasses.field(default_factory=ParallelDims)
    rank: int = 0
    tp_group: Group = None
    cp_group: Group = None
    ep_group: Group = None
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))

    def coord(self, axis: str) -> int:
        return self.dims.coords(self.rank)[axis]  # type: ignore[index]

    @property
    def stage(self) -> int:
        return self.coord("pp")

    @property
    def first_stage(self) -> bool:
        return self.stage == 0

    @property
    def last_stage(self) -> bool:
        return self.stage == self.dims.pp - 1

    def stage_rank(self, stage: int) -> int:
        """Global rank at the same dp/cp/tp coordinates on pipeline stage ``stage``."""
        coords = {a: self.coord(a) for a in ("dp", "cp", "tp")}
        return self.dims.rank_of({**coords, "pp": stage})


# --------------------------------------------------------------------------- collectives


def _size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _all_gather(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim)


def _reduce_scatter(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Sum over the group, keep this rank's slice (all_reduce + slice: gloo has no
    reduce_scatter)."""
    total = x.contiguous().clone()
    dist.all_reduce(total, group=group)
    return total.chunk(_size(group), dim)[_rank(group)].contiguous()


def _split(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    return x.chunk(_size(group), dim)[_rank(group)].contiguous()


class _Gather(torch.autograd.Function):
    """Forward all-gather along ``dim``; backward reduce-scatter (every rank used it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter(grad, ctx.group, ctx.dim), None, None


class _ReduceScatter(torch.autograd.Function):
    """Forward sum over the group and keep this rank's slice; backward all-gather."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(grad, ctx.group, ctx.dim), None, None


class _Split(torch.autograd.Function):
    """Forward keep this rank's slice of a replicated tensor; backward all-gather."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _split(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(grad, ctx.group, ctx.dim), None, None


class _AllReduce(torch.autograd.Function):
    """Forward sum of partial results; backward identity (the sum is used replicated)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def gather(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    return x if _size(group) == 1 else _Gather.apply(x, group, dim)


def reduce_scatter(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    return x if _size(group) == 1 else _ReduceScatter.apply(x, group, dim)


def split(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    return x if _size(group) == 1 else _Split.apply(x, group, dim)


def all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if _size(group) == 1 else _AllReduce.apply(x, group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy of logits split over the vocabulary (Megatron's)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: Group) -> torch.Tensor:
        shard = logits.shape[-1]
        start = _rank(group) * shard
        logits_max = logits.max(-1).values
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max[:, None]
        in_shard = (target >= start) & (target < start + shard)
        local_target = (target - start).clamp(0, shard - 1)
        predicted = shifted.gather(1, local_target[:, None]).squeeze(1) * in_shard
        dist.all_reduce(predicted, group=group)
        exp = shifted.exp()
        sum_exp = exp.sum(-1)
        dist.all_reduce(sum_exp, group=group)
        ctx.save_for_backward(exp / sum_exp[:, None], in_shard, local_target)
        return sum_exp.log() - predicted

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, in_shard, local_target = ctx.saved_tensors
        grad_logits = softmax.clone()
        rows = torch.arange(grad_logits.shape[0], device=grad_logits.device)
        grad_logits[rows, local_target] -= in_shard.to(grad_logits.dtype)
        return grad_logits * grad[:, None], None, None


def token_losses(logits: torch.Tensor, target: torch.Tensor, group: Group) -> torch.Tensor:
    """Cross entropy per token; ``logits`` [N, V / tp] are this rank's vocabulary shard."""
    if _size(group) == 1:
        return F.cross_entropy(logits, target, reduction="none")
    return _VocabParallelCrossEntropy.apply(logits, target, group)


# --------------------------------------------------------------------------- layers


def _flag(module: nn.Module, **flags: bool) -> None:
    for p in module.parameters():
        for name, value in flags.items():
            setattr(p, name, value)


class LayerNorm(nn.LayerNorm):
    """A layernorm whose parameters are flagged ``sequence_parallel`` when SP is on."""

    def __init__(self, size: int, sequence_parallel: bool) -> None:
        super().__init__(size)
        _flag(self, sequence_parallel=sequence_parallel)


class ColumnParallelLinear(nn.Module):
    """Output features split over tp; with SP the sequence-sharded input is all-gathered."""

    def __init__(self, in_features: int, out_features: int, par: Parallel, bias: bool = True) -> None:
        super().__init__()
        tp = par.dims.tp
        self.group = par.tp_group
        self.weight = nn.Parameter(torch.empty(out_features // tp, in_features))
        self.bias = nn.Parameter(torch.empty(out_features // tp)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(gather(x, self.group, 1), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Input features split over tp; the partial outputs are reduce-scattered over the
    sequence (SP), then the bias (flagged ``sequence_parallel``) is added."""

    def __init__(self, in_features: int, out_features: int, par: Parallel, bias: bool = True) -> None:
        super().__init__()
        self.group = par.tp_group
        self.weight = nn.Parameter(torch.empty(out_features, in_features // par.dims.tp))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        if self.bias is not None:
            self.bias.sequence_parallel = par.dims.tp > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = reduce_scatter(F.linear(x, self.weight), self.group, 1)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows of the vocabulary split over tp; partial lookups summed over tp."""

    def __init__(self, vocab: int, hidden: int, par: Parallel) -> None:
        super().__init__()
        self.group = par.tp_group
        self.weight = nn.Parameter(torch.empty(vocab // par.dims.tp, hidden))
        self.start = _rank(par.tp_group) * (vocab // par.dims.tp)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return all_reduce(out * (~outside)[..., None].to(out.dtype), self.group)


class LanguageModelEmbedding(nn.Module):
    """Word + learned position embedding, then scattered over tp along the sequence."""

    def __init__(self, config: TransformerConfig, par: Parallel) -> None:
        super().__init__()
        self.par = par
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size, par)
        self.position_embeddings = nn.Embedding(config.seq_length, config.hidden_size)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.word_embeddings(ids) + self.position_embeddings(positions)[None]
        return split(out, self.par.tp_group, 1)


class SelfAttention(nn.Module):
    """Causal attention; heads split over tp, keys/values all-gathered over cp."""

    def __init__(self, config: TransformerConfig, par: Parallel) -> None:
        super().__init__()
        self.par = par
        self.head_dim = config.head_dim
        h = config.hidden_size
        # Full weight rows are ordered [head, (q, k, v), head_dim]: a tp slice is whole heads.
        self.linear_qkv = ColumnParallelLinear(h, 3 * h, par)
        self.q_layernorm = nn.LayerNorm(self.head_dim)
        self.k_layernorm = nn.LayerNorm(self.head_dim)
        self.linear_proj = RowParallelLinear(h, h, par)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.linear_qkv(x)
        b, s, _ = qkv.shape
        q, k, v = qkv.view(b, s, -1, 3, self.head_dim).unbind(3)
        q, k = self.q_layernorm(q), self.k_layernorm(k)
        k = gather(k, self.par.cp_group, 1)
        v = gather(v, self.par.cp_group, 1)
        q_pos = self.par.coord("cp") * s + torch.arange(s, device=x.device)
        k_pos = torch.arange(k.shape[1], device=x.device)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
        return self.linear_proj(out.reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, config: TransformerConfig, par: Parallel) -> None:
        super().__init__()
        self.linear_fc1 = ColumnParallelLinear(config.hidden_size, config.ffn_hidden_size, par)
        self.linear_fc2 = RowParallelLinear(config.ffn_hidden_size, config.hidden_size, par)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class TopKRouter(nn.Module):
    """Sigmoid top-k router with an expert bias (aux-loss-free load balancing).

    The bias only shifts which experts are chosen; ``local_tokens_per_expert`` counts this
    rank's routed tokens until ``finalize_model_grads`` updates the bias and resets it.
    """

    def __init__(self, config: TransformerConfig, par: Parallel) -> None:
        super().__init__()
        self.topk = config.moe_router_topk
        self.weight = nn.Parameter(torch.empty(config.num_moe_experts, config.hidden_size))
        self.weight.sequence_parallel = par.dims.tp > 1  # tokens are sequence-sharded
        self.enable_expert_bias = config.moe_router_enable_expert_bias
        self.register_buffer("expert_bias", torch.zeros(config.num_moe_experts))
        self.register_buffer("local_tokens_per_expert", torch.zeros(config.num_moe_experts))

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(F.linear(tokens, self.weight))
        _, top = torch.topk(scores + self.expert_bias, self.topk, dim=-1)
        chosen = scores.gather(1, top)
        chosen = chosen / (chosen.sum(-1, keepdim=True) + 1e-20)
        probs = torch.zeros_like(scores).scatter(1, top, chosen)
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, top, True)
        if self.training and torch.is_grad_enabled():
            with torch.no_grad():
                self.local_tokens_per_expert += routing_map.sum(0).to(self.local_tokens_per_expert.dtype)
        return probs, routing_map


class Expert(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.moe_ffn_hidden_size, bias=False)
        self.linear_fc2 = nn.Linear(config.moe_ffn_hidden_size, config.hidden_size, bias=False)
        _flag(self, allreduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Experts(nn.Module):
    def __init__(self, config: TransformerConfig, count: int) -> None:
        super().__init__()
        self.local_experts = nn.ModuleList(Expert(config) for _ in range(count))


class MoELayer(nn.Module):
    """Router + experts over ``ep`` ranks with an all-gather token dispatcher: every rank of
    the ep group sees all the group's tokens, runs its own experts on those routed to them,
    and the partial outputs are reduce-scattered back to the tokens' owners."""

    def __init__(self, config: TransformerConfig, par: Parallel) -> None:
        super().__init__()
        self.group = par.ep_group
        local = config.num_moe_experts // par.dims.ep
        self.first_expert = par.coord("ep") * local
        self.router = TopKRouter(config, par)
        self.experts = Experts(config, local)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probs, routing_map = self.router(tokens)
        tokens = gather(tokens, self.group, 0)
        probs = gather(probs, self.group, 0)
        if _size(self.group) > 1:
            routing_map = _all_gather(routing_map.to(torch.uint8), self.group, 0).bool()
        out = torch.zeros_like(tokens)
        for j, expert in enumerate(self.experts.local_experts):
            e = self.first_expert + j
            idx = routing_map[:, e].nonzero().squeeze(1)
            out = out.index_add(0, idx, expert(tokens[idx]) * probs[idx, e, None])
        return reduce_scatter(out, self.group, 0).view_as(x)


class TransformerLayer(nn.Module):
    def __init__(self, config: TransformerConfig, par: Parallel, layer_number: int) -> None:
        super().__init__()
        sp = par.dims.tp > 1
        self.layer_number = layer_number
        self.input_layernorm = LayerNorm(config.hidden_size, sp)
        self.self_attention = SelfAttention(config, par)
        self.pre_mlp_layernorm = LayerNorm(config.hidden_size, sp)
        self.mlp = MoELayer(config, par) if config.is_moe_layer(layer_number) else MLP(config, par)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.pre_mlp_layernorm(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: TransformerConfig, par: Parallel, post_process: bool) -> None:
        super().__init__()
        per_stage = config.num_layers // par.dims.pp
        first = par.stage * per_stage
        self.layers = nn.ModuleList(TransformerLayer(config, par, first + i) for i in range(per_stage))
        self.final_layernorm = LayerNorm(config.hidden_size, par.dims.tp > 1) if post_process else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x if self.final_layernorm is None else self.final_layernorm(x)


class GPTChunk(nn.Module):
    """This rank's pipeline stage of the model (a Megatron ``GPTModel`` chunk).

    ``forward`` takes token ids (first stage) or the previous stage's hidden states
    [b, s / (cp*tp), h] and returns hidden states, or per-token losses [b, s / cp] on the
    last stage.
    """

    def __init__(self, config: TransformerConfig, par: Parallel) -> None:
        super().__init__()
        self.config = config
        self.par = par
        self.pre_process = par.first_stage
        self.post_process = par.last_stage
        self.share_embeddings_and_output_weights = config.share_embeddings_and_output_weights
        if self.pre_process:
            self.embedding = LanguageModelEmbedding(config, par)
        self.decoder = TransformerBlock(config, par, self.post_process)
        if self.post_process and not self.pre_process:
            self.output_layer = ColumnParallelLinear(config.hidden_size, config.vocab_size, par, bias=False)

    @property
    def position_embeddings(self) -> nn.Embedding:
        """The learned position embedding (first stage only)."""
        if not self.pre_process:
            raise AttributeError("position_embeddings live on the first pipeline stage")
        return self.embedding.position_embeddings

    def shared_embedding_or_output_weight(self) -> nn.Parameter | None:
        """The tied word-embedding copy of this stage (None on middle stages)."""
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.output_layer.weight
        return None

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if self.pre_process:
            s = x.shape[1]
            positions = self.par.coord("cp") * s + torch.arange(s, device=x.device)
            x = self.embedding(x, positions)
        x = self.decoder(x)
        if not self.post_process:
            return x
        x = gather(x, self.par.tp_group, 1)
        weight = self.shared_embedding_or_output_weight()
        if weight is None:
            raise RuntimeError("the last stage has no output weight")
        logits = F.linear(x, weight)
        if labels is None:
            raise ValueError("the last pipeline stage needs labels")
        return token_losses(logits.flatten(0, 1), labels.flatten(), self.par.tp_group).view(labels.shape)


# --------------------------------------------------------------------------- sharding


@dataclasses.dataclass(frozen=True)
class Shard:
    """Where a local tensor sits in its full tensor: ``full_name``, split along ``dim``
    into ``parts`` with this one at ``index`` (``dim`` None: a whole replica)."""

    full_name: str
    dim: int | None = None
    parts: int = 1
    index: int = 0

    def take(self, full: torch.Tensor) -> torch.Tensor:
        return full if self.dim is None else full.chunk(self.parts, self.dim)[self.index]


def shard_layout(chunk: GPTChunk) -> dict[str, Shard]:
    """Local parameter / buffer name -> its place in the single-device model."""
    par = chunk.par
    tp, tp_rank = par.dims.tp, par.coord("tp")
    per_stage = chunk.config.num_layers // par.dims.pp
    out: dict[str, Shard] = {}
    names = [n for n, _ in chunk.named_parameters()] + [n for n, _ in chunk.named_buffers()]
    for name in names:
        parts = name.split(".")
        if parts[:2] == ["decoder", "layers"]:
            parts[2] = str(par.stage * per_stage + int(parts[2]))
        if "local_experts" in parts:
            i = parts.index("local_experts") + 1
            module = chunk.get_submodule(".".join(name.split(".")[: parts.index("experts")]))
            parts[i] = str(module.first_expert + int(parts[i]))
        full = ".".join(parts)
        if full == "output_layer.weight":
            out[name] = Shard(full, 0, tp, tp_rank)
        elif name.endswith(("word_embeddings.weight", "linear_qkv.weight", "linear_qkv.bias",
                            "linear_fc1.weight", "linear_fc1.bias")) and "local_experts" not in name:
            out[name] = Shard(full, 0, tp, tp_rank)
        elif name.endswith(("linear_proj.weight", "linear_fc2.weight")) and "local_experts" not in name:
            out[name] = Shard(full, 1, tp, tp_rank)
        else:
            out[name] = Shard(full)
    return out


def init_full_model(config: TransformerConfig, seed: int) -> dict[str, torch.Tensor]:
    """Initialise the single-device model from ``seed``; return its full state."""
    model = GPTChunk(config, Parallel())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return {k: v.clone() for k, v in model.state_dict().items()}


def load_shards(chunk: GPTChunk, full: dict[str, torch.Tensor]) -> None:
    """Copy this rank's slices of the single-device state into ``chunk``."""
    state = chunk.state_dict()
    with torch.no_grad():
        for name, shard in shard_layout(chunk).items():
            source = "embedding.word_embeddings.weight" if shard.full_name == "output_layer.weight" else shard.full_name
            state[name].copy_(shard.take(full[source]))


# --------------------------------------------------------------------------- data


@dataclasses.dataclass(frozen=True)
class Batch:
    ids: torch.Tensor  # [B, S]
    labels: torch.Tensor  # [B, S]
    mask: torch.Tensor  # [B, S], 1.0 where the token's loss counts

    def shard(self, rows: slice, cols: slice) -> "Batch":
        return Batch(self.ids[rows, cols], self.labels[rows, cols], self.mask[rows, cols])

    def to(self, device: torch.device, dtype: torch.dtype) -> "Batch":
        return Batch(self.ids.to(device), self.labels.to(device), self.mask.to(device, dtype))


def global_batch(config: TransformerConfig, batch_size: int, seed: int, step: int) -> Batch:
    """The step's global batch; identical on every rank and in ``--single`` mode."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.randint(config.vocab_size, (batch_size, config.seq_length + 1), generator=gen)
    mask = (torch.rand(batch_size, config.seq_length, generator=gen) < 0.8).float()
    return Batch(tokens[:, :-1], tokens[:, 1:], mask)


def local_microbatches(batch: Batch, par: Parallel, microbatches: int) -> list[Batch]:
    """This rank's dp rows and cp columns, split into micro-batches."""
    dims = par.dims
    rows = batch.ids.shape[0] // dims.dp
    cols = batch.ids.shape[1] // dims.cp
    dp, cp = par.coord("dp"), par.coord("cp")
    mine = batch.shard(slice(dp * rows, (dp + 1) * rows), slice(cp * cols, (cp + 1) * cols))
    size = rows // microbatches
    return [mine.shard(slice(m * size, (m + 1) * size), slice(None)) for m in range(microbatches)]


# --------------------------------------------------------------------------- training


def routers(model: nn.Module) -> Iterator[tuple[str, TopKRouter]]:
    for name, module in model.named_modules():
        if isinstance(module, TopKRouter):
            yield name, module


def pipeline_step(chunk: GPTChunk, micro: list[Batch]) -> torch.Tensor:
    """GPipe: all forwards, then all backwards, with send/recv between stages.

    Gradients accumulate in ``param.main_grad`` (float32, or float64 for a float64 model).
    Returns the sum of this rank's masked token losses (zero off the last stage).
    """
    par = chunk.par
    shape = (micro[0].ids.shape[0], micro[0].ids.shape[1] // par.dims.tp, chunk.config.hidden_size)
    dtype = micro[0].mask.dtype
    inputs, outputs = [], []
    loss_sum = torch.zeros((), device=par.device, dtype=dtype)
    for mb in micro:
        if par.first_stage:
            x = mb.ids
        else:
            x = torch.empty(shape, device=par.device, dtype=dtype)
            dist.recv(x, par.stage_rank(par.stage - 1))
            x.requires_grad_()
        out = chunk(x, mb.labels if par.last_stage else None)
        if par.last_stage:
            out = (out * mb.mask).sum()
            loss_sum += out.detach()
        else:
            dist.send(out.detach().contiguous(), par.stage_rank(par.stage + 1))
        inputs.append(x)
        outputs.append(out)
    for x, out in zip(inputs, outputs):
        if par.last_stage:
            out.backward()
        else:
            grad = torch.empty_like(out)
            dist.recv(grad, par.stage_rank(par.stage + 1))
            out.backward(grad)
        if not par.first_stage:
            dist.send(x.grad.contiguous(), par.stage_rank(par.stage - 1))
    for p in chunk.parameters():
        if p.grad is not None:
            p.main_grad += p.grad.to(p.main_grad.dtype)
            p.grad = None
    return loss_sum


def expert_bias_reference(router: TopKRouter, rate: float) -> None:
    """The expert_bias and reset steps (docs/semantics.md) on one device: sign update of the
    bias, then zero the counts."""
    tokens = router.local_tokens_per_expert
    router.expert_bias += rate * torch.sign(tokens.mean() - tokens)
    tokens.zero_()


def collect(chunk: GPTChunk, grads: bool) -> list[tuple[Shard, torch.Tensor]]:
    """(shard, CPU tensor) of every parameter's gradient (``grads``) or every router's
    expert bias."""
    layout = shard_layout(chunk)
    if grads:
        items = [(n, p.main_grad) for n, p in chunk.named_parameters()]
    else:
        items = [(f"{n}.expert_bias", r.expert_bias) for n, r in routers(chunk)]
    return [(layout[n], t.detach().cpu().clone()) for n, t in items]


def assemble(pieces: list[tuple[Shard, torch.Tensor]], tied: bool = True) -> tuple[dict[str, torch.Tensor], float]:
    """Full tensors from every rank's shards; also the largest difference between copies of
    one shard held by several ranks (replicas must agree after finalization)."""
    by_name: dict[str, dict[int, torch.Tensor]] = {}
    spec: dict[str, Shard] = {}
    worst = 0.0
    for shard, tensor in pieces:
        slots = by_name.setdefault(shard.full_name, {})
        spec[shard.full_name] = shard
        if shard.index in slots:
            worst = max(worst, (slots[shard.index] - tensor).abs().max().item())
        else:
            slots[shard.index] = tensor
    out = {}
    for name, slots in by_name.items():
        shard = spec[name]
        if sorted(slots) != list(range(shard.parts)):
            raise RuntimeError(f"{name}: got shards {sorted(slots)} of {shard.parts}")
        out[name] = slots[0] if shard.dim is None else torch.cat([slots[i] for i in range(shard.parts)], shard.dim)
    if tied and "output_layer.weight" not in out:  # tied and on one stage: one tensor, two names
        out["output_layer.weight"] = out["embedding.word_embeddings.weight"]
    return out, worst


def setup_distributed(args: argparse.Namespace) -> tuple[Parallel, Any]:
    """Initialise torch.distributed (NCCL with CUDA, else gloo); return this rank's
    Parallel and the dense DeviceMesh ("pp", "dp", "cp", "tp") for finalize_model_grads."""
    from torch.distributed.device_mesh import init_device_mesh

    dims = ParallelDims(pp=args.pp, dp=args.dp, cp=args.cp, tp=args.tp, ep=args.ep, etp=1)
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank()
    if dims.world_size != dist.get_world_size():
        raise SystemExit(f"pp*dp*cp*tp = {dims.world_size} but the world has {dist.get_world_size()} ranks")
    device = torch.device("cpu")
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (dims.pp, dims.dp, dims.cp, dims.tp), mesh_dim_names=("pp", "dp", "cp", "tp"))
    # The model's own expert-parallel group (finalize derives edp from the config's ep).
    experts = init_device_mesh(device.type, (dims.pp, dims.edp, dims.ep), mesh_dim_names=("pp", "edp", "ep"))
    par = Parallel(dims, rank, mesh.get_group("tp"), mesh.get_group("cp"), experts.get_group("ep"), device)
    for axis in ("pp", "dp", "cp", "tp"):
        if mesh.get_local_rank(axis) != par.coord(axis):
            raise RuntimeError(f"rank {rank}: DeviceMesh {axis} coordinate differs from meshgrad's rank order")
    return par, mesh


def cast_model(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Move to ``dtype``; router buffers stay float32 (as in Megatron)."""
    model.to(device=device, dtype=dtype)
    for _, router in routers(model):
        router.expert_bias.data = router.expert_bias.float()
        router.local_tokens_per_expert.data = router.local_tokens_per_expert.float()


def run_distributed(args: argparse.Namespace, config: TransformerConfig) -> dict[str, Any] | None:
    """Train on the torchrun world; rank 0 returns the dump."""
    from torch_impl import finalize_model_grads

    par, mesh = setup_distributed(args)
    dtype = getattr(torch, args.dtype)
    chunk = GPTChunk(config, par)
    load_shards(chunk, init_full_model(config, args.seed))
    cast_model(chunk, dtype, par.device)
    chunk.train()
    for p in chunk.parameters():
        p.main_grad = torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32))

    dump: dict[str, Any] = {"losses": [], "grads": [], "expert_bias": [], "replica_diff": []}
    for step in range(args.steps):
        batch = global_batch(config, args.batch, args.seed, step)
        micro = [mb.to(par.device, dtype) for mb in local_microbatches(batch, par, args.microbatches)]
        for p in chunk.parameters():
            p.main_grad.zero_()
        loss_sum = pipeline_step(chunk, micro)
        num_tokens = torch.stack([mb.mask.sum() for mb in micro]).sum().to(torch.int64)
        if args.audit is not None and step == 0:  # record this step for `python -m parity_tests audit DIR`
            from torch_impl import audit

            with audit.record(args.audit, sample=64, finalize=finalize_model_grads) as audited:
                audited([chunk], num_tokens=num_tokens, pg_collection=mesh)
        else:
            finalize_model_grads([chunk], num_tokens=num_tokens, pg_collection=mesh)

        # The step's loss: each last-stage (dp, cp) shard's sum once (tp rank 0), / all tokens.
        counted = loss_sum if par.last_stage and par.coord("tp") == 0 else torch.zeros_like(loss_sum)
        dist.all_reduce(counted)
        loss = counted.item() / batch.mask.sum().item()
        grads = collect(chunk, grads=True)
        with torch.no_grad():
            for p in chunk.parameters():
                p -= args.lr * p.main_grad.to(p.dtype)
        biases = collect(chunk, grads=False)
        gathered: list[Any] | None = [None] * dist.get_world_size() if par.rank == 0 else None
        dist.gather_object((grads, biases), gathered, dst=0)
        if gathered is not None:
            full_grads, grad_diff = assemble([x for g, _ in gathered for x in g])
            full_biases, bias_diff = assemble([x for _, b in gathered for x in b], tied=False)
            dump["losses"].append(loss)
            dump["grads"].append(full_grads)
            dump["expert_bias"].append(full_biases)
            dump["replica_diff"].append(max(grad_diff, bias_diff))
            print(f"step {step}: loss {loss:.6f} replica diff {dump['replica_diff'][-1]:.3g}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return dump if par.rank == 0 else None


def run_single(args: argparse.Namespace, config: TransformerConfig) -> dict[str, Any]:
    """The same model, unsharded, in this process: the reference."""
    model = GPTChunk(config, Parallel())
    model.load_state_dict(init_full_model(config, args.seed))
    cast_model(model, getattr(torch, args.dtype), torch.device("cpu"))
    model.train()
    dump: dict[str, Any] = {"losses": [], "grads": [], "expert_bias": [], "replica_diff": []}
    for step in range(args.steps):
        batch = global_batch(config, args.batch, args.seed, step).to(torch.device("cpu"), getattr(torch, args.dtype))
        model.zero_grad(set_to_none=True)
        total = batch.mask.sum()
        loss = (model(batch.ids, batch.labels) * batch.mask).sum() / total
        loss.backward()
        grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
                 for n, p in model.named_parameters()}
        grads["output_layer.weight"] = grads["embedding.word_embeddings.weight"]
        for _, router in routers(model):
            expert_bias_reference(router, config.moe_router_bias_update_rate)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p -= args.lr * grads[n]
        dump["losses"].append(loss.item())
        dump["grads"].append(grads)
        dump["expert_bias"].append({f"{n}.expert_bias": r.expert_bias.clone() for n, r in routers(model)})
        dump["replica_diff"].append(0.0)
        print(f"step {step}: loss {loss.item():.6f}", flush=True)
    return dump


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for axis in ("pp", "dp", "cp", "tp", "ep"):
        parser.add_argument(f"--{axis}", type=int, default=1, help=f"{axis} size")
    parser.add_argument("--single", action="store_true", help="unsharded reference in one process")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="global batch size (sequences)")
    parser.add_argument("--microbatches", type=int, default=2, help="micro-batches per dp rank")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32", help="model dtype")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--dump", type=Path, help="write losses, finalized grads, expert biases here")
    parser.add_argument("--audit", type=Path, help="record step 0's finalize on every rank into this directory")
    return parser.parse_args(argv)


def make_config(args: argparse.Namespace) -> TransformerConfig:
    tp = 1 if args.single else args.tp
    config = TransformerConfig(
        num_layers=args.layers,
        seq_length=args.seq,
        sequence_parallel=tp > 1,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1 if args.single else args.pp,
        context_parallel_size=1 if args.single else args.cp,
        expert_model_parallel_size=1 if args.single else args.ep,
    )
    checks = {
        "num_layers % pp": config.num_layers % config.pipeline_model_parallel_size,
        "heads % tp": config.num_attention_heads % tp,
        "vocab % tp": config.vocab_size % tp,
        "ffn % tp": config.ffn_hidden_size % tp,
        "seq % (cp*tp)": config.seq_length % (config.context_parallel_size * tp),
        "experts % ep": config.num_moe_experts % config.expert_model_parallel_size,
        "batch % (dp*microbatches)": args.batch % ((1 if args.single else args.dp) * args.microbatches),
    }
    bad = [k for k, v in checks.items() if v]
    if bad:
        raise SystemExit(f"sizes do not divide: {', '.join(bad)}")
    return config


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = make_config(args)
    torch.manual_seed(args.seed)
    dump = run_single(args, config) if args.single else run_distributed(args, config)
    if dump is not None and args.dump is not None:
        dump["args"] = vars(args) | {"dump": str(args.dump)}
        torch.save(dump, args.dump)


if __name__ == "__main__":
    main()
