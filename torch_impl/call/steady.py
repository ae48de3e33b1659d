"""The steady path of ``finalize_model_grads``: a call that finds everything the last
call read as that call left it takes the last call's inputs and plan, without going
through the read and plan stages' memos one by one.

The check is the memos' own, in one pass and in full (:func:`steady_read`): the chunks
(the model state's chunk list), the configs on their ``.module`` chains (the same
objects, holding the values the FinalizeConfig and the stated sizes were made from),
the group source (the same object; ``parallel_state``'s globals as they were), the kept
discovery (still the one the model state holds for the call, and its
:class:`~torch_impl.call.model_watch.ModelWatch` sees the same model) and the call's
options. Where each holds, the read stage would return the same config, groups and
discovery, and the plan stage, keyed by exactly those, the same plan: the path skips
nothing the stages would find different. The check, agree and run stages run as on every
call. A seed helper, a torch FSDP2 / DDP model (their hooks' settings are read per call)
and a mesh group source (resolved per call) always take the stages.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from torch_impl.call.model_state import ModelState
from torch_impl.call.plan_memo import BoundPlan
from torch_impl.call.read import CallInputs, Request, as_chunks
from torch_impl.sources.config import chunk_configs
from torch_impl.sources.group_sources import MESH_KINDS, source_kind


class SteadyCall(NamedTuple):
    """What the last finalize call read and planned, with what it was checked against.

    Args:
      source: the group source it was given.
      options: its request's options (:func:`_options`).
      raw: the config and DDP config found on the chunks' ``.module`` chains.
      slot: the model state's discovery slot it read, and whether the complete slot was kept then.
      kept: the model state's entry in that slot (token, discovery, watch, DDP objects).
      inputs: what the read stage read.
      bound: the plan.
    """

    source: Any
    options: tuple[Any, ...]
    raw: tuple[Any, Any]
    slot: tuple[tuple[bool, bool], bool]
    kept: tuple[Any, ...]
    inputs: CallInputs
    bound: BoundPlan


def _options(request: Request) -> tuple[Any, ...] | None:
    """What of ``request`` decides its read and plan (num_tokens only by presence); None
    for a seed helper's request, which takes the stages."""
    if not request.finalize or request.config is not None or request.embedding is not None:
        return None
    return (request.force_all_reduce, request.num_tokens is None, request.merge_ddp_config,
            request.config_default, request.per_token_loss, request.over)


def steady_read(model: Any, source: Any, request: Request, known: dict[str, Any]) -> tuple[CallInputs, BoundPlan] | None:
    """The last call's inputs and plan when this call would read and plan the same
    (module doc), with ``known`` filled as the read stage fills it; else None.

    Raises:
      TypeError: ``model`` is not a module or a non-empty sequence of modules.
    """
    chunks = as_chunks(model)
    state = ModelState.of(chunks)
    last: SteadyCall | None = state.steady
    if last is None or last.source is not source or last.options != _options(request):
        return None
    raw = chunk_configs(chunks)
    inputs = last.inputs
    (slot, had_complete), full = last.slot, (inputs.config.has_mtp, True)
    if (
        raw[0] is not last.raw[0] or raw[1] is not last.raw[1]
        or state.found.get(slot) is not last.kept or (full in state.found) != had_complete
        or not state.config_memo.unchanged(raw[0], raw[1], inputs.config, inputs.requested)
        or not state.group_memo.unchanged(source, inputs.config, inputs.groups)
        or not last.kept[2].same()
    ):
        return None
    known.update(raw=raw, config=inputs.config, groups=inputs.groups)
    return inputs, last.bound


def keep_steady(inputs: CallInputs, bound: BoundPlan, source: Any, request: Request, raw: tuple[Any, Any]) -> None:
    """Keep this finalize call's inputs and plan for the next call (:func:`steady_read`).
    A finalize call the steady path does not serve (module doc) drops what was kept; a
    seed helper's call leaves it (the next finalize call checks it in full)."""
    options = _options(request)
    if options is None:
        return
    state, found = inputs.state, inputs.found
    kept = state.kept(found)
    if kept is None or found.fsdp or found.torch_ddp or source_kind(source) in MESH_KINDS:
        state.steady = None
        return
    full = (inputs.config.has_mtp, True)
    state.steady = SteadyCall(source, options, raw, (kept[0], full in state.found), kept[1], inputs, bound)


__all__ = ["SteadyCall", "keep_steady", "steady_read"]
