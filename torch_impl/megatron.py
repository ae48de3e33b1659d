"""The one place where torch_impl reads Megatron-Core's objects.

Megatron is never imported here: its modules can only matter once the user's process has
imported them, so they are found in ``sys.modules``. This module reads

* ``parallel_state`` (:func:`parallel_state`, :func:`parallel_state_values`,
  :func:`parallel_state_groups`): the groups of an initialized Megatron job, by meshgrad
  name, including the GTP-remat ones;
* a ``ProcessGroupCollection`` (:func:`collection_groups`), with the meaning
  ``finalize_model_grads`` gives each field: a field never set reads as None through the
  collection's ``__getattr__``, so only ``vars(collection)`` says what was set; a None
  group is looked up, passed on as torch.distributed's default group, or an error,
  exactly where Megatron does each;
* a helper's None group argument (:func:`helper_group`), with the same per-helper rules;
* Megatron configs and DDP chunks (:func:`chunk_configs`, :func:`resolve_config`,
  :func:`ddp_object`, :class:`Requested` -- the one reader of the config's sizes, with
  one strictness);
* a group source of any kind a call accepts (:func:`resolve_groups`, and
  :func:`status_groups` for a rank whose set-up failed);
* the GTP fence (:func:`gtp_fence`): ``gtp_api.wait_for_gtp_grad_reduction_on_current_stream``.

Where Megatron asserts (or fails on a None group), these functions raise
:class:`~torch_impl.errors.MegatronAssertionError` before anything is communicated.
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch.distributed as dist

from meshgrad.axes import Group
from meshgrad.config import FinalizeConfig
from meshgrad.errors import FinalizeInputError, FinalizeTypeError
from torch_impl.discover import attr_or, find_attr, has_attr
from torch_impl.errors import MegatronAssertionError
from torch_impl.groups import MeshGroups, TorchGroups, group_ranks, is_device_mesh, world_rank, world_size

ProcessGroup = Any

PARALLEL_STATE = "megatron.core.parallel_state"
GTP_API = "megatron.core.tensor_parallel.gtp_api"
GTP_FENCE = "wait_for_gtp_grad_reduction_on_current_stream"


# =========================================================================== modules


def loaded_parallel_state() -> Any | None:
    """Megatron's ``parallel_state`` module when the process imported it, else None."""
    return sys.modules.get(PARALLEL_STATE)


def parallel_state() -> Any | None:
    """Megatron-Core's ``parallel_state`` when its model-parallel groups are initialized
    in this process, else None."""
    ps = loaded_parallel_state()
    if ps is None:
        return None
    try:
        return ps if ps.model_parallel_is_initialized() else None
    except Exception:  # an older or partial parallel_state: treat as not initialized
        return None


def gtp_fence() -> Callable[[], None] | None:
    """Megatron's ``wait_for_gtp_grad_reduction_on_current_stream`` when its ``gtp_api``
    module is loaded, else None (looked up at every call, so a patched one is used)."""
    fence = getattr(sys.modules.get(GTP_API), GTP_FENCE, None)
    return fence if callable(fence) else None


# =========================================================================== parallel_state

#: How each named group is read from Megatron's ``parallel_state``: getter, keywords, and
#: keywords an older Megatron lacks (dropped when the getter does not take them).
#: DP_CP is the replicate group (the gradient sync); DP_CP_GTP the full data group
#: (num_tokens and qb_beta), which is what ``get_data_parallel_group`` returns by default.
PARALLEL_STATE_GETTERS: dict[Group, tuple[str, dict[str, Any], tuple[str, ...]]] = {
    Group.TP: ("get_tensor_model_parallel_group", {}, ()),
    Group.PP: ("get_pipeline_model_parallel_group", {}, ()),
    Group.EMBD: ("get_embedding_group", {"check_initialized": False}, ()),
    Group.POS_EMBD: ("get_position_embedding_group", {"check_initialized": False}, ()),
    Group.DP_CP: ("get_data_parallel_group", {"with_context_parallel": True, "with_gtp_remat": False}, ("with_gtp_remat",)),
    Group.DP_CP_GTP: ("get_data_parallel_group", {"with_context_parallel": True}, ()),
    Group.EDP: ("get_expert_data_parallel_group", {"with_gtp_remat": False}, ("with_gtp_remat",)),
    Group.TP_DP_CP: ("get_tensor_and_data_parallel_group", {"with_context_parallel": True}, ()),
    Group.GTP: ("get_gtp_weight_remat_group", {"check_initialized": False}, ()),
    Group.EGTP: ("get_expert_gtp_weight_remat_group", {"check_initialized": False}, ()),
}
_UNDEFINED = object()


