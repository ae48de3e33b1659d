"""Named meshgrad groups as torch ProcessGroups, from a DeviceMesh or a group collection.

:class:`TorchGroups` is one rank's view of the named groups of docs/semantics.md (ranks, axes and groups): the
process group of each :class:`meshgrad.Group` (``None`` = size 1, no communication), its
pipeline stage and the pp stages of the embedding groups. It comes from

* a Megatron ``ProcessGroupCollection`` or any object with its attribute names
  (:meth:`TorchGroups.from_collection`), or a plain mapping (:meth:`TorchGroups.from_mapping`);
* a torch ``DeviceMesh`` whose dim names are meshgrad axis names, through
  :class:`~torch_impl.sources.mesh_groups.MeshGroups`, which builds the multi-axis, expert and embedding groups with
  ``dist.new_group`` once and caches them on itself;
* Megatron's ``parallel_state`` and ``ProcessGroupCollection`` through
  :mod:`torch_impl.sources.megatron` and :mod:`torch_impl.sources.pg_collection`.

Nothing here is global: the caller keeps the objects.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch.distributed as dist

from meshgrad.axes import Group
from meshgrad.config import FinalizeConfig
from meshgrad.errors import FinalizeInputError
from meshgrad.plan import GroupSizes
from torch_impl.run.group_config import STAGE_CONFIG, missing_message, planned_stages, size_mismatch
from torch_impl.run.warn import warn_user

ProcessGroup = Any  # torch.distributed.ProcessGroup; Any keeps duck-typed groups usable
STAGE_GROUPS = (Group.EMBD, Group.POS_EMBD)


def world_rank() -> int:
    """This process's global rank (0 when torch.distributed is not initialized)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """The world size (1 when torch.distributed is not initialized)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


_NON_MEMBER = getattr(dist.GroupMember, "NON_GROUP_MEMBER", object())


def _is_group(value: Any) -> bool:
    return value is not None and value is not _NON_MEMBER


def group_ranks(group: ProcessGroup) -> list[int]:
    """Global ranks of ``group`` in group-rank order."""
    ranks = dist.get_process_group_ranks(group)
    return sorted(ranks, key=lambda r: dist.get_group_rank(group, r))


