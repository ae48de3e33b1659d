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
import numpy as np

from meshgrad.axes import DENSE_AXES, Group, ParallelDims
from meshgrad.config import FinalizeConfig
from meshgrad.params import ParamKey, ParamSpec, RouterSpec
from meshgrad.plan import Action, FinalizePlan, plan_finalize

from jax_impl.execute import (
    Collectives,
    LocalState,
    action_groups,
    execute_local,
    execute_stacked,
    merge,
    select,
)
from jax_impl.mesh import make_meshes

Array = jax.Array


def plan_actions(plan: FinalizePlan, with_tokens: bool) -> tuple[Action, ...]:
    """The plan's actions, plus its token scaling when num_tokens is given."""
    return plan.actions + ((plan.token_scale,) if with_tokens else ())


def check_plan(plan: FinalizePlan, dims: ParallelDims) -> None:
    """Raise ValueError when ``plan`` was made for other group sizes than ``dims``.

    Only the groups the plan communicates over (and pp) are compared.
    """
    used = {Group.PP} | {g for a in plan_actions(plan, True) for g in action_groups(a)}
    for group in sorted(used - {Group.EMBD, Group.POS_EMBD}, key=lambda g: g.value):
        if plan.sizes[group] != dims.group_size(group):
            raise ValueError(
                f"plan was made for {group} of size {plan.sizes[group]}, "
                f"but the mesh has {dims.group_size(group)} ({dims}); plan again with "
                "meshgrad.plan_finalize(specs, config, dims) for these dims"
            )
    for stages in (plan.sizes.embd_stages, plan.sizes.pos_embd_stages):
        if any(not 0 <= s < dims.pp for s in stages):
            raise ValueError(
                f"plan embedding stages {stages} outside pp = {dims.pp}; set "
                "FinalizeConfig.embedding_stages / position_embedding_stages within range(pp)"
            )


def check_keys(grads: Mapping[Any, Any], routers: Mapping[Any, Any]) -> None:
    """Raise TypeError unless every key of ``grads`` and ``routers`` is ``(chunk, name)``.

    Args:
      grads: gradients by key.
      routers: router buffers by key.

    Raises:
      TypeError: a key that is not a ``(int chunk, str name)`` tuple, e.g. a bare
        parameter name; the message shows the key to use instead.
    """
    for what, mapping in (("gradient", grads), ("router", routers)):
        for key in mapping:
            ok = (
                isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], int)
                and not isinstance(key[0], bool) and isinstance(key[1], str)
            )
            if not ok:
                hint = f" (use (0, {key!r}) for chunk 0)" if isinstance(key, str) else ""
                raise TypeError(
                    f"{what} key {key!r} is not (chunk, name): key {what}s by a tuple of the "
                    f"chunk index and the parameter name, as ParamSpec.key does{hint}"
                )


def _leading(plan: FinalizePlan, grads: Mapping[ParamKey, Array], routers: Mapping[ParamKey, Any],
             num_tokens: Any) -> tuple[int, ...] | None:
    """Leading (stacking) dims of the inputs, checked consistent; None if there are no inputs."""
    shapes = {s.key: s.shape for s in plan.params}
    experts = {r.key: r.num_experts for r in plan.routers}
    found: dict[tuple[int, ...], str] = {}
    for key, value in grads.items():
        if key not in shapes:
            raise ValueError(
                f"gradient {key[1]!r} (chunk {key[0]}) is not in the plan; add a ParamSpec for it "
                "to plan_finalize, or leave it out of grads"
            )
        base = shapes[key]
        shape = tuple(jnp.shape(value))
        if len(shape) < len(base) or shape[len(shape) - len(base):] != base:
            raise ValueError(f"gradient {key[1]!r} (chunk {key[0]}): shape {shape} does not end in {base}")
        found.setdefault(shape[: len(shape) - len(base)], f"gradient {key}")
    for key, state in routers.items():
        if key in experts and "expert_bias" in state:
            shape = tuple(jnp.shape(state["expert_bias"]))
            found.setdefault(shape[:-1], f"router {key}")
    if num_tokens is not None:
        found.setdefault(tuple(jnp.shape(num_tokens)), "num_tokens")
    if len(found) > 1:
        raise ValueError(
            f"inputs disagree on their leading (rank) dims: {found}; stack every gradient, router "
            "buffer and num_tokens along the same leading dims ([W] or a mesh shape)"
        )
    return next(iter(found), None)


