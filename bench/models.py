"""GPT-like model chunks for the benchmark: real ``nn.Module`` trees with Megatron's
parameter names and flags, one pipeline stage of a tensor-parallel rank.

Per layer (Megatron's local GPT layer spec, TP-sharded shapes): ``input_layernorm``
(weight, bias), ``self_attention.linear_qkv`` (weight, bias), ``self_attention.q_layernorm``
/ ``k_layernorm`` (weight), ``self_attention.linear_proj`` (weight, bias),
``pre_mlp_layernorm`` (weight, bias), ``mlp.linear_fc1`` / ``linear_fc2`` (weight, bias) --
or, with MoE, ``mlp.router`` (weight, ``expert_bias`` / ``local_tokens_per_expert``
buffers) and per local expert ``mlp.experts.local_experts.{e}.linear_fc1/2.weight``
(``allreduce=False``). Layernorms, the row-parallel biases and the router weight are
flagged ``sequence_parallel`` (Megatron sets it from ``config.sequence_parallel``), so with
sequence parallelism and qk-layernorm a 24-layer model has 8 non-TP gradients per layer
plus the final layernorm: 193, the count of the reference figure.

Large layouts: parameters can live on the ``meta`` device (no memory; finalization never
reads parameter values, only their gradients), and gradients in lazily committed buffers.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class Layout:
    """One benchmark layout.

    Args:
      name: label in the table.
      layers: transformer layers of the whole model (split evenly over pp stages).
      hidden: hidden size.
      tp: tensor-parallel size; pp: pipeline stages; dp: data-parallel size.
      vocab: vocabulary size (sharded over tp).
      moe_experts: experts per MoE layer (0 = dense MLP); experts are sharded over dp as
        expert parallelism (ep = dp, so the expert-DP group has size 1 here).
      ffn: MLP hidden size factor.
    """

    name: str
    layers: int
    hidden: int
    tp: int = 8
    pp: int = 2
    dp: int = 2
    vocab: int = 50304
    moe_experts: int = 0
    ffn: int = 4

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def heads(self) -> int:
        return max(self.hidden // 128, self.tp)


def _param(shape: tuple[int, ...], device: Any, dtype: torch.dtype, **flags: Any) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
    for name, value in flags.items():
        setattr(p, name, value)
    return p


class _Norm(nn.Module):
    def __init__(self, size: int, device: Any, dtype: torch.dtype, sp: bool, bias: bool = True) -> None:
        super().__init__()
        self.weight = _param((size,), device, dtype, sequence_parallel=sp)
        if bias:
            self.bias = _param((size,), device, dtype, sequence_parallel=sp)


class _Linear(nn.Module):
    def __init__(self, out: int, inp: int, device: Any, dtype: torch.dtype, *, row: bool, sp: bool, bias: bool = True, expert: bool = False) -> None:
        super().__init__()
        flags: dict[str, Any] = {"tensor_model_parallel": True}
        if expert:
            flags["allreduce"] = False
        self.weight = _param((out, inp), device, dtype, **flags)
        if bias:
            # Row-parallel biases are replicated over tp: Megatron flags them sequence_parallel.
            bias_flags = {"sequence_parallel": sp} if row else {"tensor_model_parallel": True}
            if expert:
                bias_flags["allreduce"] = False
            self.bias = _param((out,), device, dtype, **bias_flags)


class _Router(nn.Module):
    def __init__(self, experts: int, hidden: int, device: Any, dtype: torch.dtype, sp: bool) -> None:
        super().__init__()
        self.weight = _param((experts, hidden), device, dtype, sequence_parallel=sp)
        self.register_buffer("expert_bias", torch.zeros(experts))
        self.register_buffer("local_tokens_per_expert", torch.zeros(experts))


class _Attention(nn.Module):
    def __init__(self, lay: Layout, device: Any, dtype: torch.dtype, sp: bool) -> None:
        super().__init__()
        h, tp = lay.hidden, lay.tp
        head = h // lay.heads
        self.linear_qkv = _Linear(3 * h // tp, h, device, dtype, row=False, sp=sp)
        self.q_layernorm = _Norm(head, device, dtype, sp, bias=False)
        self.k_layernorm = _Norm(head, device, dtype, sp, bias=False)
        self.linear_proj = _Linear(h, h // tp, device, dtype, row=True, sp=sp)


class _MLP(nn.Module):
    def __init__(self, lay: Layout, device: Any, dtype: torch.dtype, sp: bool) -> None:
        super().__init__()
        h, f = lay.hidden, lay.ffn * lay.hidden // lay.tp
        if lay.moe_experts:
            self.router = _Router(lay.moe_experts, h, device, dtype, sp)
            local = nn.ModuleList()
            for _ in range(max(lay.moe_experts // lay.dp, 1)):
                expert = nn.Module()
                expert.linear_fc1 = _Linear(f, h, device, dtype, row=False, sp=sp, bias=False, expert=True)
                expert.linear_fc2 = _Linear(h, f, device, dtype, row=True, sp=sp, bias=False, expert=True)
                local.append(expert)
            self.experts = nn.Module()
            self.experts.local_experts = local
        else:
            self.linear_fc1 = _Linear(f, h, device, dtype, row=False, sp=sp)
            self.linear_fc2 = _Linear(h, f, device, dtype, row=True, sp=sp)


class _Layer(nn.Module):
    def __init__(self, lay: Layout, device: Any, dtype: torch.dtype, sp: bool) -> None:
        super().__init__()
        self.input_layernorm = _Norm(lay.hidden, device, dtype, sp)
        self.self_attention = _Attention(lay, device, dtype, sp)
        self.pre_mlp_layernorm = _Norm(lay.hidden, device, dtype, sp)
        self.mlp = _MLP(lay, device, dtype, sp)


class GPTChunk(nn.Module):
    """One pipeline stage of a GPT-like model on one tensor-parallel rank.

    Attributes Megatron's finalize reads: ``config``, ``ddp_config``, ``pre_process``,
    ``post_process``, ``share_embeddings_and_output_weights``,
    ``shared_embedding_or_output_weight()``.
    """

    def __init__(self, lay: Layout, stage: int, config: Any, ddp_config: Any, device: Any, dtype: torch.dtype) -> None:
        super().__init__()
        sp = bool(config.sequence_parallel)
        self.config = config
        self.ddp_config = ddp_config
        self.pre_process = stage == 0
        self.post_process = stage == lay.pp - 1
        self.share_embeddings_and_output_weights = True
        rows = lay.vocab // lay.tp
        if self.pre_process:
            self.embedding = nn.Module()
            self.embedding.word_embeddings = nn.Module()
            self.embedding.word_embeddings.weight = _param((rows, lay.hidden), device, dtype, tensor_model_parallel=True)
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList(_Layer(lay, device, dtype, sp) for _ in range(lay.layers // lay.pp))
        if self.post_process:
            self.decoder.final_layernorm = _Norm(lay.hidden, device, dtype, sp, bias=False)
            if not self.pre_process:
                self.output_layer = nn.Module()
                self.output_layer.weight = _param((rows, lay.hidden), device, dtype, tensor_model_parallel=True)

    def shared_embedding_or_output_weight(self) -> nn.Parameter | None:
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.output_layer.weight
        return None


def megatron_config(moe: bool) -> Any:
    """A duck-typed TransformerConfig with the fields both implementations read."""
    return types.SimpleNamespace(
        sequence_parallel=True,
        qk_layernorm=True,
        has_cond_embedder=False,
        calculate_per_token_loss=True,  # DP sync is a plain SUM: no compute on the big buffer
        timers=None,
        barrier_with_L1_time=False,
        mtp_num_layers=None,
        moe_router_enable_expert_bias=moe,
        moe_router_bias_update_rate=1e-3,
        moe_router_load_balancing_type="aux_loss",
        gtp_weight_remat_size=1,  # megatron-core 0.19's GTP remat fields: off
        expert_gtp_weight_remat_size=1,
    )


def ddp_config() -> Any:
    return types.SimpleNamespace(
        use_megatron_fsdp=False,
        use_distributed_optimizer=False,
        average_in_collective=False,
        grad_reduce_in_fp32=False,
        check_for_nan_in_grad=False,
    )


def build_chunk(lay: Layout, stage: int, *, meta: bool = True, dtype: torch.dtype = torch.float32) -> GPTChunk:
    """The chunk of pp ``stage``; parameters on ``meta`` (default) or the CPU."""
    return GPTChunk(lay, stage, megatron_config(bool(lay.moe_experts)), ddp_config(), "meta" if meta else "cpu", dtype)


def non_tp_params(chunk: nn.Module) -> list[nn.Parameter]:
    """Parameters whose gradients Megatron's non-TP step reduces (sequence parallel +
    qk-layernorm), in ``named_parameters`` order."""
    return [
        p
        for name, p in chunk.named_parameters()
        if p.requires_grad and (getattr(p, "sequence_parallel", False) or "q_layernorm" in name or "k_layernorm" in name)
    ]


def count_non_tp(chunk: nn.Module) -> int:
    """Gradients Megatron's non-TP step reduces (sequence parallel + qk-layernorm)."""
    return len(non_tp_params(chunk))


