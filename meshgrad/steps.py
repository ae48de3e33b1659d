"""One planner per step of docs/semantics.md: which gradients go over which group, how.

Each function takes the parameter / router specs, the config and the sizes it needs (plain
ints and stage tuples) and returns that step's actions in order. :func:`meshgrad.plan.
plan_finalize` calls them in step order; nothing else decides a selection.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from meshgrad.actions import Action, ExpertBiasUpdate, QbBetaUpdate, ReduceOp, Reduction, ResetTemporaries
from meshgrad.actions import StageReduction, Step, TokenScale
from meshgrad.axes import Group
from meshgrad.config import FinalizeConfig
from meshgrad.params import ParamKey, ParamSpec, Role, RouterSpec

QK_LAYERNORM_NAMES = ("q_layernorm", "k_layernorm")
#: A part of every q / k layernorm name, without a dot: a dotted name without it in any
#: of its parts is none (a cheap first test before :func:`is_qk_layernorm`).
QK_MARK = "_layernorm"
#: Steps whose actions read routers only, no gradient (their plans do not depend on the
#: parameters).
ROUTER_ONLY_STEPS = frozenset({Step.EXPERT_BIAS, Step.QB_BETA, Step.RESET})
#: Steps whose plans depend on the parameters' embedding roles; every other step picks its
#: parameters by flags and names alone (so a call of other steps need not read what
#: decides the roles: the model's ``shared_embedding_or_output_weight()``).
ROLE_STEPS = frozenset({Step.WORD_EMBEDDING, Step.POS_EMBEDDING})


def is_qk_layernorm(name: str) -> bool:
    """Whether a parameter name is a q / k layernorm's (``qk_layernorm`` sums it over tp)."""
    return QK_MARK in name and any(n in name for n in QK_LAYERNORM_NAMES)


def may_touch(name: str, role: Role, flags: Iterable[Any]) -> bool:
    """Whether a step other than the DP sync and GTP may touch a parameter (given a
    gradient): an embedding role, one of its step flags set (``sequence_parallel``,
    ``average_gradients_across_tp_domain``, ``pipeline_parallel``,
    ``flextron_router_pp_sync``, ``is_gtp_weight_remat``: truth values) or a q / k
    layernorm name."""
    return role is not Role.NONE or any(flags) or is_qk_layernorm(name)

#: num_tokens and qb_beta reduce over every distinct-data rank: dp x cp x gtp (dp_cp when
#: GTP is inactive), as Megatron's dp_cp_gtp_remat group.
DISTINCT_DATA_GROUP = Group.DP_CP_GTP


def _by_dtype(specs: Iterable[ParamSpec]) -> dict[str, list[ParamSpec]]:
    out: dict[str, list[ParamSpec]] = {}
    for spec in specs:
        out.setdefault(spec.dtype, []).append(spec)
    return out


def _reductions(
    step: Step,
    group: Group,
    op: ReduceOp,
    specs: Sequence[ParamSpec],
    pre_scale: float = 1.0,
    scatter: bool = False,
    reduce_in_fp32: bool = False,
) -> list[Reduction]:
    """One Reduction per dtype over ``specs`` (empty when there is nothing to reduce)."""
    return [
        Reduction(step, group, op, tuple(s.key for s in group_specs), dtype, pre_scale, scatter, reduce_in_fp32)
        for dtype, group_specs in _by_dtype(specs).items()
    ]


def dp_scaling(config: FinalizeConfig, dp_cp: int, edp: int) -> tuple[ReduceOp, float, float]:
    """The DP sync's op and (dense, expert) pre-scales, chosen once from the config."""
    if config.calculate_per_token_loss:
        return ReduceOp.SUM, 1.0, 1.0
    if config.average_in_collective:
        return ReduceOp.AVG, 1.0, edp / dp_cp
    return ReduceOp.SUM, 1.0 / dp_cp, 1.0 / dp_cp


#: Steps that sum a gradient across pipeline stages after the DP sync.
CROSS_STAGE_STEPS = frozenset({Step.COND_EMBEDDER, Step.ROUTER, Step.WORD_EMBEDDING, Step.POS_EMBEDDING})


def cross_stage_keys(actions: Iterable[Action]) -> frozenset[ParamKey]:
    """The gradients that ``actions`` sum across pp stages (every stage's key and every
    chunk copy): tied word / position embeddings, conditional embedder, flextron router."""
    out: set[ParamKey] = set()
    for action in actions:
        if isinstance(action, StageReduction):
            out.update(action.distinct_keys())
        elif isinstance(action, Reduction) and set(action.steps) & CROSS_STAGE_STEPS:
            out.update(action.all_keys)
    return frozenset(out)


