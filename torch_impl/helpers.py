"""Megatron's helper functions (the ``_allreduce_*`` / ``_update_*`` ones) over the call
pipeline: a helper's steps run over its own groups (:func:`run_helper`), and the embedding helpers' chunk and stage rule
(:func:`embedding_grad`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist
from torch import nn

from meshgrad.axes import Group
from meshgrad.errors import FinalizeInputError
from meshgrad.params import Role
from meshgrad.plan import Step, embedding_chunk
from torch_impl.call.pipeline import call
from torch_impl.call.read import Request, as_chunks
from torch_impl.sources.wrappers import unwrap
from torch_impl.run.groups import TorchGroups, world_rank
from torch_impl.call.model_state import ModelState

ProcessGroup = Any


def run_helper(model: Any, groups: Mapping[Group, Any] | TorchGroups, request: Request) -> None:
    """Run a seed helper's steps over its own groups (its status round and comparison
    over them too) through the call pipeline."""
    if not request.over and not isinstance(groups, TorchGroups):
        request = dataclasses.replace(request, over=tuple(groups))
    call(model, groups, request)


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
    (Megatron's position-embedding helper never applies it)."""
    chunks = as_chunks(model)
    members = dist.get_process_group_ranks(embd_group) if embd_group is not None else ()
    if len(members) <= 1 or world_rank() not in members:
        return
    state = ModelState.of(chunks)
    # Without a pp group Megatron treats the rank as the first stage; the embedding
    # group's members then stand in for the stages.
    groups = state.group_memo.explicit({Group.EMBD: embd_group, Group.POS_EMBD: embd_group, Group.PP: pp_group or embd_group})
    if groups.stages.get(Group.EMBD) is None:
        return
    stage, pp = (groups.pp_stage, groups.pp_size) if pp_group is not None else (0, 1)
    index = embedding_chunk(stage, pp, len(chunks), has_mtp)
    weight = weight_getter(unwrap(chunks[index]))
    if weight is None and not skip_if_none:
        raise FinalizeInputError(f"rank {groups.rank}: pp stage {stage}: chunk {index} has no embedding weight to reduce")
    role, step = (
        (Role.WORD_EMBEDDING, Step.WORD_EMBEDDING) if skip_if_none else (Role.POSITION_EMBEDDING, Step.POS_EMBEDDING)
    )
    request = Request(
        steps=(step,),
        config=config,
        found=state.embedding(chunks, index, weight, role),
        over=(Group.EMBD, Group.POS_EMBD),
    )
    run_helper(chunks, groups, request)
