"""The read and plan stages of every entry point.

:func:`prepare` goes config -> groups -> model state -> discovery -> plan -> checks, for
``finalize_model_grads`` (every step), each seed helper (its steps, its groups) and
``attach_grad_buffers`` (the plan's layout only); anything raised while reading is held
for the status round (:func:`_shared`); :func:`run` runs what it prepared. What is
memoized lives in :mod:`torch_impl.model_state`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from torch import nn

from meshgrad.axes import Group
from meshgrad.config import FinalizeConfig
from meshgrad.plan import GroupSizes, Step, plan_finalize
from meshgrad.errors import FinalizeTypeError
from meshgrad.steps import ROUTER_ONLY_STEPS
from torch_impl.checks import plan_keys
from torch_impl.group_checks import requirements
from torch_impl.consensus import CheckSpec, before_communication, share_local_error
from torch_impl.discover import Discovered, discover, dtype_name
from torch_impl.errors import ranked
from torch_impl.execute import execute_local
from torch_impl.program import Program
from torch_impl.grads import GradAccess
from torch_impl.groups import TorchGroups, world_rank
from torch_impl.group_sources import LISTED_KINDS, MEGATRON_KINDS, source_kind
from torch_impl.megatron_config import Requested, accepts, chunk_configs
from torch_impl.model_state import ModelState, Reads
from torch_impl.plan_memo import BoundPlan
from torch_impl.notices import warn_plan
from torch_impl.status import already_shared


def as_chunks(model: Any) -> list[Any]:
    """The model as a non-empty list of chunks.

    Raises:
      TypeError: ``model`` is not a module or a sequence of modules.
    """
    if isinstance(model, nn.Module):
        return [model]
    if not isinstance(model, (list, tuple)) or not model:
        raise FinalizeTypeError(
            f"rank {world_rank()}: model must be a non-empty list of nn.Module chunks, got {type(model).__name__}"
        )
    for i, chunk in enumerate(model):
        if not isinstance(chunk, nn.Module):
            raise FinalizeTypeError(f"rank {world_rank()}: model[{i}] is a {type(chunk).__name__}, not an nn.Module")
    return list(model)


def build_plan(
    found: Discovered,
    config: FinalizeConfig,
    sizes: GroupSizes,
    ddp: Sequence[Any],
    force_all_reduce: bool,
    stage: int | None = None,
) -> BoundPlan:
    """Plan every step; step 1 only for chunks without a DDP wrapper (``ddp[i]`` None)."""
    plain = {i for i, obj in enumerate(ddp) if obj is None}
    if len(plain) == len(ddp):
        plan = plan_finalize(
            found.params, config, sizes, found.routers, force_all_reduce=force_all_reduce, stage=stage
        )
    else:
        plan = plan_finalize(found.params, config, sizes, found.routers, dp_sync=False, stage=stage)
        if plain:
            dp = plan_finalize(
                [p for p in found.params if p.chunk in plain], config, sizes, force_all_reduce=force_all_reduce
            ).for_step(Step.DP_SYNC)
            plan = dataclasses.replace(plan, actions=tuple(dp) + plan.actions)
    objects: list[Any] = []
    for obj in ddp:
        if obj is not None and all(obj is not o for o in objects):
            objects.append(obj)
    return BoundPlan(
        plan=plan,
        ddp=tuple(objects),
        ddp_force_kwarg=tuple(accepts(o.finish_grad_sync, "force_all_reduce") for o in objects),
        plain_scale_keys=tuple(k for k in plan.token_scale.keys if k[0] in plain),
    )


@dataclasses.dataclass(frozen=True)
class Request:
    """What one call asks of :func:`prepare`.

    Args:
      steps: the steps a seed helper runs; empty: every step (``finalize_model_grads``).
      config: a helper's config (a Megatron config, a mapping or a FinalizeConfig; None:
        the chunks' ``config``), merged with the chunks' ``ddp_config`` unless
        ``merge_ddp_config`` is False.
      merge_ddp_config: merge the chunks' ``ddp_config`` into ``config``.
      overrides: FinalizeConfig fields a helper sets (Megatron's helpers skip some gates).
      num_tokens: the call's ``num_tokens`` (checked every step).
      force_all_reduce: all-reduce instead of the distributed optimizer's reduce-scatter.
      found: a helper's own discovery (the embedding helpers' one weight).
      over: the groups a helper communicates over: its status round and comparison.
      layout: plan only, as ``finalize_model_grads`` will, for ``attach_grad_buffers``
        (every trainable parameter counted as having a gradient; no checks).
    """

    steps: tuple[Step, ...] = ()
    config: Any = None
    merge_ddp_config: bool = True
    overrides: tuple[tuple[str, Any], ...] = ()
    num_tokens: Any = None
    force_all_reduce: bool = False
    found: Discovered | None = None
    over: tuple[Group, ...] = ()
    layout: bool = False

    @property
    def finalize(self) -> bool:
        """Whether this is ``finalize_model_grads`` (or its layout): every step."""
        return not self.steps

    @property
    def reads(self) -> Reads:
        """What the call's plan may read: every watched parameter (finalize), the routers
        only (router steps), else what a step besides the DP sync may touch."""
        if self.finalize:
            return "all"
        return "routers" if ROUTER_ONLY_STEPS.issuperset(self.steps) else "touched"


@dataclasses.dataclass(frozen=True, eq=False)
class Prepared:
    """Everything a call needs after :func:`prepare`: the plan and what it runs on."""

    bound: BoundPlan
    found: Discovered
    groups: TorchGroups
    config: FinalizeConfig
    requested: Requested
    state: ModelState


def _config(state: ModelState, chunks: Sequence[Any], request: Request) -> tuple[FinalizeConfig, tuple[Any, Any]]:
    """The call's FinalizeConfig and the raw configs it came from."""
    raw, ddp_config = chunk_configs(chunks)
    if request.config is not None:
        raw = request.config
    if not request.merge_ddp_config:
        ddp_config = None
    config = state.config_memo.config(raw, ddp_config)
    if request.overrides or not request.finalize:
        config = state.config_memo.helper_config(config, request.overrides)
    return config, (raw, ddp_config)


