"""plan_finalize: the ordered steps of SPEC.md section 2, decided once per model.

Which gradient is reduced over which group, with which op and pre-scale, is decided here
and nowhere else. Backends execute a :class:`FinalizePlan`; they never re-derive it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from meshgrad.axes import Group, ParallelDims, stage_set
from meshgrad.config import FinalizeConfig
from meshgrad.params import ParamKey, ParamSpec, Role, RouterSpec


class Step(str, enum.Enum):
    """The steps of SPEC.md section 2, in execution order."""

    DP_SYNC = "dp_sync"  # 2.1
    COND_EMBEDDER = "cond_embedder"  # 2.2
    ROUTER = "router"  # 2.3
    NON_TP = "non_tp"  # 2.4
    GTP = "gtp"  # 2.5
    WORD_EMBEDDING = "word_embedding"  # 2.6
    POS_EMBEDDING = "pos_embedding"  # 2.7
    EXPERT_BIAS = "expert_bias"  # 2.8
    QB_BETA = "qb_beta"  # 2.9
    RESET = "reset"  # 2.10
    TOKEN_SCALE = "token_scale"  # 2.11

    def __str__(self) -> str:
        return self.value


STEP_ORDER: tuple[Step, ...] = tuple(Step)


class ReduceOp(str, enum.Enum):
    SUM = "sum"
    AVG = "avg"

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class GroupSizes:
    """Sizes of the named groups a plan uses (a size-1 group means no communication).

    Args:
      sizes: size of every group of :class:`Group` except EMBD / POS_EMBD.
      embd_stages: pp stages of the word-embedding group.
      pos_embd_stages: pp stages of the position-embedding group.
    """

    sizes: Mapping[Group, int]
    embd_stages: tuple[int, ...]
    pos_embd_stages: tuple[int, ...]

    def __getitem__(self, group: Group) -> int:
        if group is Group.EMBD:
            return len(self.embd_stages)
        if group is Group.POS_EMBD:
            return len(self.pos_embd_stages)
        return int(self.sizes.get(group, 1))

    @property
    def pp(self) -> int:
        return self[Group.PP]

    @classmethod
    def from_dims(cls, dims: ParallelDims, config: FinalizeConfig) -> "GroupSizes":
        """Group sizes of a full mesh, with the embedding stage sets of ``config``."""
        sizes = {g: dims.group_size(g) for g in Group if g not in (Group.EMBD, Group.POS_EMBD)}
        return cls(
            sizes=sizes,
            embd_stages=stage_set(config.embedding_stages, dims.pp, "first_last"),
            pos_embd_stages=stage_set(config.position_embedding_stages, dims.pp, "first"),
        )


def scatter_shard(total: int, size: int, index: int) -> tuple[int, int]:
    """The elements a group member keeps after a reduce-scatter (distributed optimizer).

    Layout: the flat buffer of one :class:`Reduction` holds the gradients of its ``keys``
    in plan order, each flattened row-major, zero-padded to a multiple of the group size;
    member ``index`` (members ordered by global rank) owns the contiguous shard
    ``[index * s, (index + 1) * s)`` with ``s = ceil(total / size)``. After the
    collective its shard holds the reduced values; every other element keeps this rank's
    local, pre-scaled value.

    Args:
      total: elements in the buffer (before padding).
      size: group size.
      index: the member's index in the group.

    Returns:
      (start, stop) into the unpadded buffer (empty when the shard is all padding).
    """
    if size < 1 or not 0 <= index < size:
        raise ValueError(f"scatter_shard: member {index} outside a group of {size}")
    shard = -(-total // size)
    start = min(index * shard, total)
    return start, min(start + shard, total)


@dataclasses.dataclass(frozen=True)
class Reduction:
    """One coalesced collective over one named group.

    Args:
      step: the SPEC step it implements.
      group: the named group it reduces over.
      op: SUM or AVG.
      keys: gradients reduced together (all of one dtype).
      dtype: their dtype name.
      pre_scale: multiply before the collective (1.0 = none).
      scatter: reduce-scatter (distributed optimizer) instead of all-reduce; see
        :func:`scatter_shard` for the shard layout.
      reduce_in_fp32: run the collective in float32 whatever the gradient dtype.
      copies: per key, further local gradients (other chunks' copies) summed into the
        key's gradient before the collective and overwritten with the result after.
      parts: when :func:`merge_reductions` fused several reductions into this one, the
        reductions it replaces (in order); empty otherwise. A fused reduction may hold
        keys of several dtypes: ``dtype`` is then the dtype the collective runs in (their
        promotion, as Megatron's ``_flatten_dense_tensors`` does).
    """

    step: Step
    group: Group
    op: ReduceOp
    keys: tuple[ParamKey, ...]
    dtype: str
    pre_scale: float = 1.0
    scatter: bool = False
    reduce_in_fp32: bool = False
    copies: tuple[tuple[ParamKey, ...], ...] = ()
    parts: tuple["Reduction", ...] = ()

    @property
    def all_keys(self) -> tuple[ParamKey, ...]:
        extra = tuple(k for c in self.copies for k in c)
        return self.keys + extra

    @property
    def steps(self) -> tuple[Step, ...]:
        """The SPEC steps this reduction implements (several when fused)."""
        if not self.parts:
            return (self.step,)
        out: list[Step] = []
        for part in self.parts:
            for step in part.steps:
                if step not in out:
                    out.append(step)
        return tuple(out)

    @property
    def work_dtype(self) -> str:
        """The dtype the collective runs in."""
        return "float32" if self.reduce_in_fp32 else self.dtype


@dataclasses.dataclass(frozen=True)
class StageReduction:
    """A SUM over a subset of pp stages (word / position embedding, SPEC 2.6 / 2.7).

    Args:
      step: WORD_EMBEDDING or POS_EMBEDDING.
      group: EMBD or POS_EMBD.
      stages: member pp stages; other stages do nothing.
      keys_by_stage: per pp stage (index = stage), the gradient that stage contributes,
        or None when that stage has none (not a member, or frozen).
      dtype: gradient dtype.
    """

    step: Step
    group: Group
    stages: tuple[int, ...]
    keys_by_stage: tuple[ParamKey | None, ...]
    dtype: str

    def key_for(self, stage: int) -> ParamKey | None:
        return self.keys_by_stage[stage] if stage in self.stages else None


@dataclasses.dataclass(frozen=True)
class ExpertBiasUpdate:
    """SPEC 2.8: sum token counts over tp_dp_cp (one collective), sign-update the bias."""

    routers: tuple[ParamKey, ...]
    num_experts: tuple[int, ...]
    rate: float
    group: Group = Group.TP_DP_CP
    step: Step = Step.EXPERT_BIAS


@dataclasses.dataclass(frozen=True)
class QbBetaUpdate:
    """SPEC 2.9: AVG accum/max(count,1) over ``group``, EMA-blend, re-centre."""

    routers: tuple[ParamKey, ...]
    num_experts: tuple[int, ...]
    ema: float
    group: Group
    step: Step = Step.QB_BETA


@dataclasses.dataclass(frozen=True)
class ResetTemporaries:
    """SPEC 2.10: zero token counts / qb accumulators, reset the global aux-loss tracker."""

    zero_tokens: tuple[ParamKey, ...]
    zero_qb: tuple[ParamKey, ...]
    reset_aux_loss: tuple[ParamKey, ...]
    step: Step = Step.RESET


@dataclasses.dataclass(frozen=True)
class TokenScale:
    """SPEC 2.11: broadcast num_tokens from the last pp stage, SUM over ``group``, scale
    every gradient in ``keys`` by 1/max(n, 1) on device."""

    keys: tuple[ParamKey, ...]
    group: Group
    step: Step = Step.TOKEN_SCALE


Action = Reduction | StageReduction | ExpertBiasUpdate | QbBetaUpdate | ResetTemporaries | TokenScale


@dataclasses.dataclass(frozen=True)
class FinalizePlan:
    """The ordered actions of one finalize call, plus what they were planned for.

    Args:
      actions: in SPEC order; each has a ``step``.
      config: the config planned for.
      sizes: the group sizes planned for.
      params: the parameter specs planned for.
      routers: the router specs planned for.
      token_scale: the num_tokens action, used only when num_tokens is given.
      layout: per gradient dtype, every key with a gradient in the order a flat gradient
        buffer should hold them (:func:`buffer_layout`): the keys of every reduction that
        can be made contiguous lie back to back in that reduction's key order, so a
        backend that allocates gradients this way reduces them in place, without copies.
    """

    actions: tuple[Action, ...]
    config: FinalizeConfig
    sizes: GroupSizes
    params: tuple[ParamSpec, ...]
    routers: tuple[RouterSpec, ...]
    token_scale: TokenScale
    layout: tuple[tuple[str, tuple[ParamKey, ...]], ...] = ()

    def for_step(self, *steps: Step) -> tuple[Action, ...]:
        """The actions of the given steps, in order.

        A fused reduction (:func:`merge_reductions`) whose steps are not all requested is
        replaced by its parts of the requested steps.
        """
        out: list[Action] = []
        for a in self.actions:
            if isinstance(a, Reduction) and a.parts:
                wanted = [s in steps for s in a.steps]
                if all(wanted):
                    out.append(a)
                elif any(wanted):
                    out += [p for p in a.parts if p.step in steps]
            elif a.step in steps:
                out.append(a)
        return tuple(out)

    def reductions(self) -> tuple[Reduction, ...]:
        return tuple(a for a in self.actions if isinstance(a, Reduction))

    def group_signatures(self, stage: int | None = None) -> dict[Group, tuple[str, ...]]:
        """Per group, what this rank will launch on it: one line per collective.

        Members of one group must produce identical signatures, or the collectives they
        launch would not match (a hang or mixed data). Backends exchange these once per
        plan to report the mismatch by name instead.

        Args:
          stage: this rank's pp stage (selects its StageReduction operand); None = all.

        Returns:
          group -> tuple of lines "step op scale dtype [name shape, ...]".
        """
        shapes = {p.key: p.shape for p in self.params}
        names = {p.key: p.name for p in self.params}
        out: dict[Group, list[str]] = {}
        for a in self.actions:
            if isinstance(a, Reduction):
                items = ",".join(f"{names[k]}{list(shapes[k])}" for k in a.keys)
                step = "+".join(map(str, a.steps))
                line = f"{step} {a.op} x{a.pre_scale!r} {a.dtype}{' scatter' if a.scatter else ''} [{items}]"
                out.setdefault(a.group, []).append(line)
            elif isinstance(a, StageReduction):
                keys = a.keys_by_stage if stage is None else (a.key_for(stage),)
                items = ",".join(f"{list(shapes[k])}" for k in keys if k is not None)
                out.setdefault(a.group, []).append(f"{a.step} sum {a.dtype} [{items}]")
            elif isinstance(a, (ExpertBiasUpdate, QbBetaUpdate)):
                out.setdefault(a.group, []).append(f"{a.step} experts {list(a.num_experts)}")
        return {g: tuple(lines) for g, lines in out.items()}

    def describe(self) -> str:
        """One line per action: step, group, op, scale and tensor count."""
        lines = []
        for a in self.actions:
            if isinstance(a, Reduction):
                lines.append(
                    f"{'+'.join(map(str, a.steps))}: {a.op} over {a.group} x{a.pre_scale:g} "
                    f"[{len(a.all_keys)} {a.dtype}{' scatter' if a.scatter else ''}]"
                )
            elif isinstance(a, StageReduction):
                lines.append(f"{a.step}: sum over {a.group} stages {list(a.stages)}")
            else:
                lines.append(f"{a.step}: {type(a).__name__}")
        return "\n".join(lines)


QK_LAYERNORM_NAMES = ("q_layernorm", "k_layernorm")


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


def _dp_sync(
    params: Sequence[ParamSpec], config: FinalizeConfig, sizes: GroupSizes, force_all_reduce: bool
) -> list[Reduction]:
    dp_cp = sizes[Group.DP_CP]
    edp = sizes[Group.EDP]
    scatter = config.use_distributed_optimizer and not force_all_reduce
    fp32 = config.grad_reduce_in_fp32
    dense = [p for p in params if p.has_grad and not p.expert]
    expert = [p for p in params if p.has_grad and p.expert]
    if config.calculate_per_token_loss:
        dense_op = expert_op = ReduceOp.SUM
        dense_scale = expert_scale = 1.0
    elif config.average_in_collective:
        dense_op = expert_op = ReduceOp.AVG
        dense_scale, expert_scale = 1.0, edp / dp_cp
    else:
        dense_op = expert_op = ReduceOp.SUM
        dense_scale = expert_scale = 1.0 / dp_cp
    out: list[Reduction] = []
    # A size-1 group still applies its pre-scale (e.g. EDP/DP_CP with edp == 1).
    if dense and (dp_cp > 1 or dense_scale != 1.0):
        out += _reductions(Step.DP_SYNC, Group.DP_CP, dense_op, dense, dense_scale, scatter, fp32)
    if expert and (edp > 1 or expert_scale != 1.0):
        out += _reductions(Step.DP_SYNC, Group.EDP, expert_op, expert, expert_scale, scatter, fp32)
    return out


def _pp_replicated(step: Step, params: Sequence[ParamSpec], flag: str) -> list[Reduction]:
    """Steps 2.2 / 2.3: flagged params matched by name across chunks, summed over pp."""
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


def _non_tp(params: Sequence[ParamSpec], config: FinalizeConfig) -> list[Reduction]:
    avg, total = [], []
    for spec in params:
        if not spec.has_grad:
            continue
        if spec.average_gradients_across_tp_domain:
            avg.append(spec)
        elif (config.sequence_parallel and spec.sequence_parallel) or (
            config.qk_layernorm and any(n in spec.name for n in QK_LAYERNORM_NAMES)
        ):
            total.append(spec)
    return _reductions(Step.NON_TP, Group.TP, ReduceOp.SUM, total) + _reductions(
        Step.NON_TP, Group.TP, ReduceOp.AVG, avg
    )


def _gtp(params: Sequence[ParamSpec], config: FinalizeConfig, sizes: GroupSizes) -> list[Reduction]:
    op = ReduceOp.SUM if config.calculate_per_token_loss else ReduceOp.AVG
    out: list[Reduction] = []
    for group, expert in ((Group.GTP, False), (Group.EGTP, True)):
        if sizes[group] > 1:
            chosen = [p for p in params if p.has_grad and p.expert == expert and not p.is_gtp_weight_remat]
            out += _reductions(Step.GTP, group, op, chosen)
    return out


def embedding_chunk(stage: int, pp: int, num_chunks: int, has_mtp: bool) -> int:
    """SPEC 2.6: which model chunk holds a stage's embedding weight."""
    last = num_chunks - 1
    if stage == 0:
        return 0
    if stage == pp - 1:
        return last
    return last if has_mtp else 0


def _stage_reduction(
    step: Step,
    group: Group,
    role: Role,
    stages: tuple[int, ...],
    params: Sequence[ParamSpec],
    config: FinalizeConfig,
    pp: int,
    own_stage: int | None,
) -> list[StageReduction]:
    if len(stages) <= 1:
        return []
    if step is Step.WORD_EMBEDDING and not (config.share_embeddings_and_output_weights or config.has_mtp):
        return []
    num_chunks = 1 + max((p.chunk for p in params), default=0)
    by_chunk = {p.chunk: p for p in params if p.role is role}
    keys: list[ParamKey | None] = []
    dtypes = set()
    # The MTP chunk rule applies to the word embedding only: megatron-core (0.16.1)
    # reduces a middle stage's position embedding from model[0] even with MTP layers.
    has_mtp = config.has_mtp and step is Step.WORD_EMBEDDING
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
    if all(k is None for k in keys):
        return []
    if len(dtypes) > 1:
        raise TypeError(f"{step}: embedding gradients differ in dtype across chunks: {sorted(dtypes)}")
    return [StageReduction(step, group, stages, tuple(keys), dtypes.pop())]


def _check_unique(params: Sequence[ParamSpec], routers: Sequence[RouterSpec]) -> None:
    for kind, items in (("parameter", params), ("router", routers)):
        seen: set[ParamKey] = set()
        for item in items:
            if item.key in seen:
                raise ValueError(f"duplicate {kind} {item.name!r} in chunk {item.chunk}")
            seen.add(item.key)


# --------------------------------------------------------------------------- fusion, layout

#: Steps whose gradients Megatron coalesces with ``_flatten_dense_tensors``: one collective
#: over gradients of every dtype, run in their promoted dtype.
FLATTENED_STEPS = frozenset({Step.COND_EMBEDDER, Step.ROUTER, Step.NON_TP, Step.GTP})

#: Groups whose members all sit on one pp stage and so plan identically: a reduction over
#: them may order its keys for the buffer layout. Reductions over pp-spanning groups keep
#: the plan's key order (their members hold different models), as do reduce-scatters
#: (their key order is the documented shard layout).
STAGE_LOCAL_GROUPS = frozenset(
    {Group.DP_CP, Group.EDP, Group.TP, Group.GTP, Group.EGTP, Group.TP_DP_CP, Group.DP_CP_GTP}
)

_FLOAT_RANK = {"float16": 0, "bfloat16": 0, "float32": 1, "float64": 2}


def promote_dtypes(a: str, b: str) -> str:
    """torch / numpy type promotion of two float dtype names (bf16 with fp16 -> fp32)."""
    if a == b:
        return a
    rank = max(_FLOAT_RANK[a], _FLOAT_RANK[b], 1)
    return "float64" if rank == 2 else "float32"


def _fusable(a: Reduction, b: Reduction) -> bool:
    if (a.group, a.op, a.pre_scale, a.reduce_in_fp32) != (b.group, b.op, b.pre_scale, b.reduce_in_fp32):
        return False
    if a.scatter or b.scatter:  # the shard layout is defined per reduction
        return False
    if set(a.all_keys) & set(b.all_keys):  # a key reduced twice must stay reduced twice
        return False
    if a.dtype == b.dtype or a.reduce_in_fp32:  # same collective dtype: exact
        return True
    # Different dtypes in one collective: what Megatron does where it flattens.
    return all(s in FLATTENED_STEPS for s in a.steps + b.steps)


def _fuse(a: Reduction, b: Reduction) -> Reduction:
    copies = (a.copies or ((),) * len(a.keys)) + (b.copies or ((),) * len(b.keys))
    return Reduction(
        step=a.step,
        group=a.group,
        op=a.op,
        keys=a.keys + b.keys,
        dtype=promote_dtypes(a.dtype, b.dtype),
        pre_scale=a.pre_scale,
        scatter=False,
        reduce_in_fp32=a.reduce_in_fp32,
        copies=copies if any(copies) else (),
        parts=(a.parts or (a,)) + (b.parts or (b,)),
    )


def merge_reductions(actions: Sequence[Action]) -> tuple[Action, ...]:
    """Fuse adjacent reductions that can share one collective.

    Two reductions next to each other in the plan (nothing runs between them) become one
    when they have the same group, op, pre-scale and reduce_in_fp32 flag, neither is a
    reduce-scatter, their keys (copies included) are disjoint, and either

    * they run in the same dtype: exact (cond-embedder + router pp syncs; dtype-split
      reductions under ``grad_reduce_in_fp32``), or
    * both belong to steps Megatron coalesces across dtypes (:data:`FLATTENED_STEPS`):
      the fused collective runs in the promoted dtype, as ``_flatten_dense_tensors`` does.

    DP-sync reductions of different dtypes stay apart without ``grad_reduce_in_fp32``
    (Megatron's DDP keeps one buffer per dtype).

    Returns:
      The actions, fused reductions carrying their ``parts``.
    """
    out: list[Action] = []
    for action in actions:
        prev = out[-1] if out else None
        if isinstance(action, Reduction) and isinstance(prev, Reduction) and _fusable(prev, action):
            out[-1] = _fuse(prev, action)
        else:
            out.append(action)
    return tuple(out)


@dataclasses.dataclass
class _Block:
    keys: tuple[ParamKey, ...]
    members: frozenset[ParamKey]
    fixed: bool
    first: int
    children: list["_Block"] = dataclasses.field(default_factory=list)


def _nests(inner: _Block, outer: _Block, order: Mapping[ParamKey, int]) -> bool:
    """Whether ``inner`` (a subset of ``outer``) can lie contiguously inside it."""
    if not outer.fixed:
        return True
    pos = [outer.keys.index(k) for k in inner.keys]
    if max(pos) - min(pos) + 1 != len(pos):
        return False
    return not inner.fixed or pos == sorted(pos)


def buffer_layout(
    actions: Sequence[Action], params: Sequence[ParamSpec]
) -> tuple[tuple[tuple[str, tuple[ParamKey, ...]], ...], tuple[Action, ...]]:
    """Order gradients for flat buffers so that reductions run in place.

    Every reduction whose keys share one dtype asks for its keys to be contiguous. The
    requests are taken largest first and kept when they nest in (or are disjoint from)
    every kept one -- a laminar family, laid out by a depth-first walk: inside a block
    its nested blocks first, then its other keys, each in parameter order. Reductions
    over pp-spanning groups and reduce-scatters keep their key order (a block nested in
    them must be a run of it). A request that cannot be kept just costs that reduction
    a copy in backends that use the layout.

    Args:
      actions: the plan's actions.
      params: the plan's parameters (their order is the default order).

    Returns:
      (per dtype, every key with a gradient in buffer order; the actions with the keys of
      each reorderable, contiguous reduction in buffer order).
    """
    order = {p.key: i for i, p in enumerate(params)}
    dtype_of = {p.key: p.dtype for p in params}
    requests: list[tuple[int, _Block]] = []
    for where, a in enumerate(actions):
        if not isinstance(a, Reduction) or not a.keys:
            continue
        if any(dtype_of.get(k) != a.dtype for k in a.keys) or len(set(a.keys)) != len(a.keys):
            continue
        fixed = a.scatter or a.group not in STAGE_LOCAL_GROUPS
        requests.append((where, _Block(a.keys, frozenset(a.keys), fixed, min(order[k] for k in a.keys))))
    kept: dict[int, _Block] = {}
    roots: list[_Block] = []
    for index in sorted(range(len(requests)), key=lambda i: -len(requests[i][1].keys)):
        block = requests[index][1]
        parent: _Block | None = None
        ok = True
        for other in kept.values():
            common = block.members & other.members
            if not common:
                continue
            if common != block.members or not _nests(block, other, order):
                ok = False
                break
            if parent is None or len(other.members) <= len(parent.members):
                parent = other
        if not ok:
            continue
        kept[index] = block  # its parent is the smallest kept block around it
        (parent.children if parent is not None else roots).append(block)

    placed: dict[ParamKey, int] = {}

    def emit(block: _Block, out: list[ParamKey]) -> None:
        if block.fixed:
            for k in block.keys:
                if k not in placed:
                    placed[k] = len(out)
                    out.append(k)
            return
        inner = {k for child in block.children for k in child.members}
        items: list[tuple[int, Any]] = [(b.first, b) for b in block.children]
        items += [(order[k], k) for k in block.keys if k not in inner]
        for _, item in sorted(items, key=lambda i: i[0]):
            if isinstance(item, _Block):
                emit(item, out)
            elif item not in placed:
                placed[item] = len(out)
                out.append(item)

    layout: dict[str, list[ParamKey]] = {}
    for block in sorted(roots, key=lambda b: b.first):
        emit(block, layout.setdefault(dtype_of[block.keys[0]], []))
    for p in params:
        if p.has_grad and p.key not in placed:
            out = layout.setdefault(p.dtype, [])
            placed[p.key] = len(out)
            out.append(p.key)

    new_actions = list(actions)
    for index, block in kept.items():
        where = requests[index][0]
        action = actions[where]
        if block.fixed or not isinstance(action, Reduction):
            continue
        ranked = sorted(range(len(action.keys)), key=lambda i: placed[action.keys[i]])
        if ranked == list(range(len(action.keys))):
            continue
        keys = tuple(action.keys[i] for i in ranked)
        copies = tuple(action.copies[i] for i in ranked) if action.copies else ()
        new_actions[where] = dataclasses.replace(action, keys=keys, copies=copies)
    return tuple((d, tuple(keys)) for d, keys in layout.items()), tuple(new_actions)


def plan_finalize(
    params: Sequence[ParamSpec],
    config: FinalizeConfig,
    sizes: GroupSizes | ParallelDims,
    routers: Sequence[RouterSpec] = (),
    *,
    force_all_reduce: bool = False,
    dp_sync: bool = True,
    merge: bool = True,
    stage: int | None = None,
) -> FinalizePlan:
    """Plan one finalize call (SPEC.md section 2, steps 1 to 11, in order).

    Args:
      params: every parameter of this rank's model chunks.
      config: the finalize options.
      sizes: group sizes (or the full ParallelDims, with config's stage sets).
      routers: MoE router modules (steps 8 to 10).
      force_all_reduce: turn a distributed optimizer's reduce-scatter into an all-reduce.
      dp_sync: include step 1 (False when the backend delegates it to DDP chunks).
      merge: fuse reductions that can share a collective (:func:`merge_reductions`).
      stage: this rank's pp stage, when the params are one rank's (torch): stage-specific
        checks (a position embedding without gradient) apply to it alone. None (SPMD
        backends, uniform layouts): they apply to every member stage.

    Returns:
      A FinalizePlan; its ``token_scale`` is used only when num_tokens is given.

    Raises:
      ValueError: duplicate parameters, or a position embedding without a gradient.
    """
    if isinstance(sizes, ParallelDims):
        sizes = GroupSizes.from_dims(sizes, config)
    params = tuple(params)
    routers = tuple(routers)
    _check_unique(params, routers)
    pp = sizes.pp
    actions: list[Action] = []
    if dp_sync:
        actions += _dp_sync(params, config, sizes, force_all_reduce)
    if pp > 1 and config.has_cond_embedder:
        actions += _pp_replicated(Step.COND_EMBEDDER, params, "pipeline_parallel")
    if pp > 1 and config.flextron:
        actions += _pp_replicated(Step.ROUTER, params, "flextron_router_pp_sync")
    if sizes[Group.TP] > 1:
        actions += _non_tp(params, config)
    actions += _gtp(params, config, sizes)
    actions += _stage_reduction(
        Step.WORD_EMBEDDING, Group.EMBD, Role.WORD_EMBEDDING, sizes.embd_stages, params, config, pp, stage
    )
    actions += _stage_reduction(
        Step.POS_EMBEDDING, Group.POS_EMBD, Role.POSITION_EMBEDDING, sizes.pos_embd_stages, params, config, pp, stage
    )
    trained = [r for r in routers if r.training]
    if config.moe_router_enable_expert_bias:
        chosen = [r for r in trained if r.has_expert_bias and not r.frozen_expert_bias]
        if chosen:
            actions.append(
                ExpertBiasUpdate(
                    tuple(r.key for r in chosen),
                    tuple(r.num_experts for r in chosen),
                    float(config.moe_router_bias_update_rate),
                )
            )
    # num_tokens and qb_beta reduce over every distinct-data rank: dp x cp x gtp (dp_cp
    # when GTP is inactive), as Megatron's dp_cp_gtp_remat group.
    qb_group = Group.DP_CP_GTP
    if config.quantile_balancing:
        chosen = [r for r in trained if r.has_qb_beta and r.qb_accum_present]
        if chosen:
            actions.append(
                QbBetaUpdate(
                    tuple(r.key for r in chosen),
                    tuple(r.num_experts for r in chosen),
                    float(config.moe_router_quantile_balancing_ema),
                    qb_group,
                )
            )
    zero_tokens = tuple(r.key for r in routers if config.moe_router_enable_expert_bias and r.has_expert_bias)
    zero_qb = tuple(r.key for r in routers if r.has_qb_beta)
    reset_aux = tuple(r.key for r in routers if config.global_aux_loss and r.has_aux_loss_tracker)
    if zero_tokens or zero_qb or reset_aux:
        actions.append(ResetTemporaries(zero_tokens, zero_qb, reset_aux))
    token_scale = TokenScale(tuple(p.key for p in params if p.has_grad), qb_group)
    final = merge_reductions(actions) if merge else tuple(actions)
    layout, final = buffer_layout(final, params)
    return FinalizePlan(final, config, sizes, params, routers, token_scale, layout)