def _accepted(getter: Callable[..., Any], kwargs: dict[str, Any], optional: tuple[str, ...]) -> dict[str, Any]:
    if not optional:
        return kwargs
    try:
        params = inspect.signature(getter).parameters
    except (TypeError, ValueError):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params or k not in optional}


def parallel_state_group(ps: Any, group: Group) -> Any:
    """One named group from ``parallel_state``; ``_UNDEFINED`` when its getter is absent
    or asserts (not initialized), None where Megatron holds none for this rank."""
    name, kwargs, optional = PARALLEL_STATE_GETTERS[group]
    getter = getattr(ps, name, None)
    if not callable(getter):
        return _UNDEFINED
    try:
        return getter(**_accepted(getter, kwargs, optional))
    except (AssertionError, RuntimeError, TypeError, AttributeError):
        return None if group in (Group.EMBD, Group.POS_EMBD, Group.GTP, Group.EGTP) else _UNDEFINED


def parallel_state_values(ps: Any) -> dict[Group, ProcessGroup | None]:
    """The groups Megatron's ``parallel_state`` defines, by meshgrad name (a getter that is
    absent or raises leaves its group out)."""
    values = {g: parallel_state_group(ps, g) for g in PARALLEL_STATE_GETTERS}
    return {g: v for g, v in values.items() if v is not _UNDEFINED}


def parallel_state_groups(ps: Any | None = None) -> TorchGroups | None:
    """This rank's :class:`TorchGroups` from Megatron's initialized ``parallel_state``
    (a new one; :func:`parallel_state_keyed` keeps one while the groups stay the same),
    or None when it is not initialized."""
    found = parallel_state_keyed(ps)
    return found[1] if found is not None else None


def parallel_state_keyed(
    ps: Any | None = None, memo: tuple[tuple[Any, ...], TorchGroups] | None = None
) -> tuple[tuple[Any, ...], TorchGroups] | None:
    """This rank's :class:`TorchGroups` from Megatron's initialized ``parallel_state``, as
    ``finalize_model_grads(pg_collection=None)`` reads it, with its key (the groups'
    identities).

    Args:
      ps: the ``parallel_state`` module (default: Megatron's, when imported).
      memo: a previous result: returned again while the groups are the same objects (the
        caller keeps it -- the model state -- so a loop passing ``pg_collection=None``
        reuses one TorchGroups, and one cached plan, every step).

    Returns:
      (key, groups), or None when parallel_state is not initialized.
    """
    ps = parallel_state() if ps is None else ps
    if ps is None:
        return None
    values = parallel_state_values(ps)
    key = tuple((g, id(v)) for g, v in values.items())
    if memo is not None and memo[0] == key:
        return memo
    return key, TorchGroups.from_mapping(values, source="Megatron parallel_state")  # it keeps the groups alive


# =========================================================================== ProcessGroupCollection


def is_process_group_collection(obj: Any) -> bool:
    """Whether ``obj`` is Megatron's ``ProcessGroupCollection`` (a dataclass of that name)."""
    return type(obj).__name__ == "ProcessGroupCollection" and dataclasses.is_dataclass(obj)


def _default_group() -> ProcessGroup | None:
    """What a None group passed to a torch.distributed collective means: the world."""
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def _size(group: Any) -> int:
    return len(group_ranks(group)) if group is not None else 1


def _check_fields(collection: Any, rank: int) -> None:
    """Megatron asserts ``hasattr(pg_collection, ...)`` for tp, pp, embd, pos_embd and
    dp_cp: always true for a collection whose ``__getattr__`` answers unset fields
    (current Megatron), false for one that does not.

    Raises:
      MegatronAssertionError: naming the attributes it lacks.
    """
    lacking = [g.value for g in (Group.TP, Group.PP, Group.EMBD, Group.POS_EMBD, Group.DP_CP) if not hasattr(collection, g.value)]
    if lacking:
        raise MegatronAssertionError(
            f"rank {rank}: pg_collection has no attribute {', '.join(lacking)} (Megatron-Core asserts "
            "hasattr for tp, pp, embd, pos_embd and dp_cp); set each, to None where there is no such group"
        )


