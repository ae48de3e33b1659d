"""jax Meshes with meshgrad's axis names and rank order (device r = rank r).

The dense view is ``Mesh(devices.reshape(pp, dp, cp, gtp, tp), ("pp", "dp", "cp", "gtp",
"tp"))`` and the expert view ``Mesh(devices.reshape(pp, edp, egtp, ep, etp), ("pp", "edp",
"egtp", "ep", "etp"))`` over the same devices in the same order. Per-rank values stacked
along one leading world dimension of size W are sharded over either view by the same
PartitionSpec entry (all the view's axes on dim 0), so switching views moves no data.

This module imports jax lazily so that :func:`ensure_host_devices` can run before jax is
first imported (the XLA flag is read when jax initialises its CPU backend).
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import types
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from meshgrad.axes import DENSE_AXES, EXPERT_AXES, Axis, ParallelDims
from meshgrad.errors import FinalizeInputError

if TYPE_CHECKING:  # pragma: no cover
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

_COUNT_FLAG = "--xla_force_host_platform_device_count"

#: Axis names of the two views, slowest to fastest varying.
DENSE_NAMES: tuple[str, ...] = tuple(a.value for a in DENSE_AXES)
EXPERT_NAMES: tuple[str, ...] = tuple(a.value for a in EXPERT_AXES)
VIEWS: Mapping[str, tuple[Axis, ...]] = types.MappingProxyType({"dense": DENSE_AXES, "expert": EXPERT_AXES})


def ensure_host_devices(n: int) -> None:
    """Make at least ``n`` (fake) CPU devices available to jax.

    Before jax is imported this sets ``XLA_FLAGS=--xla_force_host_platform_device_count``
    (raising a smaller count already there, keeping other flags). Once jax is imported it
    tries ``jax_num_cpu_devices`` and then checks that enough CPU devices exist.

    Args:
      n: the number of CPU devices needed.

    Raises:
      FinalizeInputError: jax was initialised with fewer than ``n`` CPU devices.
    """
    if n < 1:
        raise FinalizeInputError(f"ensure_host_devices: n must be >= 1, got {n}")
    flags = os.environ.get("XLA_FLAGS", "")
    match = re.search(rf"{_COUNT_FLAG}=(\d+)", flags)
    count = n if match is None else max(n, int(match.group(1)))
    if match is None or int(match.group(1)) < n:
        flags = re.sub(rf"\s*{_COUNT_FLAG}=\d+", "", flags).strip()
        os.environ["XLA_FLAGS"] = f"{flags} {_COUNT_FLAG}={n}".strip()
    if "jax" not in sys.modules:
        return
    import jax

    try:  # works until jax initialises its backends
        if jax.config.jax_num_cpu_devices < n:
            jax.config.update("jax_num_cpu_devices", count)
    except (RuntimeError, AttributeError):  # backends already initialised / older jax
        pass
    found = len(jax.devices("cpu"))
    if found < n:
        raise FinalizeInputError(
            f"jax has {found} CPU device(s) but {n} are needed: jax was initialised before "
            f"ensure_host_devices({n}) ran. Set XLA_FLAGS={_COUNT_FLAG}={n} before jax is "
            "first imported (e.g. at the top of conftest.py)."
        )


def default_devices(world: int) -> list[Any]:
    """The first ``world`` devices: the default backend's, else the CPU's.

    Raises:
      FinalizeInputError (a ValueError): fewer than ``world`` devices on both.
    """
    import jax

    devices = jax.devices()
    if len(devices) < world:
        devices = jax.devices("cpu")
    if len(devices) < world:
        raise FinalizeInputError(
            f"{world} devices needed, {len(devices)} available; call "
            f"jax_impl.mesh.ensure_host_devices({world}) before jax is imported"
        )
    return list(devices[:world])


@dataclasses.dataclass(frozen=True)
class MeshViews:
    """The dense and expert Meshes over the same devices in rank order.

    Args:
      dims: the parallel dimensions.
      dense: Mesh with axes ``pp, dp, cp, gtp, tp``.
      expert: Mesh with axes ``pp, edp, egtp, ep, etp``.
    """

    dims: ParallelDims
    dense: "Mesh"
    expert: "Mesh"

    def mesh(self, view: str) -> "Mesh":
        """The Mesh of ``view`` ("dense" or "expert")."""
        if view not in VIEWS:
            raise FinalizeInputError(f"unknown mesh view {view!r}; expected one of {sorted(VIEWS)}")
        return self.dense if view == "dense" else self.expert

    def rank_spec(self, view: str = "dense") -> "PartitionSpec":
        """PartitionSpec sharding a leading world dim (rank order) over every axis of ``view``."""
        from jax.sharding import PartitionSpec

        return PartitionSpec(tuple(self.mesh(view).axis_names))

    def rank_sharding(self, view: str = "dense") -> "NamedSharding":
        """NamedSharding placing row r of a [W, ...] array on device r."""
        from jax.sharding import NamedSharding

        return NamedSharding(self.mesh(view), self.rank_spec(view))


def make_meshes(dims: ParallelDims, devices: Sequence[Any] | None = None) -> MeshViews:
    """Build both views of ``dims`` over ``devices`` (default: the first W devices).

    Args:
      dims: the parallel dimensions.
      devices: W devices in rank order (device r holds rank r).

    Returns:
      The two Meshes.

    Raises:
      FinalizeInputError (a ValueError): the number of devices is not the world size.
    """
    import numpy as np
    from jax.sharding import Mesh

    world = dims.world_size
    devices = default_devices(world) if devices is None else list(devices)
    if len(devices) != world:
        raise FinalizeInputError(f"{len(devices)} devices given for a world of {world} ranks ({dims})")
    flat = np.empty(world, dtype=object)
    flat[:] = devices
    dense = Mesh(flat.reshape(dims.dense_shape()), DENSE_NAMES)
    expert = Mesh(flat.reshape(dims.expert_shape()), EXPERT_NAMES)
    return MeshViews(dims, dense, expert)