def check_inputs(
    plan: FinalizePlan,
    grads: Mapping[ParamKey, Any],
    num_tokens: Any,
    leading: tuple[int, ...] | None,
) -> None:
    """Dtypes always; NaN / Inf with ``config.check_for_nan_in_grad`` (concrete inputs:
    a traced value, under ``jax.jit``, cannot be inspected -- use ``jax_debug_nans``).

    Raises:
      TypeError: a gradient that is not floating point, or num_tokens that is not integer.
      ValueError: NaN / Inf in a gradient, naming the parameter and the first rank (the
        index along the flattened leading dims) that holds it.
    """
    for key, value in grads.items():
        dtype = jnp.result_type(value)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(f"gradient {key[1]!r} (chunk {key[0]}) has dtype {dtype}, not a floating type")
    if num_tokens is not None and not jnp.issubdtype(jnp.result_type(num_tokens), jnp.integer):
        raise TypeError(f"num_tokens must hold integers, got dtype {jnp.result_type(num_tokens)}")
    if not plan.config.check_for_nan_in_grad:
        return
    width = int(np.prod(leading)) if leading else 1
    for spec in plan.params:
        value = grads.get(spec.key)
        if value is None or not spec.has_grad or isinstance(value, jax.core.Tracer):
            continue
        ok = np.asarray(jnp.isfinite(jnp.asarray(value)).reshape(width, -1).all(axis=1))
        if not ok.all():
            where = f"rank {int(np.argmin(ok))}: " if leading else ""
            raise ValueError(
                f"{where}NaN or Inf in the gradient of {spec.name!r} (chunk {spec.chunk}) "
                "(check_for_nan_in_grad); nothing was finalized"
            )


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
      ValueError: plan / dims / shape mismatch, or NaN / Inf with check_for_nan_in_grad
        (concrete inputs); TypeError: a non-floating gradient or non-integer num_tokens;
        KeyError: a planned entry is missing.
    """
    check_plan(plan, dims)
    routers = {} if routers is None else routers
    check_keys(grads, routers)
    actions = plan_actions(plan, num_tokens is not None)
    leading = _leading(plan, grads, routers, num_tokens)
    check_inputs(plan, grads, num_tokens, leading)
    if not leading:
        state = LocalState(dict(grads), {k: dict(v) for k, v in routers.items()}, num_tokens)
        state = execute_local(actions, state, Collectives(dims, DENSE_AXES))
        return state.grads, state.routers
    world = dims.world_size
    if leading not in ((world,), dims.dense_shape(), dims.expert_shape()):
        raise ValueError(
            f"stacked inputs have leading dims {leading}; expected ({world},), the dense "
            f"mesh shape {dims.dense_shape()} or the expert mesh shape {dims.expert_shape()}"
        )
    n = len(leading)
    flat = lambda x: jnp.reshape(x, (world,) + jnp.shape(x)[n:])  # noqa: E731
    back = lambda x: jnp.reshape(x, leading + jnp.shape(x)[1:])  # noqa: E731
    meshes = make_meshes(dims, devices)
    out_grads, out_routers = execute_stacked(
        actions,
        jax.tree.map(flat, dict(grads)),
        jax.tree.map(flat, {k: dict(v) for k, v in routers.items()}),
        None if num_tokens is None else flat(num_tokens),
        meshes,
    )
    return jax.tree.map(back, out_grads), jax.tree.map(back, out_routers)


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


def _to_world(x: Any, leading: tuple[int, ...], world: int, sharding: Any) -> Array:
    x = jnp.asarray(x) if not isinstance(x, jax.Array) else x
    x = jnp.reshape(x, (world,) + tuple(x.shape[len(leading):])) if leading != (world,) else x
    return jax.device_put(x, sharding)


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
      ValueError / KeyError: as :func:`finalize`, before anything runs.
    """
    routers_stacked = {} if routers_stacked is None else routers_stacked
    check_keys(grads_stacked, routers_stacked)
    plan = plan_finalize(params, config, dims, routers, force_all_reduce=force_all_reduce)
    actions = plan_actions(plan, num_tokens_stacked is not None)
    leading = _leading(plan, grads_stacked, routers_stacked, num_tokens_stacked)
    world = dims.world_size
    leading = (world,) if leading is None else leading
    if leading not in ((world,), dims.dense_shape(), dims.expert_shape()):
        raise ValueError(
            f"stacked inputs have leading dims {leading}, expected ({world},) or a mesh shape "
            f"({dims.dense_shape()} / {dims.expert_shape()}): stack one row per rank, in rank order"
        )
    for spec in plan.params:
        if spec.has_grad and spec.key not in grads_stacked:
            raise KeyError(
                f"gradient of {spec.name!r} (chunk {spec.chunk}) is missing: pass it under key "
                f"{spec.key!r}, or plan it with ParamSpec(..., has_grad=False)"
            )
    check_inputs(plan, grads_stacked, num_tokens_stacked, leading)
    grads, rstate, uses_tokens = select(grads_stacked, routers_stacked, actions)
    meshes = make_meshes(dims, devices)
    put = lambda x: _to_world(x, leading, world, meshes.rank_sharding("dense"))  # noqa: E731
    grads = jax.tree.map(put, grads)
    rstate = jax.tree.map(put, rstate)
    tokens = put(num_tokens_stacked) if uses_tokens else None
    program = Program(actions, dims, tuple(meshes.dense.devices.flat))
    out_grads, out_routers = _program_jit(grads, rstate, tokens, program=program)
    if leading != (world,):
        back = lambda x: jnp.reshape(x, leading + x.shape[1:])  # noqa: E731
        out_grads, out_routers = jax.tree.map(back, out_grads), jax.tree.map(back, out_routers)
    return {**grads_stacked, **out_grads}, merge(routers_stacked, out_routers)


__all__ = ["Program", "check_inputs", "check_keys", "check_plan", "finalize", "finalize_stacked", "plan_actions", "run_stacked"]