@dataclasses.dataclass(frozen=True, eq=False)
class TorchGroups:
    """One rank's process groups for every named group.

    Args:
      rank: this process's global rank.
      groups: per Group, the ProcessGroup this rank is a member of, or None (size 1, or
        for EMBD / POS_EMBD possibly "not a member").
      sizes: per Group, its size (1 where the group is None).
      pp_ranks: global ranks of this rank's pp group, by pp stage.
      stages: for EMBD / POS_EMBD, the member pp stages, or None when this rank is not a
        member.
      missing: groups the source does not define at all (collections only).
      source: a short description of where the groups came from (for errors).
      first_stage_for: embedding groups whose chunk rule treats this rank as the first
        pipeline stage (Megatron does so for a collection without ``pp``).
      token_broadcast: (group, source rank) of the num_tokens broadcast when it is not
        the pp group's last stage (Megatron: the world's last rank without ``pp``).
      layout: the digest of the DeviceMesh group layout these groups were built for (0:
        not from a DeviceMesh); it travels in every status round, which then runs over the
        world (:mod:`torch_impl.run.status`).
      layout_text: that layout in words (for errors).
      routes: a cache of the status round's routes over these groups.
      quiet_rounds: the quiet rounds of those routes, each with the host wire its rounds reuse.
      fused: a cache of whether a status round carries the token count, per round and
        kind of count (:func:`torch_impl.run.status.fused_tokens`).
      token_counts: the token count's collectives bound once, per token group, for calls
        whose round does not carry it (:mod:`torch_impl.run.token_count`).
    """

    rank: int
    groups: Mapping[Group, ProcessGroup | None]
    sizes: Mapping[Group, int]
    pp_ranks: tuple[int, ...]
    stages: Mapping[Group, tuple[int, ...] | None]
    missing: frozenset[Group] = frozenset()
    source: str = "process groups"
    first_stage_for: frozenset[Group] = frozenset()
    token_broadcast: tuple[ProcessGroup, int] | None = None
    layout: int = 0
    layout_text: str = ""
    #: Status-round routes computed for these groups (torch_impl.run.status.status_route).
    routes: dict[tuple[Group, ...], Any] = dataclasses.field(default_factory=dict, init=False, repr=False)
    #: Quiet rounds of those routes (torch_impl.run.quiet_round.QuietRound), dropped when a round fails.
    quiet_rounds: dict[tuple[Group, ...], Any] = dataclasses.field(default_factory=dict, init=False, repr=False)
    #: fused_tokens' answers, per (groups of the round, token group, count's dtype, device, numel).
    fused: dict[tuple[Any, ...], bool] = dataclasses.field(default_factory=dict, init=False, repr=False)
    #: The token count's bound collectives per token group (torch_impl.run.token_count.TokenCount),
    #: dropped when one fails on the host word.
    token_counts: dict[Group, Any] = dataclasses.field(default_factory=dict, init=False, repr=False)

    # ------------------------------------------------------------------ queries
    def group(self, group: Group) -> ProcessGroup | None:
        """The process group to communicate over, or None when there is nothing to do."""
        return self.groups.get(group) if self.size(group) > 1 else None

    def size(self, group: Group) -> int:
        return int(self.sizes.get(group, 1))

    @property
    def pp_size(self) -> int:
        return len(self.pp_ranks)

    @property
    def pp_stage(self) -> int:
        return self.pp_ranks.index(self.rank)

    def embedding_stage(self, group: Group) -> int:
        """The pp stage whose chunk rule an embedding group's step applies on this rank."""
        return 0 if group in self.first_stage_for else self.pp_stage

    @property
    def pp_last_rank(self) -> int:
        """Global rank of the last pipeline stage of this rank's pp group."""
        return self.pp_ranks[-1]

    def group_sizes(self, config: FinalizeConfig) -> GroupSizes:
        """The :class:`meshgrad.plan.GroupSizes` to plan with.

        Members of EMBD / POS_EMBD use the stages of their group; a non-member uses the
        configured stage set without its own stage (it then does nothing).

        Raises:
          ValueError: the configured stage set disagrees with the group's members.
        """
        embd, pos = (planned_stages(self, config, *spec) for spec in STAGE_CONFIG)
        plain = {g: self.size(g) for g in Group if g not in STAGE_GROUPS}
        plain[Group.PP] = self.pp_size
        return GroupSizes(sizes=plain, embd_stages=embd, pos_embd_stages=pos)

    # ------------------------------------------------------------------ validation
    def check(
        self,
        required: Mapping[Group, str] | None = None,
        expected: Mapping[Group, tuple[int, str]] | None = None,
        *,
        strict: bool = True,
    ) -> None:
        """Raise before any communication when a needed group is absent; raise (``strict``)
        or warn when a group's size differs from what the config states.

        Args:
          required: groups that must be defined by the source, with the reason.
          expected: groups whose size should equal a value, with the reason.
          strict: a size mismatch raises instead of warning.

        Raises:
          ValueError: naming the group, this rank and what was expected.
        """
        for group, why in (required or {}).items():
            if group in self.missing:
                raise FinalizeInputError(missing_message(self, group, why))
        for group, (size, why) in (expected or {}).items():
            message = size_mismatch(self, group, size, why)
            if message is None:
                continue
            if strict:
                raise FinalizeInputError(message)
            warn_user(
                f"{message}; running with the groups as given, as Megatron-Core does "
                "(config.strict_groups = True makes this an error)"
            )

    # ------------------------------------------------------------------ constructors
    @classmethod
    def trivial(cls, rank: int | None = None, source: str = "trivial groups") -> "TorchGroups":
        """Every group of size 1 (a world of one rank)."""
        rank = world_rank() if rank is None else rank
        return cls(
            rank=rank,
            groups={},
            sizes={},
            pp_ranks=(rank,),
            stages={Group.EMBD: (0,), Group.POS_EMBD: (0,)},
            source=source,
        )

    @classmethod
    def from_collection(cls, collection: Any, source: str | None = None) -> "TorchGroups":
        """From a ``ProcessGroupCollection`` (or any object with its attribute names).

        An attribute set to None is a size-1 group (EMBD / POS_EMBD: this rank is not a
        member); an absent attribute is recorded in ``missing``.
        """
        values = {g: getattr(collection, g.value) for g in Group if hasattr(collection, g.value)}
        return cls.from_mapping(values, defined=frozenset(values), source=source or type(collection).__name__)

    @classmethod
    def from_mapping(
        cls,
        values: Mapping[Group | str, ProcessGroup | None],
        defined: Iterable[Group | str] | None = None,
        source: str = "process groups",
        rank: int | None = None,
    ) -> "TorchGroups":
        """From ``{group: ProcessGroup or None}``; see :func:`groups_from_mapping`."""
        return groups_from_mapping(values, defined, source, rank, factory=cls)


