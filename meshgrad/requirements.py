"""The groups a finalize call needs from its group source, and the sizes it expects.

Decided here, for every backend: the groups the plan's actions communicate over
(:meth:`~meshgrad.plan.FinalizePlan.required_groups`), the groups Megatron-Core's
``finalize_model_grads`` validates first (docs/semantics.md: tp, pp, embd, pos_embd and
dp_cp; tp_dp_cp with expert bias; dp_cp x gtp when GTP-remat reduces num_tokens or
qb_beta), and the sizes the config states for the GTP-remat groups. A backend checks its
groups against the result; it does not work the rules out again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from meshgrad.axes import Group
from meshgrad.plan import FinalizePlan

#: The groups Megatron-Core's finalize_model_grads reads on every call.
ALWAYS_READ = (Group.TP, Group.PP, Group.EMBD, Group.POS_EMBD, Group.DP_CP)
_GTP_REASON = "GTP-remat is active and num_tokens / qb_beta reduce over dp_cp x gtp"


@dataclasses.dataclass(frozen=True)
class GroupRequirements:
    """What a call needs of its groups.

    Args:
      required: group -> why it must be given.
      expected: group -> (the size it must have, why).
    """

    required: Mapping[Group, str]
    expected: Mapping[Group, tuple[int, str]]


def group_requirements(
    plan: FinalizePlan,
    *,
    num_tokens: bool,
    read_by_megatron_rules: bool,
    own_dp_sync: bool,
    stated_gtp: int = 1,
    stated_egtp: int = 1,
) -> GroupRequirements:
    """The groups ``finalize_model_grads`` needs, for a plan made with the source's sizes.

    Args:
      plan: the call's plan (its sizes are the group source's; a missing group is size 1).
      num_tokens: whether the call scales by num_tokens.
      read_by_megatron_rules: the groups were resolved by Megatron's own look-ups and
        assertions (a ProcessGroupCollection, ``parallel_state``): what Megatron would
        refuse was refused there, so only the plan's own needs are added.
      own_dp_sync: some chunk has no DDP wrapper, so meshgrad runs its DP sync.
      stated_gtp: the config's ``gtp_weight_remat_size``.
      stated_egtp: the config's ``expert_gtp_weight_remat_size``.

    Returns:
      The required groups with reasons and the expected sizes with reasons.
    """
    config, sizes = plan.config, plan.sizes
    required: dict[Group, str] = {}
    gtp_reduces = sizes[Group.GTP] > 1 and (num_tokens or config.quantile_balancing)
    if not read_by_megatron_rules:
        for group in ALWAYS_READ:
            required[group] = "finalize_model_grads always needs it"
        if config.moe_router_enable_expert_bias:
            required[Group.TP_DP_CP] = "moe_router_enable_expert_bias is set"
        if gtp_reduces:
            required[Group.DP_CP_GTP] = _GTP_REASON
    if own_dp_sync:
        required[Group.DP_CP] = "meshgrad runs the DP sync of chunks without a DDP wrapper"
    if own_dp_sync and any(p.expert and p.has_grad and p.chunk not in plan.delegated for p in plan.params):
        required[Group.EDP] = "expert parameters (allreduce=False) are synced over expert data parallel"
    expected: dict[Group, tuple[int, str]] = {}
    if stated_gtp > 1:
        expected[Group.GTP] = (stated_gtp, "config.gtp_weight_remat_size")
    if stated_egtp > 1:
        expected[Group.EGTP] = (stated_egtp, "config.expert_gtp_weight_remat_size")
    if gtp_reduces:
        expected[Group.DP_CP_GTP] = (sizes[Group.DP_CP] * sizes[Group.GTP], _GTP_REASON)
    return GroupRequirements(required, expected)


__all__ = ["ALWAYS_READ", "GroupRequirements", "group_requirements"]
