"""A Megatron ``ProcessGroupCollection`` read with the meaning ``finalize_model_grads``
gives each field: a field never set reads as None through the collection's
``__getattr__``, so only ``vars(collection)`` says what was set; a None group is looked
up, passed on as torch.distributed's default group, or an error, exactly where Megatron
does each (:class:`~torch_impl.run.errors.MegatronAssertionError`, before anything is
communicated)."""

from __future__ import annotations

import dataclasses
from typing import Any

from meshgrad.axes import Group
from torch_impl.run.errors import MegatronAssertionError
from torch_impl.run.groups import TorchGroups, group_ranks, world_rank, world_size
from torch_impl.sources.megatron import (
    UNDEFINED,
    ProcessGroup,
    default_group,
    loaded_parallel_state,
    parallel_state,
    parallel_state_group,
)


def is_process_group_collection(obj: Any) -> bool:
    """Whether ``obj`` is Megatron's ``ProcessGroupCollection`` (a dataclass of that name)."""
    return type(obj).__name__ == "ProcessGroupCollection" and dataclasses.is_dataclass(obj)


def _size(group: Any) -> int:
    return len(group_ranks(group)) if group is not None else 1


def _check_fields(collection: Any, rank: int) -> None:
    """Megatron asserts ``hasattr(pg_collection, ...)`` for tp, pp, embd, pos_embd and
    dp_cp: always true for a collection whose ``__getattr__`` answers unset fields
    (current Megatron), false for one that does not.

    Raises:
      MegatronAssertionError: naming the attributes it lacks.
    """
    lacking = [g.value for g in (Group.TP, Group.PP, Group.EMBD, Group.POS_EMBD, Group.DP_CP) if not hasattr(collection, g.value)]
    if lacking:
        raise MegatronAssertionError(
            f"rank {rank}: pg_collection has no attribute {', '.join(lacking)} (Megatron-Core asserts "
            "hasattr for tp, pp, embd, pos_embd and dp_cp); set each, to None where there is no such group"
        )


def _parallel_state_embd(loaded: Any, *, pp_given: bool, rank: int) -> ProcessGroup | None:
    """parallel_state's embedding group for a collection whose ``embd`` is None.

    Raises:
      MegatronAssertionError: it has several ranks and the collection's ``pp`` is set.
    """
    found = parallel_state_group(loaded, Group.EMBD)
    found = None if found is UNDEFINED else found
    if found is not None and _size(found) > 1 and pp_given:
        raise MegatronAssertionError(
            f"rank {rank}: pg_collection.embd is None, so Megatron-Core takes parallel_state's "
            f"embedding group {group_ranks(found)}, and then requires pg_collection.pp to be None "
            "(it asserts); set pg_collection.embd"
        )
    return found


def collection_groups(collection: Any, *, expert_bias: bool, flextron: bool = False) -> TorchGroups:
    """This rank's groups from a Megatron ``ProcessGroupCollection``, read as Megatron's
    ``finalize_model_grads`` reads it.

    A field is set when it is in ``vars(collection)``; unset and None fields both read as
    None there, and None means, per field: ``tp`` / ``pp`` -- parallel_state's group (an
    error without an initialized parallel_state); ``embd`` -- parallel_state's embedding
    group (none if it has none); ``pos_embd`` -- no position-embedding step; num_tokens and
    qb_beta reduce over ``dp_cp_gtp_remat``, else ``dp_cp``, else the default (world)
    group; ``gtp_remat`` / ``expt_gtp_remat`` -- parallel_state's (GTP inactive without
    one); ``tp_dp_cp`` -- an error when the expert bias is updated.

    Args:
      collection: the ProcessGroupCollection.
      expert_bias: ``config.moe_router_enable_expert_bias``.
      flextron: ``config.flextron`` (Megatron's router sync then needs parallel_state).

    Raises:
      MegatronAssertionError: where Megatron asserts or fails on a None group.
    """
    given = {g: vars(collection).get(g.value) for g in Group if g.value in vars(collection)}
    ps = parallel_state()
    loaded = loaded_parallel_state()
    rank = world_rank()
    _check_fields(collection, rank)
    values: dict[Group, Any] = dict(given)
    for group, what in ((Group.TP, "tensor-parallel"), (Group.PP, "pipeline")):
        if values.get(group) is None:
            found = parallel_state_group(ps, group) if ps is not None else None
            if found is None or found is UNDEFINED:
                raise MegatronAssertionError(
                    f"rank {rank}: pg_collection.{group.value} is {'None' if group in given else 'not set'} "
                    f"and Megatron's parallel_state is not initialized, so there is no {what} group "
                    f"(Megatron-Core fails here too); set pg_collection.{group.value}"
                )
            values[group] = found
    values.setdefault(Group.POS_EMBD, None)
    values.setdefault(Group.EMBD, None)
    if values[Group.EMBD] is None and loaded is not None:
        values[Group.EMBD] = _parallel_state_embd(loaded, pp_given=given.get(Group.PP) is not None, rank=rank)
    values[Group.DP_CP_GTP] = given.get(Group.DP_CP_GTP) or given.get(Group.DP_CP) or default_group()
    for group in (Group.GTP, Group.EGTP):
        if values.get(group) is None and loaded is not None:
            found = parallel_state_group(loaded, group)
            values[group] = None if found is UNDEFINED else found
    if flextron and ps is None:
        raise MegatronAssertionError(
            f"rank {rank}: config.flextron is set, and Megatron-Core syncs the router grads over "
            "parallel_state's pipeline group, but parallel_state is not initialized (Megatron asserts)"
        )
    if expert_bias and given.get(Group.TP_DP_CP) is None:
        raise MegatronAssertionError(
            f"rank {rank}: pg_collection must have tp_dp_cp when moe_router_enable_expert_bias is "
            f"enabled (it is {'None' if Group.TP_DP_CP in given else 'not set'}); Megatron-Core asserts "
            "the same"
        )
    groups = TorchGroups.from_mapping(values, defined=frozenset(values), source="ProcessGroupCollection")
    if given.get(Group.PP) is None:
        groups = _without_pp(groups, embd_given=given.get(Group.EMBD) is not None)
    return groups


def _without_pp(groups: TorchGroups, *, embd_given: bool) -> TorchGroups:
    """What Megatron's finalize does with a collection whose ``pp`` is None: its embedding
    helpers see no pipeline group and take this rank for the first stage (the word
    embedding only when ``embd`` was given: otherwise it uses parallel_state's groups),
    and ``num_tokens`` is broadcast over the world from its last rank."""
    first = frozenset({Group.POS_EMBD, Group.EMBD} if embd_given else {Group.POS_EMBD})
    world = default_group()
    broadcast = (world, world_size() - 1) if world is not None and world_size() > 1 else None
    return dataclasses.replace(groups, first_stage_for=first, token_broadcast=broadcast)
