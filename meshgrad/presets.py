"""Model descriptions for ``python -m meshgrad explain``: Megatron-named parameter specs
per pipeline stage, from a size preset or from a JSON list, without building a model.

A preset names its parameters as Megatron-Core's GPT model with the Transformer Engine
layer spec does (``decoder.layers.{i}.self_attention.linear_qkv.weight``, layer numbers
local to each chunk, RMSNorm weights fused into the following linear as
``layer_norm_weight``) and sets the flags Megatron sets (:mod:`torch_impl.sources.discover`
reads the same attributes from a real model):

* norm weights and the MoE router weight are replicated over tp: ``sequence_parallel``;
* MoE expert weights (``TEGroupedMLP``: ``mlp.experts.linear_fc1.weight{e}``) are
  ``allreduce=False``: ``expert``;
* with tied embeddings the output layer of the last stage and the word embedding of the
  first are the word-embedding role (``shared_embedding_or_output_weight``);
* a learned position embedding (``max_positions > 0``) is the position-embedding role;
* with gtp > 1 the tensor-parallel linear weights are ``is_gtp_weight_remat``.

Shapes are one rank's shards: tp splits attention heads, the MLP hidden size and the
(padded) vocabulary; ep splits the experts, etp the expert MLP hidden size.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from meshgrad.errors import FinalizeInputError
from meshgrad.params import ParamSpec, Role, RouterSpec

#: Megatron pads the vocabulary to a multiple of this times tp (``make_vocab_size_divisible_by``).
VOCAB_DIVISOR = 128


@dataclasses.dataclass(frozen=True)
class ModelPreset:
    """A GPT-style model's sizes (Megatron ``TransformerConfig`` names in brackets).

    Args:
      name: the preset's name.
      layers: transformer layers [num_layers].
      hidden: hidden size [hidden_size].
      ffn: MLP hidden size [ffn_hidden_size] (per expert for MoE [moe_ffn_hidden_size]).
      heads: attention heads [num_attention_heads].
      kv_heads: key/value heads [num_query_groups] (GQA; = heads for MHA).
      vocab: vocabulary size before padding.
      experts: experts per layer (0: a dense MLP) [num_moe_experts].
      swiglu: gated MLP (fc1 is twice as tall) [gated_linear_unit].
      tied: input and output embeddings tied [share_embeddings_and_output_weights].
      qk_layernorm: q / k layernorms [qk_layernorm].
      max_positions: rows of a learned position embedding (0: rotary, none).
      grad_dtype: the gradient dtype (Megatron's ``main_grad`` is float32 under bf16).
      expert_bias: routers keep an expert bias [moe_router_enable_expert_bias].
    """

    name: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    experts: int = 0
    swiglu: bool = True
    tied: bool = False
    qk_layernorm: bool = False
    max_positions: int = 0
    grad_dtype: str = "float32"
    expert_bias: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def total_params(self) -> int:
        """Parameters of the whole model (unsharded, unpadded vocabulary)."""
        h, d = self.hidden, self.head_dim
        attn = h * (self.heads + 2 * self.kv_heads) * d + self.heads * d * h + h
        fc1 = (2 if self.swiglu else 1) * self.ffn * h
        mlp = (self.experts or 1) * (fc1 + self.ffn * h) + h + (self.experts * h if self.experts else 0)
        qk = 2 * d if self.qk_layernorm else 0
        embed = self.vocab * h * (1 if self.tied else 2) + self.max_positions * h
        return self.layers * (attn + mlp + qk) + embed + h

    def active_params(self, top_k: int = 2) -> int:
        """Parameters one token passes through (MoE: ``top_k`` experts; the compute estimate)."""
        if not self.experts:
            return self.total_params()
        fc = ((2 if self.swiglu else 1) + 1) * self.ffn * self.hidden
        return self.total_params() - self.layers * (self.experts - min(top_k, self.experts)) * fc


#: Size presets: Llama-3-shaped dense GPTs and a Mixtral-shaped MoE (public model cards).
PRESETS: Mapping[str, ModelPreset] = {
    "gpt-8b": ModelPreset("gpt-8b", layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256),
    "gpt-70b": ModelPreset("gpt-70b", layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8, vocab=128256),
    "moe-8x7b": ModelPreset(
        "moe-8x7b", layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=32000, experts=8, expert_bias=True
    ),
    # A toy of every feature (tied + learned positions + qk layernorm + MoE), for tests and docs.
    "tiny": ModelPreset(
        "tiny", layers=4, hidden=16, ffn=32, heads=4, kv_heads=2, vocab=96, experts=4, tied=True,
        qk_layernorm=True, max_positions=8, expert_bias=True,
    ),
}


@dataclasses.dataclass(frozen=True)
class StageModel:
    """One pp stage's parameters and routers (every chunk it holds), as one rank plans them."""

    params: tuple[ParamSpec, ...]
    routers: tuple[RouterSpec, ...]


def _div(value: int, by: int, what: str) -> int:
    """``value // by``; ``what`` names them, ``"heads / tp"``."""
    if value % by:
        top, bottom = what.split(" / ")
        raise FinalizeInputError(f"model: {top} = {value} is not divisible by {bottom} = {by}")
    return value // by


def padded_vocab(vocab: int, tp: int) -> int:
    """Megatron's padded vocabulary: a multiple of ``VOCAB_DIVISOR * tp``."""
    step = VOCAB_DIVISOR * tp
    return -(-vocab // step) * step


def _layer(m: ModelPreset, i: int, chunk: int, tp: int, ep: int, etp: int, remat: bool) -> tuple[list[ParamSpec], list[RouterSpec]]:
    """One transformer layer's parameters (and router) as one rank holds them."""
    p = f"decoder.layers.{i}."
    dt = m.grad_dtype
    heads, kv = _div(m.heads, tp, "heads / tp"), _div(m.kv_heads, tp, "kv_heads / tp")
    d, h = m.head_dim, m.hidden

    def spec(name: str, shape: tuple[int, ...], **flags: Any) -> ParamSpec:
        return ParamSpec(p + name, chunk, shape, dt, **flags)

    out = [
        spec("self_attention.linear_qkv.layer_norm_weight", (h,), sequence_parallel=True),
        spec("self_attention.linear_qkv.weight", ((heads + 2 * kv) * d, h), is_gtp_weight_remat=remat),
    ]
    if m.qk_layernorm:
        out += [spec("self_attention.q_layernorm.weight", (d,)), spec("self_attention.k_layernorm.weight", (d,))]
    out.append(spec("self_attention.linear_proj.weight", (h, heads * d), is_gtp_weight_remat=remat))
    gate = 2 if m.swiglu else 1
    routers: list[RouterSpec] = []
    if not m.experts:
        f = _div(m.ffn, tp, "ffn / tp")
        out += [
            spec("mlp.linear_fc1.layer_norm_weight", (h,), sequence_parallel=True),
            spec("mlp.linear_fc1.weight", (gate * f, h), is_gtp_weight_remat=remat),
            spec("mlp.linear_fc2.weight", (h, f), is_gtp_weight_remat=remat),
        ]
        return out, routers
    f = _div(m.ffn, etp, "ffn / etp")
    local = _div(m.experts, ep, "experts / ep")
    out += [spec("pre_mlp_layernorm.weight", (h,), sequence_parallel=True),
            spec("mlp.router.weight", (m.experts, h), sequence_parallel=True)]
    out += [spec(f"mlp.experts.linear_fc1.weight{e}", (gate * f, h), expert=True) for e in range(local)]
    out += [spec(f"mlp.experts.linear_fc2.weight{e}", (h, f), expert=True) for e in range(local)]
    routers.append(RouterSpec(p + "mlp.router", chunk, m.experts, has_expert_bias=m.expert_bias))
    return out, routers


def preset_stage(m: ModelPreset, *, pp: int, stage: int, vpp: int = 1, tp: int = 1, ep: int = 1,
                 etp: int | None = None, gtp: int = 1) -> StageModel:
    """The parameters and routers one rank of pp ``stage`` holds, in Megatron's order.

    Args:
      m: the model.
      pp, vpp: pipeline stages and virtual chunks per stage (layers split evenly over pp * vpp).
      stage: the pp stage.
      tp, ep, etp, gtp: tensor, expert, expert-tensor parallel sizes, GTP remat factor.

    Raises:
      FinalizeInputError: a size does not divide (layers by pp * vpp, heads by tp, ...).
    """
    etp = tp if etp is None else etp
    per_chunk = _div(m.layers, pp * vpp, "layers / pp x vpp")
    rows = padded_vocab(m.vocab, tp) // tp
    params: list[ParamSpec] = []
    routers: list[RouterSpec] = []
    for chunk in range(vpp):
        virtual = chunk * pp + stage
        first, last = virtual == 0, virtual == pp * vpp - 1
        if first:
            role = Role.WORD_EMBEDDING if m.tied else Role.NONE
            params.append(ParamSpec("embedding.word_embeddings.weight", chunk, (rows, m.hidden), m.grad_dtype, role=role))
            if m.max_positions:
                params.append(ParamSpec("embedding.position_embeddings.weight", chunk, (m.max_positions, m.hidden),
                                        m.grad_dtype, role=Role.POSITION_EMBEDDING))
        for i in range(per_chunk):
            layer, layer_routers = _layer(m, i, chunk, tp, ep, etp, gtp > 1)
            params += layer
            routers += layer_routers
        if last:
            params.append(ParamSpec("decoder.final_layernorm.weight", chunk, (m.hidden,), m.grad_dtype, sequence_parallel=True))
            if not (m.tied and first):
                role = Role.WORD_EMBEDDING if m.tied else Role.NONE
                params.append(ParamSpec("output_layer.weight", chunk, (rows, m.hidden), m.grad_dtype, role=role))
    return StageModel(tuple(params), tuple(routers))


#: ParamSpec / RouterSpec fields a JSON entry may set (besides ``stages``).
_PARAM_FIELDS = frozenset(f.name for f in dataclasses.fields(ParamSpec) if f.init)
_ROUTER_FIELDS = frozenset(f.name for f in dataclasses.fields(RouterSpec))


def _entries(items: Any, fields: frozenset[str], what: str) -> list[dict[str, Any]]:
    if not isinstance(items, list):
        raise FinalizeInputError(f"model JSON: {what} must be a list of objects, got {type(items).__name__}")
    out = []
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            raise FinalizeInputError(f"model JSON: {what}[{index}] must be an object, got {item!r}")
        unknown = sorted(set(item) - fields - {"stages"})
        if unknown:
            raise FinalizeInputError(f"model JSON: {what}[{index}] ({item.get('name')!r}) has unknown keys {unknown}; "
                                     f"known: {sorted(fields | {'stages'})}")
        out.append(item)
    return out


def _held(item: Mapping[str, Any], stage: int, pp: int, what: str) -> bool:
    stages = item.get("stages")
    if stages is None or stages == "all":
        return True
    named = {"first": [0], "last": [pp - 1], "first_last": [0, pp - 1]}
    chosen = named.get(stages, stages) if isinstance(stages, str) else stages
    if not isinstance(chosen, list) or not all(isinstance(s, int) and 0 <= s < pp for s in chosen):
        raise FinalizeInputError(
            f"model JSON: {what} {item.get('name')!r}: stages must be 'all', 'first', 'last', 'first_last' "
            f"or a list of pp stages in [0, {pp}), got {stages!r}"
        )
    return stage in chosen


def json_stage(text: str | Sequence[Any] | Mapping[str, Any], *, pp: int, stage: int) -> StageModel:
    """One pp stage's parameters from a JSON model description.

    The JSON is a list of parameters, or ``{"params": [...], "routers": [...]}``. Each
    parameter is an object of :class:`~meshgrad.params.ParamSpec` fields (``name``,
    ``shape`` as one rank's shard, ``dtype``, ``chunk``, ``expert``, ``sequence_parallel``,
    ``role``: ``"word_embedding"`` / ``"position_embedding"``, ...) plus ``stages``: the pp
    stages that hold it (``"all"``, the default, ``"first"``, ``"last"``, ``"first_last"``
    or a list). Routers take :class:`~meshgrad.params.RouterSpec` fields and ``stages``.

    Raises:
      FinalizeInputError: not JSON, an unknown key, a bad stage list.
    """
    data: Any = text
    if isinstance(text, str):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise FinalizeInputError(f"model JSON: not valid JSON: {err}") from err
    if isinstance(data, Mapping):
        unknown = sorted(set(data) - {"params", "routers"})
        if unknown:
            raise FinalizeInputError(f"model JSON: unknown top-level keys {unknown}; known: ['params', 'routers']")
        params, routers = data.get("params", []), data.get("routers", [])
    else:
        params, routers = data, []
    specs = []
    for index, item in enumerate(_entries(params, _PARAM_FIELDS, "params")):
        if _held(item, stage, pp, "parameter"):
            fields = {k: v for k, v in item.items() if k != "stages"}
            specs.append(_built(ParamSpec, fields, f"params[{index}]"))
    found = [_built(RouterSpec, {k: v for k, v in item.items() if k != "stages"}, f"routers[{index}]")
             for index, item in enumerate(_entries(routers, _ROUTER_FIELDS, "routers")) if _held(item, stage, pp, "router")]
    return StageModel(tuple(specs), tuple(found))


def _built(kind: Any, fields: dict[str, Any], where: str) -> Any:
    """``kind(**fields)``; a bad value raises FinalizeInputError naming the entry."""
    if kind is ParamSpec:
        shape = fields.get("shape", ())
        if not isinstance(shape, list | tuple) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                         for d in shape):
            raise FinalizeInputError(f"model JSON: {where} ({fields.get('name')!r}): shape must be a list of "
                                     f"non-negative ints, got {shape!r}")
        fields = {**fields, "shape": tuple(shape)}
    try:
        return kind(**fields)
    except (TypeError, ValueError) as err:
        raise FinalizeInputError(f"model JSON: {where} ({fields.get('name')!r}): {err}") from err


__all__ = ["ModelPreset", "PRESETS", "StageModel", "VOCAB_DIVISOR", "json_stage", "padded_vocab", "preset_stage"]
