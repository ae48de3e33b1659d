"""Named meshgrad groups from a torch ``DeviceMesh`` whose dim names are meshgrad axis
names or torchtitan's (:mod:`torch_impl.sources.mesh_names`): :class:`MeshGroups` builds
the multi-axis, expert and embedding groups with ``dist.new_group`` once (after the ranks
agree on the layout) and caches them on itself; :func:`mesh_groups` keeps one per live
DeviceMesh, so every model given that mesh shares its process groups (nothing is written
on the mesh).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch.distributed as dist

from meshgrad.axes import DENSE_AXES, EXPERT_AXES, GROUP_AXES, Axis, Group, ParallelDims, stage_set
from meshgrad.errors import FinalizeInputError
from torch_impl.sources.mesh_names import dense_dims, mapping_text
from torch_impl.run.groups import STAGE_GROUPS, ProcessGroup, TorchGroups, world_rank, world_size
from torch_impl.run.status import (
    AgreedInputError, layout_digest, reduce_status, settle, share_error, status_vector, timeout_of, world_route,
)


def _rows(grid: np.ndarray, names: Sequence[Any], axes: Sequence[Any]) -> list[tuple[int, ...]]:
    """Every instance of the group varying ``axes`` of ``grid`` (dims named ``names``)."""
    varying = [names.index(a) for a in axes]
    fixed = [i for i in range(grid.ndim) if i not in varying]
    moved = np.transpose(grid, fixed + varying)
    width = int(np.prod([grid.shape[i] for i in varying], dtype=np.int64))
    return [tuple(int(r) for r in row) for row in moved.reshape(-1, width)]


def _dense_grid(mesh: Any) -> tuple[tuple[str, ...], np.ndarray, np.ndarray]:
    """A DeviceMesh's dim names, its global ranks as laid out, and the same ranks as a
    grid over every dense axis in meshgrad's order (absent axes have size 1; torchtitan's
    data-parallel dims make up ``dp``: :mod:`torch_impl.sources.mesh_names`).

    Args:
      mesh: the DeviceMesh.

    Returns:
      (dim names, the mesh's rank grid, the dense rank grid).

    Raises:
      ValueError: a dim name meshgrad does not read, or a repeated one (with the mapping).
    """
    names = tuple(mesh.mesh_dim_names or ())
    if len(names) != mesh.ndim:
        raise FinalizeInputError(
            f"rank {world_rank()}: a DeviceMesh without dim names cannot be read. {mapping_text()}"
        )
    dims = dense_dims(names, world_rank())
    raw = np.asarray(mesh.mesh.cpu().numpy())
    order = [i for a in DENSE_AXES for i in dims.get(a, ())]
    shape = [int(np.prod([raw.shape[i] for i in dims.get(a, ())], dtype=np.int64)) for a in DENSE_AXES]
    return names, raw, np.transpose(raw, order).reshape(shape)


def _mesh_dim_groups(
    mesh: Any, raw: np.ndarray, names: Sequence[str], timeout: Any
) -> dict[tuple[tuple[int, ...], ...], ProcessGroup | None]:
    """The mesh dims' own groups that meshgrad can use, by their canonical rows.

    A mesh dim's group (torch makes it with its 30-minute default) is used only when its
    timeout is the default group's (``timeout``); otherwise meshgrad makes its own, so
    that a stalled peer fails every collective in time.

    Args:
      mesh: the DeviceMesh.
      raw: its rank grid, as laid out.
      names: its dim names.
      timeout: the default group's timeout, or None when unknown.

    Returns:
      ``{canonical rows: process group}`` for the dims of size > 1 that qualify.
    """
    out: dict[tuple[tuple[int, ...], ...], ProcessGroup | None] = {}
    for name in names:
        rows = _rows(raw, names, (name,))
        if len(rows[0]) > 1:
            pg = mesh.get_group(name)
            if timeout is None or timeout_of(pg) in (None, timeout):
                out[_canon(rows)] = pg
    return out


def _layout_rows(
    grid: np.ndarray, dims: ParallelDims, embd: tuple[int, ...], pos: tuple[int, ...]
) -> dict[Group, list[tuple[int, ...]]]:
    """Every instance of every group of a layout, in the order the groups are created.

    Args:
      grid: the rank grid over the dense axes.
      dims: the layout's ParallelDims (its expert factoring).
      embd: the embedding stages.
      pos: the position embedding stages.

    Returns:
      Per group, its instances as rows of global ranks (EMBD / POS_EMBD: one per pp row).
    """
    expert_grid = grid.reshape(dims.expert_shape())
    out: dict[Group, list[tuple[int, ...]]] = {}
    for group in Group:
        if group in STAGE_GROUPS:
            continue
        axes = GROUP_AXES[group]
        expert = any(a in EXPERT_AXES and a is not Axis.PP for a in axes)
        out[group] = _rows(expert_grid, EXPERT_AXES, axes) if expert else _rows(grid, DENSE_AXES, axes)
    for group, chosen in ((Group.EMBD, embd), (Group.POS_EMBD, pos)):
        out[group] = [tuple(row[s] for s in chosen) for row in _rows(grid, DENSE_AXES, (Axis.PP,))]
    return out


class MeshGroups:
    """Process groups of a torch ``DeviceMesh`` with meshgrad dim names, built once.

    The mesh's dims must be named after dense axes (``pp``, ``dp``, ``cp``, ``gtp``,
    ``tp``) or torchtitan's (``dp_replicate`` x ``dp_shard`` make up ``dp``:
    :mod:`torch_impl.sources.mesh_names`); absent ones have size 1. Expert groups come from the same ranks in the expert
    order (``pp, edp, egtp, ep, etp``). Groups that span several mesh dims, expert groups
    and the embedding subset groups are created with ``dist.new_group`` the first time a
    layout asks for them (call :meth:`resolve` collectively) and cached on this object,
    after the ranks agree on the layout over the default group; they get the default
    group's timeout (``init_process_group(timeout=)``), not torch's 30-minute default.

    Args:
      mesh: the DeviceMesh.

    Raises:
      ValueError: a dim name meshgrad does not read, or a repeated one (with the mapping).
    """

    def __init__(self, mesh: Any) -> None:
        names, raw, self.grid = _dense_grid(mesh)
        self._mesh = weakref.ref(mesh)
        self.rank = world_rank()
        self.timeout = self.default_timeout()
        self._by_rows: dict[tuple[tuple[int, ...], ...], ProcessGroup | None] = _mesh_dim_groups(
            mesh, raw, names, self.timeout
        )
        self._resolved: dict[tuple[Any, ...], TorchGroups] = {}
        self._last_key: tuple[Any, ...] | None = None  # the layout the last call used

    @property
    def mesh(self) -> Any:
        """The DeviceMesh, held weakly (None once collected)."""
        return self._mesh()

    def dims(self, *, ep: int = 1, etp: int | None = None, egtp: int = 1) -> ParallelDims:
        """The ParallelDims of this mesh with the given expert factoring."""
        pp, dp, cp, gtp, tp = self.grid.shape
        return ParallelDims(pp=pp, dp=dp, cp=cp, gtp=gtp, tp=tp, ep=ep, etp=etp, egtp=egtp)

    def resolve(
        self,
        *,
        ep: int = 1,
        etp: int | None = None,
        egtp: int = 1,
        embedding_stages: Sequence[int] | None = None,
        position_embedding_stages: Sequence[int] | None = None,
    ) -> TorchGroups:
        """This rank's :class:`TorchGroups` for an expert factoring and embedding stages.

        Collective on first use of a layout: the ranks agree on it in the status round
        over the world (:meth:`layout_round`; a rank whose layout is invalid takes part
        with its error), then create its groups; cached afterwards.

        Raises:
          ValueError: the expert sizes do not factor the mesh, a stage is out of range,
            or the ranks ask for different layouts (on every rank, naming them).
        """
        try:
            dims = self.dims(ep=ep, etp=etp, egtp=egtp)
            embd = stage_set(embedding_stages, dims.pp, "first_last")
            pos = stage_set(position_embedding_stages, dims.pp, "first")
        except ValueError as err:
            error = AgreedInputError(f"rank {self.rank}: DeviceMesh {tuple(self.grid.shape)}: {err}")
            self.join_failure(error)
            raise error from None
        key = (dims.ep, dims.etp, dims.egtp, embd, pos)
        if key not in self._resolved or key != self._last_key:  # met for the first time, or switched to
            self.layout_round(key)
            if key not in self._resolved:
                self._resolved[key] = self._build(dims, embd, pos, key)
            self._last_key = key
        return self._resolved[key]

    def last_resolved(self) -> TorchGroups | None:
        """The groups of the layout the last :meth:`resolve` used: what it gives again for
        that layout without a round (None before the first)."""
        return self._resolved.get(self._last_key)  # type: ignore[arg-type]

    @staticmethod
    def default_timeout() -> Any:
        """The default process group's timeout (a timedelta), or None when unknown."""
        try:
            return timeout_of(dist.distributed_c10d._get_default_group())
        except Exception:  # not initialized, or a torch without these internals
            return None

    @staticmethod
    def describe(key: tuple[Any, ...]) -> str:
        """A layout key in words."""
        return (f"ep={key[0]}, etp={key[1]}, egtp={key[2]}, embedding stages {list(key[3])}, "
                f"position embedding stages {list(key[4])}")

    def layout_round(self, key: tuple[Any, ...]) -> None:
        """The status round (over the world) for a layout met for the first time: the same
        kind of round as every call's status round, so a rank meeting a new layout while
        its peers check a cached one (or another layout) makes every rank raise.

        Raises:
          FinalizeInputError: the ranks ask for different layouts (naming them).
          ConsistencyError: another rank failed before this round.
          CollectiveError: the round timed out (a peer may not have entered finalize).
        """
        if world_size() <= 1:
            return
        route = world_route()
        reduced, _ = reduce_status(status_vector(layout_round=True), route, self.rank, "DeviceMesh group layout agreement")
        settle(reduced, route, self.rank, "DeviceMesh group layout agreement", layout=layout_digest(key),
               layout_text=self.describe(key))

    def join_failure(self, error: BaseException) -> None:
        """For a rank that failed before resolving its layout: take part in the peers'
        round (a layout round, or the status round of a call) with ``error`` flagged;
        returns so that the caller raises ``error``."""
        if world_size() > 1:
            share_error(error, world_route(), self.rank, "finalize status check")

    def _build(
        self, dims: ParallelDims, embd: tuple[int, ...], pos: tuple[int, ...], key: tuple[Any, ...]
    ) -> TorchGroups:
        pp_row = next((r for r in _rows(self.grid, DENSE_AXES, (Axis.PP,)) if self.rank in r), None)
        if pp_row is None:
            raise FinalizeInputError(f"rank {self.rank} is not part of the DeviceMesh {self.grid.tolist()}")
        groups: dict[Group, ProcessGroup | None] = {}
        sizes: dict[Group, int] = {}
        stages: dict[Group, tuple[int, ...] | None] = {}
        for group, rows in _layout_rows(self.grid, dims, embd, pos).items():
            groups[group], sizes[group] = self._group(rows, group.value), len(rows[0])
            if group in STAGE_GROUPS:
                member = any(self.rank in row for row in rows)
                sizes[group] = sizes[group] if member else 1
                stages[group] = (embd if group is Group.EMBD else pos) if member else None
        return TorchGroups(
            rank=self.rank,
            groups=groups,
            sizes=sizes,
            pp_ranks=pp_row,
            stages=stages,
            source=f"DeviceMesh {dict(zip([a.value for a in DENSE_AXES], self.grid.shape))}",
            layout=layout_digest(key),
            layout_text=self.describe(key),
        )

    def _group(self, rows: list[tuple[int, ...]], desc: str) -> ProcessGroup | None:
        """This rank's group among ``rows`` (None when size 1 or not a member)."""
        if len(rows[0]) <= 1:
            return None
        key = _canon(rows)
        if key not in self._by_rows:
            mine = None
            for row in rows:  # every rank creates every instance, in the same order
                pg = dist.new_group(sorted(row), timeout=self.timeout, group_desc=f"meshgrad_{desc}")
                if self.rank in row:
                    mine = pg
            self._by_rows[key] = mine
        return self._by_rows[key]