def _parallel_state_embd(loaded: Any, *, pp_given: bool, rank: int) -> ProcessGroup | None:
    """parallel_state's embedding group for a collection whose ``embd`` is None.

    Raises:
      MegatronAssertionError: it has several ranks and the collection's ``pp`` is set.
    """
    found = parallel_state_group(loaded, Group.EMBD)
    found = None if found is _UNDEFINED else found
    if found is not None and _size(found) > 1 and pp_given:
        raise MegatronAssertionError(
            f"rank {rank}: pg_collection.embd is None, so Megatron-Core takes parallel_state's "
            f"embedding group {group_ranks(found)}, and then requires pg_collection.pp to be None "
            "(it asserts); set pg_collection.embd"
        )
    return found


def collection_groups(collection: Any, *, expert_bias: bool, flextron: bool = False) -> TorchGroups:
    """This rank's groups from a Megatron ``ProcessGroupCollection``, read as Megatron's
    ``finalize_model_grads`` reads it.

    A field is set when it is in ``vars(collection)``; unset and None fields both read as
    None there, and None means, per field: ``tp`` / ``pp`` -- parallel_state's group (an
    error without an initialized parallel_state); ``embd`` -- parallel_state's embedding
    group (none if it has none); ``pos_embd`` -- no position-embedding step; num_tokens and
    qb_beta reduce over ``dp_cp_gtp_remat``, else ``dp_cp``, else the default (world)
    group; ``gtp_remat`` / ``expt_gtp_remat`` -- parallel_state's (GTP inactive without
    one); ``tp_dp_cp`` -- an error when the expert bias is updated.

    Args:
      collection: the ProcessGroupCollection.
      expert_bias: ``config.moe_router_enable_expert_bias``.
      flextron: ``config.flextron`` (Megatron's router sync then needs parallel_state).

    Raises:
      MegatronAssertionError: where Megatron asserts or fails on a None group.
    """
    given = {g: vars(collection).get(g.value) for g in Group if g.value in vars(collection)}
    ps = parallel_state()
    loaded = loaded_parallel_state()
    rank = world_rank()
    _check_fields(collection, rank)
    values: dict[Group, Any] = dict(given)
    for group, what in ((Group.TP, "tensor-parallel"), (Group.PP, "pipeline")):
        if values.get(group) is None:
            found = parallel_state_group(ps, group) if ps is not None else None
            if found is None or found is _UNDEFINED:
                raise MegatronAssertionError(
                    f"rank {rank}: pg_collection.{group.value} is {'None' if group in given else 'not set'} "
                    f"and Megatron's parallel_state is not initialized, so there is no {what} group "
                    f"(Megatron-Core fails here too); set pg_collection.{group.value}"
                )
            values[group] = found
    values.setdefault(Group.POS_EMBD, None)
    values.setdefault(Group.EMBD, None)
    if values[Group.EMBD] is None and loaded is not None:
        values[Group.EMBD] = _parallel_state_embd(loaded, pp_given=given.get(Group.PP) is not None, rank=rank)
    values[Group.DP_CP_GTP] = given.get(Group.DP_CP_GTP) or given.get(Group.DP_CP) or _default_group()
    for group in (Group.GTP, Group.EGTP):
        if values.get(group) is None and loaded is not None:
            found = parallel_state_group(loaded, group)
            values[group] = None if found is _UNDEFINED else found
    if flextron and ps is None:
        raise MegatronAssertionError(
            f"rank {rank}: config.flextron is set, and Megatron-Core syncs the router grads over "
            "parallel_state's pipeline group, but parallel_state is not initialized (Megatron asserts)"
        )
    if expert_bias and given.get(Group.TP_DP_CP) is None:
        raise MegatronAssertionError(
            f"rank {rank}: pg_collection must have tp_dp_cp when moe_router_enable_expert_bias is "
            f"enabled (it is {'None' if Group.TP_DP_CP in given else 'not set'}); Megatron-Core asserts "
            "the same"
        )
    groups = TorchGroups.from_mapping(values, defined=frozenset(values), source="ProcessGroupCollection")
    if given.get(Group.PP) is None:
        groups = _without_pp(groups, embd_given=given.get(Group.EMBD) is not None)
    return groups


