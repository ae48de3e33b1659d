"""The per-model memo of every call: :class:`ModelState`, the one object meshgrad writes
onto objects it does not own (the attribute ``_meshgrad_finalize_state`` of ``chunks[0]``).

It is made on the first call with a chunk list, replaced when the call's chunk list
differs (another list, order or length), starts afresh when the model is copied or
pickled, dies with the chunk, and is emptied by
:func:`torch_impl.finalize.invalidate_plans`. Every cache in it is bounded: at most
:data:`MAX_PLANS` plans (each with its bound program and its check record, evicted
together, oldest first), one discovery per ``has_mtp`` (dropped with its bindings when
the model watch fires), one resolved group source, the groups of each DeviceMesh and of
Megatron's ``parallel_state`` (kept here, not on those objects), and :data:`MAX_PLANS`
helper group sets and embedding discoveries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from meshgrad.axes import Group
from meshgrad.config import FinalizeConfig
from meshgrad.params import ParamKey, Role
from meshgrad.plan import FinalizePlan
from torch_impl.checks import plan_keys
from torch_impl.consensus import CheckSpec, PlanRecord
from torch_impl.discover import Discovered, candidate_keys, chunk_facts, discover, one_weight, watched_keys
from torch_impl.exec_stats import ExecStats
from torch_impl.program import Program
from torch_impl.grads import GradAccess, get_grad, is_dtensor
from torch_impl.model_watch import ModelWatch
from torch_impl.watches import differs
from torch_impl.groups import TorchGroups, world_size
from torch_impl.mesh_groups import MeshGroups
from torch_impl.group_sources import MESH_KINDS, resolve_groups, source_kind
from torch_impl.megatron import parallel_state_keyed
from torch_impl.megatron_config import CONFIG_SIZES, Requested, ddp_object, resolve_config

_STATE_ATTR = "_meshgrad_finalize_state"
#: Most plans (and helper group sets, embedding discoveries) one model state keeps.
MAX_PLANS = 16
_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(FinalizeConfig))
_GROUP_NAMES = tuple(g.value for g in Group)
_ABSENT = object()


@dataclasses.dataclass(frozen=True, eq=False)
class BoundPlan:
    """A plan with everything a step needs to run it (immutable; what the checks found
    per plan is kept by :class:`ModelState`).

    Args:
      plan: the FinalizePlan (all steps; DP sync only for plain chunks).
      ddp: the DDP objects whose ``finish_grad_sync`` does step 1 for their chunks.
      ddp_force_kwarg: per DDP object, whether it accepts ``force_all_reduce``.
      plain_scale_keys: gradients this backend scales by num_tokens (plain chunks).
      checks: what a call of this plan checks before communicating (None: nothing).
      helper: a seed helper's plan (its kept discovery is checked for what it touches:
        :meth:`~torch_impl.model_watch.ModelWatch.touched_same`).
    """

    plan: FinalizePlan
    ddp: tuple[Any, ...]
    ddp_force_kwarg: tuple[bool, ...]
    plain_scale_keys: tuple[ParamKey, ...]
    checks: CheckSpec | None = None
    helper: bool = False


def _read(source: Any, names: tuple[str, ...]) -> tuple[Any, ...]:
    """The values of ``names`` in ``source`` (absent ones marked)."""
    if source is None:
        return ()
    if isinstance(source, Mapping):
        return tuple([source.get(name, _ABSENT) for name in names])
    return tuple([getattr(source, name, _ABSENT) for name in names])


class Snapshot:
    """Whether an object (a config, a group source) still holds what it held when a
    result was derived from it: its attribute dict against a copy -- one C-level
    comparison -- when reading its attributes is plain (an instance dict, no
    ``__getattr__``); a mapping's items against a copy; else the values of ``names`` read
    again.

    Args:
      source: the object (a mapping, any object, or None).
      names: the attributes the result was derived from.
      by_vars: the result was derived from the instance dict alone (a Megatron
        ProcessGroupCollection, read as Megatron reads it), whatever ``__getattr__`` does.
    """

    __slots__ = ("source", "names", "live", "copy", "values")

    def __init__(self, source: Any, names: tuple[str, ...], by_vars: bool = False) -> None:
        self.source, self.names = source, names
        self.live = self.copy = None
        if isinstance(source, Mapping):
            self.values: Any = dict(source)
            return
        state = getattr(source, "__dict__", None)
        if isinstance(state, dict) and (by_vars or not hasattr(type(source), "__getattr__")):
            self.live, self.copy = state, dict(state)
        else:
            self.values = _read(source, names)

    def same(self) -> bool:
        """Whether ``source`` still holds the same values."""
        if self.live is not None:
            return not differs(self.live, self.copy)
        if isinstance(self.source, Mapping):
            return not differs(dict(self.source), self.values)
        return _read(self.source, self.names) == self.values


def _put(cache: dict[Any, Any], key: Any, value: Any, limit: int = MAX_PLANS) -> Any:
    """``cache[key] = value``, first evicting the oldest entry when ``cache`` is full."""
    if key not in cache and len(cache) >= limit:
        cache.pop(next(iter(cache)))
    cache[key] = value
    return value


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

    Discovery is keyed on the chunk objects, resolved groups on the group source, and
    plans on everything that can change them: parameters' requires_grad / gradient
    presence and dtype, router modes, the config, the groups and the call's options.
    Each plan is bound once to the gradient tensors (:class:`~torch_impl.program.Program`);
    a :class:`~torch_impl.model_watch.ModelWatch` tells, at C speed, whether a step still sees
    the same model (structure, flags, requires_grad, gradient tensors, routers), so a
    repeated step neither re-discovers nor re-binds. ``stats`` counts calls, plans built,
    bindings and the bytes coalescing had to copy.
    """

    def __init__(self, chunks: Sequence[Any]) -> None:
        self.chunk_ids = tuple(id(c) for c in chunks)
        self.found: dict[tuple[bool, bool], tuple[int, Discovered, ModelWatch, tuple[Any, ...]]] = {}
        self.tokens: dict[_Fingerprint, int] = {}  # specs -> token
        self.next_token = 0
        self.groups: tuple[Snapshot, tuple[Any, ...], TorchGroups] | None = None  # the last resolved source
        self.plans: dict[tuple[Any, ...], BoundPlan] = {}
        self.programs: dict[int, tuple[BoundPlan, Program, Discovered]] = {}
        self.records: dict[int, tuple[BoundPlan, PlanRecord]] = {}
        self.last_config: tuple[Snapshot, Snapshot, FinalizeConfig] | None = None
        self.last_requested: tuple[Snapshot, Requested] | None = None
        self.helper_configs: dict[tuple[FinalizeConfig, tuple[tuple[str, Any], ...]], FinalizeConfig] = {}
        self.embeddings: dict[tuple[Any, ...], tuple[Any, Any, bool, Discovered]] = {}
        self.explicit_groups: dict[tuple[Any, ...], tuple[dict[Group, Any], TorchGroups]] = {}
        self.meshes: dict[int, MeshGroups] = {}  # id(DeviceMesh) -> its groups (which hold the mesh)
        self.parallel_state: tuple[tuple[Any, ...], TorchGroups] | None = None
        self.stats = ExecStats()

    def __reduce__(self) -> tuple[Any, ...]:
        # A cache: copying or pickling the model (deepcopy, torch.save) starts it afresh
        # instead of trying to copy process groups.
        return (ModelState, ((),))

    @classmethod
    def of(cls, chunks: Sequence[Any]) -> "ModelState":
        """The state of this chunk list (made, or replaced when the list differs)."""
        state = getattr(chunks[0], _STATE_ATTR, None)
        if not isinstance(state, cls) or state.chunk_ids != tuple(id(c) for c in chunks):
            state = cls(chunks)
            object.__setattr__(chunks[0], _STATE_ATTR, state)
        return state

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

        While the :class:`~torch_impl.model_watch.ModelWatch` sees the same model (structure,
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
            watched parameter, :meth:`~torch_impl.model_watch.ModelWatch.same`), ``"touched"``
            (a seed helper: the parameters a step besides the DP sync may touch, the
            others' flags, :meth:`~torch_impl.model_watch.ModelWatch.touched_same`) or
            ``"routers"`` (expert bias, qb_beta, reset: routers only,
            :meth:`~torch_impl.model_watch.ModelWatch.routers_same`).
        """
        full = (config.has_mtp, True)
        # A complete discovery serves a call that needs less (an audit keeps one).
        slot = full if complete or full in self.found else (config.has_mtp, False)
        cached = self.found.get(slot)
        if cached is not None and _CHECKS[reads](cached[2]):
            return cached[0], cached[1], cached[3]  # the watch's chunk facts hold the DDP objects
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
            found, chunks, lambda: chunk_facts(chunks, found, has_mtp, ddp_object),
            watched_keys(found, [obj is None for obj in ddp]), candidate_keys(found),
        )
        self.found[slot] = (token, found, watch, ddp)
        return token, found, ddp

    def invalidate(self) -> None:
        """Forget every discovery, plan and binding: the next call reads the model anew."""
        for _, _, watch, _ in self.found.values():
            watch.close()
        self.found.clear()
        self.plans.clear()
        self.programs.clear()
        self.records.clear()
        self.embeddings.clear()

    def config(self, raw: Any, ddp_config: Any) -> FinalizeConfig:
        """``resolve_config(raw, ddp_config)``, memoized: the same two objects with the same
        values of every attribute FinalizeConfig reads give the last result (a config
        mutated between steps is resolved again)."""
        if isinstance(raw, FinalizeConfig) and ddp_config is None:
            return raw
        hit = self.last_config
        if (
            hit is not None and hit[0].source is raw and hit[1].source is ddp_config
            and hit[0].same() and hit[1].same()
        ):
            return hit[2]
        snapshots = Snapshot(raw, _CONFIG_FIELDS), Snapshot(ddp_config, _CONFIG_FIELDS)
        resolved = resolve_config(raw, ddp_config)
        self.last_config = (*snapshots, resolved)
        return resolved

    def helper_config(self, config: FinalizeConfig, overrides: tuple[tuple[str, Any], ...]) -> FinalizeConfig:
        """A seed helper's config: ``config`` with the helper's ``overrides`` and without
        configured embedding stage sets (no embedding step of finalize runs in a helper),
        memoized (a FinalizeConfig is immutable)."""
        key = (config, overrides)
        hit = self.helper_configs.get(key)
        if hit is not None:
            return hit
        derived = config.replace(**dict(overrides)) if overrides else config
        if derived.embedding_stages is not None or derived.position_embedding_stages is not None:
            derived = derived.replace(embedding_stages=None, position_embedding_stages=None)
        return _put(self.helper_configs, key, derived)

    def last_resolved_config(self, raw: Any, ddp_config: Any) -> FinalizeConfig | None:
        """The config last resolved from these two objects (not checked again), or None."""
        hit = self.last_config
        return hit[2] if hit is not None and hit[0].source is raw and hit[1].source is ddp_config else None

    def last_resolved_groups(self, source: Any) -> TorchGroups | None:
        """The groups last resolved from ``source`` (not checked again), or None."""
        hit = self.groups
        return hit[2] if hit is not None and hit[0].source is source else None

    def requested(self, raw: Any) -> Requested:
        """``Requested.from_config(raw)``, memoized like :meth:`config`."""
        if raw is None or isinstance(raw, FinalizeConfig):
            return Requested()
        hit = self.last_requested
        if hit is not None and hit[0].source is raw and hit[0].same():
            return hit[1]
        snapshot = Snapshot(raw, CONFIG_SIZES)
        requested = Requested.from_config(raw)
        self.last_requested = (snapshot, requested)
        return requested

    def program(self, bound: BoundPlan, found: Discovered, groups: TorchGroups, config: FinalizeConfig) -> Program | None:
        """The plan bound to this step's gradient tensors (cached until the watch fires),
        or None when gradients are DTensors (they are unsharded per step)."""
        hit = self.programs.get(id(bound))
        if hit is not None and hit[0] is bound and hit[2] is found:
            return hit[1]
        cached = next((hit for hit in self.found.values() if hit[1] is found), None)
        if cached is not None:
            cached[2].cover(plan_keys(bound.plan, bound.plain_scale_keys), bound.helper)  # what the plan reads is watched
            if cached[2].has_dtensor():
                return None
        elif any(is_dtensor(get_grad(t)) for t in found.tensors.values()):  # a helper's own discovery
            return None
        grads = GradAccess(found.tensors, config.use_megatron_fsdp)
        program = Program(bound.plan.actions, grads, found.router_modules, groups, self.stats, bound.plain_scale_keys)
        _put(self.programs, id(bound), (bound, program, found))
        return program

    def mesh_groups(self, mesh: Any) -> MeshGroups:
        """The MeshGroups of a DeviceMesh, made once per mesh and kept here (nothing is
        written on the mesh)."""
        hit = self.meshes.get(id(mesh))
        if hit is None or hit.mesh is not mesh:
            hit = _put(self.meshes, id(mesh), MeshGroups(mesh))
        return hit

    def parallel_state_groups(self) -> TorchGroups | None:
        """Megatron's ``parallel_state`` groups, one TorchGroups while its groups stay the
        same objects (so one cached plan serves every step; nothing is written on the
        module)."""
        found = parallel_state_keyed(memo=self.parallel_state)
        if found is not None:
            self.parallel_state = found
        return found[1] if found is not None else None

    def resolve_groups(self, source: Any, config: FinalizeConfig, requested: Requested) -> TorchGroups:
        """Resolved groups, cached per group source (a DeviceMesh's groups by its
        MeshGroups, kept here)."""
        kind = source_kind(source)
        if kind == "device_mesh":
            source = self.mesh_groups(source)
        if kind in MESH_KINDS or kind == "torch_groups":
            return resolve_groups(source, config, requested)
        key = (world_size(), config.moe_router_enable_expert_bias, config.flextron)
        hit = self.groups
        if hit is not None and hit[0].source is source and hit[1] == key and hit[0].same():
            return hit[2]
        snapshot = Snapshot(source, _GROUP_NAMES, by_vars=kind == "megatron_collection")
        resolved = resolve_groups(source, config, requested)
        self.groups = (snapshot, key, resolved)
        return resolved

    def explicit(self, values: Mapping[Group, Any]) -> TorchGroups:
        """TorchGroups from a seed helper's groups, memoized on the group objects'
        identity (the memo holds the groups, so their ids stay theirs)."""
        key = tuple(sorted((g.value, id(v)) for g, v in values.items()))
        hit = self.explicit_groups.get(key)
        if hit is not None and all(hit[0][g] is v for g, v in values.items()):
            return hit[1]
        resolved = TorchGroups.from_mapping(dict(values), source="the helper's groups")
        return _put(self.explicit_groups, key, (dict(values), resolved))[1]

    def plan(self, key: tuple[Any, ...], make: Callable[[], BoundPlan]) -> BoundPlan:
        """The cached plan for ``key``, or ``make()``'s (evicting the oldest plan, with its
        program and record, when :data:`MAX_PLANS` are kept)."""
        bound = self.plans.get(key)
        if bound is None:
            bound = make()
            self.stats.plans_built += 1
            if len(self.plans) >= MAX_PLANS:
                old = self.plans.pop(next(iter(self.plans)))
                self.programs.pop(id(old), None)
                self.records.pop(id(old), None)
            self.plans[key] = bound
        return bound

    def record(self, bound: BoundPlan) -> PlanRecord | None:
        """What the once-per-plan checks found for ``bound`` (None before they passed)."""
        hit = self.records.get(id(bound))
        return hit[1] if hit is not None and hit[0] is bound else None

    def keep_record(self, bound: BoundPlan, record: PlanRecord | None) -> None:
        """Keep what the checks found for ``bound`` (bounded like the plans)."""
        if record is not None:
            _put(self.records, id(bound), (bound, record))

    def embedding(self, chunks: Sequence[Any], index: int, weight: Any, role: Role) -> Discovered:
        """An embedding helper's own discovery of its one weight (of chunk ``index``),
        kept while the weight, its gradient tensor and ``requires_grad`` stay the same."""
        grad = get_grad(weight) if weight is not None else None
        trained = bool(getattr(weight, "requires_grad", False))
        key = (role, id(weight), index)
        hit = self.embeddings.get(key)
        if hit is not None and hit[0] is weight and hit[1] is grad and hit[2] == trained:
            return hit[3]
        found = one_weight(chunks, index, weight, role)
        return _put(self.embeddings, key, (weight, grad, trained, found))[3]


__all__ = ["MAX_PLANS", "BoundPlan", "ModelState", "Reads", "Snapshot"]
