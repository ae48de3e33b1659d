"""A seed helper's None group argument, with Megatron's per-helper rules."""

from __future__ import annotations

from meshgrad.axes import Group
from torch_impl.run.errors import MegatronAssertionError
from torch_impl.run.groups import world_rank, world_size
from torch_impl.sources.megatron import UNDEFINED, ProcessGroup, default_group, loaded_parallel_state, parallel_state, parallel_state_group

#: What a helper does with a None group argument (Megatron's per-helper rule):
#: ``lookup`` -- parallel_state's group (without one: no communication in a world of one
#: rank, else an error); ``lookup_optional`` -- parallel_state's group if any, else none;
#: ``world`` -- torch.distributed's default group; ``none`` -- no such group.
HELPER_RULES = ("lookup", "lookup_optional", "world", "none")


def helper_group(group: Group, value: ProcessGroup | None, rule: str, where: str) -> ProcessGroup | None:
    """A seed helper's group argument as Megatron's helper uses it.

    Args:
      group: which named group the argument is.
      value: the argument.
      rule: one of :data:`HELPER_RULES`.
      where: ``"helper(argument)"`` for the error message.

    Raises:
      MegatronAssertionError: ``lookup`` with no initialized parallel_state in a world of
        more than one rank.
    """
    if value is not None or rule == "none":
        return value
    if rule == "world":
        return default_group()
    ps = parallel_state() if rule == "lookup" else loaded_parallel_state()
    found = parallel_state_group(ps, group) if ps is not None else UNDEFINED
    if found is not UNDEFINED and (found is not None or rule == "lookup_optional"):
        return found
    if rule == "lookup_optional" or world_size() == 1:
        return None
    raise MegatronAssertionError(
        f"rank {world_rank()}: {where} is None and Megatron's parallel_state is not initialized in a "
        f"world of {world_size()} ranks (Megatron-Core would look the {group.value!r} group up there and "
        "fail); pass the group"
    )
