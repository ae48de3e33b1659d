"""Pure, jittable finalization: (grads, routers, num_tokens) -> (grads, routers).

:func:`finalize` executes a :class:`meshgrad.FinalizePlan` either on one rank's local
values (inside a user's ``shard_map`` over the dense mesh) or on per-rank values stacked
along leading world / mesh dimensions (it then runs its own ``shard_map`` calls).
:func:`finalize_stacked` plans, places and runs in one call, reusing one compiled program
per (plan, shapes) through ``jax.jit``'s cache.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from meshgrad.axes import DENSE_AXES, ParallelDims
from meshgrad.config import FinalizeConfig
from meshgrad.params import ParamKey, ParamSpec, RouterSpec
from meshgrad.plan import Action, FinalizePlan, plan_finalize

from jax_impl.checks import check_inputs, check_keys, check_plan, check_present, check_stacked, leading_dims
from jax_impl.execute import LocalState, execute_local, execute_stacked, merge, select
from jax_impl.groups import Collectives
from jax_impl.mesh import make_meshes

Array = jax.Array
Grads = dict[ParamKey, Array]
RouterStates = dict[ParamKey, dict[str, Array]]


def _to_world(x: Any, leading: tuple[int, ...], world: int) -> Array:
    """``x`` with its leading dims folded into one world dim."""
    return jnp.reshape(x, (world,) + tuple(jnp.shape(x)[len(leading):]))


def _from_world(tree: Any, leading: tuple[int, ...]) -> Any:
    """Every leaf of ``tree`` with its world dim unfolded into ``leading``."""
    return jax.tree.map(lambda x: jnp.reshape(x, leading + tuple(jnp.shape(x)[1:])), tree)


def _finalize_stacked_mode(
    actions: tuple[Action, ...],
    grads: Mapping[ParamKey, Array],
    routers: Mapping[ParamKey, Mapping[str, Array]],
    num_tokens: Array | None,
    leading: tuple[int, ...],
    dims: ParallelDims,
    devices: Sequence[Any] | None,
) -> tuple[Grads, RouterStates]:
    """Run ``actions`` on stacked inputs with its own ``shard_map`` calls."""
    check_stacked(leading, dims)
    world = dims.world_size
    flat = lambda x: _to_world(x, leading, world)  # noqa: E731
    out_grads, out_routers = execute_stacked(
        actions,
        jax.tree.map(flat, dict(grads)),
        jax.tree.map(flat, {k: dict(v) for k, v in routers.items()}),
        None if num_tokens is None else flat(num_tokens),
        make_meshes(dims, devices),
    )
    return _from_world(out_grads, leading), _from_world(out_routers, leading)


def finalize(
    grads: Mapping[ParamKey, Array],
    routers: Mapping[ParamKey, Mapping[str, Array]] | None = None,
    num_tokens: Array | None = None,
    *,
    plan: FinalizePlan,
    dims: ParallelDims,
    devices: Sequence[Any] | None = None,
) -> tuple[dict[ParamKey, Array], dict[ParamKey, dict[str, Array]]]:
    """Finalize gradients as planned (docs/semantics.md). Pure and jittable.

    Local mode (arrays have exactly their ParamSpec shapes): call inside a
    ``jax.shard_map`` over the dense mesh (axes pp, dp, cp, gtp, tp); expert groups are
    summed by a gather over the inner axes. Stacked mode (arrays have leading dims
    ``[W]``, the dense mesh shape or the expert mesh shape, in rank order): runs its own
    ``shard_map`` calls over the two views built from ``devices``.

    Args:
      grads: (chunk, name) -> gradient, for every planned key with a gradient.
      routers: (chunk, name) -> {field: array} router buffers (fields named as in
        Megatron: local_tokens_per_expert, expert_bias, qb_beta, qb_beta_accum,
        qb_beta_count; optional aux_loss_tracker).
      num_tokens: this rank's token count (or stacked counts); None skips step 11.
      plan: from ``meshgrad.plan_finalize`` for these dims.
      dims: the parallel dimensions.
      devices: stacked mode: W devices in rank order (default: the first W).

    Returns:
      (grads, routers) in the same layout; untouched entries are returned as given.

    Raises:
      PlanMismatchError, FinalizeInputError (ValueErrors): plan / dims / shape mismatch;
      NonFiniteGradError (a ValueError): NaN / Inf with check_for_nan_in_grad (concrete
      inputs); FinalizeTypeError (a TypeError): a non-floating gradient, non-integer
      num_tokens or a key that is not (chunk, name); MissingInputError (a KeyError): a
      planned entry is missing. All from :mod:`meshgrad.errors`.
    """
    check_plan(plan, dims)
    routers = {} if routers is None else routers
    check_keys(grads, routers)
    actions = plan.actions_with(num_tokens is not None)
    leading = leading_dims(plan, grads, routers, num_tokens)
    check_inputs(plan, grads, num_tokens, leading)
    if leading:
        return _finalize_stacked_mode(actions, grads, routers, num_tokens, leading, dims, devices)
    state = LocalState(dict(grads), {k: dict(v) for k, v in routers.items()}, num_tokens)
    state = execute_local(actions, state, Collectives(dims, DENSE_AXES))
    return state.grads, state.routers


@dataclasses.dataclass(frozen=True)
class Program:
    """Everything a compiled finalize depends on besides the arrays (a jit static arg).

    Args:
      actions: the planned actions (token scaling included when num_tokens is given).
      dims: the parallel dimensions.
      devices: the W devices, in rank order.
    """

    actions: tuple[Action, ...]
    dims: ParallelDims
    devices: tuple[Any, ...]


def run_stacked(program: Program, grads: Any, routers: Any, num_tokens: Any) -> tuple[Any, Any]:
    """Trace ``program`` on stacked [W, ...] arrays (the body of the jitted function)."""
    return execute_stacked(program.actions, grads, routers, num_tokens, make_meshes(program.dims, program.devices))


def _program_body(grads: Any, routers: Any, num_tokens: Any, *, program: Program) -> tuple[Any, Any]:
    return run_stacked(program, grads, routers, num_tokens)


# jax.jit's own cache holds one executable per (program, input shapes / dtypes).
_program_jit = jax.jit(_program_body, static_argnames=("program",))


def _placed(x: Any, leading: tuple[int, ...], world: int, sharding: Any) -> Array:
    """``x`` as a jax array with one world dim, row r on device r."""
    x = jnp.asarray(x) if not isinstance(x, jax.Array) else x
    x = _to_world(x, leading, world) if leading != (world,) else x
    return jax.device_put(x, sharding)


def _run_program(
    actions: tuple[Action, ...],
    grads: Mapping[ParamKey, Any],
    routers: Mapping[ParamKey, Mapping[str, Any]],
    num_tokens: Any,
    leading: tuple[int, ...],
    dims: ParallelDims,
    devices: Sequence[Any] | None,
) -> tuple[Grads, RouterStates]:
    """Place the entries ``actions`` use and run them as one compiled program."""
    world = dims.world_size
    used_grads, used_routers, uses_tokens = select(grads, routers, actions)
    meshes = make_meshes(dims, devices)
    put = lambda x: _placed(x, leading, world, meshes.rank_sharding("dense"))  # noqa: E731
    program = Program(actions, dims, tuple(meshes.dense.devices.flat))
    tokens = put(num_tokens) if uses_tokens else None
    out_grads, out_routers = _program_jit(
        jax.tree.map(put, used_grads), jax.tree.map(put, used_routers), tokens, program=program
    )
    if leading != (world,):
        out_grads, out_routers = _from_world(out_grads, leading), _from_world(out_routers, leading)
    return out_grads, out_routers


def finalize_stacked(
    grads_stacked: Mapping[ParamKey, Any],
    routers_stacked: Mapping[ParamKey, Mapping[str, Any]] | None,
    num_tokens_stacked: Any | None,
    *,
    params: Sequence[ParamSpec],
    routers: Sequence[RouterSpec] = (),
    config: FinalizeConfig,
    dims: ParallelDims,
    devices: Sequence[Any] | None = None,
    force_all_reduce: bool = False,
) -> tuple[dict[ParamKey, Array], dict[ParamKey, dict[str, Array]]]:
    """Plan once, then finalize per-rank inputs stacked along leading world / mesh dims.

    Repeated calls with the same plan and shapes reuse one compiled program.

    Args:
      grads_stacked: (chunk, name) -> [W, *shape] (or leading dense / expert mesh dims),
        numpy or jax arrays, for every param with ``has_grad``.
      routers_stacked: (chunk, name) -> {field: [W, ...]}.
      num_tokens_stacked: [W] per-rank token counts, or None.
      params, routers, config: planned with ``meshgrad.plan_finalize``.
      dims: the parallel dimensions.
      devices: W devices in rank order (default: the first W).
      force_all_reduce: all-reduce even under a distributed optimizer (docs/semantics.md,
        "DP sync").

    Returns:
      (grads, routers) with the inputs' leading dims: what the plan touches as new jax
      arrays, every other entry as given.

    Raises:
      The :mod:`meshgrad.errors` types of :func:`finalize`, before anything runs.
    """
    routers_stacked = {} if routers_stacked is None else routers_stacked
    check_keys(grads_stacked, routers_stacked)
    plan = plan_finalize(params, config, dims, routers, force_all_reduce=force_all_reduce)
    actions = plan.actions_with(num_tokens_stacked is not None)
    leading = leading_dims(plan, grads_stacked, routers_stacked, num_tokens_stacked)
    leading = (dims.world_size,) if leading is None else leading
    check_stacked(leading, dims)
    check_present(plan, grads_stacked)
    check_inputs(plan, grads_stacked, num_tokens_stacked, leading)
    out_grads, out_routers = _run_program(
        actions, grads_stacked, routers_stacked, num_tokens_stacked, leading, dims, devices
    )
    return {**grads_stacked, **out_grads}, merge(routers_stacked, out_routers)


__all__ = ["Program", "finalize", "finalize_stacked", "run_stacked"]

