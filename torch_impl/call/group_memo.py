"""The group memo of a model: resolved groups per group source, Megatron's
``parallel_state`` groups and a seed helper's groups (kept here, never on those objects;
a DeviceMesh's groups are shared by every model: :func:`torch_impl.sources.mesh_groups.mesh_groups`)."""

from __future__ import annotations

import operator
from collections.abc import Mapping
from functools import partial
from typing import Any

import torch.distributed as dist

from meshgrad.axes import Group
from meshgrad.config import FinalizeConfig
from torch_impl.sources.group_sources import MESH_KINDS, resolve_groups, source_kind
from torch_impl.run.groups import TorchGroups, world_size
from torch_impl.sources.megatron import (
    ParallelStateRead, parallel_state, parallel_state_current, parallel_state_keyed, probe_parallel_state,
)
from torch_impl.sources.config import Requested
from torch_impl.call.memo import Snapshot, put
from torch_impl.call.probes import Probes
from torch_impl.sources.mesh_groups import live_mesh_groups, mesh_groups

_GROUP_NAMES = tuple(g.value for g in Group)


def _key(config: FinalizeConfig) -> tuple[Any, ...]:
    """What a source's resolved groups depend on besides the source: the world's size and
    the config fields that add groups."""
    return world_size(), config.moe_router_enable_expert_bias, config.flextron


#: Where torch.distributed keeps the default process group it reads the world size from
#: (private to torch: :func:`probe_world_size` reads it only where it is there).
_C10D = getattr(dist, "distributed_c10d", None)
_ABSENT = object()


def probe_world_size(probes: Probes, size: int) -> None:
    """``world_size() == size`` written down as a probe: the default process group itself,
    by identity (one C-level read: a group's size is fixed, and ``get_world_size`` reads it
    from that group; None while torch.distributed is not initialized), where torch keeps
    it as ``distributed_c10d._world._default_pg`` and it gives ``size``; else
    :func:`~torch_impl.run.groups.world_size` itself, read again."""
    world = getattr(_C10D, "_world", None)
    pg = getattr(world, "_default_pg", _ABSENT)
    if pg is not _ABSENT and (1 if pg is None else pg.size()) == size == world_size():
        probes.same(partial(getattr, world, "_default_pg"), pg)
    else:
        probes.equal(world_size, size)


def mesh_unchanged(source: Any, groups: TorchGroups) -> bool:
    """Whether resolving a mesh source (a DeviceMesh or MeshGroups) again for the layout
    that gave ``groups`` gives them again without a layout round: its MeshGroups is the live
    one and the layout its last call used is that one (each layout resolves to its own
    TorchGroups, once)."""
    known = live_mesh_groups(source)
    return known is not None and known.last_resolved() is groups


class GroupMemo:
    """The groups resolved for one model (owned by its ModelState)."""

    def __init__(self) -> None:
        self.groups: tuple[Snapshot, tuple[Any, ...], TorchGroups] | None = None  # the last resolved source
        self.explicit_groups: dict[tuple[Any, ...], tuple[dict[Group, Any], TorchGroups]] = {}
        self.parallel_state: ParallelStateRead | None = None

    def last_resolved_groups(self, source: Any) -> TorchGroups | None:
        """The groups last resolved from ``source`` (not checked again), or None."""
        hit = self.groups
        return hit[2] if hit is not None and hit[0].source is source else None

    def parallel_state_groups(self) -> TorchGroups | None:
        """Megatron's ``parallel_state`` groups, one TorchGroups while its groups stay the
        same objects (so one cached plan serves every step; nothing is written on the
        module)."""
        found = parallel_state_keyed(memo=self.parallel_state)
        if found is not None:
            self.parallel_state = found
        return found.groups if found is not None else None

    def resolve_groups(self, source: Any, config: FinalizeConfig, requested: Requested) -> TorchGroups:
        """Resolved groups, cached per group source (a DeviceMesh's groups by its
        MeshGroups, kept here)."""
        kind = source_kind(source)
        if kind == "device_mesh":
            source = mesh_groups(source)  # one per live mesh, shared by every model
        if kind in MESH_KINDS or kind == "torch_groups":
            return resolve_groups(source, config, requested)
        key = _key(config)
        if self._hit(source, key):
            return self.groups[2]  # type: ignore[index]
        snapshot = Snapshot(source, _GROUP_NAMES, by_vars=kind == "megatron_collection")
        resolved = resolve_groups(source, config, requested)
        self.groups = (snapshot, key, resolved)
        return resolved

    def _hit(self, source: Any, key: tuple[Any, ...]) -> bool:
        """Whether the last resolved source is ``source``, resolved for ``key``, holding the same values."""
        hit = self.groups
        return hit is not None and hit[0].source is source and hit[1] == key and hit[0].same()

    def unchanged(self, source: Any, config: FinalizeConfig, groups: TorchGroups) -> bool:
        """Whether :meth:`parallel_state_groups` then :meth:`resolve_groups` (as a call with
        ``source`` and ``config`` makes them) would give ``groups`` again. A mesh source,
        resolved per call, by its MeshGroups (:func:`mesh_unchanged`: the config, and so the
        layout, is the caller's to compare)."""
        if source is None:  # parallel_state's groups, or none when it is not initialized
            memo = self.parallel_state
            if memo is not None and memo.groups is groups:
                return parallel_state_current(memo)
            if parallel_state() is not None:
                return False
        kind = source_kind(source)
        if kind == "torch_groups":
            return source is groups
        if kind in MESH_KINDS:
            return mesh_unchanged(source, groups)
        return self._hit(source, _key(config)) and self.groups[2] is groups  # type: ignore[index]

    def probe(self, probes: Probes, source: Any, config: FinalizeConfig, groups: TorchGroups) -> bool:
        """Write :meth:`unchanged` down as probes, for a call it has just answered True
        (``source`` itself is the caller's to compare); a mesh source's as its one check."""
        if source is None:
            memo = self.parallel_state
            probes.same(partial(getattr, self, "parallel_state"), memo)
            if memo is not None and memo.groups is groups:
                probe_parallel_state(probes, memo)
                return True
            probe_parallel_state(probes, None)  # parallel_state() stays None
        kind = source_kind(source)
        if kind == "torch_groups":
            return True  # the source is the groups
        if kind in MESH_KINDS:
            probes.check(partial(mesh_unchanged, source, groups))
            return True
        probes.same(partial(getattr, self, "groups"), self.groups)
        probe_world_size(probes, self.groups[1][0])  # type: ignore[index]  # _key's one read (the config is fixed)
        self.groups[0].probe(probes)  # type: ignore[index]
        return True

    def explicit_unchanged(self, values: Mapping[Group, Any], groups: TorchGroups) -> bool:
        """Whether :meth:`explicit` would give ``groups`` again for ``values``."""
        hit = self.explicit_groups.get((tuple(values), tuple(map(id, values.values()))))
        return hit is not None and hit[1] is groups and all(map(operator.is_, hit[0].values(), values.values()))

    def explicit(self, values: Mapping[Group, Any]) -> TorchGroups:
        """TorchGroups from a seed helper's groups, memoized on the group objects'
        identity (the memo holds the groups, so their ids stay theirs) and the names'
        order (each helper builds its mapping in one order)."""
        key = (tuple(values), tuple(map(id, values.values())))
        hit = self.explicit_groups.get(key)
        if hit is not None and all(map(operator.is_, hit[0].values(), values.values())):
            return hit[1]
        resolved = TorchGroups.from_mapping(dict(values), source="the helper's groups")
        return put(self.explicit_groups, key, (dict(values), resolved))[1]
