"""Megatron's helper functions (the ``_allreduce_*`` / ``_update_*`` ones) over the call
pipeline: a helper's steps run over its own groups (:func:`run_helper`); the embedding
helpers' groups and request (:func:`embedding_grad`: the read stage picks the chunk and
its weight, :func:`torch_impl.sources.embedding_read.embedding_weight`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist
from torch import nn

from meshgrad.axes import Group
from meshgrad.params import Role
from meshgrad.plan import Step
from torch_impl.call.pipeline import call
from torch_impl.call.read import Request
from torch_impl.sources.embedding_read import EmbeddingRead
from torch_impl.run.groups import TorchGroups, world_rank

ProcessGroup = Any


def run_helper(model: Any, groups: Mapping[Group, Any] | TorchGroups, request: Request) -> None:
    """Run a seed helper's steps over its own groups (its status round and comparison
    over them too) through the call pipeline."""
    if not request.over and not isinstance(groups, TorchGroups):
        request = request._replace(over=tuple(groups))
    call(model, groups, request)


#: torch's process group class (None where torch.distributed has none).
_PROCESS_GROUP = getattr(dist, "ProcessGroup", None)


def _reduces_over(embd_group: ProcessGroup | None) -> bool:
    """Whether this rank is a member of ``embd_group`` and it has several ranks. A
    ``ProcessGroup`` object is given only to its members (torch gives the others
    ``GroupMember.NON_GROUP_MEMBER``), so its own size and rank answer in C++; any other
    group is looked up by its global ranks."""
    if type(embd_group) is _PROCESS_GROUP and embd_group.rank() >= 0:
        return embd_group.size() > 1
    members = dist.get_process_group_ranks(embd_group) if embd_group is not None else ()
    return len(members) > 1 and world_rank() in members


def embedding_grad(
    model: list[nn.Module],
    embd_group: ProcessGroup | None,
    pp_group: ProcessGroup | None,
    weight_getter: Callable[[nn.Module], nn.Parameter | None],
    skip_if_none: bool,
    config: Any,
    has_mtp: bool,
) -> None:
    """:func:`torch_impl.finalize._allreduce_embedding_grad` with the MTP chunk rule decided by the caller
    (Megatron's position-embedding helper never applies it): members of an embedding group
    of size > 1 run the helper's step; the read stage picks the chunk and its weight."""
    if not _reduces_over(embd_group):
        return
    # Without a pp group Megatron treats the rank as the first stage; the embedding
    # group's members then stand in for the stages.
    groups = {Group.EMBD: embd_group, Group.POS_EMBD: embd_group, Group.PP: pp_group or embd_group}
    role, step = (
        (Role.WORD_EMBEDDING, Step.WORD_EMBEDDING) if skip_if_none else (Role.POSITION_EMBEDDING, Step.POS_EMBEDDING)
    )
    read = EmbeddingRead(role, weight_getter, required=not skip_if_none, has_mtp=has_mtp, pp_given=pp_group is not None)
    run_helper(model, groups, Request(steps=(step,), config=config, embedding=read, over=(Group.EMBD, Group.POS_EMBD)))
