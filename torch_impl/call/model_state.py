"""The per-model memo of every call: :class:`ModelState`, the one object meshgrad writes
onto objects it does not own (the attribute ``_meshgrad_finalize_state`` of ``chunks[0]``).

It is made on the first call with a chunk list, replaced when the call's chunk list
differs (another list, order or length), starts afresh when the model is copied or
pickled, dies with the chunk, and is emptied by
:func:`torch_impl.finalize.invalidate_plans`. Every cache in it is bounded: at most
:data:`~torch_impl.call.memo.MAX_PLANS` plans (each with its bound program and its check record, evicted
together, oldest first), one discovery per ``has_mtp`` (dropped with its bindings when
the model watch fires), one resolved group source, the groups of each DeviceMesh and of
Megatron's ``parallel_state`` (kept here, not on those objects), and :data:`~torch_impl.call.memo.MAX_PLANS`
helper group sets and embedding discoveries.
"""

from __future__ import annotations

import operator
import weakref

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Literal

from meshgrad.config import FinalizeConfig
from torch_impl.call.config_memo import ConfigMemo
from torch_impl.sources.discover import (
    Discovered, candidate_keys, chunk_facts, discover, probe_chunk_reads, watched_keys,
)
from torch_impl.sources.embedding_read import EmbeddingRead, embedding_weight, one_weight
from torch_impl.run.stats import ExecStats
from torch_impl.run.grads import get_grad, is_dtensor
from torch_impl.call.group_memo import GroupMemo
from torch_impl.run.groups import TorchGroups
from torch_impl.sources.config import ddp_object
from torch_impl.call.memo import MAX_PLANS, put
from torch_impl.call.model_watch import ModelWatch
from torch_impl.call.plan_memo import BoundPlan, PlanMemo
from torch_impl.call.probes import Probes
from torch_impl.call.watches import tensor_layout
from torch_impl.run.program import Program
from torch_impl.run.scaling import HostFactor

#: The attribute of ``chunks[0]`` that holds its :class:`ModelState`.
STATE_ATTR = "_meshgrad_finalize_state"


class _Fingerprint:
    """The specs of a discovery as a dict key, hashed once (a model's specs are many)."""

    __slots__ = ("specs", "hash")

    def __init__(self, specs: tuple[Any, ...]) -> None:
        self.specs, self.hash = specs, hash(specs)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Fingerprint) and self.hash == other.hash and self.specs == other.specs


#: What a call's plan may read (:attr:`Request.reads`).
Reads = Literal["all", "touched", "routers"]

#: What a kept discovery is checked for, by what the call's plan may read.
_CHECKS: dict[Reads, Callable[[ModelWatch], bool]] = {
    "all": ModelWatch.same,
    "touched": ModelWatch.touched_same,
    "routers": ModelWatch.routers_same,
}


