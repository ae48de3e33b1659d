"""Named groups as jax collectives over mesh axes (the counterpart of torch_impl.run.groups).

:class:`Collectives` sums per-rank values over a meshgrad :class:`~meshgrad.axes.Group`
inside a ``jax.shard_map`` over one mesh view; :func:`view_for` picks the view that binds
every axis a set of groups communicates over.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshgrad.axes import DENSE_AXES, GROUP_AXES, Axis, Group, ParallelDims
from meshgrad.errors import FinalizeInputError

from jax_impl.mesh import VIEWS

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Collectives:
    """Group sums for per-rank values inside a ``shard_map`` over one mesh view.

    Args:
      dims: the parallel dimensions.
      view: the axes bound by the enclosing ``shard_map`` (DENSE_AXES or EXPERT_AXES).
    """

    dims: ParallelDims
    view: tuple[Axis, ...] = DENSE_AXES

    def axes(self, group: Group) -> tuple[str, ...]:
        """The group's axes of size > 1 (size-1 axes need no communication)."""
        return tuple(a.value for a in GROUP_AXES[group] if self.dims.size(a) > 1)

    def size(self, group: Group) -> int:
        """The group's size."""
        return self.dims.group_size(group)

    def stage(self) -> Array:
        """This rank's pp stage."""
        return lax.axis_index(Axis.PP.value) if self.dims.pp > 1 else jnp.zeros((), jnp.int32)

    def sum(self, x: Any, group: Group) -> Any:
        """SUM of ``x`` (an array or a list of arrays: one collective) over ``group``.

        A group whose axes are not all in the view (an expert group on the dense view) is
        summed by gathering over the view's inner axes and masking to the group.
        """
        axes = self.axes(group)
        if not axes:
            return x
        if self.in_view(group):
            return lax.psum(x, axes)
        return jax.tree.map(lambda leaf: self._masked_sum(leaf, group), x)

    def in_view(self, group: Group) -> bool:
        """Whether every communicating axis of ``group`` is bound by this view."""
        return {Axis(a) for a in self.axes(group)} <= set(self.view)

    def member_index(self, group: Group) -> Array:
        """This rank's index in its ``group`` (members ordered by global rank)."""
        rank = jnp.zeros((), jnp.int32)
        for axis in self.view:
            rank = rank * self.dims.size(axis) + lax.axis_index(axis.value)
        table = np.zeros(self.dims.world_size, dtype=np.int32)
        for r in range(self.dims.world_size):
            table[r] = self.dims.group_ranks(group, r).index(r)
        return jnp.asarray(table)[rank]

    def _masked_sum(self, x: Array, group: Group) -> Array:
        if Axis.PP in GROUP_AXES[group]:
            raise FinalizeInputError(f"group {group} varies pp and is not on the {self.view} view")
        inner_axes = tuple(a.value for a in self.view if a is not Axis.PP and self.dims.size(a) > 1)
        inner = self.dims.world_size // self.dims.pp
        member = np.zeros((inner, inner), dtype=bool)
        for i in range(inner):  # ranks of stage 0; every stage has the same pattern
            member[i, self.dims.group_ranks(group, i)] = True
        index = jnp.zeros((), jnp.int32)
        for name in inner_axes:
            index = index * self.dims.size(Axis(name)) + lax.axis_index(name)
        gathered = lax.all_gather(x, inner_axes)
        row = jnp.asarray(member)[index].reshape((inner,) + (1,) * x.ndim)
        return jnp.sum(jnp.where(row, gathered, jnp.zeros((), x.dtype)), axis=0).astype(x.dtype)


def view_for(groups: Iterable[Group], dims: ParallelDims, what: str) -> str | None:
    """The mesh view ("dense" or "expert") binding every communicating axis of ``groups``.

    Args:
      groups: the groups one action communicates over.
      dims: the parallel dimensions.
      what: the action, for the error.

    Returns:
      The view's name, or None when either view fits.

    Raises:
      FinalizeInputError: the groups mix dense-only and expert-only axes.
    """
    axes = {a for g in groups for a in GROUP_AXES[g] if dims.size(a) > 1}
    fits = [name for name, view in VIEWS.items() if axes <= set(view)]
    if not fits:
        raise FinalizeInputError(f"{what} mixes dense and expert axes {sorted(axes)}")
    return None if len(fits) == len(VIEWS) else fits[0]


__all__ = ["Collectives", "view_for"]