def dp_sync(
    params: Sequence[ParamSpec],
    config: FinalizeConfig,
    dp_cp: int,
    edp: int,
    force_all_reduce: bool,
    own_buffers: frozenset[ParamKey] = frozenset(),
) -> list[Reduction]:
    """Dense gradients over dp_cp, expert ones over expt_dp (reduce-scatter with a
    distributed optimizer unless ``force_all_reduce``).

    Under a reduce-scatter each key of ``own_buffers`` (:func:`cross_stage_keys`: a later
    step sums it across stages) is a reduction of its own, after the others: its shards
    then cover the same elements on every stage and in every chunk copy, so the
    cross-stage sum adds reduced values to reduced values (Megatron-LM issue 844).
    """
    scatter = config.use_distributed_optimizer and not force_all_reduce
    fp32 = config.grad_reduce_in_fp32
    op, dense_scale, expert_scale = dp_scaling(config, dp_cp, edp)
    out: list[Reduction] = []
    for group, expert, size, scale in ((Group.DP_CP, False, dp_cp, dense_scale), (Group.EDP, True, edp, expert_scale)):
        chosen = [p for p in params if p.has_grad and p.expert == expert]
        # A size-1 group still applies its pre-scale (e.g. EDP/DP_CP with edp == 1).
        if not chosen or (size <= 1 and scale == 1.0):
            continue
        alone = [p for p in chosen if p.key in own_buffers] if scatter and size > 1 else []
        shared = [p for p in chosen if p not in alone]
        out += _reductions(Step.DP_SYNC, group, op, shared, scale, scatter, fp32)
        for spec in alone:
            out += _reductions(Step.DP_SYNC, group, op, [spec], scale, scatter, fp32)
    return out


def pp_replicated(step: Step, params: Sequence[ParamSpec], flag: str) -> list[Reduction]:
    """Conditional embedder / router: flagged params matched by name across chunks,
    summed into the first copy, SUM over pp, written back to every copy."""
    by_name: dict[str, list[ParamSpec]] = {}
    for spec in params:
        if spec.has_grad and getattr(spec, flag):
            by_name.setdefault(spec.name, []).append(spec)
    firsts = [sorted(c, key=lambda s: s.chunk)[0] for c in by_name.values()]
    out = []
    for dtype, group_specs in _by_dtype(firsts).items():
        copies = tuple(
            tuple(s.key for s in sorted(by_name[f.name], key=lambda s: s.chunk)[1:]) for f in group_specs
        )
        out.append(
            Reduction(step, Group.PP, ReduceOp.SUM, tuple(s.key for s in group_specs), dtype, copies=copies)
        )
    return out


def non_tp(params: Sequence[ParamSpec], config: FinalizeConfig) -> list[Reduction]:
    """Gradients replicated over tp: SUM (sequence parallel, qk layernorm) and AVG lists."""
    avg, total = [], []
    for spec in params:
        if not spec.has_grad:
            continue
        if spec.average_gradients_across_tp_domain:
            avg.append(spec)
        elif (config.sequence_parallel and spec.sequence_parallel) or (config.qk_layernorm and is_qk_layernorm(spec.name)):
            total.append(spec)
    return _reductions(Step.NON_TP, Group.TP, ReduceOp.SUM, total) + _reductions(
        Step.NON_TP, Group.TP, ReduceOp.AVG, avg
    )


def gtp(params: Sequence[ParamSpec], config: FinalizeConfig, gtp_size: int, egtp_size: int) -> list[Reduction]:
    """Gradients not sharded over GTP remat: dense over gtp_remat, expert over expt_gtp_remat."""
    op = ReduceOp.SUM if config.calculate_per_token_loss else ReduceOp.AVG
    out: list[Reduction] = []
    for group, expert, size in ((Group.GTP, False, gtp_size), (Group.EGTP, True, egtp_size)):
        if size > 1:
            chosen = [p for p in params if p.has_grad and p.expert == expert and not p.is_gtp_weight_remat]
            out += _reductions(Step.GTP, group, op, chosen)
    return out


def embedding_chunk(stage: int, pp: int, num_chunks: int, has_mtp: bool) -> int:
    """Which model chunk holds a stage's embedding weight.

    Args:
      stage: the pp stage.
      pp: the number of pp stages.
      num_chunks: the rank's (virtual pipeline) chunks.
      has_mtp: apply the MTP rule (a middle stage reads the last chunk).

    Returns:
      The chunk index: 0 on the first stage, the last on the last stage.
    """
    last = num_chunks - 1
    if stage == 0:
        return 0
    if stage == pp - 1:
        return last
    return last if has_mtp else 0


def mtp_rule_applies(step: Step, config: FinalizeConfig) -> bool:
    """Whether ``step``'s chunk follows the MTP rule: the word embedding's alone
    (megatron-core reduces a middle stage's position embedding from model[0] even with
    MTP layers)."""
    return config.has_mtp and step is Step.WORD_EMBEDDING