def groups_from_mapping(
    values: Mapping[Group | str, ProcessGroup | None],
    defined: Iterable[Group | str] | None = None,
    source: str = "process groups",
    rank: int | None = None,
    factory: type[TorchGroups] = TorchGroups,
) -> TorchGroups:
    """:class:`TorchGroups` from ``{group: ProcessGroup or None}``; unlisted groups are size 1.

    Args:
      values: the groups this rank belongs to.
      defined: the groups the source defines (default: the keys of ``values``).
      source: description used in error messages.
      rank: global rank (default: this process's).
      factory: the class to build (``TorchGroups`` or a subclass).

    Returns:
      This rank's groups.

    Raises:
      ValueError: this rank is not a member of a group it was given (other than
        EMBD / POS_EMBD), or the embedding group is not within its pp group.
    """
    rank = world_rank() if rank is None else rank
    named = {Group(g): v for g, v in values.items()}
    defined_set = frozenset(Group(g) for g in (named if defined is None else defined))
    if Group.DP_CP_GTP not in named and Group.DP_CP in named:
        # num_tokens / qb_beta reduce over dp_cp x gtp; without GTP that is dp_cp. The
        # alias is not "defined": a plan with GTP active still needs the real group.
        named[Group.DP_CP_GTP] = named[Group.DP_CP]
    groups, sizes, member_ranks = _memberships(named, rank, source)
    pp_ranks = tuple(member_ranks.get(Group.PP) or (rank,))
    stages = _stages(named, member_ranks, pp_ranks, Group.PP in defined_set, rank, source)
    return factory(
        rank=rank,
        groups=groups,
        sizes=sizes,
        pp_ranks=pp_ranks,
        stages=stages,
        missing=frozenset(Group) - defined_set,
        source=source,
    )


def _memberships(
    named: Mapping[Group, Any], rank: int, source: str
) -> tuple[dict[Group, ProcessGroup | None], dict[Group, int], dict[Group, list[int] | None]]:
    """Per group: the process group this rank communicates over (None: size 1 or, for
    EMBD / POS_EMBD, not a member), its size and its members.

    Raises:
      ValueError: this rank is not a member of a group it was given (other than EMBD /
        POS_EMBD).
    """
    groups: dict[Group, ProcessGroup | None] = {}
    sizes: dict[Group, int] = {}
    member_ranks: dict[Group, list[int] | None] = {}
    for group, value in named.items():
        if value is _NON_MEMBER and group not in STAGE_GROUPS:
            raise FinalizeInputError(
                f"rank {rank} is not a member of the {group.value!r} group given by the {source} "
                "(dist.new_group returned NON_GROUP_MEMBER here)"
            )
        if not _is_group(value):
            groups[group], sizes[group] = None, 1
            member_ranks[group] = None
            continue
        ranks = group_ranks(value)
        if rank not in ranks:
            if group in STAGE_GROUPS:
                groups[group], sizes[group] = None, 1
                member_ranks[group] = None
                continue
            raise FinalizeInputError(
                f"rank {rank} is not a member of the {group.value!r} group {ranks} given by "
                f"the {source}"
            )
        groups[group], sizes[group] = value, len(ranks)
        member_ranks[group] = ranks
    return groups, sizes, member_ranks


def _stages(
    named: Mapping[Group, Any],
    member_ranks: Mapping[Group, list[int] | None],
    pp_ranks: tuple[int, ...],
    pp_defined: bool,
    rank: int,
    source: str,
) -> dict[Group, tuple[int, ...] | None]:
    """For EMBD / POS_EMBD, the member pp stages (None: this rank is not a member).

    Raises:
      ValueError: the group has ranks outside this rank's pp group.
    """
    stages: dict[Group, tuple[int, ...] | None] = {}
    for group in STAGE_GROUPS:
        ranks = member_ranks.get(group)
        if ranks is None:
            # None / absent: a member of a size-1 group when pp == 1, else not a member.
            stages[group] = (0,) if len(pp_ranks) == 1 and _is_none_group(named, group) else None
            continue
        outside = [r for r in ranks if r not in pp_ranks]
        if outside and not pp_defined:
            raise FinalizeInputError(
                f"rank {rank}: process group 'pp' is missing from the {source}; it is required "
                f"(the {group.value!r} group {ranks} spans several pipeline stages)"
            )
        if outside:
            raise FinalizeInputError(
                f"rank {rank}: the {group.value!r} group {ranks} of the {source} has ranks "
                f"{outside} outside this rank's pp group {list(pp_ranks)}"
            )
        stages[group] = tuple(sorted(pp_ranks.index(r) for r in ranks))
    return stages


def _is_none_group(named: Mapping[Group, Any], group: Group) -> bool:
    return not _is_group(named.get(group))
