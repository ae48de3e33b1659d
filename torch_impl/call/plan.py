"""The plan stage of a call: the plan of its steps (decided by :mod:`meshgrad.plan`),
bound to the chunks' DDP objects, memoized by everything that can change it
(:mod:`torch_impl.call.plan_memo`), with the groups it needs checked
(:mod:`meshgrad.requirements`) and the plan's warnings given once
(:mod:`torch_impl.call.notices`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from meshgrad.axes import Group
from meshgrad.config import FinalizeConfig
from meshgrad.helpers import plan_helper
from meshgrad.params import ParamKey
from meshgrad.plan import GroupSizes, Step, plan_finalize
from meshgrad.requirements import group_requirements
from torch_impl.call.check import CheckSpec, PlanRecord
from torch_impl.call.notices import warn_plan
from torch_impl.call.plan_memo import BoundPlan
from torch_impl.call.read import CallInputs, Request
from torch_impl.run.groups import TorchGroups
from torch_impl.sources.config import Requested, accepts
from torch_impl.sources.discover import Discovered
from torch_impl.sources.fsdp2 import synced_steps
from torch_impl.sources.torch_ddp import synced_steps as ddp_synced_steps
from torch_impl.sources.group_sources import LISTED_KINDS, MEGATRON_KINDS, source_kind


def plan(inputs: CallInputs, request: Request, source: Any) -> tuple[BoundPlan, PlanRecord | None]:
    """The plan stage: the call's plan, memoized by everything that can change it, with
    what its once-per-plan checks found on an earlier call (None on its first)."""
    state, config, groups, found, ddp = inputs.state, inputs.config, inputs.groups, inputs.found, inputs.ddp
    key = (request.steps, inputs.token, config, groups, inputs.requested, request.force_all_reduce,
           request.num_tokens is not None, tuple(map(id, ddp)), found.wrapper_settings())
    if request.finalize:
        return state.plan_memo.plan(
            key, lambda: _finalize_plan(found, config, groups, inputs.requested, ddp, request, source)
        )
    return state.plan_memo.plan(key, lambda: _helper_plan(found, config, groups, request))


def build_plan(
    found: Discovered,
    config: FinalizeConfig,
    sizes: GroupSizes,
    ddp: Sequence[Any],
    force_all_reduce: bool,
    stage: int | None = None,
    synced: Mapping[ParamKey, frozenset[Step]] | None = None,
) -> BoundPlan:
    """The plan of every step, bound to the chunks' DDP objects: a chunk with one
    (``ddp[i]``) is delegated to it (its ``finish_grad_sync`` and ``scale_gradients``);
    ``synced``: per parameter, the steps torch's FSDP2 or DDP already did
    (:func:`torch_impl.sources.fsdp2.synced_steps`, :func:`torch_impl.sources.torch_ddp.synced_steps`)."""
    delegated = frozenset(i for i, obj in enumerate(ddp) if obj is not None)
    plan = plan_finalize(
        found.params, config, sizes, found.routers, force_all_reduce=force_all_reduce, stage=stage,
        delegated=delegated, synced=synced,
    )
    objects: list[Any] = []
    for obj in ddp:
        if obj is not None and all(obj is not o for o in objects):
            objects.append(obj)
    return BoundPlan(
        plan=plan,
        ddp=tuple(objects),
        ddp_force_kwarg=tuple(accepts(o.finish_grad_sync, "force_all_reduce") for o in objects),
        plain_scale_keys=plan.own_scale_keys,
    )


def _finalize_plan(
    found: Discovered, config: FinalizeConfig, groups: TorchGroups, requested: Requested,
    ddp: tuple[Any, ...], request: Request, source: Any,
) -> BoundPlan:
    """``finalize_model_grads``' plan, after checking the groups it needs (decided by
    :func:`meshgrad.requirements.group_requirements`)."""
    synced = synced_steps(found.params, found.tensors, found.fsdp, groups, config)
    synced.update(ddp_synced_steps(found.params, found.tensors, found.torch_ddp, groups, config))
    sizes = groups.group_sizes(config)
    bound = build_plan(found, config, sizes, ddp, request.force_all_reduce, groups.pp_stage, synced)
    needs = group_requirements(
        bound.plan,
        num_tokens=request.num_tokens is not None,
        read_by_megatron_rules=source_kind(source) in MEGATRON_KINDS,
        own_dp_sync=any(obj is None for obj in ddp),
        stated_gtp=requested.gtp,
        stated_egtp=requested.egtp,
    )
    groups.check(needs.required, needs.expected, strict=config.strict_groups)
    warn_plan(
        bound.plan, found.params, config, ddp, num_tokens_given=request.num_tokens is not None,
        tp_size=groups.size(Group.TP), force_all_reduce=request.force_all_reduce,
    )
    own = tuple(s.key for s in found.params if s.has_grad and s.chunk not in bound.plan.delegated)
    checks = CheckSpec(
        keys=tuple(dict.fromkeys(own + bound.plan.gradient_keys(bound.plain_scale_keys))),
        nan_keys=own,
        ddp=bound.ddp,
        requested=requested,
        experts=found.untouched_experts or any(p.expert and p.has_grad for p in found.params),
        collection=source_kind(source) in LISTED_KINDS,
        router_writes=bound.plan.router_writes(),
    )
    return dataclasses.replace(bound, checks=checks)


def _helper_plan(found: Discovered, config: FinalizeConfig, groups: TorchGroups, request: Request) -> BoundPlan:
    """A seed helper's plan (:func:`meshgrad.helpers.plan_helper`: its steps, built with its
    rules), checked over its own groups."""
    plan = plan_helper(found.params, config, groups.group_sizes(config), found.routers, request.steps)
    checks = CheckSpec(keys=plan.gradient_keys(()), nan=False, over=request.over, compared=request.over,
                       router_writes=plan.router_writes())
    return BoundPlan(plan, (), (), (), checks, helper=True)


__all__ = ["build_plan", "plan"]
