"""The steady path of a call: a call that finds everything the last call of its kind read
as that call left it takes that call's inputs and plan, without going through the read
and plan stages' memos one by one.

The check is the memos' own, in one pass and in full (:func:`steady_read`): the chunks
(the model state's chunk list), the configs the call resolves (the same objects, holding
the values the FinalizeConfig and the stated sizes were made from), the group source
(``parallel_state``'s globals as they were; a collection holding the same groups; a
helper's groups the same objects under the same names), the kept discovery (still the
one the model state holds for the call, and its
:class:`~torch_impl.call.model_watch.ModelWatch` sees what the call's plan depends on) and
the call's options. Where each holds, the read stage would return the same config, groups
and discovery, and the plan stage, keyed by exactly those, the same plan: the path skips
nothing the stages would find different. The check, agree and run stages run as on every
call. An embedding helper reads its one weight its own way, through a getter it is given
per call: the path runs that read in full on every call (the getter called on the chunk
Megatron's rule picks, the weight, its gradient tensor and ``requires_grad`` compared
with the kept discovery's, :meth:`~torch_impl.call.model_state.ModelState.embedding`) and
takes the kept plan only when it gives the kept discovery itself. A model under torch's
FSDP2 or DDP also has its wrappers' settings compared with the kept call's
(:meth:`~torch_impl.sources.discover.Discovered.wrapper_settings`: the part of the plan's
key the stages read from the wrappers on every call, such as a forward run under
``no_sync()`` or a comm hook registered since); a mesh group source (a DeviceMesh, resolved
per call) is checked by its MeshGroups (:func:`~torch_impl.call.group_memo.mesh_unchanged`:
the same layout as the last call, so no layout round is due).

Inside a distributed world that check costs far more than its own work: after each
step's collectives the code and objects of each function it runs come back cold from
memory, a few microseconds per distinct function. So once the full check has passed,
the call also writes it down as probes (:class:`SteadyGuard`,
:class:`~torch_impl.call.probes.Probes`): each memo states its own check as C-level
reads with the values they gave, and the next call replays them in one pass. What a
memo already compares element by element over fixed lists -- the watched parameters'
:class:`~torch_impl.call.watches.GradWatch`, the routers, the module-tree edges -- is
written down as that comparison itself (a ``check`` probe), with the calls above it
left out. Every probe is at least as strict as the read it stands for, and each object
a check reads is one its watch holds or is reached only through probed reads, so while
the probes hold the full check would pass too; when they do not, the full check runs and
decides (and writes new probes, at most :data:`MAX_GUARD_BUILDS` times per kept call: a
model whose probed state changes every step keeps the full check). A seed helper's
groups, a dict it builds per call, are checked by the group memo's own check on every
call (:func:`_per_call_groups`), where ``finalize_model_grads``' group source is compared
by identity.
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple

from meshgrad.config import FinalizeConfig
from torch_impl.call.memo import put
from torch_impl.call.model_state import ModelState
from torch_impl.call.plan_memo import BoundPlan
from torch_impl.call.probes import Probes
from torch_impl.call.read import EMBEDDING_FOUND, CallInputs, Request, as_chunks, config_sources, helper_groups


class SteadyCall(NamedTuple):
    """What the last call of one kind read and planned, with what it was checked against.

    Args:
      raw: the config and DDP config it resolved.
      config: the FinalizeConfig resolved from them (before a helper's own rules).
      slot: the model state's discovery slot it read, and whether the complete slot was kept
        then (:data:`EMBEDDING_SLOT` for an embedding helper: its discovery is its own).
      kept: the model state's entry in that slot (token, discovery, watch, DDP objects;
        empty for an embedding helper).
      inputs: what the read stage read.
      bound: the plan.
      settings: the FSDP2 / DDP wrappers' settings it planned with (() without wrappers).
    """

    raw: tuple[Any, Any]
    config: FinalizeConfig
    slot: tuple[tuple[bool, bool], bool]
    kept: tuple[Any, ...]
    inputs: CallInputs
    bound: BoundPlan
    settings: tuple[Any, ...] = ()


#: The slot of an embedding helper's kept call: it reads no discovery slot of the model
#: state (its own discovery is checked per call, :func:`_embedding_unchanged`).
EMBEDDING_SLOT: tuple[Any, bool] = (None, False)
#: How many times the probes of one kept call are written (the first, then after each
#: miss whose full check passed), before its calls keep the full check.
MAX_GUARD_BUILDS = 4
#: A guard's ``source`` when the call's groups are a dict made per call: asked of the group
#: memo's own check on every call instead of compared by identity.
PER_CALL = object()


class SteadyGuard(NamedTuple):
    """A kept call's steady check as probes, with what the call itself passed.

    Args:
      last: the kept call it stands for.
      source: the group source of the call that wrote it (compared by identity), or
        :data:`PER_CALL` for a seed helper's per-call groups (:func:`_per_call_groups`).
      config: that call's own config argument (compared by identity).
      raw: the config and DDP config that call resolved.
      probes: the probes (None: none could be written, or :data:`MAX_GUARD_BUILDS` ran out).
      builds: how many times they were written for ``last``.
    """

    last: SteadyCall
    source: Any
    config: Any
    raw: tuple[Any, Any]
    probes: Probes | None
    builds: int

    def holds(self, last: SteadyCall, source: Any, request: Request) -> bool:
        """Whether a call of ``last``'s kind with these arguments would pass the full check
        (:func:`~torch_impl.call.replay.replayed` asks its probes alone where the call's
        source and config are the guard's own)."""
        return (
            self.probes is not None and last is self.last and request.config is self.config
            and (source is self.source or self.source is PER_CALL and type(source) is dict
                 and last.inputs.state.group_memo.explicit_unchanged(source, last.inputs.groups))
            and self.probes.hold()
        )


def _per_call_groups(source: Any, request: Request) -> bool:
    """Whether ``source`` is a seed helper's groups as the helpers build them, a new dict
    per call: no probe stands for it, the guard asks the group memo's own check each call
    (:meth:`~torch_impl.call.group_memo.GroupMemo.explicit_unchanged`; :data:`PER_CALL`)."""
    return type(source) is dict and not request.finalize


def _write_probes(state: ModelState, last: SteadyCall, source: Any, request: Request) -> Probes | None:
    """The full check of ``last`` (which has just passed) as probes, or None where some
    part cannot be written down (module doc)."""
    probes = Probes()
    inputs = last.inputs
    (slot, complete_kept), (raw, ddp_config) = last.slot, last.raw
    try:
        state.config_memo.probe(probes, raw, ddp_config, inputs.requested if request.finalize else None)
        # A helper's per-call dict is asked of the group memo on every call (PER_CALL); another
        # kind of mapping as a helper's groups keeps the full check.
        if not _per_call_groups(source, request) and (
            helper_groups(source, request) or not state.group_memo.probe(probes, source, inputs.config, inputs.groups)
        ):
            return None
        if request.embedding is None and not state.probe_kept(probes, slot, last.kept, complete_kept, request.reads):
            return None
        if last.settings:
            probes.equal(inputs.found.wrapper_settings, last.settings)
    except Exception:  # noqa: BLE001 -- a read that raises now: no probes, the full check stays
        return None
    return probes


def _keep_guard(state: ModelState, kind: Any, last: SteadyCall, source: Any, request: Request,
                raw: tuple[Any, Any]) -> None:
    """After a full check of ``last`` passed: write its probes, unless they were written
    :data:`MAX_GUARD_BUILDS` times already or could not be written for it."""
    old = state.steady_guards.get(kind)
    same_call = old is not None and old.last is last
    if same_call and old.probes is None:  # none could be written, or the builds ran out
        return
    builds = old.builds + 1 if same_call else 1
    probes = _write_probes(state, last, source, request) if builds <= MAX_GUARD_BUILDS else None
    kept_source = PER_CALL if _per_call_groups(source, request) else source
    state.steady_guards[kind] = SteadyGuard(last, kept_source, request.config, raw, probes, builds)


#: The fields of a :class:`Request` that :func:`call_kind` takes as they are (in C).
KIND_FIELDS = operator.attrgetter(
    "steps", "force_all_reduce", "merge_ddp_config", "config_default", "per_token_loss", "over",
)


def call_kind(request: Request) -> tuple[Any, ...]:
    """What of ``request`` decides its read and plan besides its config (num_tokens only by
    presence; of an embedding helper's read, all but its getter, which is given per call
    and called on every call). :func:`~torch_impl.call.replay.replayed` writes it out for
    a call without an embedding read."""
    read = request.embedding
    return (*KIND_FIELDS(request), request.num_tokens is None,
            None if read is None else (read.role, read.required, read.has_mtp, read.pp_given))


def entry_kind(request: Request) -> tuple[Any, ...]:
    """Which entry point ``request`` is (finalize, or a seed helper): its steps and the
    groups it communicates over; unlike :func:`call_kind`, not whether it has
    ``num_tokens``, which a switch between its calls may change
    (:func:`~torch_impl.call.check.same_call`)."""
    return request.steps, request.over


def _same_raw(raw: Any, kept: Any) -> bool:
    """The same config object, or an equal FinalizeConfig (immutable: a helper given one
    per call resolves the same)."""
    return raw is kept or (type(raw) is FinalizeConfig and raw == kept)


def _groups_unchanged(state: ModelState, source: Any, request: Request, inputs: CallInputs) -> bool:
    """Whether the read stage would resolve ``inputs.groups`` again from ``source``."""
    memo = state.group_memo
    if helper_groups(source, request):
        return memo.explicit_unchanged(source, inputs.groups)
    return memo.unchanged(source, inputs.config, inputs.groups)


def steady_read(
    model: Any, source: Any, request: Request, known: dict[str, Any]
) -> tuple[CallInputs, BoundPlan] | None:
    """The last inputs and plan of this call's kind when this call would read and plan
    the same (module doc), with ``known`` filled as the read stage fills it; else None.

    Raises:
      TypeError: ``model`` is not a module or a non-empty sequence of modules.
    """
    chunks = as_chunks(model)
    state = ModelState.of(chunks)
    kind = call_kind(request)
    last: SteadyCall | None = state.steady.get(kind)
    if last is None:
        return None
    guard = state.steady_guards.get(kind)
    if guard is not None and guard.holds(last, source, request):
        raw = guard.raw
    else:
        checked = _full_check(state, last, chunks, source, request)
        if checked is None:
            return None
        raw, entry = checked
        if entry is last.kept:
            _keep_guard(state, kind, last, source, request, raw)
        else:  # renewed gradients: the renewed discovery kept; no probes (the next step renews again)
            last = put(state.steady, kind, last._replace(kept=entry, inputs=last.inputs._replace(found=entry[1])))
            state.steady_guards.pop(kind, None)
    inputs = last.inputs
    known.update(raw=raw, config=inputs.config, groups=inputs.groups)
    if request.embedding is not None and not _embedding_unchanged(state, chunks, request, inputs, known):
        return None
    return inputs, last.bound


def _embedding_unchanged(
    state: ModelState, chunks: list[Any], request: Request, inputs: CallInputs, known: dict[str, Any]
) -> bool:
    """Whether an embedding helper's read, run now in full, gives the kept discovery. The
    groups are the ones the read stage would resolve (checked before), so on a miss the
    discovery is handed to it in ``known`` (the getter is called once per call).

    Raises:
      ValueError: the weight is required and the chunk has none (as the read stage raises).
    """
    found = state.embedding(chunks, inputs.groups, request.embedding)
    if found is inputs.found:
        return True
    known[EMBEDDING_FOUND] = found
    return False


def _full_check(
    state: ModelState, last: SteadyCall, chunks: Any, source: Any, request: Request
) -> tuple[tuple[Any, Any], tuple[Any, ...]] | None:
    """The memos' own checks of ``last`` (module doc) when they all hold: the config and
    DDP config this call resolves, and the model state's entry it reads (the kept one, or
    it renewed: :meth:`~torch_impl.call.model_state.ModelState.current`); else None."""
    raw = config_sources(chunks, request)
    inputs = last.inputs
    (slot, complete_kept), kept_raw = last.slot, last.raw
    stated = inputs.requested if request.finalize else None  # a helper states no sizes
    if (
        not _same_raw(raw[0], kept_raw[0]) or raw[1] is not kept_raw[1]
        or not state.config_memo.unchanged(kept_raw[0], raw[1], last.config, stated)
        or not _groups_unchanged(state, source, request, inputs)
        or last.settings and inputs.found.wrapper_settings() != last.settings
    ):
        return None
    if request.embedding is not None:
        return raw, last.kept
    entry = state.current(slot, last.kept, complete_kept, request.reads)  # last: it may renew
    return (raw, entry) if entry is not None else None


def keep_steady(inputs: CallInputs, bound: BoundPlan, source: Any, request: Request, raw: tuple[Any, Any]) -> None:
    """Keep this call's inputs and plan for the next call of its kind
    (:func:`steady_read`); a call the steady path does not serve (module doc) drops what
    was kept for its kind."""
    kind = call_kind(request)
    state, found = inputs.state, inputs.found
    if request.embedding is not None:  # its discovery is its own, checked on every call
        slot, entry = EMBEDDING_SLOT, ()
    else:
        kept = state.kept(found)
        slot, entry = ((kept[0], state.complete_kept(kept[0])), kept[1]) if kept is not None else (None, None)
    config = state.config_memo.last_resolved_config(*raw)  # before a helper's rules
    if slot is None or config is None:
        state.steady.pop(kind, None)
        return
    put(state.steady, kind, SteadyCall(raw, config, slot, entry, inputs, bound, found.wrapper_settings()))


__all__ = [
    "EMBEDDING_SLOT", "KIND_FIELDS", "MAX_GUARD_BUILDS", "PER_CALL", "SteadyCall", "SteadyGuard", "call_kind", "entry_kind", "keep_steady",
    "steady_read",
]