def _layout_found(chunks: Sequence[Any], config: FinalizeConfig) -> Discovered:
    """The model as ``attach_grad_buffers`` plans it: every trainable parameter with a
    gradient of the dtype the DP sync will reduce."""
    found = discover(chunks, config)
    grad_dtype = "float32" if config.grad_reduce_in_fp32 else None
    specs = tuple(
        dataclasses.replace(
            spec,
            has_grad=bool(found.tensors[spec.key].requires_grad),
            dtype=grad_dtype or dtype_name(found.tensors[spec.key].dtype),
        )
        for spec in found.params
    )
    return dataclasses.replace(found, params=specs)


def _finalize_plan(
    found: Discovered, config: FinalizeConfig, groups: TorchGroups, requested: Requested,
    ddp: tuple[Any, ...], request: Request, source: Any,
) -> BoundPlan:
    """``finalize_model_grads``' plan, after checking the groups it needs."""
    plain = {i for i, obj in enumerate(ddp) if obj is None}
    required, expected = requirements(
        config,
        [p for p in found.params if p.chunk in plain],
        groups,
        requested,
        plain_dp_sync=bool(plain),
        num_tokens=request.num_tokens is not None,
        megatron_groups=source_kind(source) in MEGATRON_KINDS,
    )
    groups.check(required, expected, strict=config.strict_groups)
    bound = build_plan(found, config, groups.group_sizes(config), ddp, request.force_all_reduce, groups.pp_stage)
    warn_plan(
        bound.plan, found.params, config, ddp, num_tokens_given=request.num_tokens is not None,
        tp_size=groups.size(Group.TP), force_all_reduce=request.force_all_reduce,
    )
    own = tuple(s.key for s in found.params if s.has_grad and ddp[s.chunk] is None)
    checks = CheckSpec(
        keys=tuple(dict.fromkeys(own + tuple(plan_keys(bound.plan, bound.plain_scale_keys)))),
        nan_keys=own,
        ddp=bound.ddp,
        requested=requested,
        experts=found.untouched_experts or any(p.expert and p.has_grad for p in found.params),
        collection=source_kind(source) in LISTED_KINDS,
    )
    return dataclasses.replace(bound, checks=checks)


