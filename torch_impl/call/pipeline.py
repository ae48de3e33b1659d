"""The call pipeline of every entry point: read -> plan -> check -> agree -> run.

:func:`prepare` runs the stages in turn (:mod:`~torch_impl.call.read`,
:mod:`~torch_impl.call.plan`, :mod:`~torch_impl.call.check`, :mod:`~torch_impl.call.agree`)
for ``finalize_model_grads`` (every step) and each seed helper (its steps, its groups);
anything raised before the agree stage, of any type, is held for the status round
(:func:`_shared`), so no rank is left alone in a collective. :func:`run` runs what it
prepared (:mod:`torch_impl.run`). :func:`prepare_layout` reads and plans only, for
``attach_grad_buffers``.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from meshgrad.config import FinalizeConfig
from torch_impl.call.agree import agree_call, share_local_error
from torch_impl.call.check import CheckSpec, check_call
from torch_impl.call.model_state import ModelState
from torch_impl.call.plan import build_plan, plan
from torch_impl.call.plan_memo import BoundPlan
from torch_impl.call.read import Request, read, read_layout
from torch_impl.run.errors import ranked
from torch_impl.run.execute import execute_local
from torch_impl.run.grads import GradAccess
from torch_impl.run.groups import TorchGroups
from torch_impl.run.program import Program
from torch_impl.run.status import already_shared
from torch_impl.sources.config import Requested
from torch_impl.sources.discover import Discovered


@dataclasses.dataclass(frozen=True, eq=False)
class Prepared:
    """Everything a call needs after :func:`prepare`: the plan and what it runs on."""

    bound: BoundPlan
    found: Discovered
    groups: TorchGroups
    config: FinalizeConfig
    requested: Requested
    state: ModelState


def _prepare(model: Any, source: Any, request: Request, known: dict[str, Any]) -> Prepared:
    """:func:`prepare`: read, plan, then check and agree; ``known`` records what resolved
    (for sharing an error)."""
    inputs = read(model, source, request, known)
    bound, record = plan(inputs, request, source)
    known["shared"] = True  # from here on, the checks' own status round shares errors
    state = inputs.state
    spec = bound.checks if bound.checks is not None else CheckSpec(keys=())
    findings = check_call(spec, inputs.found, inputs.groups, inputs.config, request.num_tokens, record)
    agree_call(findings, spec, bound.plan, inputs.groups, inputs.config, request.num_tokens)
    state.plan_memo.keep_record(bound, findings.record)
    return Prepared(bound, inputs.found, inputs.groups, inputs.config, inputs.requested, state)


def prepare_layout(model: Any, source: Any, force_all_reduce: bool) -> Prepared:
    """Read and plan only, as ``finalize_model_grads`` will, for ``attach_grad_buffers``:
    every trainable parameter counted as having a gradient; no checks, no rounds."""
    with ranked():
        inputs = read_layout(model, source)
        config, groups = inputs.config, inputs.groups
        bound = build_plan(inputs.found, config, groups.group_sizes(config), inputs.ddp, force_all_reduce)
        return Prepared(bound, inputs.found, groups, config, inputs.requested, inputs.state)


def prepare(model: Any, source: Any, request: Request = Request()) -> Prepared:
    """The one set-up path: the read, plan, check and agree stages, in turn; the plan
    and what the read stage read are memoized on the model.

    Args:
      model: the model chunks (or one module).
      source: the group source (``pg_collection``; a seed helper's TorchGroups).
      request: what the call asks for.

    Returns:
      The :class:`Prepared` call.

    Raises:
      TypeError / ValueError: a local check failed -- on every rank: a local error found
        before the status round is shared through it (:func:`~torch_impl.call.agree.share_local_error`).
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
        if not known.get("shared") and not already_shared(err):
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


__all__ = ["Prepared", "prepare", "prepare_layout", "run"]
