"""A steady call replayed: what the read and check stages answered on the last call of a
kind, kept for the next one (:class:`Replay`).

A call whose steady check holds (:mod:`torch_impl.call.steady`: the probes of everything
the read stage read) reads and plans what the last call of its kind read and planned.
When the check stage then had nothing to look at on that call beyond what it checks once
per plan and the call's ``num_tokens`` -- no NaN check, ``consistency_check`` not
``"every_step"``, the plan's record kept for this very discovery, consistent, with no
inference tensor and, for its round, the same kind of ``num_tokens`` compared -- it finds
nothing else on the next call either: its findings are a function of those inputs, and
:func:`replayable` reads each of them again (the guard's probes, the record's fields, a
CUDA graph capture, the kind of ``num_tokens``), and :func:`replayed` checks the call's
``num_tokens`` as the check stage does (a failure: the stages run, and raise it as on the
full path). :func:`replayed` then hands the agree stage that call's plan, inputs and
findings without the read and check stages' layers of calls (each a few microseconds with
cold caches inside a step).

Nothing of the agreement is skipped: the agree stage runs as on every call, the same
status round over the same groups (carrying ``num_tokens``), before anything changes, so
an error, a comparison or a NaN found on another rank is met as on the full path. A call
for which any part does not hold takes the pipeline's stages, which write the replay anew.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from torch_impl.call.check import CheckSpec, Findings, nothing_per_step, same_call, tokens_kind
from torch_impl.call.checks import check_num_tokens
from torch_impl.call.memo import put
from torch_impl.call.model_state import ModelState
from torch_impl.call.plan_memo import BoundPlan
from torch_impl.call.read import CallInputs, Request, chunks_of
from torch_impl.call.steady import SteadyCall, SteadyGuard, call_kind, entry_kind
from torch_impl.run.status import capturing


class Replay(NamedTuple):
    """The last call of one kind, as the agree stage took it.

    Args:
      last: the kept call (its inputs and plan: :class:`~torch_impl.call.steady.SteadyCall`).
      guard: its steady check as probes, which must hold for the next call.
      spec: what the plan's calls check.
      findings: what the check stage found: nothing (the plan's record, a round due or not).
    """

    last: SteadyCall
    guard: SteadyGuard
    spec: CheckSpec
    findings: Findings


def replayable(replay: Replay, state: ModelState, kind: Any, source: Any, request: Request) -> bool:
    """Whether the check stage would find for this call what it found for ``replay``'s, its
    ``num_tokens`` passing its own check: the kept call and its probes still current and
    holding, the plan's record still the one it had, with nothing to look at per step
    for this kind of ``num_tokens`` (:func:`~torch_impl.call.check.nothing_per_step`; the
    kind compared only by a call with a round), no CUDA graph capture, and the last call
    of its entry point on the model of the same plan and kind of ``num_tokens`` (else the
    call compares: the ``switched`` of :func:`~torch_impl.call.check.check_call`)."""
    last, findings = replay.last, replay.findings
    given = tokens_kind(request.num_tokens)
    tokens = given if findings.round_due else None
    return (
        state.steady.get(kind) is last and state.steady_guards.get(kind) is replay.guard
        and state.plan_memo.record(last.bound) is findings.record and tokens == findings.tokens
        and nothing_per_step(replay.spec, last.inputs.config, findings.record, last.inputs.found, tokens)
        and not capturing()
        and same_call(state.last_calls.get(entry_kind(request)), last.bound, given)
        and replay.guard.holds(last, source, request)
    )


def replayed(model: Any, source: Any, request: Request) -> tuple[Replay, BoundPlan, CallInputs] | None:
    """The replay of the last call of this kind (module doc), with its plan and inputs, when
    this call is one; else None (an exception, the check of ``num_tokens`` among them, is
    the stages' to read again and report). An embedding helper's call is never one
    (:func:`keep_replay`)."""
    if request.embedding is not None:
        return None
    try:
        chunks = chunks_of(model)
        state = ModelState.existing(chunks) if chunks is not None else None
        if state is None or not state.replays:
            return None
        kind = call_kind(request)
        replay = state.replays.get(kind)
        if replay is None or not replayable(replay, state, kind, source, request):
            return None
        if request.num_tokens is not None:
            record, inputs = replay.findings.record, replay.last.inputs
            check_num_tokens(request.num_tokens, record.device, inputs.groups, replay.spec.ddp, record.nccl)
    except Exception:  # noqa: BLE001 -- a read that raises: the stages read it and report
        return None
    return replay, replay.last.bound, replay.last.inputs


def keep_replay(state: ModelState, request: Request, spec: CheckSpec, findings: Findings) -> None:
    """After a call that took the steady path and passed its status round: keep it for
    :func:`replayed` when the check stage had nothing to look at per step but the call's
    ``num_tokens`` (module doc); else drop what was kept for its kind (an embedding
    helper's never has one)."""
    if request.embedding is not None:
        return
    kind = call_kind(request)
    last, guard = state.steady.get(kind), state.steady_guards.get(kind)
    quiet = (
        guard is not None and guard.last is last and guard.probes is not None
        and findings.error is None and not findings.compare and findings.nonfinite is None
        and nothing_per_step(spec, last.inputs.config, findings.record, last.inputs.found, findings.tokens)
        and findings.round_due == (last.inputs.config.consistency_check != "off")  # not under a capture
    )
    if quiet:
        put(state.replays, kind, Replay(last, guard, spec, findings))
    else:
        state.replays.pop(kind, None)


__all__ = ["Replay", "keep_replay", "replayable", "replayed"]
