"""jax_impl.mesh: both views put rank r on device r; fake host devices."""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest

from meshgrad.errors import FinalizeInputError

from jax_impl.mesh import DENSE_NAMES, EXPERT_NAMES, ensure_host_devices, make_meshes
from meshgrad import DENSE_AXES, EXPERT_AXES, ParallelDims


@pytest.mark.parametrize(
    "dims",
    [ParallelDims(pp=2, dp=2, tp=2), ParallelDims(dp=2, gtp=2, tp=2, egtp=2, ep=2, etp=1), ParallelDims(dp=4, tp=2, ep=2, etp=2)],
)
def test_views_follow_meshgrad_rank_order(dims):
    devices = jax.devices("cpu")[: dims.world_size]
    meshes = make_meshes(dims, devices)
    assert meshes.dense.axis_names == DENSE_NAMES == ("pp", "dp", "cp", "gtp", "tp")
    assert meshes.expert.axis_names == EXPERT_NAMES == ("pp", "edp", "egtp", "ep", "etp")
    for view, axes in ((meshes.dense, DENSE_AXES), (meshes.expert, EXPERT_AXES)):
        for point in itertools.product(*(range(n) for n in view.devices.shape)):
            rank = dims.rank_of(dict(zip(axes, point)), expert=axes is EXPERT_AXES)
            assert view.devices[point] == devices[rank]


def test_rank_sharding_puts_row_r_on_device_r():
    dims = ParallelDims(pp=2, dp=2, tp=2)
    meshes = make_meshes(dims)
    for view in ("dense", "expert"):
        x = jax.device_put(np.arange(8.0)[:, None], meshes.rank_sharding(view))
        for shard in x.addressable_shards:
            assert float(shard.data[0, 0]) == shard.device.id - meshes.dense.devices.flat[0].id


def test_errors():
    with pytest.raises(ValueError, match="devices given"):
        make_meshes(ParallelDims(dp=4), jax.devices("cpu")[:2])
    with pytest.raises(ValueError, match="unknown mesh view"):
        make_meshes(ParallelDims()).mesh("moe")
    with pytest.raises(ValueError):
        ensure_host_devices(0)


def test_ensure_host_devices_after_import(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_foo=1")
    ensure_host_devices(8)  # enough devices already: no error
    with pytest.raises(FinalizeInputError, match="before jax is"):
        ensure_host_devices(4096)
    import os

    assert "--xla_foo=1" in os.environ["XLA_FLAGS"]
    assert "--xla_force_host_platform_device_count=4096" in os.environ["XLA_FLAGS"]