class _ScaleLayer(nn.Module):
    """A GPT layer reduced to what finalization touches at MoE scale: two SP layernorms
    (weight, bias), a router (SP weight, expert-bias buffers) and ``experts`` local
    experts of two ``allreduce=False`` weights each, held as TEGroupedMLP holds them (one
    module per projection, ``linear_fc1.weight{e}`` / ``linear_fc2.weight{e}``)."""

    def __init__(self, lay: Layout, device: Any, dtype: torch.dtype, sp: bool) -> None:
        super().__init__()
        h, f = lay.hidden, lay.ffn * lay.hidden // lay.tp
        self.input_layernorm = _Norm(h, device, dtype, sp)
        self.pre_mlp_layernorm = _Norm(h, device, dtype, sp)
        self.mlp = nn.Module()
        self.mlp.router = _Router(lay.moe_experts, h, device, dtype, sp)
        self.mlp.experts = nn.Module()
        for proj, shape in (("linear_fc1", (f, h)), ("linear_fc2", (h, f))):
            module = nn.Module()
            for e in range(lay.moe_experts):
                module.register_parameter(f"weight{e}", _param(shape, device, dtype, tensor_model_parallel=True, allreduce=False))
            setattr(self.mlp.experts, proj, module)


class MoEStack(nn.Module):
    """A whole decoder (pp = 1, no embedding) of ``lay.layers`` :class:`_ScaleLayer` s and a
    final SP layernorm, every expert local (expert parallelism 1): ``layers * (5 + 2 *
    experts) + 1`` parameters, ``5 * layers + 1`` of them non-TP gradients."""

    def __init__(self, lay: Layout, config: Any, ddp_config: Any, device: Any, dtype: torch.dtype) -> None:
        super().__init__()
        sp = bool(config.sequence_parallel)
        self.config = config
        self.ddp_config = ddp_config
        self.pre_process = self.post_process = True
        self.share_embeddings_and_output_weights = False
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList(_ScaleLayer(lay, device, dtype, sp) for _ in range(lay.layers))
        self.decoder.final_layernorm = _Norm(lay.hidden, device, dtype, sp, bias=False)

    def shared_embedding_or_output_weight(self) -> nn.Parameter | None:
        return None


def build_moe_stack(lay: Layout, *, expert_bias: bool = False, meta: bool = True, dtype: torch.dtype = torch.float32) -> MoEStack:
    """The MoE scale model of ``lay`` (``layers`` x ``moe_experts``).

    Args:
      expert_bias: ``moe_router_enable_expert_bias`` (the expert-bias update runs).
      meta: parameters on ``meta`` (default) or the CPU.
    """
    return MoEStack(lay, megatron_config(expert_bias), ddp_config(), "meta" if meta else "cpu", dtype)
