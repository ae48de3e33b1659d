"""A steady call replayed: what the read and check stages answered on the last call of a
kind, kept for the next one (:class:`Replay`).

A call whose steady check holds (:mod:`torch_impl.call.steady`: the probes of everything
the read stage read) reads and plans what the last call of its kind read and planned.
When the check stage then had nothing to look at on that call beyond what it checks once
per plan and the call's ``num_tokens`` -- no NaN check, ``consistency_check`` not
``"every_step"``, the plan's record kept for this very discovery, consistent, with no
inference tensor and, for its round, the same kind of ``num_tokens`` compared -- it finds
nothing else on the next call either: its findings are a function of those inputs, and
:func:`replayed` reads each of them again (the guard's probes, the record's fields, a
CUDA graph capture, the kind of ``num_tokens``) and checks the call's ``num_tokens`` as
the check stage does, from the kind it read (a failure: the stages run, and raise it as
on the full path) -- or, where that kind, the gradients' device and the route's backend
are the ones the kept call's ``num_tokens`` passed that check with, reads again only what
else the check reads, the DDP objects' ``scale_gradients``. It then hands the agree stage
that call's plan, inputs and findings without the read and check stages' layers of calls
(each a few microseconds with cold caches inside a step). It is one function on purpose:
each call it makes is one more function that comes back cold from memory on every step.
So the small reads and predicates
it shares with the stages (the chunk list, the model's state, the call's kind, the checks'
predicates) are written out in it, each marked with the function it stands for
(``tests/test_replay.py`` changes each input they read, one at a time, and sees the replay
refused).

Nothing of the agreement is skipped: the agree stage runs as on every call, the same
status round over the same groups (carrying ``num_tokens``), before anything changes, so
an error, a comparison or a NaN found on another rank is met as on the full path. A call
for which any part does not hold takes the pipeline's stages, which write the replay anew.
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple

from torch import Tensor
from torch.nn import Module

from torch_impl.call.check import CheckSpec, Findings, nothing_per_step
from torch_impl.call.checks import tokens_error, tokens_kind
from torch_impl.call.memo import put
from torch_impl.call.model_state import STATE_ATTR, ModelState
from torch_impl.call.plan_memo import BoundPlan
from torch_impl.call.read import CallInputs, Request
from torch_impl.call.steady import KIND_FIELDS, SteadyCall, SteadyGuard, call_kind, entry_kind
from torch_impl.run.status import capturing


class Replay(NamedTuple):
    """The last call of one kind, as the agree stage took it.

    Args:
      last: the kept call (its inputs and plan: :class:`~torch_impl.call.steady.SteadyCall`).
      guard: its steady check as probes, which must hold for the next call.
      spec: what the plan's calls check.
      findings: what the check stage found: nothing (the plan's record, a round due or not).
      entry: its entry point (:func:`~torch_impl.call.steady.entry_kind`; the kind of call
        decides it).
      judged: what that call's ``num_tokens`` passed
        :func:`~torch_impl.call.checks.check_num_tokens` with -- its kind
        (:func:`~torch_impl.call.checks.tokens_kind`), the gradients' device, whether the
        route is NCCL -- the check's every input but the DDP objects; None without a tensor.
    """

    last: SteadyCall
    guard: SteadyGuard
    spec: CheckSpec
    findings: Findings
    entry: tuple[Any, ...]
    judged: tuple[Any, ...] | None


#: A DDP object's ``scale_gradients`` (a miss raises: the stages run and report it).
_SCALES = operator.attrgetter("scale_gradients")


def replayed(model: Any, source: Any, request: Request) -> tuple[Replay, BoundPlan, CallInputs] | None:
    """The replay of the last call of this kind (module doc), with its plan and inputs, when
    this call is one; else None (an exception, a bad ``num_tokens`` among them, is the
    stages' to read again and report). An embedding helper's call is never one
    (:func:`keep_replay`).

    It is one when the check stage would find for this call what it found for the kept
    one, its ``num_tokens`` passing its own check: the kept call and its probes still
    current and holding, the plan's record still the one it had, with nothing to look at
    per step for this kind of ``num_tokens`` (:func:`~torch_impl.call.check.nothing_per_step`,
    of which its record's part is read again, :func:`~torch_impl.call.check.record_quiet`'s
    conditions: the rest is a function of the kept call's fixed plan and config; the kind
    compared only by a call with a round), no CUDA graph capture, and the last call of its
    entry point on the model of the same plan and kind of ``num_tokens`` (else the call
    compares: the ``switched`` of :func:`~torch_impl.call.check.check_call`, by
    :func:`~torch_impl.call.check.same_call`'s test)."""
    if request.embedding is not None:
        return None
    try:
        # read.chunks_of
        if isinstance(model, Module):
            chunks = (model,)
        elif isinstance(model, (list, tuple)) and model:
            for chunk in model:
                if not isinstance(chunk, Module):
                    return None
            chunks = model
        else:
            return None
        # ModelState.existing
        state = getattr(chunks[0], STATE_ATTR, None)
        if type(state) is not ModelState or state.chunk_ids != tuple(map(id, chunks)) or not state.replays:
            return None
        kind = (*KIND_FIELDS(request), request.num_tokens is None, None)  # steady.call_kind, no embedding read
        replay = state.replays.get(kind)
        if replay is None:
            return None
        last, guard, spec, findings, entry, judged = replay
        num_tokens, record, inputs, bound = request.num_tokens, findings.record, last.inputs, last.bound
        # checks.tokens_kind
        given = (num_tokens.dtype, num_tokens.numel(), num_tokens.device) if isinstance(num_tokens, Tensor) else None
        kept_record = state.plan_memo.records.get(id(bound))  # PlanMemo.record: (plan, record)
        last_call = state.last_calls.get(entry)
        probes = guard.probes
        if not (
            state.steady.get(kind) is last and state.steady_guards.get(kind) is guard
            and kept_record is not None and kept_record[0] is bound and kept_record[1] is record
            and (given if findings.round_due else None) == findings.tokens
            # check.record_quiet (the record is not None: kept)
            and record.found is inputs.found and record.inference_tensor is None
            and (inputs.config.consistency_check == "off" or record.consistent and record.tokens == findings.tokens)
            and not capturing()
            # check.same_call
            and last_call is not None and last_call[0] is bound and last_call[1] == given
            # SteadyGuard.holds: its probes alone where the call's source and config are the guard's own
            and (probes.hold() if source is guard.source and guard.last is last and request.config is guard.config
                 and probes is not None else guard.holds(last, source, request))
            and (num_tokens is None or given is not None and (
                # judged as the kept call's was (its inputs the same), but for the DDP objects
                all(map(callable, map(_SCALES, spec.ddp))) if (given, record.device, record.nccl) == judged
                else tokens_error(num_tokens, given, record.device, inputs.groups, spec.ddp, record.nccl) is None))
        ):
            return None
    except Exception:  # noqa: BLE001 -- a read that raises: the stages read it and report
        return None
    return replay, last.bound, inputs


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
        given = tokens_kind(request.num_tokens)  # passed its check (no error found) on the record's device and route
        record = findings.record
        judged = (given, record.device, record.nccl) if given is not None else None
        put(state.replays, kind, Replay(last, guard, spec, findings, entry_kind(request), judged))
    else:
        state.replays.pop(kind, None)


__all__ = ["Replay", "keep_replay", "replayed"]