class ModelState:
    """What meshgrad caches on a model (on its first chunk; lifetime in the module doc).

    It owns its memos: :class:`~torch_impl.call.config_memo.ConfigMemo` (configs),
    :class:`~torch_impl.call.group_memo.GroupMemo` (groups) and
    :class:`~torch_impl.call.plan_memo.PlanMemo` (plans, programs, check records); discovery
    is its own. Discovery is keyed on the chunk objects, resolved groups on the group source, and
    plans on everything that can change them: parameters' requires_grad / gradient
    presence and dtype, router modes, the config, the groups and the call's options.
    Each plan is bound once to the gradient tensors (:class:`~torch_impl.run.program.Program`);
    a :class:`~torch_impl.call.model_watch.ModelWatch` tells, at C speed, whether a step still sees
    the same model (structure, flags, requires_grad, gradient tensors, routers), so a
    repeated step neither re-discovers nor re-binds. ``stats`` counts calls, plans built,
    bindings and the bytes coalescing had to copy.
    """

    def __init__(self, chunks: Sequence[Any]) -> None:
        self.chunk_ids = tuple(map(id, chunks))
        self.found: dict[tuple[bool, bool], tuple[int, Discovered, ModelWatch, tuple[Any, ...]]] = {}
        self.renewed: Discovered | None = None  # the discovery of this call's renewed gradients
        self.tokens: dict[_Fingerprint, int] = {}  # specs -> token
        self.next_token = 0
        self.embeddings: dict[tuple[Any, ...], tuple[Any, Any, tuple[Any, ...], Discovered]] = {}
        self.stats = ExecStats()
        self.config_memo = ConfigMemo()  # resolved configs
        self.group_memo = GroupMemo()  # resolved groups per source, meshes, parallel_state
        self.plan_memo = PlanMemo(self.stats)  # plans, programs, check records
        self.plans, self.programs = self.plan_memo.plans, self.plan_memo.programs
        self.host_factor = HostFactor()  # the last num_tokens factor known on the host
        self.steady: dict[Any, Any] = {}  # per kind of call, its last inputs and plan (torch_impl.call.steady)
        self.steady_guards: dict[Any, Any] = {}  # per kind of call, its steady check as probes (same module)
        self.replays: dict[Any, Any] = {}  # per kind of call, its stages' answers (torch_impl.call.replay)
        # Per entry point (steady.entry_kind), the plan and kind of num_tokens of its last call
        # that passed its round (torch_impl.call.pipeline: a call that differs compares).
        self.last_calls: dict[Any, tuple[Any, Any]] = {}
        # The gradient views of meshgrad's own buffers (attach_grad_buffers), by id; weak:
        # an entry goes with its view, so an id cannot be reused while it is here.
        self.own_views: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()

    def __reduce__(self) -> tuple[Any, ...]:
        # A cache: copying or pickling the model (deepcopy, torch.save) starts it afresh
        # instead of trying to copy process groups.
        return (ModelState, ((),))

    @classmethod
    def of(cls, chunks: Sequence[Any]) -> "ModelState":
        """The state of this chunk list (made, or replaced when the list differs)."""
        state = cls.existing(chunks)
        if state is None:
            state = cls(chunks)
            object.__setattr__(chunks[0], STATE_ATTR, state)
        return state

    @classmethod
    def existing(cls, chunks: Sequence[Any]) -> "ModelState | None":
        """The state :meth:`of` would give for this chunk list, or None where it would make
        one (:func:`~torch_impl.call.replay.replayed` writes it out)."""
        state = getattr(chunks[0], STATE_ATTR, None)
        return state if type(state) is cls and state.chunk_ids == tuple(map(id, chunks)) else None

    def _token(self, found: Discovered) -> int:
        """A small int standing for the specs (cheap to hash in plan keys): equal specs,
        equal tokens, so an unchanged plan is found again in the cache."""
        fingerprint = _Fingerprint((found.params, found.routers))
        token = self.tokens.get(fingerprint)
        if token is None:
            if len(self.tokens) >= 4 * MAX_PLANS:
                self.tokens.clear()
            token = self.tokens[fingerprint] = self.next_token
            self.next_token += 1
        return token

    def discovered(
        self, chunks: Sequence[Any], config: FinalizeConfig, complete: bool = True, reads: Reads = "all"
    ) -> tuple[Any, Discovered, tuple[Any, ...]]:
        """(fingerprint token, Discovered, the chunks' DDP objects) for this step.

        While the :class:`~torch_impl.call.model_watch.ModelWatch` sees the same model (structure,
        watched parameters' flags, requires_grad and gradient tensors, routers, chunk
        facts), nothing is re-read. Otherwise every bound program is dropped and the
        model is discovered again (structure changed) or its specs re-read.

        Args:
          chunks: the model chunks.
          config: the call's config.
          complete: a spec for every parameter; False leaves out the parameters of
            Megatron-DDP chunks that no step of meshgrad touches (read once per
            discovery: their DDP does the DP sync; the GTP step needs them all).
          reads: what the call's plan may read, which a kept discovery is checked for
            (the next call that reads more checks more): ``"all"`` (finalize: every
            watched parameter, :meth:`~torch_impl.call.model_watch.ModelWatch.same`), ``"touched"``
            (a seed helper: the parameters a step besides the DP sync may touch, the
            others' flags, :meth:`~torch_impl.call.model_watch.ModelWatch.touched_same`) or
            ``"routers"`` (expert bias, qb_beta, reset: routers only,
            :meth:`~torch_impl.call.model_watch.ModelWatch.routers_same`).
        """
        full = (config.has_mtp, True)
        # A complete discovery serves a call that needs less (an audit keeps one).
        slot = full if complete or full in self.found else (config.has_mtp, False)
        cached = self.found.get(slot)
        entry = self.current(slot, cached, self.complete_kept(slot), reads) if cached is not None else None
        if entry is not None:  # kept, or renewed; the watch's chunk facts hold the DDP objects
            return entry[0], entry[1], entry[3]
        self.programs.clear()
        ddp = tuple(ddp_object(c) for c in chunks)
        if cached is None or not cached[2].structure_same():
            found = discover(chunks, config, () if slot[1] else [obj is not None for obj in ddp])
        else:
            found = cached[1].refresh()
        if cached is not None:
            cached[2].close()
        token = self._token(found)
        has_mtp = config.has_mtp
        watch = ModelWatch(
            found, chunks, partial(chunk_facts, chunks, has_mtp, ddp_object),
            watched_keys(found, [obj is None for obj in ddp]), candidate_keys(found), self.own_views,
            partial(probe_chunk_reads, model=chunks, has_mtp=has_mtp, ddp_object=ddp_object),
        )
        self.found[slot] = (token, found, watch, ddp)
        return token, found, ddp

    def _renew(self, slot: tuple[bool, bool], cached: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """The entry ``cached`` of ``slot`` with its discovery renewed, where its watch sees
        the model unchanged but for new ``.grad`` tensors like the old
        (:meth:`~torch_impl.call.model_watch.ModelWatch.renewal`: ``zero_grad(set_to_none=True)``);
        else None. The specs, plans and checks hold; the discovery becomes a new object of
        its lineage, so that the binding and NaN scan of the old gradients (keyed on it)
        are redone for the new ones. Renewed twice running, they are not held past the call
        (:meth:`release_renewed`)."""
        renewal = cached[2].renewal()
        if renewal is None:
            return None
        self.programs.clear()
        found = cached[1].renewal()
        if cached[2].renew(found, renewal):
            self.renewed = found
        entry = self.found[slot] = (cached[0], found, cached[2], cached[3])
        return entry

    def release_renewed(self, bound: BoundPlan, found: Discovered) -> None:
        """After a call on renewed gradients (:meth:`discovered`; ``found``: its discovery):
        hold none of them until the next call -- not in the watch, not in a bound program,
        not in the spans of the plan's NaN scan -- so that ``zero_grad(set_to_none=True)``
        frees them. The next call checks and binds its own (it would anyway: they are new)."""
        if self.renewed is not found:
            return
        self.renewed = None
        kept = self.kept(found)
        if kept is not None:
            kept[1][2].release()
        self.programs.pop(id(bound), None)
        record = self.plan_memo.record(bound)
        if record is not None:
            record.nan_spans = None

    def current(self, slot: tuple[bool, bool], kept: tuple[Any, ...], complete_kept: bool,
                reads: Reads) -> tuple[Any, ...] | None:
        """The entry of ``slot`` that :meth:`discovered` would return for a call that chose
        that slot while the complete slot was kept or not, as then, without reading the
        model again: ``kept`` itself (its watch sees what a plan of ``reads`` depends on),
        or ``kept`` renewed where its watch sees new gradients like the old
        (:meth:`_renew`, done here); None where it would read again."""
        if self.found.get(slot) is not kept or self.complete_kept(slot) != complete_kept:
            return None
        if _CHECKS[reads](kept[2]):
            return kept
        return self._renew(slot, kept) if reads != "routers" else None

    def probe_kept(self, probes: Probes, slot: tuple[bool, bool], kept: tuple[Any, ...], complete_kept: bool,
                   reads: Reads) -> bool:
        """Write :meth:`current` down as probes, for a call it has just answered with
        ``kept`` itself. False where it cannot be (see :meth:`~torch_impl.call.model_watch.ModelWatch.probe`)."""
        probes.same(partial(self.found.get, slot), kept)
        probes.same(partial(operator.contains, self.found, (slot[0], True)), complete_kept)
        return kept[2].probe(probes, reads)

    def complete_kept(self, slot: tuple[bool, bool]) -> bool:
        """Whether the complete discovery for ``slot``'s ``has_mtp`` is kept (then
        :meth:`discovered` reads it, whatever a call needs)."""
        return (slot[0], True) in self.found

    def kept(self, found: Discovered) -> tuple[tuple[bool, bool], tuple[Any, ...]] | None:
        """(slot, kept entry) of the discovery ``found`` (None: not kept here)."""
        return next(((slot, hit) for slot, hit in self.found.items() if hit[1] is found), None)

    def invalidate(self) -> None:
        """Forget every discovery, plan and binding: the next call reads the model anew."""
        for _, _, watch, _ in self.found.values():
            watch.close()
        self.found.clear()
        self.steady.clear()
        self.steady_guards.clear()
        self.replays.clear()
        self.last_calls.clear()  # (their plans are dropped with the others)
        self.plans.clear()
        self.programs.clear()
        self.plan_memo.records.clear()
        self.embeddings.clear()

    def program(self, bound: BoundPlan, found: Discovered, groups: TorchGroups, config: FinalizeConfig) -> Program | None:
        """The plan bound to this step's gradient tensors (cached until the watch fires),
        or None when gradients are DTensors (they are unsharded per step; that answer is
        kept the same way). The pipeline's run stage writes out its first lines, the kept
        binding's lookup."""
        hit = self.programs.get(id(bound))  # (plan, program, the discovery it was bound to)
        if hit is not None and hit[0] is bound and hit[2] is found:
            return hit[1]
        kept = self.kept(found)
        cached = kept[1] if kept is not None else None
        if cached is not None:
            cached[2].cover_plan(bound)  # what the plan reads is watched
            if cached[2].has_dtensor():  # kept: the watch's DTensor facts hold while the discovery does
                put(self.programs, id(bound), (bound, None, found))
                return None
        elif any(is_dtensor(get_grad(t)) for t in found.tensors.values()):  # a helper's own discovery
            return None
        return self.plan_memo.bind(bound, found, groups, config, self.own_views)

    def embedding(self, chunks: Sequence[Any], groups: TorchGroups, read: EmbeddingRead) -> Discovered:
        """An embedding helper's own discovery of its one weight, from the chunk Megatron's
        rule picks at this rank's pp stage; kept while the weight, its gradient tensor,
        ``requires_grad`` and the two tensors' layouts (:func:`tensor_layout`: an in-place
        ``.data = ...``, ``set_`` or dtype view of the gradient) stay the same.

        Raises:
          ValueError: the weight is required and the chunk has none.
        """
        stage, pp = (groups.pp_stage, groups.pp_size) if read.pp_given else (0, 1)
        index, weight = embedding_weight(chunks, stage, pp, read, groups.rank)
        grad = get_grad(weight) if weight is not None else None
        facts = (bool(getattr(weight, "requires_grad", False)), tensor_layout(weight), tensor_layout(grad))
        key = (read.role, id(weight), index)
        hit = self.embeddings.get(key)
        if hit is not None and hit[0] is weight and hit[1] is grad and hit[2] == facts:
            return hit[3]
        found = one_weight(chunks, index, weight, read.role)
        return put(self.embeddings, key, (weight, grad, facts, found))[3]


__all__ = ["STATE_ATTR", "ModelState", "Reads"]