def _canon(rows: Iterable[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(sorted(tuple(sorted(r)) for r in rows))


#: The MeshGroups of each live DeviceMesh, by identity: every model and call given one mesh
#: shares its process groups (a model rebuilt over the same mesh creates none). An entry
#: goes when its mesh is collected; nothing is written on the mesh.
_BY_MESH: dict[int, MeshGroups] = {}


def mesh_groups(mesh: Any) -> MeshGroups:
    """The :class:`MeshGroups` of a DeviceMesh: one per live mesh, shared by every caller
    (a MeshGroups is returned as it is).

    Raises:
      ValueError: a dim name meshgrad does not read, or a repeated one (with the mapping).
    """
    hit = live_mesh_groups(mesh)
    if hit is None:
        hit = _BY_MESH[id(mesh)] = MeshGroups(mesh)
        weakref.finalize(mesh, _BY_MESH.pop, id(mesh), None)
    return hit


def live_mesh_groups(mesh: Any) -> MeshGroups | None:
    """The :class:`MeshGroups` :func:`mesh_groups` gives for ``mesh`` where it holds one
    already (a MeshGroups is returned as it is), else None: nothing is built, no process
    group is created."""
    if isinstance(mesh, MeshGroups):
        return mesh
    hit = _BY_MESH.get(id(mesh))
    return hit if hit is not None and hit.mesh is mesh else None


def is_device_mesh(obj: Any) -> bool:
    """Whether ``obj`` is a torch DeviceMesh (no import: none exists before the module is)."""
    module = sys.modules.get("torch.distributed.device_mesh")
    return module is not None and isinstance(obj, getattr(module, "DeviceMesh", ()))