def _helper_plan(found: Discovered, config: FinalizeConfig, groups: TorchGroups, request: Request) -> BoundPlan:
    """A seed helper's plan: only its steps, no DP sync, checked over its own groups."""
    plan = plan_finalize(found.params, config, groups.group_sizes(config), found.routers, dp_sync=False)
    plan = dataclasses.replace(plan, actions=plan.for_step(*request.steps))
    checks = CheckSpec(keys=tuple(plan_keys(plan, ())), nan=False, over=request.over, compared=request.over)
    return BoundPlan(plan, (), (), (), checks, helper=True)


def _prepare(model: Any, source: Any, request: Request, known: dict[str, Any]) -> Prepared:
    """:func:`prepare`; ``known`` records what resolved (for sharing an error)."""
    chunks = as_chunks(model)
    state = ModelState.of(chunks)
    config, known["raw"] = _config(state, chunks, request)
    known["config"] = config
    requested = state.config_memo.requested(known["raw"][0]) if request.finalize else Requested()
    groups = state.group_memo.resolve_groups(state.group_memo.parallel_state_groups() if source is None else source, config, requested)
    known["groups"] = groups
    if request.layout:
        found = _layout_found(chunks, config)
        bound = build_plan(found, config, groups.group_sizes(config), (None,) * len(chunks), request.force_all_reduce)
        return Prepared(bound, found, groups, config, requested, state)
    if request.found is not None:
        token, found, ddp = (request.found.params, request.found.routers), request.found, (None,) * len(chunks)
    else:
        gtp = groups.size(Group.GTP) > 1 or groups.size(Group.EGTP) > 1
        token, found, ddp = state.discovered(chunks, config, complete=gtp, reads=request.reads)
    if not request.finalize:
        ddp = (None,) * len(chunks)
    key = (request.steps, token, config, groups, requested, request.force_all_reduce,
           request.num_tokens is not None, tuple(map(id, ddp)))
    if request.finalize:
        bound = state.plan_memo.plan(key, lambda: _finalize_plan(found, config, groups, requested, ddp, request, source))
    else:
        bound = state.plan_memo.plan(key, lambda: _helper_plan(found, config, groups, request))
    known["shared"] = True  # from here on, the checks' own status round shares errors
    checks = bound.checks if bound.checks is not None else CheckSpec(keys=())
    record = before_communication(checks, bound.plan, found, groups, config, request.num_tokens, state.plan_memo.record(bound))
    state.plan_memo.keep_record(bound, record)
    return Prepared(bound, found, groups, config, requested, state)


def prepare(model: Any, source: Any, request: Request = Request()) -> Prepared:
    """The one set-up path: config, groups, model state, discovery, plan (cached on the
    model) and every check before communication.

    Args:
      model: the model chunks (or one module).
      source: the group source (``pg_collection``; a seed helper's TorchGroups).
      request: what the call asks for.

    Returns:
      The :class:`Prepared` call.

    Raises:
      TypeError / ValueError: a local check failed -- on every rank: a local error found
        before the status round is shared through it (:func:`~torch_impl.consensus.share_local_error`).
      ConsistencyError / NonFiniteGradError / CollectiveError: from the cross-rank rounds.
    """
    with ranked():
        return _shared(model, source, request)


def _shared(model: Any, source: Any, request: Request) -> Prepared:
    """:func:`_prepare`, sharing a local error found before the status round with the
    other ranks through that round (the caller prefixes this rank to the message)."""
    known: dict[str, Any] = {}
    try:
        return _prepare(model, source, request, known)
    except BaseException as err:  # any type (KeyboardInterrupt too) is held for the status round
        if not request.layout and not known.get("shared") and not already_shared(err):
            extra = {"over": request.over} if not request.finalize else {}
            share_local_error(
                err, known.get("groups"), known.get("config"), source=source, raw=known.get("raw", ()), **extra
            )
        raise


def run(prepared: Prepared) -> Program | None:
    """Run the prepared plan's actions: through its bound program, or (DTensor gradients)
    binding each action as it runs.

    Returns:
      The bound program (None for DTensor gradients).
    """
    bound, found, groups, config, state = (
        prepared.bound, prepared.found, prepared.groups, prepared.config, prepared.state
    )
    program = state.program(bound, found, groups, config)
    if program is not None:
        program.run()
    else:
        grads = GradAccess(found.tensors, config.use_megatron_fsdp)
        execute_local(bound.plan.actions, grads, found.router_modules, groups, stats=state.stats)
    return program


__all__ = [
    "Prepared",
    "Request",
    "as_chunks",
    "build_plan",
    "prepare",
    "run",
]