def _without_pp(groups: TorchGroups, *, embd_given: bool) -> TorchGroups:
    """What Megatron's finalize does with a collection whose ``pp`` is None: its embedding
    helpers see no pipeline group and take this rank for the first stage (the word
    embedding only when ``embd`` was given: otherwise it uses parallel_state's groups),
    and ``num_tokens`` is broadcast over the world from its last rank."""
    first = frozenset({Group.POS_EMBD, Group.EMBD} if embd_given else {Group.POS_EMBD})
    world = _default_group()
    broadcast = (world, world_size() - 1) if world is not None and world_size() > 1 else None
    return dataclasses.replace(groups, first_stage_for=first, token_broadcast=broadcast)


# =========================================================================== helpers' groups

#: What a helper does with a None group argument (Megatron's per-helper rule):
#: ``lookup`` -- parallel_state's group (without one: no communication in a world of one
#: rank, else an error); ``lookup_optional`` -- parallel_state's group if any, else none;
#: ``world`` -- torch.distributed's default group; ``none`` -- no such group.
HELPER_RULES = ("lookup", "lookup_optional", "world", "none")


def helper_group(group: Group, value: ProcessGroup | None, rule: str, where: str) -> ProcessGroup | None:
    """A seed helper's group argument as Megatron's helper uses it.

    Args:
      group: which named group the argument is.
      value: the argument.
      rule: one of :data:`HELPER_RULES`.
      where: ``"helper(argument)"`` for the error message.

    Raises:
      MegatronAssertionError: ``lookup`` with no initialized parallel_state in a world of
        more than one rank.
    """
    if value is not None or rule == "none":
        return value
    if rule == "world":
        return _default_group()
    ps = parallel_state() if rule == "lookup" else loaded_parallel_state()
    found = parallel_state_group(ps, group) if ps is not None else _UNDEFINED
    if found is not _UNDEFINED and (found is not None or rule == "lookup_optional"):
        return found
    if rule == "lookup_optional" or world_size() == 1:
        return None
    raise MegatronAssertionError(
        f"rank {world_rank()}: {where} is None and Megatron's parallel_state is not initialized in a "
        f"world of {world_size()} ranks (Megatron-Core would look the {group.value!r} group up there and "
        "fail); pass the group"
    )


# =========================================================================== configs and DDP


def chunk_configs(model: Sequence[Any]) -> tuple[Any, Any]:
    """The ``config`` and ``ddp_config`` found along the ``.module`` chain of the chunks
    (Megatron's ``get_model_config``)."""
    config = ddp_config = None
    for chunk in model:
        config = config if config is not None else find_attr(chunk, "config")
        ddp_config = ddp_config if ddp_config is not None else find_attr(chunk, "ddp_config")
    return config, ddp_config


def ddp_object(chunk: Any) -> Any:
    """The object in the ``.module`` chain that does Megatron DDP's grad sync, or None."""
    for _ in range(64):
        if callable(attr_or(chunk, "finish_grad_sync", None)):
            return chunk
        if not has_attr(chunk, "module"):
            return None
        chunk = chunk.module
    return None


