"""Group sources: the one classification of what ``finalize_model_grads`` is given as
``pg_collection`` (:func:`source_kind`), the groups resolved from it
(:func:`resolve_groups`), and the status round's groups for a rank whose set-up failed
(:func:`status_groups`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from meshgrad.axes import Group
from meshgrad.config import FinalizeConfig
from meshgrad.errors import FinalizeTypeError
from torch_impl.run.errors import MegatronAssertionError
from torch_impl.run.groups import TorchGroups, world_rank, world_size
from torch_impl.sources.mesh_groups import MeshGroups, is_device_mesh, mesh_groups
from torch_impl.sources.megatron import parallel_state_groups
from torch_impl.sources.config import Requested
from torch_impl.sources.pg_collection import collection_groups, is_process_group_collection


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
        groups = mesh_groups(pg_collection) if kind == "device_mesh" else pg_collection
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
    DeviceMesh's round runs over the world: :mod:`torch_impl.run.status`)."""
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
