"""The call pipeline of every entry point: read -> plan -> check -> agree -> run.

:func:`call` runs the stages in turn for ``finalize_model_grads`` (every step) and each
seed helper (its steps, its groups): :mod:`~torch_impl.call.read`,
:mod:`~torch_impl.call.plan`, :mod:`~torch_impl.call.check`,
:mod:`~torch_impl.call.agree`, then the run stage (:mod:`torch_impl.run`). Anything
raised before the agree stage, of any type, is held for the status round
(:func:`_agreed`), so no rank is left alone in a collective. :func:`prepare_layout`
reads and plans only, for ``attach_grad_buffers``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch_impl.call.agree import agree_call, share_local_error
from torch_impl.call.check import CheckSpec, check_call, same_call
from torch_impl.call.checks import tokens_kind
from torch_impl.call.plan import build_plan, plan
from torch_impl.call.plan_memo import BoundPlan
from torch_impl.call.read import CallInputs, Request, read, read_layout
from torch_impl.call.replay import keep_replay, replayed
from torch_impl.call.steady import entry_kind, keep_steady, steady_read
from torch_impl.run.errors import ranked
from torch_impl.run.execute import execute_local, finish_ddp_sync
from torch_impl.run.grads import GradAccess
from torch_impl.run.program import without_grad
from torch_impl.run.scaling import bind_scale, scale_by_tokens
from torch_impl.run.status import already_shared
from torch_impl.sources.megatron import gtp_fence


def _agreed(model: Any, source: Any, request: Request) -> tuple[BoundPlan, CallInputs, Any]:
    """The read, plan, check and agree stages; an error raised before the status round,
    of any type, is shared with the other ranks through that round, then re-raised (the
    entry point's wrapper, :func:`~torch_impl.sources.wrappers.eager_under_compile`,
    prefixes a ValueError / TypeError with this rank).
    A call that replays the last call of its kind (:func:`~torch_impl.call.replay.replayed`:
    its read and check stages would answer as they did) goes to the agree stage at once.
    Returns the plan, the inputs and the global token count when the round carried it."""
    known: dict[str, Any] = {}
    try:
        replay = replayed(model, source, request)
        if replay is not None:
            kept, bound, inputs = replay
            known["shared"] = True
            return bound, inputs, agree_call(kept.findings, kept.spec, bound.plan, inputs.groups, inputs.config,
                                             request.num_tokens)
        steady = steady_read(model, source, request, known)
        if steady is None:
            inputs = read(model, source, request, known)
            bound, record = plan(inputs, request, source)
            keep_steady(inputs, bound, source, request, known["raw"])
        else:
            inputs, bound = steady
            record = inputs.state.plan_memo.record(bound)
        spec = bound.checks if bound.checks is not None else CheckSpec(keys=())
        entry, tokens = entry_kind(request), tokens_kind(request.num_tokens)
        switched = not same_call(inputs.state.last_calls.get(entry), bound, tokens)
        findings = check_call(spec, inputs.found, inputs.groups, inputs.config, request.num_tokens, record, switched)
        known["shared"] = True  # from here on, the status round itself carries every error
        total = agree_call(findings, spec, bound.plan, inputs.groups, inputs.config, request.num_tokens)
    except BaseException as err:  # any type (KeyboardInterrupt too) is held for the status round
        if not known.get("shared") and not already_shared(err):
            extra = {"over": request.over} if not request.finalize else {}
            raw = known.get("raw", (request.config,))
            share_local_error(err, known.get("groups"), known.get("config"), source=source, raw=raw, **extra)
        raise
    if findings.record is not record:  # else the kept one, updated in place
        inputs.state.plan_memo.keep_record(bound, findings.record)
    inputs.state.last_calls[entry] = (bound, tokens)
    if steady is not None:
        keep_replay(inputs.state, request, spec, findings)
    return bound, inputs, total


def call(model: Any, source: Any, request: Request = Request(), fence: Callable[[], None] | None = None) -> None:
    """One call of an entry point: the read, plan, check and agree stages
    (:func:`_agreed`), then the run stage: the GTP fence, each Megatron DDP's own
    ``finish_grad_sync``, the plan's actions (its bound program, or each action bound as
    it runs for DTensor gradients) and the num_tokens scale.

    Args:
      model: the model chunks (or one module).
      source: the group source (``pg_collection``; a seed helper's groups).
      request: what the call asks for.
      fence: called before the DP sync while GTP is active (None: Megatron's own fence
        when its module is loaded).

    Raises:
      TypeError / ValueError: a local check failed -- on every rank: a local error found
        before the status round is shared through it
        (:func:`~torch_impl.call.agree.share_local_error`).
      ConsistencyError / NonFiniteGradError / CollectiveError: from the cross-rank rounds
        or a failed collective.
    """
    bound, inputs, total = _agreed(model, source, request)
    finalize = not request.steps  # Request.finalize, without a property's call on every step
    try:
        if not finalize and not bound.plan.actions:
            return
        if finalize:
            inputs.state.stats.calls += 1
            fence = (fence or gtp_fence()) if inputs.requested.gtp_active else None
            if fence is not None:
                fence()
        without_grad(_run, request, bound, inputs, total)
    finally:  # gradients renewed every step (zero_grad(set_to_none=True)) are not held past the call
        if inputs.state.renewed is not None:
            inputs.state.release_renewed(bound, inputs.found)


def _run(request: Request, bound: BoundPlan, inputs: CallInputs, total: Any) -> None:
    """The run stage, with grad mode off: each Megatron DDP's own ``finish_grad_sync``,
    the plan's actions (its bound program, or each action bound as it runs for DTensor
    gradients) and the num_tokens scale (``total``: the count the status round carried)."""
    state, groups, found, config = inputs.state, inputs.groups, inputs.found, inputs.config
    if bound.ddp:
        finish_ddp_sync(bound.ddp, bound.ddp_force_kwarg, request.force_all_reduce, groups)
    hit = state.programs.get(id(bound))  # ModelState.program's kept binding, written out
    program = hit[1] if hit is not None and hit[0] is bound and hit[2] is found else state.program(
        bound, found, groups, config)
    if program is not None:
        if program.ops:  # none bound where the DDP does the whole step: no call to make
            program.run()
    elif bound.plan.actions:  # DTensor gradients: each action bound as it runs
        execute_local(bound.plan.actions, GradAccess(found.tensors, config.use_megatron_fsdp),
                      found.router_modules, groups, stats=state.stats)
    if request.num_tokens is not None:
        if program is not None:
            apply = program.scale
        else:  # DTensor gradients: the scale goes to their local shards (FSDP2 makes them anew each step)
            apply = bind_scale(GradAccess(found.tensors, local_shards=True).read(bound.plain_scale_keys))
        scale_by_tokens(request.num_tokens, bound.plan.token_scale, groups, bound.ddp, apply, total,
                        state.host_factor)


def prepare_layout(model: Any, source: Any, force_all_reduce: bool) -> tuple[BoundPlan, CallInputs]:
    """Read and plan only, as ``finalize_model_grads`` will, for ``attach_grad_buffers``:
    every trainable parameter counted as having a gradient; no checks, no rounds."""
    with ranked():
        inputs = read_layout(model, source)
        config, groups = inputs.config, inputs.groups
        bound = build_plan(inputs.found, config, groups.group_sizes(config), inputs.ddp, force_all_reduce)
        return bound, inputs


__all__ = ["call", "prepare_layout"]