def _stage_keys(
    step: Step, role: Role, stages: tuple[int, ...], params: Sequence[ParamSpec], config: FinalizeConfig,
    pp: int, own_stage: int | None,
) -> tuple[list[ParamKey | None], set[str]]:
    """Per pp stage, the key it contributes (or None), and the dtypes seen."""
    num_chunks = 1 + max((p.chunk for p in params), default=0)
    by_chunk = {p.chunk: p for p in params if p.role is role}
    has_mtp = mtp_rule_applies(step, config)
    keys: list[ParamKey | None] = []
    dtypes = set()
    for stage in range(pp):
        spec = by_chunk.get(embedding_chunk(stage, pp, num_chunks, has_mtp))
        checked = own_stage is None or stage == own_stage
        if spec is not None and not spec.has_grad and step is Step.POS_EMBEDDING and stage in stages and checked:
            raise ValueError(
                f"position embedding {spec.name!r} (chunk {spec.chunk}) has no gradient on pp "
                f"stage {stage}; pos_embd group requires one (skip_if_none=False)"
            )
        if spec is None or not spec.has_grad or stage not in stages:
            keys.append(None)
        else:
            keys.append(spec.key)
            dtypes.add(spec.dtype)
    return keys, dtypes


def stage_reduction(
    step: Step,
    group: Group,
    role: Role,
    stages: tuple[int, ...],
    params: Sequence[ParamSpec],
    config: FinalizeConfig,
    pp: int,
    own_stage: int | None,
) -> list[StageReduction]:
    """Word / position embedding: SUM over the member stages of each stage's chunk copy.

    Raises:
      ValueError: a member stage's position embedding has no gradient (``own_stage``
        only, when given).
      TypeError: the stages' embedding gradients differ in dtype.
    """
    if len(stages) <= 1:
        return []
    if step is Step.WORD_EMBEDDING and not (config.share_embeddings_and_output_weights or config.has_mtp):
        return []
    keys, dtypes = _stage_keys(step, role, stages, params, config, pp, own_stage)
    if all(k is None for k in keys):
        return []
    if len(dtypes) > 1:
        raise TypeError(f"{step}: embedding gradients differ in dtype across chunks: {sorted(dtypes)}")
    return [StageReduction(step, group, stages, tuple(keys), dtypes.pop())]


def router_updates(routers: Sequence[RouterSpec], config: FinalizeConfig) -> list[Action]:
    """Expert bias, quantile balancing and the reset of router temporaries, in order."""
    trained = [r for r in routers if r.training]
    out: list[Action] = []
    if config.moe_router_enable_expert_bias:
        chosen = [r for r in trained if r.has_expert_bias and not r.frozen_expert_bias]
        if chosen:
            keys, experts = tuple(r.key for r in chosen), tuple(r.num_experts for r in chosen)
            out.append(ExpertBiasUpdate(keys, experts, float(config.moe_router_bias_update_rate)))
    if config.quantile_balancing:
        chosen = [r for r in trained if r.has_qb_beta and r.qb_accum_present]
        if chosen:
            keys, experts = tuple(r.key for r in chosen), tuple(r.num_experts for r in chosen)
            ema = float(config.moe_router_quantile_balancing_ema)
            out.append(QbBetaUpdate(keys, experts, ema, DISTINCT_DATA_GROUP))
    zero_tokens = tuple(r.key for r in routers if config.moe_router_enable_expert_bias and r.has_expert_bias)
    zero_qb = tuple(r.key for r in routers if r.has_qb_beta)
    reset_aux = tuple(r.key for r in routers if config.global_aux_loss and r.has_aux_loss_tracker)
    if zero_tokens or zero_qb or reset_aux:
        out.append(ResetTemporaries(zero_tokens, zero_qb, reset_aux))
    return out


def token_scale(params: Sequence[ParamSpec]) -> TokenScale:
    """Scale every gradient by 1 / the global token count (used when num_tokens is given)."""
    return TokenScale(tuple(p.key for p in params if p.has_grad), DISTINCT_DATA_GROUP)


def check_unique(params: Sequence[ParamSpec], routers: Sequence[RouterSpec]) -> None:
    """Raise ValueError on a parameter or router key given twice."""
    for kind, items in (("parameter", params), ("router", routers)):
        seen: set[ParamKey] = set()
        for item in items:
            if item.key in seen:
                raise ValueError(f"duplicate {kind} {item.name!r} in chunk {item.chunk}")
            seen.add(item.key)


__all__ = [
    "CROSS_STAGE_STEPS",
    "DISTINCT_DATA_GROUP",
    "QK_LAYERNORM_NAMES",
    "QK_MARK",
    "ROLE_STEPS",
    "ROUTER_ONLY_STEPS",
    "check_unique",
    "cross_stage_keys",
    "dp_scaling",
    "dp_sync",
    "embedding_chunk",
    "gtp",
    "is_qk_layernorm",
    "may_touch",
    "mtp_rule_applies",
    "non_tp",
    "pp_replicated",
    "router_updates",
    "stage_reduction",
    "token_scale",
]
