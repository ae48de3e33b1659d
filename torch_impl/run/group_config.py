"""How a :class:`~torch_impl.run.groups.TorchGroups` meets the config: the pp stages its
embedding groups plan with, and the messages for a group that is missing or whose size
differs from what the config states.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Protocol

from meshgrad.axes import Group, stage_set
from meshgrad.config import FinalizeConfig
from meshgrad.errors import FinalizeInputError
from meshgrad.plan import STAGE_GROUPS


class TorchGroups(Protocol):
    """What these functions read of a :class:`torch_impl.run.groups.TorchGroups`."""

    rank: int
    source: str
    stages: Mapping[Group, tuple[int, ...] | None]
    missing: Collection[Group]

    @property
    def pp_size(self) -> int: ...

    @property
    def pp_stage(self) -> int: ...

    def size(self, group: Group) -> int: ...

#: Per embedding group: the config field of its stage set and that field's default.
STAGE_CONFIG = (
    (Group.EMBD, "embedding_stages", "first_last"),
    (Group.POS_EMBD, "position_embedding_stages", "first"),
)


def planned_stages(
    groups: TorchGroups, config: FinalizeConfig, group: Group, name: str, default: str
) -> tuple[int, ...]:
    """The pp stages an embedding group plans with: its member stages, or for a non-member
    the configured stage set without its own stage.

    Args:
      groups: this rank's groups.
      config: the finalize config.
      group: EMBD or POS_EMBD.
      name: the config field of the group's stage set.
      default: that field's default (for :func:`meshgrad.axes.stage_set`).

    Returns:
      The stages to plan with.

    Raises:
      ValueError: the configured stage set is invalid or disagrees with the group's members.
    """
    configured = getattr(config, name)
    stages = groups.stages.get(group)
    try:
        wanted = stage_set(configured, groups.pp_size, default)
    except ValueError as err:
        raise FinalizeInputError(f"rank {groups.rank}: config.{name}: {err}") from None
    if stages is None:
        return tuple(s for s in wanted if s != groups.pp_stage)
    if configured is not None and tuple(stages) != wanted:
        raise FinalizeInputError(
            f"rank {groups.rank}: group {group.value!r} of the {groups.source} spans pp "
            f"stages {list(stages)} but config.{name} = {list(configured)}"
        )
    return tuple(stages)


def missing_message(groups: TorchGroups, group: Group, why: str) -> str:
    """The error for a required ``group`` the source does not define."""
    return (
        f"rank {groups.rank}: process group {group.value!r} is missing from the "
        f"{groups.source}; it is required ({why}). Set it (None if it has size 1)."
    )


def size_mismatch(groups: TorchGroups, group: Group, size: int, why: str) -> str | None:
    """The message for ``group`` not having the expected ``size`` (None: it matches, or
    it is an embedding group, whose size the config does not state)."""
    have = groups.size(group)
    if group in STAGE_GROUPS or size == have or (size <= 1 and have <= 1):
        return None
    state = "missing" if group in groups.missing else f"of size {have}"
    return (
        f"rank {groups.rank}: process group {group.value!r} is {state} in the "
        f"{groups.source}, expected size {size} ({why})"
    )


__all__ = ["STAGE_CONFIG", "missing_message", "planned_stages", "size_mismatch"]
