"""Megatron-Core's ``finalize_model_grads`` API, executed from a meshgrad plan.

Every function of the seed API page is here with its name and signature. Each helper
discovers the model (:mod:`torch_impl.discover`), plans its step with
:func:`meshgrad.plan.plan_finalize` (the selection rules live there only) and runs the
plan (:mod:`torch_impl.execute`). :func:`finalize_model_grads` plans all steps at once
and caches the plan on the model, so a repeated step does O(collectives) work.

Groups: helpers take Megatron's explicit groups; a ``None`` group that Megatron would look
up is taken from Megatron's ``parallel_state`` when that is initialized (found in
``sys.modules``; megatron is never imported), else it is an error in a world of more than
one rank. :func:`finalize_model_grads` takes a ``ProcessGroupCollection`` (or any object
with its attribute names, or a mapping), a torch ``DeviceMesh`` with meshgrad dim names, a
:class:`~torch_impl.groups.MeshGroups`, a :class:`~torch_impl.groups.TorchGroups`, or
``None`` (``parallel_state``, or no communication in a world of one rank).

Megatron objects are duck-typed: ``TransformerConfig`` (``chunk.config``) and
``DistributedDataParallelConfig`` (``chunk.ddp_config``), both found along the ``.module``
chain of wrapped chunks, and Megatron DDP chunks (``finish_grad_sync`` /
``scale_gradients``), which keep doing their own DP sync.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from meshgrad.axes import Group
from meshgrad.config import FinalizeConfig
from meshgrad.params import ParamKey, Role
from meshgrad.plan import FinalizePlan, GroupSizes, Step, embedding_chunk, plan_finalize
from torch_impl.discover import (
    Discovered,
    chunk_facts,
    discover,
    find_attr,
    get_grad,
    grad_attr,
    param_spec,
    position_embedding,
    shared_word_embedding,
    unwrap,
    watched_keys,
)
from torch_impl.execute import (
    ExecStats,
    GradAccess,
    ModelWatch,
    Program,
    global_token_scale,
    is_dtensor,
    reshard,
    run_actions,
    scale_grads,
    unshard,
)
from torch_impl import validate
from torch_impl.errors import MegatronAssertionError
from torch_impl.groups import (
    MeshGroups,
    TorchGroups,
    group_ranks,
    is_device_mesh,
    mesh_groups,
    world_rank,
    world_size,
)
from torch_impl.megatron import (
    Requested,
    accepts,
    chunk_configs,
    collection_groups,
    ddp_object,
    gtp_fence as megatron_gtp_fence,
    helper_group,
    is_process_group_collection,
    parallel_state_groups,
)

ProcessGroup = Any
_STATE_ATTR = "_meshgrad_finalize_state"
_MAX_PLANS = 16


# =========================================================================== config


@contextlib.contextmanager
def ranked() -> Iterator[None]:
    """Prefix the message of a ValueError / TypeError with this rank when it lacks one."""
    try:
        yield
    except (ValueError, TypeError) as err:
        text = str(err)
        if text.startswith("rank "):
            raise
        try:
            renamed = type(err)(f"rank {world_rank()}: {text}")
        except Exception:  # an exception type with another constructor
            raise err from None
        raise renamed from err


def resolve_config(config: Any, ddp_config: Any = None) -> FinalizeConfig:
    """A FinalizeConfig from a Megatron TransformerConfig, a duck-typed object or a
    FinalizeConfig, merged with a DDP config.

    Raises:
      TypeError: neither a config nor a DDP config is given.
    """
    if isinstance(config, FinalizeConfig) and ddp_config is None:
        return config
    if config is None and ddp_config is None:
        raise TypeError(
            f"rank {world_rank()}: no config found: set `config` (a Megatron TransformerConfig or a "
            "meshgrad.FinalizeConfig) on the first model chunk (or on a module along its `.module` chain)"
        )
    return FinalizeConfig.from_megatron(config, ddp_config)


def _chunks(model: Any) -> list[Any]:
    """The model as a non-empty list of chunks.

    Raises:
      TypeError: ``model`` is not a module or a sequence of modules.
    """
    if isinstance(model, nn.Module):
        return [model]
    if not isinstance(model, (list, tuple)) or not model:
        raise TypeError(
            f"rank {world_rank()}: model must be a non-empty list of nn.Module chunks, got {type(model).__name__}"
        )
    for i, chunk in enumerate(model):
        if not isinstance(chunk, nn.Module):
            raise TypeError(f"rank {world_rank()}: model[{i}] is a {type(chunk).__name__}, not an nn.Module")
    return list(model)


# =========================================================================== groups


def resolve_groups(pg_collection: Any, config: FinalizeConfig, requested: Requested) -> TorchGroups:
    """This rank's TorchGroups from whatever ``finalize_model_grads`` was given.

    A Megatron ``ProcessGroupCollection`` and ``None`` (Megatron's ``parallel_state``) are
    read as Megatron reads them (:mod:`torch_impl.megatron`); meshgrad's own sources (a
    DeviceMesh, MeshGroups, TorchGroups, a mapping or any object with the collection's
    attribute names) name every group they mean, None being size 1.

    Raises:
      MegatronAssertionError: where Megatron asserts (a field it needs is None or unset).
      ValueError: no groups in a multi-rank world, or a DeviceMesh that does not fit.
      TypeError: an object that is no group source.
    """
    if pg_collection is None:
        from_megatron = parallel_state_groups()
        if from_megatron is not None:
            return from_megatron
        if world_size() > 1:
            raise MegatronAssertionError(
                f"rank {world_rank()}: pg_collection is None in a world of {world_size()} ranks and "
                "Megatron's parallel_state is not initialized; pass a ProcessGroupCollection (or any "
                "object with its attribute names) or a torch DeviceMesh with meshgrad dim names "
                "(pp, dp, cp, gtp, tp)"
            )
        return TorchGroups.trivial()
    if isinstance(pg_collection, TorchGroups):
        return pg_collection
    if is_device_mesh(pg_collection) or isinstance(pg_collection, MeshGroups):
        groups = mesh_groups(pg_collection) if is_device_mesh(pg_collection) else pg_collection
        return groups.resolve(
            ep=requested.ep,
            etp=requested.etp,
            egtp=requested.egtp,
            embedding_stages=config.embedding_stages,
            position_embedding_stages=config.position_embedding_stages,
        )
    if is_process_group_collection(pg_collection):
        return collection_groups(
            pg_collection, expert_bias=config.moe_router_enable_expert_bias, flextron=config.flextron
        )
    if isinstance(pg_collection, Mapping):
        return TorchGroups.from_mapping(pg_collection, source="group mapping")
    if not any(hasattr(pg_collection, g.value) for g in Group):
        raise TypeError(
            f"rank {world_rank()}: pg_collection must be None, a ProcessGroupCollection (or any object "
            f"with its attribute names tp, pp, embd, pos_embd, dp_cp, ...), a torch DeviceMesh, a "
            f"MeshGroups or a TorchGroups; got {type(pg_collection).__name__}"
        )
    return TorchGroups.from_collection(pg_collection)


def requirements(
    config: FinalizeConfig,
    params: Sequence[Any],
    groups: TorchGroups,
    requested: Requested,
    *,
    plain_dp_sync: bool,
    num_tokens: bool,
    megatron_groups: bool,
) -> tuple[dict[Group, str], dict[Group, tuple[int, str]]]:
    """The groups ``finalize_model_grads`` needs, for :meth:`TorchGroups.check`.

    Groups read the Megatron way (``megatron_groups``) were already resolved or refused
    by Megatron's rules; meshgrad's own sources must name every group a step reads. Sizes
    the config states are expectations: a mismatch warns (raises with
    ``config.strict_groups``), since Megatron takes the groups as the truth.

    Returns:
      (required groups with reasons, expected sizes with reasons).
    """
    required: dict[Group, str] = {}
    if not megatron_groups:
        for g in (Group.TP, Group.PP, Group.EMBD, Group.POS_EMBD, Group.DP_CP):
            required[g] = "finalize_model_grads always needs it"
        if config.moe_router_enable_expert_bias:
            required[Group.TP_DP_CP] = "moe_router_enable_expert_bias is set"
        if groups.size(Group.GTP) > 1 and (num_tokens or config.quantile_balancing):
            required[Group.DP_CP_GTP] = "GTP-remat is active and num_tokens / qb_beta reduce over dp_cp x gtp"
    if plain_dp_sync:
        required[Group.DP_CP] = "meshgrad runs the DP sync of chunks without a DDP wrapper"
        if any(p.expert and p.has_grad for p in params):
            required[Group.EDP] = "expert parameters (allreduce=False) are synced over expert data parallel"
    expected: dict[Group, tuple[int, str]] = {}
    if requested.gtp > 1:
        expected[Group.GTP] = (requested.gtp, "config.gtp_weight_remat_size")
    if requested.egtp > 1:
        expected[Group.EGTP] = (requested.egtp, "config.expert_gtp_weight_remat_size")
    gtp = groups.size(Group.GTP)
    if gtp > 1 and (num_tokens or config.quantile_balancing):
        why = "GTP-remat is active and num_tokens / qb_beta reduce over dp_cp x gtp"
        expected[Group.DP_CP_GTP] = (groups.size(Group.DP_CP) * gtp, why)
    return required, expected


# =========================================================================== plan cache


_ddp_object = ddp_object  # kept for torch_impl.buffers


@dataclasses.dataclass(frozen=True, eq=False)
class BoundPlan:
    """A plan with everything a step needs to run it.

    Args:
      plan: the FinalizePlan (all steps; DP sync only for plain chunks).
      ddp: the DDP objects whose ``finish_grad_sync`` does step 1 for their chunks.
      ddp_force_kwarg: per DDP object, whether it accepts ``force_all_reduce``.
      plain_scale_keys: gradients this backend scales by num_tokens (plain chunks).
    """

    plan: FinalizePlan
    ddp: tuple[Any, ...]
    ddp_force_kwarg: tuple[bool, ...]
    plain_scale_keys: tuple[ParamKey, ...]
    checks: dict[str, Any] = dataclasses.field(default_factory=dict)  # validate's once-per-plan record


def build_plan(
    found: Discovered,
    config: FinalizeConfig,
    sizes: GroupSizes,
    ddp: Sequence[Any],
    force_all_reduce: bool,
    stage: int | None = None,
) -> BoundPlan:
    """Plan every step; step 1 only for chunks without a DDP wrapper."""
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
    objects = []
    for obj in ddp:
        if obj is not None and all(obj is not o for o in objects):
            objects.append(obj)
    return BoundPlan(
        plan=plan,
        ddp=tuple(objects),
        ddp_force_kwarg=tuple(accepts(o.finish_grad_sync, "force_all_reduce") for o in objects),
        plain_scale_keys=tuple(k for k in plan.token_scale.keys if k[0] in plain),
    )


_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(FinalizeConfig))
_ABSENT = object()


def _config_snapshot(source: Any) -> tuple[Any, ...]:
    """The values FinalizeConfig.from_megatron reads from ``source`` (absent ones marked)."""
    if source is None:
        return ()
    if isinstance(source, Mapping):
        return tuple([source.get(name, _ABSENT) for name in _CONFIG_FIELDS])
    return tuple([getattr(source, name, _ABSENT) for name in _CONFIG_FIELDS])


class ModelState:
    """What ``finalize_model_grads`` caches on a model (on its first chunk).

    Discovery is keyed on the chunk objects, resolved groups on the group source, and
    plans on everything that can change them: parameters' requires_grad / gradient
    presence and dtype, router modes, the config, the groups and the call's options.
    Each plan is bound once to the gradient tensors (:class:`~torch_impl.execute.Program`);
    a :class:`~torch_impl.execute.ModelWatch` tells, at C speed, whether a step still sees
    the same model (structure, flags, requires_grad, gradient tensors, routers), so a
    repeated step neither re-discovers nor re-binds. ``stats`` counts calls, plans built,
    bindings and the bytes coalescing had to copy.
    """

    def __init__(self, chunks: Sequence[Any]) -> None:
        self.chunk_ids = tuple(id(c) for c in chunks)
        self.found: dict[bool, tuple[int, Discovered, ModelWatch]] = {}
        self.tokens: dict[tuple[Any, ...], int] = {}  # specs -> token
        self.next_token = 0
        self.groups: dict[tuple[Any, ...], tuple[Any, TorchGroups]] = {}
        self.plans: dict[tuple[Any, ...], BoundPlan] = {}
        self.programs: dict[int, tuple[BoundPlan, Program]] = {}
        self.last_config: tuple[Any, Any, tuple[Any, ...], FinalizeConfig] | None = None
        self.embedding_programs: dict[tuple[Any, ...], tuple[Any, Any, bool, Program]] = {}
        self.explicit_groups: dict[tuple[Any, ...], tuple[dict[Group, Any], TorchGroups]] = {}
        self.stats = ExecStats()

    def __reduce__(self) -> tuple[Any, ...]:
        # A cache: copying or pickling the model (deepcopy, torch.save) starts it afresh
        # instead of trying to copy process groups.
        return (ModelState, ((),))

    @classmethod
    def of(cls, chunks: Sequence[Any]) -> "ModelState":
        state = getattr(chunks[0], _STATE_ATTR, None)
        if not isinstance(state, cls) or state.chunk_ids != tuple(id(c) for c in chunks):
            state = cls(chunks)
            object.__setattr__(chunks[0], _STATE_ATTR, state)
        return state

    def discovered(self, chunks: Sequence[Any], config: FinalizeConfig) -> tuple[Any, Discovered]:
        """(fingerprint token, Discovered) for this step.

        While the :class:`~torch_impl.execute.ModelWatch` sees the same model (structure,
        watched parameters' flags, requires_grad and gradient tensors, routers, chunk
        facts), nothing is re-read. Otherwise every bound program is dropped and the
        model is discovered again (structure changed) or its specs re-read; the token is
        a small int standing for the specs (cheap to hash in plan keys): equal specs,
        equal tokens, so an unchanged plan is found again in the cache.
        """
        cached = self.found.get(config.has_mtp)
        if cached is not None and cached[2].same():
            return cached[0], cached[1]
        self.programs.clear()
        if cached is None or not cached[2].structure_same():
            found = discover(chunks, config)
        else:
            found = cached[1].refresh()
        if cached is not None:
            cached[2].close()
        fingerprint = (found.params, found.routers)
        token = self.tokens.get(fingerprint)
        if token is None:
            if len(self.tokens) >= 4 * _MAX_PLANS:
                self.tokens.clear()
            token = self.tokens[fingerprint] = self.next_token
            self.next_token += 1
        plain = [_ddp_object(c) is None for c in chunks]
        has_mtp = config.has_mtp
        watch = ModelWatch(
            found, chunks, lambda: chunk_facts(chunks, found, has_mtp, _ddp_object), watched_keys(found, plain)
        )
        self.found[config.has_mtp] = (token, found, watch)
        return token, found

    def invalidate(self) -> None:
        """Forget every discovery, plan and binding: the next call reads the model anew."""
        for _, _, watch in self.found.values():
            watch.close()
        self.found.clear()
        self.plans.clear()
        self.programs.clear()
        self.embedding_programs.clear()

    def config(self, raw: Any, ddp_config: Any) -> FinalizeConfig:
        """``resolve_config(raw, ddp_config)``, memoized: the same two objects with the same
        values of every attribute FinalizeConfig reads give the last result (a config
        mutated between steps is resolved again)."""
        if isinstance(raw, FinalizeConfig) and ddp_config is None:
            return raw
        snapshot = _config_snapshot(raw) + _config_snapshot(ddp_config)
        hit = self.last_config
        if hit is not None and hit[0] is raw and hit[1] is ddp_config and hit[2] == snapshot:
            return hit[3]
        resolved = resolve_config(raw, ddp_config)
        self.last_config = (raw, ddp_config, snapshot, resolved)
        return resolved

    def program(self, bound: BoundPlan, found: Discovered, groups: TorchGroups, config: FinalizeConfig) -> Program | None:
        """The plan bound to this step's gradient tensors (cached until the watch fires),
        or None when gradients are DTensors (they are unsharded per step)."""
        hit = self.programs.get(id(bound))
        if hit is not None and hit[0] is bound:
            return hit[1]
        watch = self.found[config.has_mtp][2]
        watch.cover(validate.plan_keys(bound.plan, bound.plain_scale_keys))  # what the plan reads is watched
        if watch.has_dtensor():
            return None
        grads = GradAccess(found.tensors, config.use_megatron_fsdp)
        program = Program(bound.plan.actions, grads, found.router_modules, groups, self.stats, bound.plain_scale_keys)
        self.programs[id(bound)] = (bound, program)
        return program

    def resolve_groups(self, source: Any, config: FinalizeConfig, requested: Requested) -> TorchGroups:
        """Resolved groups, cached per group source (DeviceMesh groups cache themselves)."""
        if isinstance(source, TorchGroups) or is_device_mesh(source) or isinstance(source, MeshGroups):
            return resolve_groups(source, config, requested)
        if isinstance(source, Mapping):
            fields = tuple((k, id(v)) for k, v in source.items())
        else:
            fields = tuple(id(getattr(source, g.value, None)) for g in Group)
        key = (id(source), fields, world_size(), config.moe_router_enable_expert_bias, config.flextron)
        hit = self.groups.get(key)
        if hit is None or hit[0] is not source:
            hit = (source, resolve_groups(source, config, requested))
            self.groups = {key: hit}
        return hit[1]

    def plan(self, key: tuple[Any, ...], make: Callable[[], BoundPlan]) -> BoundPlan:
        bound = self.plans.get(key)
        if bound is None:
            bound = make()
            self.stats.plans_built += 1
            if len(self.plans) >= _MAX_PLANS:
                self.plans.pop(next(iter(self.plans)))
            self.plans[key] = bound
        return bound


def invalidate_plans(model: Any) -> None:
    """Make the next call re-read ``model`` entirely (e.g. after changing flags or
    ``requires_grad`` of parameters of a Megatron-DDP chunk that no meshgrad step
    touches, which are read once per plan)."""
    ModelState.of(_chunks(model)).invalidate()


def execution_stats(model: Any) -> ExecStats:
    """The counters kept on ``model``'s cached finalize state: calls, plans built, plans
    bound to gradient tensors, and gradient bytes copied to coalesce (0 when every
    reduced gradient lives in a meshgrad buffer, :mod:`torch_impl.buffers`)."""
    return ModelState.of(_chunks(model)).stats


# =========================================================================== checks


# Checks before communication live in torch_impl.validate (validate.before_communication).


# =========================================================================== entry point


def finalize_model_grads(
    model: list[nn.Module],
    num_tokens: torch.Tensor | None = None,
    pg_collection: Any = None,
    force_all_reduce: bool | None = False,
    *,
    gtp_fence: Callable[[], None] | None = None,
) -> None:
    """Finalize gradients: DP sync, pipeline/tensor-parallel fix-ups, router updates,
    temporaries reset and num_tokens scaling (SPEC.md section 2, steps 1 to 11).

    Args:
      model: this rank's model chunks (virtual pipeline chunks), possibly wrapped in
        Megatron DDP (then its ``finish_grad_sync`` / ``scale_gradients`` are used).
      num_tokens: pass it only with a per-token loss: a one-element integer or floating
        tensor holding this rank's token count (the last pipeline stage's counts); it is
        broadcast over pp and summed over dp x cp (x gtp) in place, so it holds the
        global count afterwards, and every gradient is multiplied by
        ``1 / max(global count, 1)`` (no host sync). Reduced in int64 / float64, so small
        integer dtypes do not overflow while summing. None: no scaling.
      pg_collection: a ProcessGroupCollection (or any object with its attribute names),
        a torch DeviceMesh with meshgrad dim names, a MeshGroups or a TorchGroups. None:
        only in a world of one rank.
      force_all_reduce: all-reduce instead of a distributed optimizer's reduce-scatter.
      gtp_fence: keyword-only extension: called before the DP sync when the config's
        ``gtp_weight_remat_size`` or ``expert_gtp_weight_remat_size`` is > 1, to wait for
        in-flight GTP gradient work. Default: Megatron's
        ``gtp_api.wait_for_gtp_grad_reduction_on_current_stream`` when that module is
        loaded, else nothing.

    Raises:
      TypeError / ValueError: before any communication or mutation, naming the rank and
        the group or parameter at fault (:mod:`torch_impl.validate`).
      torch_impl.validate.ConsistencyError: ranks of a group would launch different
        collectives (``config.consistency_check``); nothing was reduced.
      torch_impl.validate.NonFiniteGradError: NaN / Inf on some rank
        (``config.check_for_nan_in_grad``); nothing was reduced.
      torch_impl.validate.CollectiveError: a collective failed (a peer died or stalled
        past the process-group timeout), naming the action.
    """
    force = bool(force_all_reduce)
    with ranked():
        bound, found, groups, config, requested = _prepare(model, num_tokens, pg_collection, force)
    state = ModelState.of(_chunks(model))
    state.stats.calls += 1
    fence = (gtp_fence or megatron_gtp_fence()) if requested.gtp_active else None
    if fence is not None:
        fence()
    with torch.no_grad():
        for obj, kwarg in zip(bound.ddp, bound.ddp_force_kwarg):
            with validate.collective_guard(f"dp_sync: {type(obj).__name__}.finish_grad_sync()", groups):
                if kwarg:
                    obj.finish_grad_sync(force_all_reduce=force)
                else:
                    obj.finish_grad_sync()
        program = state.program(bound, found, groups, config)
        if program is not None:
            program.run()
        else:
            grads = GradAccess(found.tensors, config.use_megatron_fsdp)
            run_actions(bound.plan.actions, grads, found.router_modules, groups, stats=state.stats)
        if num_tokens is not None:
            with validate.collective_guard(
                f"token_scale: num_tokens broadcast over 'pp' and sum over {bound.plan.token_scale.group.value!r}",
                groups,
            ):
                scale = global_token_scale(num_tokens, bound.plan.token_scale, groups)
            for obj in bound.ddp:
                obj.scale_gradients(scale)
            if program is not None:
                program.scale(scale)
            elif bound.plain_scale_keys:
                grads = GradAccess(found.tensors, local_shards=True)
                scale_grads([grads[k] for k in bound.plain_scale_keys], scale)


def _prepare(
    model: Any, num_tokens: Any, pg_collection: Any, force: bool
) -> tuple[BoundPlan, Discovered, TorchGroups, FinalizeConfig, Requested]:
    """Everything finalize_model_grads checks and plans before touching anything.

    Returns:
      (the cached or new plan, the discovered model, the groups, the config, the sizes
      the Megatron config states).

    A TypeError / ValueError found on this rank before the checks' status round (a bad
    model list, config value, group, gradient or router buffer) is shared with the
    other ranks through that round (:func:`torch_impl.validate.share_local_error`), so
    that every rank raises at once.
    """
    known: dict[str, Any] = {}
    try:
        return _prepare_steps(model, num_tokens, pg_collection, force, known)
    except (TypeError, ValueError) as err:
        if not known.get("shared"):
            validate.share_local_error(
                err, known.get("groups"), known.get("config"), source=pg_collection, raw=known.get("raw", ())
            )
        raise


def _prepare_steps(
    model: Any, num_tokens: Any, pg_collection: Any, force: bool, known: dict[str, Any]
) -> tuple[BoundPlan, Discovered, TorchGroups, FinalizeConfig, Requested]:
    """:func:`_prepare`; ``known`` records what resolved (for sharing an error)."""
    chunks = _chunks(model)
    raw_config, ddp_config = chunk_configs(chunks)
    known["raw"] = (raw_config, ddp_config)
    state = ModelState.of(chunks)
    config = state.config(raw_config, ddp_config)
    known["config"] = config
    requested = Requested.from_config(raw_config)
    collection = validate.collection_source(pg_collection)
    megatron_groups = pg_collection is None or is_process_group_collection(pg_collection)
    if pg_collection is None:  # Megatron's parallel_state when initialized (one stable TorchGroups)
        pg_collection = parallel_state_groups()
    groups = state.resolve_groups(pg_collection, config, requested)
    known["groups"] = groups
    fingerprint, found = state.discovered(chunks, config)
    ddp = tuple(_ddp_object(c) for c in chunks)

    def make() -> BoundPlan:
        plain = {i for i, obj in enumerate(ddp) if obj is None}
        plain_params = [p for p in found.params if p.chunk in plain]
        required, expected = requirements(
            config,
            plain_params,
            groups,
            requested,
            plain_dp_sync=bool(plain),
            num_tokens=num_tokens is not None,
            megatron_groups=megatron_groups,
        )
        groups.check(required, expected, strict=config.strict_groups)
        return build_plan(found, config, groups.group_sizes(config), ddp, force, groups.pp_stage)

    key = (fingerprint, config, groups, requested, force, num_tokens is not None, tuple(id(d) for d in ddp))
    bound = state.plan(key, make)
    known["shared"] = True  # from here on, the checks' own status round shares errors
    validate.before_communication(
        bound, found, groups, config, num_tokens, ddp=ddp, raw_config=raw_config, collection=collection
    )
    return bound, found, groups, config, requested


# =========================================================================== seed helpers


def _get_main_grad_attr(param: nn.Parameter) -> str:
    """Name of the gradient attribute to use: ``"main_grad"`` if the parameter has one,
    else ``"grad"``."""
    return grad_attr(param)


def _unshard_if_dtensor(tensor: torch.Tensor) -> torch.Tensor:
    """Unshards the input tensor if it is a DTensor and otherwise returns it unmodified.

    Args:
      tensor: the tensor to potentially unshard.

    Returns:
      The whole tensor of a DTensor, or ``tensor`` itself.
    """
    return unshard(tensor)


def _reshard_if_dtensor(tensor_to_shard: torch.Tensor, reference_tensor: torch.Tensor) -> torch.Tensor:
    """Reshards ``tensor_to_shard`` like ``reference_tensor`` if that is a DTensor.

    Args:
      tensor_to_shard: the whole tensor (identical on every rank of the DTensor's mesh).
      reference_tensor: the reference for mesh and placements.

    Returns:
      A DTensor with the reference's mesh, placements and attributes, or
      ``reference_tensor`` itself when it is not a DTensor.
    """
    if not is_dtensor(reference_tensor):
        return reference_tensor
    return reshard(tensor_to_shard, reference_tensor)


def _explicit(groups: Mapping[Group, ProcessGroup | None], *, model: Any = None) -> TorchGroups:
    """TorchGroups from a helper's groups, already resolved by Megatron's per-helper rules
    (:func:`torch_impl.megatron.helper_group`); None means size 1 (EMBD / POS_EMBD: not a
    member).

    Args:
      groups: the helper's groups.
      model: the helper's model: the resolved groups are memoized on its cached state
        (keyed on the group objects' identity), so a repeated call does not rebuild them.
    """
    values = dict(groups)
    source = "the helper's groups"
    if model is None:
        return TorchGroups.from_mapping(values, source=source)
    memo = ModelState.of(_chunks(model)).explicit_groups
    key = tuple(sorted((g.value, id(v)) for g, v in values.items()))
    hit = memo.get(key)
    if hit is not None and all(hit[0][g] is v for g, v in values.items()):
        return hit[1]
    resolved = TorchGroups.from_mapping(values, source=source)
    if len(memo) >= _MAX_PLANS:
        memo.pop(next(iter(memo)))
    memo[key] = (values, resolved)  # holds the groups: their ids stay theirs
    return resolved


def _model_config(model: Sequence[Any], config: Any) -> FinalizeConfig:
    """A helper's FinalizeConfig: ``config`` (default: the chunks' ``config``) merged with
    the chunks' ``ddp_config`` (Megatron reads ``use_megatron_fsdp`` from there)."""
    raw, ddp_config = chunk_configs(model)
    return ModelState.of(model).config(raw if config is None else config, ddp_config)


def _run_steps(
    model: Any,
    config: FinalizeConfig,
    groups: TorchGroups,
    steps: Sequence[Step],
    found: Discovered | None = None,
) -> None:
    """Discover, plan, and run only ``steps``.

    Like :func:`finalize_model_grads`, a helper plans once per model, steps, config and
    groups (kept on the model's :class:`ModelState`) and binds the plan once to the
    gradient tensors, so calling it every step does O(collectives) work.
    """
    chunks = _chunks(model)
    # No embedding step runs here: the configured embedding stage sets do not apply.
    if config.embedding_stages is not None or config.position_embedding_stages is not None:
        config = config.replace(embedding_stages=None, position_embedding_stages=None)
    if found is not None:
        plan = plan_finalize(found.params, config, groups.group_sizes(config), found.routers, dp_sync=False)
        actions = plan.for_step(*steps)
        if actions:
            run_actions(actions, GradAccess(found.tensors, config.use_megatron_fsdp), found.router_modules, groups)
        return
    state = ModelState.of(chunks)
    fingerprint, found = state.discovered(chunks, config)

    def make() -> BoundPlan:
        plan = plan_finalize(found.params, config, groups.group_sizes(config), found.routers, dp_sync=False)
        return BoundPlan(dataclasses.replace(plan, actions=plan.for_step(*steps)), (), (), ())

    bound = state.plan(("steps", tuple(steps), fingerprint, config, _groups_key(groups)), make)
    if not bound.plan.actions:
        return
    program = state.program(bound, found, groups, config)
    if program is not None:
        program.run()
    else:
        grads = GradAccess(found.tensors, config.use_megatron_fsdp)
        run_actions(bound.plan.actions, grads, found.router_modules, groups, stats=state.stats)


def _groups_key(groups: TorchGroups) -> tuple[Any, ...]:
    """What a helper's freshly built TorchGroups is made of (the process groups by
    identity): equal keys may share a cached plan and its bound program."""
    return (
        groups.rank,
        tuple((g, id(v), groups.size(g)) for g, v in groups.groups.items()),
        groups.pp_ranks,
        tuple(groups.stages.items()),
        groups.missing,
    )


@ranked()
def _allreduce_conditional_embedding_grads(
    model: list[nn.Module], config: Any, pp_group: ProcessGroup | None = None
) -> None:
    """All-reduce conditional embedding grads (params flagged ``pipeline_parallel``) over
    the pipeline stages, summing this rank's virtual-chunk copies first; only with
    ``config.has_cond_embedder``. A None ``pp_group`` is parallel_state's, as in Megatron."""
    cfg = _model_config(_chunks(model), config)
    pp = helper_group(Group.PP, pp_group, "lookup", "_allreduce_conditional_embedding_grads(pp_group)")
    _run_steps(model, cfg, _explicit({Group.PP: pp}, model=model), [Step.COND_EMBEDDER])


@ranked()
def _allreduce_router_grads(
    model: list[nn.Module], config: Any, *, pp_group: ProcessGroup | None = None
) -> None:
    """All-reduce router grads (params flagged ``flextron_router_pp_sync``) over the
    pipeline stages. As Megatron's helper, it does not check ``config.flextron`` (only
    :func:`finalize_model_grads` does).

    Args:
      model: the model chunks.
      config: transformer config.
      pp_group: keyword-only extension: the pipeline group (default: Megatron's
        parallel_state's, which is what Megatron's helper always uses).
    """
    cfg = _model_config(_chunks(model), config).replace(flextron=True)
    pp = helper_group(Group.PP, pp_group, "lookup", "_allreduce_router_grads: the pipeline group")
    _run_steps(model, cfg, _explicit({Group.PP: pp}, model=model), [Step.ROUTER])


@ranked()
def _allreduce_non_tensor_model_parallel_grads(
    model: list[nn.Module], config: Any, tp_group: ProcessGroup | None = None
) -> None:
    """All-reduce layernorm grads (sequence parallel, qk-layernorm) and
    ``average_gradients_across_tp_domain`` grads over the tensor-parallel group. A None
    ``tp_group`` is parallel_state's, as in Megatron."""
    cfg = _model_config(_chunks(model), config)
    tp = helper_group(Group.TP, tp_group, "lookup", "_allreduce_non_tensor_model_parallel_grads(tp_group)")
    _run_steps(model, cfg, _explicit({Group.TP: tp}, model=model), [Step.NON_TP])


_allreduce_layernorm_grads = _allreduce_non_tensor_model_parallel_grads


@ranked()
def _allreduce_replicated_grads_over_gtp_remat_group(
    model: list[nn.Module],
    gtp_remat_group: ProcessGroup | None,
    egtp_remat_group: ProcessGroup | None,
    calculate_per_token_loss: bool = False,
) -> None:
    """Complete the gtp_remat / egtp_remat reduction of replicated (not
    ``is_gtp_weight_remat``) params: SUM with per-token loss, else AVG; one collective per
    group over the promoted dtype. No-op when both groups are None or of size 1."""
    chunks = _chunks(model)
    raw, ddp_config = chunk_configs(chunks)
    base = resolve_config(raw, ddp_config) if raw is not None or ddp_config is not None else FinalizeConfig()
    cfg = base.replace(calculate_per_token_loss=bool(calculate_per_token_loss))
    groups = _explicit({Group.GTP: gtp_remat_group, Group.EGTP: egtp_remat_group}, model=chunks)
    _run_steps(chunks, cfg, groups, [Step.GTP])


def _get_shared_word_embedding_weight(model_module: nn.Module, config: Any) -> nn.Parameter | None:
    """Return the shared word-embedding weight if it is duplicated across stages.

    Args:
      model_module: the (unwrapped) model chunk.
      config: transformer config (``mtp_num_layers``).

    Returns:
      ``shared_embedding_or_output_weight()`` when the module shares embeddings and
      output weights or MTP is on; otherwise None.
    """
    return shared_word_embedding(model_module, bool(getattr(config, "mtp_num_layers", None)))


def _get_position_embedding_weight(model_module: nn.Module) -> nn.Parameter:
    """Return ``model_module.position_embeddings.weight``.

    Raises:
      AttributeError: the module has no position embedding.
    """
    weight = position_embedding(model_module)
    if weight is None:
        raise AttributeError(f"{type(model_module).__name__} has no position_embeddings.weight")
    return weight


@ranked()
def _allreduce_embedding_grad(
    model: list[nn.Module],
    embd_group: ProcessGroup,
    pp_group: ProcessGroup,
    weight_getter: Callable[[nn.Module], nn.Parameter | None],
    skip_if_none: bool = True,
    config: Any = None,
) -> None:
    """All-reduce one embedding parameter over ``embd_group`` (members of a group of size
    > 1 only).

    The chunk used is ``model[0]`` on the first stage of ``pp_group`` (also when it is
    None), ``model[-1]`` on the last, and on middle stages ``model[-1]`` when
    ``config.mtp_num_layers`` > 0, else ``model[0]``.

    Args:
      model: the model chunks (PP/VPP).
      embd_group: the group to reduce over (None: nothing to do).
      pp_group: the pipeline group (stage detection).
      weight_getter: returns the parameter of the unwrapped chunk, or None.
      skip_if_none: quietly return when the parameter or its gradient is None; else raise.
      config: transformer config (``mtp_num_layers``); None: no MTP rule.

    Raises:
      ValueError: ``skip_if_none`` is False and the parameter or its gradient is None.
    """
    has_mtp = bool(getattr(config, "mtp_num_layers", None) or 0)
    _embedding_grad(model, embd_group, pp_group, weight_getter, skip_if_none, config, has_mtp)


def _embedding_grad(
    model: list[nn.Module],
    embd_group: ProcessGroup | None,
    pp_group: ProcessGroup | None,
    weight_getter: Callable[[nn.Module], nn.Parameter | None],
    skip_if_none: bool,
    config: Any,
    has_mtp: bool,
) -> None:
    """:func:`_allreduce_embedding_grad` with the MTP chunk rule decided by the caller
    (Megatron's position-embedding helper never applies it)."""
    chunks = _chunks(model)
    if embd_group is None or world_rank() not in group_ranks(embd_group) or len(group_ranks(embd_group)) <= 1:
        return
    cfg = _model_config(chunks, config)
    # Without a pp group Megatron treats the rank as the first stage; the embedding
    # group's members then stand in for the stages.
    groups = _explicit(
        {Group.EMBD: embd_group, Group.POS_EMBD: embd_group, Group.PP: pp_group or embd_group}, model=chunks
    )
    stages = groups.stages.get(Group.EMBD)
    if stages is None:
        return
    stage, pp = (groups.pp_stage, groups.pp_size) if pp_group is not None else (0, 1)
    index = embedding_chunk(stage, pp, len(chunks), has_mtp)
    module = unwrap(chunks[index])
    weight = weight_getter(module)
    if weight is None:
        if skip_if_none:
            return
        raise ValueError(f"rank {groups.rank}: pp stage {stage}: chunk {index} has no embedding weight to reduce")
    # Planned and bound once per weight, gradient tensor and groups (plan once, run many).
    state = ModelState.of(chunks)
    grad = get_grad(weight)
    key = (skip_if_none, id(weight), index, _groups_key(groups), cfg.use_megatron_fsdp, has_mtp)
    hit = state.embedding_programs.get(key)
    if hit is not None and hit[0] is weight and hit[1] is grad and hit[2] == bool(weight.requires_grad):
        hit[3].run()
        return
    name = next((n for n, p in module.named_parameters() if p is weight), "embedding.weight")
    role, step = (
        (Role.WORD_EMBEDDING, Step.WORD_EMBEDDING) if skip_if_none else (Role.POSITION_EMBEDDING, Step.POS_EMBEDDING)
    )
    if not skip_if_none and not (weight.requires_grad and grad is not None):
        raise ValueError(
            f"rank {groups.rank}: embedding {name!r} (chunk {index}) has no gradient on pp stage {stage}; "
            "its group requires one (skip_if_none=False)"
        )
    if grad is None:  # frozen
        return
    # Labelled chunk 0: this helper already chose the chunk (the plan's rule must not).
    spec = param_spec(name, 0, weight, role)
    found = Discovered((spec,), (), {spec.key: weight}, {}, tuple(chunks))
    plan_cfg = FinalizeConfig(share_embeddings_and_output_weights=True)
    sizes = GroupSizes(sizes={Group.PP: groups.pp_size}, embd_stages=stages, pos_embd_stages=stages)
    with ranked():
        plan = plan_finalize(found.params, plan_cfg, sizes, dp_sync=False)
    actions = plan.for_step(step)
    grads = GradAccess(found.tensors, cfg.use_megatron_fsdp)
    if is_dtensor(grad):  # unsharded per call
        run_actions(actions, grads, {}, groups, stats=state.stats)
        return
    program = Program(actions, grads, {}, groups, state.stats)
    if len(state.embedding_programs) >= _MAX_PLANS:
        state.embedding_programs.pop(next(iter(state.embedding_programs)))
    state.embedding_programs[key] = (weight, grad, bool(weight.requires_grad), program)
    program.run()


def _allreduce_word_embedding_grads(
    model: list[nn.Module],
    config: Any,
    embd_group: ProcessGroup | None = None,
    pp_group: ProcessGroup | None = None,
) -> None:
    """All-reduce the tied word-embedding gradient across the stages of ``embd_group``
    (first and last by default).

    As in Megatron, a None ``embd_group`` is parallel_state's embedding group (none: nothing
    to do), and then ``pp_group`` must be None too: parallel_state's is used.

    Raises:
      MegatronAssertionError: ``embd_group`` is None, parallel_state's embedding group has
        several ranks, and ``pp_group`` was given (Megatron asserts).
    """
    with ranked():
        if embd_group is None:
            embd_group = helper_group(Group.EMBD, None, "lookup_optional", "embd_group")
            if embd_group is not None and len(group_ranks(embd_group)) > 1:
                if pp_group is not None:
                    raise MegatronAssertionError(
                        f"rank {world_rank()}: _allreduce_word_embedding_grads: embd_group is None, so "
                        "parallel_state's embedding group is used, and then pp_group must be None too "
                        "(Megatron-Core asserts); pass both groups or neither"
                    )
                pp_group = helper_group(Group.PP, None, "lookup", "_allreduce_word_embedding_grads(pp_group)")
        has_mtp = bool(getattr(config, "mtp_num_layers", None) or 0)
        _embedding_grad(
            model,
            embd_group,
            pp_group,
            lambda module: _get_shared_word_embedding_weight(module, config),
            True,
            config,
            has_mtp,
        )


def _allreduce_position_embedding_grads(
    model: list[nn.Module], config: Any, pos_emb_group: ProcessGroup, pp_group: ProcessGroup
) -> None:
    """All-reduce the position-embedding gradient over ``pos_emb_group`` (None: nothing to
    do); a missing gradient on a member stage is an error. Middle stages use ``model[0]``."""
    with ranked():
        _embedding_grad(model, pos_emb_group, pp_group, _get_position_embedding_weight, False, config, False)


@ranked()
def _update_router_expert_bias(
    model: list[nn.Module], config: Any, tp_dp_cp_group: ProcessGroup | None = None
) -> None:
    """Update trained routers' expert bias from token counts summed over tp x gtp x dp x cp
    (one collective for all routers).

    As in Megatron, ``config.moe_router_enable_expert_bias`` gates this step inside
    :func:`finalize_model_grads` only: called directly, the helper always updates.

    Args:
      model: the model chunks.
      config: transformer config (``moe_router_bias_update_rate``).
      tp_dp_cp_group: the tp x dp x cp group (None: Megatron's parallel_state's, as
        Megatron's helper).
    """
    cfg = _model_config(_chunks(model), config).replace(moe_router_enable_expert_bias=True)
    group = helper_group(Group.TP_DP_CP, tp_dp_cp_group, "lookup", "_update_router_expert_bias(tp_dp_cp_group)")
    _run_steps(model, cfg, _explicit({Group.TP_DP_CP: group}, model=model), [Step.EXPERT_BIAS])


@ranked()
def _update_router_qb_beta(model: list[nn.Module], config: Any, dp_cp_group: ProcessGroup | None = None) -> None:
    """Update the quantile-balancing bias once per global batch: AVG of
    ``qb_beta_accum / max(qb_beta_count, 1)`` over ``dp_cp_group``, EMA blend, re-centre.

    As Megatron's helper, it does not check ``moe_router_load_balancing_type`` (only
    :func:`finalize_model_grads` does), and a None ``dp_cp_group`` is torch.distributed's
    default group (the world), to which Megatron passes it on.
    """
    cfg = _model_config(_chunks(model), config).replace(moe_router_load_balancing_type="quantile_balancing")
    group = helper_group(Group.DP_CP_GTP, dp_cp_group, "world", "_update_router_qb_beta(dp_cp_group)")
    groups = _explicit({Group.DP_CP: group, Group.DP_CP_GTP: group}, model=model)
    _run_steps(model, cfg, groups, [Step.QB_BETA])


@ranked()
def reset_model_temporary_tensors(config: Any, model: list[nn.Module]) -> None:
    """Reset the temporary tensors of the model: token counts, qb accumulators, the global
    aux-loss tracker (SPEC 2.10)."""
    _run_steps(model, resolve_config(config), TorchGroups.trivial(), [Step.RESET])
