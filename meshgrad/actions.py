"""The actions of a finalize plan: what one step communicates, as data.

Each action type owns its groups (:meth:`groups`), its human text (:meth:`describe` for
errors, :meth:`summary` for a plan listing), its structured signature (:meth:`signature`:
what the members of its group must launch identically, as a
:class:`~meshgrad.signature.Signature`) and the router buffers it updates in place
(:meth:`router_writes`). Backends map action type to executor in one table each; adding an
action type touches this module, the planner and one entry per backend.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping
from typing import ClassVar

from meshgrad.axes import Group
from meshgrad.params import ParamKey
from meshgrad.signature import Operand, Signature

#: A group's size, when a description should show it (e.g. ``TorchGroups.size``).
SizeOf = Callable[[Group], int]
#: Gradient shapes by key (from the plan's ParamSpecs).
Shapes = Mapping[ParamKey, tuple[int, ...]]


class Step(str, enum.Enum):
    """The steps of docs/semantics.md, in execution order."""

    DP_SYNC = "dp_sync"
    COND_EMBEDDER = "cond_embedder"
    ROUTER = "router"
    NON_TP = "non_tp"
    GTP = "gtp"
    WORD_EMBEDDING = "word_embedding"
    POS_EMBEDDING = "pos_embedding"
    EXPERT_BIAS = "expert_bias"
    QB_BETA = "qb_beta"
    RESET = "reset"
    TOKEN_SCALE = "token_scale"

    def __str__(self) -> str:
        return self.value


class ReduceOp(str, enum.Enum):
    """The reduction of a collective."""

    SUM = "sum"
    AVG = "avg"

    def __str__(self) -> str:
        return self.value


def _size_text(group: Group, size_of: SizeOf | None) -> str:
    return f" (size {size_of(group)})" if size_of is not None else ""


@dataclasses.dataclass(frozen=True)
class Reduction:
    """One coalesced collective over one named group.

    Args:
      step: the step it implements.
      group: the named group it reduces over.
      op: SUM or AVG.
      keys: gradients reduced together (all of one dtype).
      dtype: their dtype name.
      pre_scale: multiply before the collective (1.0 = none).
      scatter: reduce-scatter (distributed optimizer) instead of all-reduce; see
        :func:`meshgrad.layout.scatter_shard` for the shard layout.
      reduce_in_fp32: run the collective in float32 whatever the gradient dtype.
      copies: per key, further local gradients (other chunks' copies) summed into the
        key's gradient before the collective and overwritten with the result after.
      parts: when :func:`meshgrad.fusion.merge_reductions` fused several reductions into
        this one, the reductions it replaces (in order); empty otherwise. A fused
        reduction may hold keys of several dtypes: ``dtype`` is then the dtype the
        collective runs in (their promotion, as Megatron's ``_flatten_dense_tensors``).
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
        """The keys and, after them, every copy."""
        extra = tuple(k for c in self.copies for k in c)
        return self.keys + extra

    @property
    def steps(self) -> tuple[Step, ...]:
        """The steps this reduction implements (several when fused)."""
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

    @property
    def step_text(self) -> str:
        """Its steps, ``"+"``-joined."""
        return "+".join(map(str, self.steps))

    def groups(self) -> tuple[Group, ...]:
        """The groups it communicates over."""
        return (self.group,)

    def router_writes(self) -> tuple[tuple[ParamKey, str], ...]:
        """None: it writes gradients only."""
        return ()

    def describe(self, size_of: SizeOf | None = None) -> str:
        """One line for errors: steps, op, collective, group (and its size), tensor count."""
        kind = "reduce-scatter" if self.scatter else "all-reduce"
        return (
            f"{self.step_text}: {self.op} {kind} over group {str(self.group)!r}{_size_text(self.group, size_of)} "
            f"of {len(self.all_keys)} {self.dtype} tensor(s), first {self.keys[0][1]!r}"
        )

    def summary(self) -> str:
        """One line for a plan listing: steps, op, group, scale, tensor count."""
        scatter = " scatter" if self.scatter else ""
        return (
            f"{self.step_text}: {self.op} over {self.group} x{self.pre_scale:g} "
            f"[{len(self.all_keys)} {self.dtype}{scatter}]"
        )

    def signature(self, stage: int | None, shapes: Shapes) -> tuple[Signature, ...]:
        """Its collective: op, scale, dtype, layout and every key's name and shape."""
        operands = tuple(Operand(k[1], shapes[k]) for k in self.keys)
        return (
            Signature(self.group, self.step_text, self.op, self.pre_scale, self.dtype, self.scatter, operands),
        )


@dataclasses.dataclass(frozen=True)
class StageReduction:
    """A SUM over a subset of pp stages (word / position embedding).

    Args:
      step: WORD_EMBEDDING or POS_EMBEDDING.
      group: EMBD or POS_EMBD.
      stages: member pp stages; other stages do nothing.
      keys_by_stage: per pp stage (index = stage), the gradient that stage contributes,
        or None when that stage has none (not a member, or frozen).
      dtype: gradient dtype.
      op: the reduction over the member stages (SUM, as Megatron; AVG divides by the
        number of member stages), so a variant can change it with ``dataclasses.replace``.
    """

    step: Step
    group: Group
    stages: tuple[int, ...]
    keys_by_stage: tuple[ParamKey | None, ...]
    dtype: str
    op: ReduceOp = ReduceOp.SUM

    def key_for(self, stage: int) -> ParamKey | None:
        """The gradient ``stage`` contributes (None: not a member, or none)."""
        return self.keys_by_stage[stage] if stage in self.stages else None

    def chunk_for(self, stage: int) -> int | None:
        """The model chunk whose embedding ``stage`` contributes (None: nothing)."""
        key = self.key_for(stage)
        return None if key is None else key[0]

    def distinct_keys(self) -> tuple[ParamKey, ...]:
        """Every contributed key once, in stage order."""
        return tuple(dict.fromkeys(k for k in self.keys_by_stage if k is not None))

    def groups(self) -> tuple[Group, ...]:
        """The groups it communicates over."""
        return (self.group,)

    def router_writes(self) -> tuple[tuple[ParamKey, str], ...]:
        """None: it writes gradients only."""
        return ()

    def describe(self, size_of: SizeOf | None = None) -> str:
        """One line for errors: step, group and its stages."""
        return (
            f"{self.step}: {self.op} all-reduce over group {str(self.group)!r} (pp stages "
            f"{list(self.stages)}) of 1 {self.dtype} tensor"
        )

    def summary(self) -> str:
        """One line for a plan listing."""
        return f"{self.step}: {self.op} over {self.group} stages {list(self.stages)}"

    def signature(self, stage: int | None, shapes: Shapes) -> tuple[Signature, ...]:
        """Its collective (the operand of ``stage``, or of every stage when None) and stages."""
        keys = self.keys_by_stage if stage is None else (self.key_for(stage),)
        operands = tuple(Operand(None, shapes[k]) for k in keys if k is not None)
        return (
            Signature(self.group, str(self.step), self.op, dtype=self.dtype, operands=operands, stages=self.stages),
        )


class _RouterUpdate:
    """Groups, listing and signature of a router-buffer update (a mixin)."""

    #: The buffer it writes in place on each of its routers.
    BUFFER: ClassVar[str]

    routers: tuple[ParamKey, ...]
    num_experts: tuple[int, ...]
    group: Group
    step: Step

    def groups(self) -> tuple[Group, ...]:
        """The groups it communicates over."""
        return (self.group,)

    def summary(self) -> str:
        """One line for a plan listing."""
        return f"{self.step}: {type(self).__name__}"

    def signature(self, stage: int | None, shapes: Shapes) -> tuple[Signature, ...]:
        """Its collective (expert counts) and the routers whose buffers meet in it."""
        return (Signature(self.group, str(self.step), experts=self.num_experts, routers=self.routers),)

    def router_writes(self) -> tuple[tuple[ParamKey, str], ...]:
        """(router key, buffer attribute) of each buffer it updates in place."""
        return tuple((key, self.BUFFER) for key in self.routers)


@dataclasses.dataclass(frozen=True)
class ExpertBiasUpdate(_RouterUpdate):
    """Sum token counts over tp_dp_cp (one collective), sign-update the bias."""

    BUFFER: ClassVar[str] = "expert_bias"

    routers: tuple[ParamKey, ...]
    num_experts: tuple[int, ...]
    rate: float
    group: Group = Group.TP_DP_CP
    step: Step = Step.EXPERT_BIAS

    def describe(self, size_of: SizeOf | None = None) -> str:
        """One line for errors."""
        return (
            f"{self.step}: sum all-reduce over group {str(self.group)!r}{_size_text(self.group, size_of)} "
            f"of the token counts of {len(self.routers)} router(s)"
        )


@dataclasses.dataclass(frozen=True)
class QbBetaUpdate(_RouterUpdate):
    """AVG accum/max(count,1) over ``group``, EMA-blend, re-centre."""

    BUFFER: ClassVar[str] = "qb_beta"

    routers: tuple[ParamKey, ...]
    num_experts: tuple[int, ...]
    ema: float
    group: Group
    step: Step = Step.QB_BETA

    def describe(self, size_of: SizeOf | None = None) -> str:
        """One line for errors."""
        return (
            f"{self.step}: avg all-reduce over group {str(self.group)!r}{_size_text(self.group, size_of)} "
            f"of the qb_beta means of {len(self.routers)} router(s)"
        )


class _LocalAction:
    """Text and signature of an action whose collectives are not planned ones (a mixin)."""

    step: Step

    def describe(self, size_of: SizeOf | None = None) -> str:
        """One line for errors."""
        return f"{self.step}: {type(self).__name__} (local)"

    def summary(self) -> str:
        """One line for a plan listing."""
        return f"{self.step}: {type(self).__name__}"

    def signature(self, stage: int | None, shapes: Shapes) -> tuple[Signature, ...]:
        """None planned (a token scale's collectives depend on the num_tokens tensor)."""
        return ()

    def router_writes(self) -> tuple[tuple[ParamKey, str], ...]:
        """None (a reset names the buffers it zeroes)."""
        return ()


@dataclasses.dataclass(frozen=True)
class ResetTemporaries(_LocalAction):
    """Zero token counts / qb accumulators, reset the global aux-loss tracker."""

    #: The buffer zeroed on each router of ``zero_tokens``, and those of ``zero_qb``.
    TOKENS: ClassVar[str] = "local_tokens_per_expert"
    QB_ACCUMULATORS: ClassVar[tuple[str, ...]] = ("qb_beta_accum", "qb_beta_count")

    zero_tokens: tuple[ParamKey, ...]
    zero_qb: tuple[ParamKey, ...]
    reset_aux_loss: tuple[ParamKey, ...]
    step: Step = Step.RESET

    def groups(self) -> tuple[Group, ...]:
        """None: local."""
        return ()

    def router_writes(self) -> tuple[tuple[ParamKey, str], ...]:
        """(router key, buffer attribute) of each buffer it zeroes."""
        return tuple((key, self.TOKENS) for key in self.zero_tokens) + tuple(
            (key, attr) for key in self.zero_qb for attr in self.QB_ACCUMULATORS
        )


@dataclasses.dataclass(frozen=True)
class TokenScale(_LocalAction):
    """Broadcast num_tokens from the last pp stage, SUM over ``group``, scale every
    gradient in ``keys`` by 1/max(n, 1) on device."""

    keys: tuple[ParamKey, ...]
    group: Group
    step: Step = Step.TOKEN_SCALE

    def groups(self) -> tuple[Group, ...]:
        """pp (the broadcast from the last stage), then the sum's group."""
        return (Group.PP, self.group)


Action = Reduction | StageReduction | ExpertBiasUpdate | QbBetaUpdate | ResetTemporaries | TokenScale

__all__ = [
    "Action", "ExpertBiasUpdate", "Operand", "QbBetaUpdate", "ReduceOp", "Reduction", "ResetTemporaries",
    "Shapes", "Signature", "SizeOf", "StageReduction", "Step", "TokenScale",
]
