"""plan_finalize: the ordered actions of docs/semantics.md, decided once per model.

Which gradient is reduced over which group, with which op and pre-scale, is decided here
(with one planner per step in :mod:`meshgrad.steps`) and nowhere else. Backends execute
a :class:`FinalizePlan` and ask it about itself (groups, signatures, embedding chunks);
they never re-derive it.

The action types (:mod:`meshgrad.actions`), the buffer layout (:mod:`meshgrad.layout`)
and the fusion of reductions (:mod:`meshgrad.fusion`) are re-exported here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from meshgrad import steps as planners
from meshgrad.actions import (
    Action,
    ExpertBiasUpdate,
    Operand,
    QbBetaUpdate,
    ReduceOp,
    Reduction,
    ResetTemporaries,
    Signature,
    StageReduction,
    Step,
    TokenScale,
)
from meshgrad.axes import Group, ParallelDims, stage_set
from meshgrad.config import FinalizeConfig
from meshgrad.fusion import FLATTENED_STEPS, merge_reductions, promote_dtypes
from meshgrad.layout import STAGE_LOCAL_GROUPS, Layout, buffer_layout, scatter_shard
from meshgrad.params import ParamKey, ParamSpec, Role, RouterSpec
from meshgrad.steps import QK_LAYERNORM_NAMES, embedding_chunk

#: Groups whose members are a subset of pp stages.
STAGE_GROUPS = (Group.EMBD, Group.POS_EMBD)


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
        """The number of pp stages."""
        return self[Group.PP]

    @classmethod
    def from_dims(cls, dims: ParallelDims, config: FinalizeConfig) -> "GroupSizes":
        """Group sizes of a full mesh, with the embedding stage sets of ``config``."""
        sizes = {g: dims.group_size(g) for g in Group if g not in STAGE_GROUPS}
        return cls(
            sizes=sizes,
            embd_stages=stage_set(config.embedding_stages, dims.pp, "first_last"),
            pos_embd_stages=stage_set(config.position_embedding_stages, dims.pp, "first"),
        )


#: The embedding steps: (step, group, parameter role).
EMBEDDING_STEPS = (
    (Step.WORD_EMBEDDING, Group.EMBD, Role.WORD_EMBEDDING),
    (Step.POS_EMBEDDING, Group.POS_EMBD, Role.POSITION_EMBEDDING),
)


@dataclasses.dataclass(frozen=True)
class FinalizePlan:
    """The ordered actions of one finalize call, plus what they were planned for.

    Args:
      actions: in step order; each has a ``step``.
      config: the config planned for.
      sizes: the group sizes planned for.
      params: the parameter specs planned for.
      routers: the router specs planned for.
      token_scale: the num_tokens action, used only when num_tokens is given.
      layout: per gradient dtype, every key with a gradient in the order a flat gradient
        buffer should hold them (:func:`~meshgrad.layout.buffer_layout`): the keys of
        every reduction that can be made contiguous lie back to back in that reduction's
        key order, so a backend that allocates gradients this way reduces them in place.
      delegated: chunks whose own DDP runs the DP sync and the token scaling (Megatron DDP
        chunks): the plan's DP sync leaves them out, and :attr:`own_scale_keys` too.
    """

    actions: tuple[Action, ...]
    config: FinalizeConfig
    sizes: GroupSizes
    params: tuple[ParamSpec, ...]
    routers: tuple[RouterSpec, ...]
    token_scale: TokenScale
    layout: Layout = ()
    delegated: frozenset[int] = frozenset()

    @property
    def own_scale_keys(self) -> tuple[ParamKey, ...]:
        """The gradients the backend scales by num_tokens itself (not a delegated chunk's)."""
        return tuple(k for k in self.token_scale.keys if k[0] not in self.delegated)

    def for_step(self, *steps: Step) -> tuple[Action, ...]:
        """The actions of the given steps, in order.

        A fused reduction (:func:`~meshgrad.fusion.merge_reductions`) whose steps are not
        all requested is replaced by its parts of the requested steps.
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

    def gradient_keys(self, scale_keys: Sequence[ParamKey] | None = None) -> tuple[ParamKey, ...]:
        """Every gradient key the plan reads or writes, in first-use order: the reductions'
        (with their chunk copies), the stage reductions' operands, then the num_tokens scale's.

        Args:
          scale_keys: the keys the backend scales itself (default: the token scale's keys).
        """
        keys: dict[ParamKey, None] = {}
        for action in self.actions:
            if isinstance(action, Reduction):
                keys.update(dict.fromkeys(action.all_keys))
            elif isinstance(action, StageReduction):
                keys.update(dict.fromkeys(k for k in action.keys_by_stage if k is not None))
        keys.update(dict.fromkeys(self.token_scale.keys if scale_keys is None else scale_keys))
        return tuple(keys)

    def router_writes(self) -> tuple[tuple[ParamKey, str], ...]:
        """(router key, buffer attribute) of every router buffer the plan updates in place:
        the expert bias and qb_beta updates' results, the reset's zeroed counts."""
        return tuple(dict.fromkeys(write for action in self.actions for write in action.router_writes()))

    def actions_with(self, num_tokens: bool) -> tuple[Action, ...]:
        """The actions to run: the plan's, plus its token scaling when num_tokens is given."""
        return self.actions + ((self.token_scale,) if num_tokens else ())

    def required_groups(self, num_tokens: bool = True) -> tuple[Group, ...]:
        """The groups the plan's actions communicate over, in :class:`Group` order.

        Args:
          num_tokens: include the token scaling's groups (pp and its sum's group).
        """
        used = {g for a in self.actions_with(num_tokens) for g in a.groups()}
        return tuple(g for g in Group if g in used)

    def embedding_chunk(self, step: Step, stage: int) -> int:
        """The model chunk whose embedding weight pp ``stage`` reduces in ``step``
        (WORD_EMBEDDING or POS_EMBEDDING), by this plan's chunks and config."""
        num_chunks = 1 + max((p.chunk for p in self.params), default=0)
        return embedding_chunk(stage, self.sizes.pp, num_chunks, planners.mtp_rule_applies(step, self.config))

    def signatures(self, stage: int | None = None) -> dict[Group, tuple[Signature, ...]]:
        """Per group, what this rank will launch on it, as data (one entry per collective).

        Members of one group must produce equal signatures, or the collectives they launch
        would not match (a hang or mixed data). Backends exchange these once per plan to
        report a mismatch by name instead.

        Args:
          stage: this rank's pp stage (selects its StageReduction operand); None = all.

        Returns:
          group -> signatures, in action order.
        """
        shapes = {p.key: p.shape for p in self.params}
        out: dict[Group, list[Signature]] = {}
        for a in self.actions:
            for sig in a.signature(stage, shapes):
                out.setdefault(sig.group, []).append(sig)
        return {g: tuple(sigs) for g, sigs in out.items()}

    def group_signatures(self, stage: int | None = None) -> dict[Group, tuple[str, ...]]:
        """:meth:`signatures` as text: group -> one line per collective,
        ``"step op xscale dtype [scatter] [name[shape], ...]"`` (:meth:`Signature.line`).

        Args:
          stage: this rank's pp stage; None = all.
        """
        return {g: tuple(s.line() for s in sigs) for g, sigs in self.signatures(stage).items()}

    def describe(self) -> str:
        """One line per action: step, group, op, scale and tensor count."""
        return "\n".join(a.summary() for a in self.actions)


def _planned_actions(
    params: tuple[ParamSpec, ...],
    config: FinalizeConfig,
    sizes: GroupSizes,
    routers: tuple[RouterSpec, ...],
    force_all_reduce: bool,
    dp_sync: bool,
    stage: int | None,
    synced: Mapping[ParamKey, frozenset[Step]],
) -> list[Action]:
    """Every step's actions, in step order (before fusion and layout)."""
    pp = sizes.pp
    actions: list[Action] = []
    if pp > 1 and config.has_cond_embedder:
        actions += planners.pp_replicated(Step.COND_EMBEDDER, params, "pipeline_parallel")
    if pp > 1 and config.flextron:
        actions += planners.pp_replicated(Step.ROUTER, params, "flextron_router_pp_sync")
    if sizes[Group.TP] > 1:
        actions += planners.non_tp(_not_synced(params, synced, Step.NON_TP), config)
    actions += planners.gtp(params, config, sizes[Group.GTP], sizes[Group.EGTP])
    stage_sets = {Group.EMBD: sizes.embd_stages, Group.POS_EMBD: sizes.pos_embd_stages}
    for step, group, role in EMBEDDING_STEPS:
        actions += planners.stage_reduction(step, group, role, stage_sets[group], params, config, pp, stage)
    actions += planners.router_updates(routers, config)
    if not dp_sync:
        return actions
    own = planners.cross_stage_keys(actions)
    dense = _not_synced(params, synced, Step.DP_SYNC)
    return planners.dp_sync(dense, config, sizes[Group.DP_CP], sizes[Group.EDP], force_all_reduce, own) + actions


def _not_synced(
    params: tuple[ParamSpec, ...], synced: Mapping[ParamKey, frozenset[Step]], step: Step
) -> tuple[ParamSpec, ...]:
    """The parameters whose ``step`` the framework has not already done (``synced``)."""
    if not synced:
        return params
    return tuple(p for p in params if step not in synced.get(p.key, ()))


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
    delegated: frozenset[int] = frozenset(),
    synced: Mapping[ParamKey, frozenset[Step]] | None = None,
) -> FinalizePlan:
    """Plan one finalize call (docs/semantics.md, every step, in order).

    Args:
      params: every parameter of this rank's model chunks.
      config: the finalize options.
      sizes: group sizes (or the full ParallelDims, with config's stage sets).
      routers: MoE router modules (expert bias, qb_beta, reset).
      force_all_reduce: turn a distributed optimizer's reduce-scatter into an all-reduce.
      dp_sync: include the DP sync (False when the backend delegates it to DDP chunks).
      merge: fuse reductions that can share a collective (:func:`merge_reductions`).
      stage: this rank's pp stage, when the params are one rank's (torch): stage-specific
        checks (a position embedding without gradient) apply to it alone. None (SPMD
        backends, uniform layouts): they apply to every member stage.
      delegated: chunks whose own DDP (a Megatron DDP wrapper) runs the DP sync and the
        token scaling. The DP sync of the other chunks is planned over their parameters
        alone and runs first.
      synced: per parameter, the steps its framework already did (torch's FSDP2:
        ``dp_sync``, and ``non_tp`` for a DTensor gradient over tp); those steps leave it
        out, every other step (and the token scale) keeps it.

    Returns:
      A FinalizePlan; its ``token_scale`` is used only when num_tokens is given.

    Raises:
      ValueError: duplicate parameters, or a position embedding without a gradient.
    """
    if isinstance(sizes, ParallelDims):
        sizes = GroupSizes.from_dims(sizes, config)
    synced = synced or {}
    if delegated:
        rest = plan_finalize(
            params, config, sizes, routers, dp_sync=False, merge=merge, stage=stage, synced=synced
        )
        own = [p for p in params if p.chunk not in delegated and Step.DP_SYNC not in synced.get(p.key, ())]
        sync = plan_finalize(own, config, sizes, force_all_reduce=force_all_reduce, merge=merge) if own and dp_sync else None
        first = sync.for_step(Step.DP_SYNC) if sync is not None else ()
        return dataclasses.replace(rest, actions=first + rest.actions, delegated=frozenset(delegated))
    params = tuple(params)
    routers = tuple(routers)
    planners.check_unique(params, routers)
    actions = _planned_actions(params, config, sizes, routers, force_all_reduce, dp_sync, stage, synced)
    final = merge_reductions(actions) if merge else tuple(actions)
    layout, final = buffer_layout(final, params)
    return FinalizePlan(final, config, sizes, params, routers, planners.token_scale(params), layout)


__all__ = [
    "Action",
    "EMBEDDING_STEPS",
    "ExpertBiasUpdate",
    "FLATTENED_STEPS",
    "FinalizePlan",
    "GroupSizes",
    "Layout",
    "Operand",
    "QK_LAYERNORM_NAMES",
    "QbBetaUpdate",
    "ReduceOp",
    "Reduction",
    "ResetTemporaries",
    "STAGE_GROUPS",
    "STAGE_LOCAL_GROUPS",
    "Signature",
    "StageReduction",
    "Step",
    "TokenScale",
    "buffer_layout",
    "embedding_chunk",
    "merge_reductions",
    "plan_finalize",
    "promote_dtypes",
    "scatter_shard",
]