def accepts(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` takes a keyword argument ``name``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def config_size(config: Any, name: str, default: int | None) -> int | None:
    """A parallel size from a Megatron config: a positive int (numpy ints too); absent or
    None gives ``default``.

    Raises:
      ValueError: any other value.
    """
    value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
        raise FinalizeInputError(f"rank {world_rank()}: config.{name} must be a positive int, got {value!r}")
    return int(value)


#: The parallel sizes a Megatron config states (what :class:`Requested` reads).
CONFIG_SIZES = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "gtp_weight_remat_size",
    "expert_gtp_weight_remat_size",
)


@dataclasses.dataclass(frozen=True)
class Requested:
    """The parallel sizes a Megatron config states (checked against the groups only in
    strict mode; Megatron itself takes the groups as the truth).

    Args:
      tp: ``tensor_model_parallel_size`` (None: not stated).
      pp: ``pipeline_model_parallel_size``.
      cp: ``context_parallel_size``.
      ep: ``expert_model_parallel_size`` (None: not stated; :attr:`ep_size` is then 1).
      etp: ``expert_tensor_parallel_size`` (None = tp).
      gtp: ``gtp_weight_remat_size`` (1 = GTP inactive).
      egtp: ``expert_gtp_weight_remat_size``.
    """

    tp: int | None = None
    pp: int | None = None
    cp: int | None = None
    ep: int | None = None
    etp: int | None = None
    gtp: int = 1
    egtp: int = 1

    @property
    def ep_size(self) -> int:
        """The expert-parallel size to build groups with (1 when not stated)."""
        return self.ep or 1

    @property
    def gtp_active(self) -> bool:
        """Whether Megatron fences against in-flight GTP gradient work."""
        return self.gtp > 1 or self.egtp > 1

    @classmethod
    def from_config(cls, config: Any) -> "Requested":
        """The sizes ``config`` states (an object or a mapping; numpy integers too).

        Raises:
          ValueError: a size that is not a positive integer.
        """
        if config is None or type(config).__name__ == "FinalizeConfig":
            return cls()
        return cls(
            tp=config_size(config, "tensor_model_parallel_size", None),
            pp=config_size(config, "pipeline_model_parallel_size", None),
            cp=config_size(config, "context_parallel_size", None),
            ep=config_size(config, "expert_model_parallel_size", None),
            etp=config_size(config, "expert_tensor_parallel_size", None),
            gtp=config_size(config, "gtp_weight_remat_size", 1),
            egtp=config_size(config, "expert_gtp_weight_remat_size", 1),
        )



# =========================================================================== group sources


def resolve_config(config: Any, ddp_config: Any = None) -> FinalizeConfig:
    """A FinalizeConfig from a Megatron TransformerConfig, a duck-typed object, a mapping or
    a FinalizeConfig, merged with a DDP config.

    Raises:
      TypeError: neither a config nor a DDP config is given.
    """
    if isinstance(config, FinalizeConfig) and ddp_config is None:
        return config
    if config is None and ddp_config is None:
        raise FinalizeTypeError(
            f"rank {world_rank()}: no config found: set `config` (a Megatron TransformerConfig or a "
            "meshgrad.FinalizeConfig) on the first model chunk (or on a module along its `.module` chain)"
        )
    return FinalizeConfig.from_megatron(config, ddp_config)


def _no_groups() -> TorchGroups:
    """``pg_collection=None`` without an initialized parallel_state: one rank only."""
    if world_size() > 1:
        raise MegatronAssertionError(
            f"rank {world_rank()}: pg_collection is None in a world of {world_size()} ranks and "
            "Megatron's parallel_state is not initialized; pass a ProcessGroupCollection (or any "
            "object with its attribute names) or a torch DeviceMesh with meshgrad dim names "
            "(pp, dp, cp, gtp, tp)"
        )
    return TorchGroups.trivial()


#: The kinds of group source ``finalize_model_grads`` takes (:func:`source_kind`).
SourceKind = Literal[
    "parallel_state", "megatron_collection", "device_mesh", "mesh_groups", "torch_groups", "mapping", "collection"
]
#: Kinds read the Megatron way (Megatron's rules resolve or refuse their groups).
MEGATRON_KINDS = frozenset({"parallel_state", "megatron_collection"})
#: Kinds whose groups a user listed (their members are checked against the mesh).
LISTED_KINDS = frozenset({"megatron_collection", "mapping", "collection"})
#: Kinds meshgrad builds from a DeviceMesh (their status round runs over the world).
MESH_KINDS = frozenset({"device_mesh", "mesh_groups"})


def source_kind(source: Any) -> SourceKind:
    """The kind of a group source: the one place it is classified.

    ``None`` is Megatron's ``parallel_state``; a Megatron ``ProcessGroupCollection``; a
    torch DeviceMesh; meshgrad's MeshGroups / TorchGroups; a mapping; else any object
    with the collection's attribute names (``resolve_groups`` refuses one without)."""
    if source is None:
        return "parallel_state"
    if isinstance(source, TorchGroups):
        return "torch_groups"
    if isinstance(source, MeshGroups):
        return "mesh_groups"
    if is_device_mesh(source):
        return "device_mesh"
    if is_process_group_collection(source):
        return "megatron_collection"
    if isinstance(source, Mapping):
        return "mapping"
    return "collection"


def resolve_groups(pg_collection: Any, config: FinalizeConfig, requested: Requested) -> TorchGroups:
    """This rank's TorchGroups from whatever ``finalize_model_grads`` was given.

    A Megatron ``ProcessGroupCollection`` and ``None`` (Megatron's ``parallel_state``) are
    read as Megatron reads them; meshgrad's own sources (a DeviceMesh, MeshGroups,
    TorchGroups, a mapping or any object with the collection's attribute names) name
    every group they mean, None being size 1.

    Raises:
      MegatronAssertionError: where Megatron asserts (a field it needs is None or unset).
      ValueError: no groups in a multi-rank world, or a DeviceMesh that does not fit.
      TypeError: an object that is no group source.
    """
    kind = source_kind(pg_collection)
    if kind == "parallel_state":
        from_megatron = parallel_state_groups()
        return from_megatron if from_megatron is not None else _no_groups()
    if kind == "torch_groups":
        return pg_collection
    if kind in MESH_KINDS:
        groups = MeshGroups(pg_collection) if kind == "device_mesh" else pg_collection
        stages = {"embedding_stages": config.embedding_stages, "position_embedding_stages": config.position_embedding_stages}
        return groups.resolve(ep=requested.ep_size, etp=requested.etp, egtp=requested.egtp, **stages)
    if kind == "megatron_collection":
        if requested.gtp > 1 and vars(pg_collection).get("gtp_remat") is None:
            raise MegatronAssertionError(
                f"rank {world_rank()}: config.gtp_weight_remat_size is {requested.gtp} but pg_collection has no "
                "gtp_remat group. Pass a pg_collection carrying `gtp_remat` (Megatron-Core asserts the same)"
            )
        return collection_groups(
            pg_collection, expert_bias=config.moe_router_enable_expert_bias, flextron=config.flextron
        )
    if kind == "mapping":
        return TorchGroups.from_mapping(pg_collection, source="group mapping")
    if not any(hasattr(pg_collection, g.value) for g in Group):
        raise FinalizeTypeError(
            f"rank {world_rank()}: pg_collection must be None, a ProcessGroupCollection (or any object "
            f"with its attribute names tp, pp, embd, pos_embd, dp_cp, ...), a torch DeviceMesh, a "
            f"MeshGroups or a TorchGroups; got {type(pg_collection).__name__}"
        )
    return TorchGroups.from_collection(pg_collection)


def status_groups(source: Any) -> TorchGroups | None:
    """The groups of the status round for a rank that failed before resolving its
    groups: built from ``source`` without creating any process group, or None (a
    DeviceMesh's round runs over the world: :mod:`torch_impl.status`)."""
    kind = source_kind(source)
    try:
        if kind == "parallel_state":
            groups = parallel_state_groups()
            return groups if groups is not None else (TorchGroups.trivial() if world_size() == 1 else None)
        if kind == "torch_groups":
            return source
        if kind in MESH_KINDS:
            return None
        if kind == "mapping":
            return TorchGroups.from_mapping(source, source="group mapping")
        return TorchGroups.from_collection(source)
    except Exception:  # nothing to share over: the caller raises locally
        return None


__all__ = [
    "CONFIG_SIZES",
    "HELPER_RULES",
    "PARALLEL_STATE_GETTERS",
    "Requested",
    "accepts",
    "chunk_configs",
    "collection_groups",
    "config_size",
    "ddp_object",
    "gtp_fence",
    "helper_group",
    "is_process_group_collection",
    "source_kind",
    "MEGATRON_KINDS",
    "LISTED_KINDS",
    "MESH_KINDS",
    "loaded_parallel_state",
    "parallel_state",
    "parallel_state_group",
    "parallel_state_groups",
    "parallel_state_keyed",
    "parallel_state_values",
    "resolve_config",
    "resolve_groups",
    "status_groups",
]
