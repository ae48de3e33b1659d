"""Mesh axes, parallel dimensions and the named groups of docs/semantics.md.

Dense parameters see the ranks as ``pp, dp, cp, gtp, tp`` (slowest to fastest);
expert parameters see the same ranks as ``pp, edp, egtp, ep, etp``. A size-1 axis means
"no communication". Everything here is pure Python: no torch, no jax.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Iterable, Sequence


class Axis(str, enum.Enum):
    """Names of mesh axes, shared by both backends (a torch DeviceMesh and a jax Mesh)."""

    PP = "pp"
    DP = "dp"
    CP = "cp"
    GTP = "gtp"
    TP = "tp"
    EDP = "edp"
    EGTP = "egtp"
    EP = "ep"
    ETP = "etp"

    def __str__(self) -> str:
        return self.value


#: Dense axes, slowest to fastest varying (Megatron order tp-cp-dp-pp, gtp right after tp).
DENSE_AXES: tuple[Axis, ...] = (Axis.PP, Axis.DP, Axis.CP, Axis.GTP, Axis.TP)
#: Expert axes, slowest to fastest varying (egtp right after ep).
EXPERT_AXES: tuple[Axis, ...] = (Axis.PP, Axis.EDP, Axis.EGTP, Axis.EP, Axis.ETP)


class Group(str, enum.Enum):
    """Named groups of docs/semantics.md, "Ranks, axes and groups" (Megatron ``ProcessGroupCollection`` fields).

    Each member's name is its value upper-cased (``Group.EXPT_DP.value == "expt_dp"``);
    the older short names (``EDP``, ``GTP``, ``EGTP``, ``DP_CP_GTP``) are aliases.
    """

    TP = "tp"
    PP = "pp"
    DP_CP = "dp_cp"
    EXPT_DP = "expt_dp"
    TP_DP_CP = "tp_dp_cp"
    EMBD = "embd"
    POS_EMBD = "pos_embd"
    GTP_REMAT = "gtp_remat"
    EXPT_GTP_REMAT = "expt_gtp_remat"
    DP_CP_GTP_REMAT = "dp_cp_gtp_remat"
    # Older names, kept as aliases of the members above (``Group.EDP is Group.EXPT_DP``).
    EDP = "expt_dp"
    GTP = "gtp_remat"
    EGTP = "expt_gtp_remat"
    DP_CP_GTP = "dp_cp_gtp_remat"

    def __str__(self) -> str:
        return self.value


#: The axes each group varies. EMBD and POS_EMBD vary ``pp`` over a subset of stages.
GROUP_AXES: dict[Group, tuple[Axis, ...]] = {
    Group.TP: (Axis.TP,),
    Group.PP: (Axis.PP,),
    Group.DP_CP: (Axis.DP, Axis.CP),
    Group.EDP: (Axis.EDP,),
    Group.TP_DP_CP: (Axis.DP, Axis.CP, Axis.GTP, Axis.TP),  # spans gtp, as Megatron builds it
    Group.EMBD: (Axis.PP,),
    Group.POS_EMBD: (Axis.PP,),
    Group.GTP: (Axis.GTP,),
    Group.EGTP: (Axis.EGTP,),
    Group.DP_CP_GTP: (Axis.DP, Axis.CP, Axis.GTP),
}


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ParallelDims.{name} must be a positive int, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    """Sizes of every mesh axis, validated once and passed explicitly.

    Args:
      pp, dp, cp, tp: dense axis sizes.
      gtp: GTP-remat factor of the dense view (1 = inactive).
      ep: expert-parallel size.
      etp: expert tensor-parallel size (defaults to ``tp``).
      egtp: GTP-remat factor of the expert view (1 = inactive).
      edp: expert data-parallel size (derived when omitted so both views cover the
        same ranks).

    Raises:
      ValueError: a size is not a positive int, or the two views disagree on the world.
    """

    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1
    gtp: int = 1
    ep: int = 1
    etp: int | None = None
    egtp: int = 1
    edp: int | None = None

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "cp", "tp", "gtp", "ep", "egtp"):
            _positive(name, getattr(self, name))
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        _positive("etp", self.etp)
        inner = self.dp * self.cp * self.gtp * self.tp
        expert_inner = self.ep * self.etp * self.egtp
        if self.edp is None:
            if inner % expert_inner:
                raise ValueError(
                    f"ParallelDims: ep*etp*egtp = {expert_inner} does not divide "
                    f"dp*cp*gtp*tp = {inner}; no expert data-parallel size fits"
                )
            object.__setattr__(self, "edp", inner // expert_inner)
        _positive("edp", self.edp)
        if self.edp * expert_inner != inner:
            raise ValueError(
                f"ParallelDims: expert view edp*egtp*ep*etp = {self.edp * expert_inner} "
                f"!= dense view dp*cp*gtp*tp = {inner}"
            )

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.gtp * self.tp

    def size(self, axis: Axis | str) -> int:
        """Size of one axis."""
        return int(getattr(self, Axis(axis).value))

    def dense_shape(self) -> tuple[int, ...]:
        return tuple(self.size(a) for a in DENSE_AXES)

    def expert_shape(self) -> tuple[int, ...]:
        return tuple(self.size(a) for a in EXPERT_AXES)

    def group_size(self, group: Group | str) -> int:
        """Number of ranks in a named group (embd/pos_embd: use :func:`stage_set`)."""
        size = 1
        for axis in GROUP_AXES[Group(group)]:
            size *= self.size(axis)
        return size

    def check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks")

    def coords(self, rank: int) -> dict[Axis, int]:
        """Coordinates of ``rank`` on every axis of both views."""
        self.check_rank(rank)
        out: dict[Axis, int] = {}
        for axes in (DENSE_AXES, EXPERT_AXES):
            rest = rank
            for axis in reversed(axes):
                out[axis] = rest % self.size(axis)
                rest //= self.size(axis)
        return out

    def rank_of(self, coords: dict[Axis, int] | dict[str, int], expert: bool = False) -> int:
        """Rank at the given coordinates of the dense (or expert) view; missing axes are 0."""
        axes = EXPERT_AXES if expert else DENSE_AXES
        named = {Axis(k): v for k, v in coords.items()}
        rank = 0
        for axis in axes:
            value = named.get(axis, 0)
            if not 0 <= value < self.size(axis):
                raise ValueError(f"coordinate {axis}={value} outside [0, {self.size(axis)})")
            rank = rank * self.size(axis) + value
        return rank

    def axis_ranks(self, rank: int, axes: Iterable[Axis | str]) -> list[int]:
        """Ranks that share ``rank``'s coordinates except along ``axes`` (sorted)."""
        axes = [Axis(a) for a in axes]
        expert = any(a in (Axis.EDP, Axis.EGTP, Axis.EP, Axis.ETP) for a in axes)
        if expert and any(a in (Axis.DP, Axis.CP, Axis.GTP, Axis.TP) for a in axes):
            raise ValueError(f"axes {axes} mix the dense and the expert view")
        base = self.coords(rank)
        ranks = []
        for values in itertools.product(*(range(self.size(a)) for a in axes)):
            point = dict(base)
            point.update(zip(axes, values))
            ranks.append(self.rank_of(point, expert=expert))
        return sorted(ranks)

    def group_ranks(
        self, group: Group | str, rank: int, stages: Sequence[int] | None = None
    ) -> list[int]:
        """Members of ``rank``'s named group; empty when ``rank`` is not a member.

        Args:
          group: the named group.
          rank: a global rank.
          stages: for EMBD / POS_EMBD, the member pp stages (see :func:`stage_set`).
        """
        group = Group(group)
        if group in (Group.EMBD, Group.POS_EMBD):
            if stages is None:
                raise ValueError(f"group {group} needs its pp stage set")
            stage_set = sorted(set(stages))
            if self.coords(rank)[Axis.PP] not in stage_set:
                return []
            point = self.coords(rank)
            return sorted(self.rank_of({**point, Axis.PP: s}) for s in stage_set)
        return self.axis_ranks(rank, GROUP_AXES[group])

    def all_groups(self, group: Group | str, stages: Sequence[int] | None = None) -> list[list[int]]:
        """Every instance of a named group, as sorted rank lists, in a fixed order."""
        seen: dict[tuple[int, ...], None] = {}
        for rank in range(self.world_size):
            members = tuple(self.group_ranks(group, rank, stages))
            if members:
                seen.setdefault(members, None)
        return [list(m) for m in seen]


def stage_set(stages: Sequence[int] | None, pp: int, default: str) -> tuple[int, ...]:
    """Resolve a configured pp stage set (None = the default) and validate it.

    Args:
      stages: configured stages or None.
      pp: pipeline size.
      default: ``"first_last"`` (word embedding) or ``"first"`` (position embedding).

    Returns:
      Sorted, de-duplicated stage indices.
    """
    if stages is None:
        stages = (0, pp - 1) if default == "first_last" else (0,)
    out = tuple(sorted({int(s) for s in stages}))
    for s in out:
        if not 0 <= s < pp:
            raise ValueError(f"embedding stage {s} is outside pp stages [0, {pp})")
    return out
