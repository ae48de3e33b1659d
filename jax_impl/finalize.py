"""Pure, jittable finalization: (grads, routers, num_tokens) -> (grads, routers).

:func:`finalize` is the one entry: it takes the gradients as the user holds them (any
pytree: an ``nnx.State``, nested dicts, a list of per-chunk trees, or the
``(chunk, name)``-keyed dict), plans when given specs instead of a plan, runs the same
checks in both layouts and executes the plan either on one rank's local values (inside a
user's ``shard_map``) or on per-rank values stacked along leading world / mesh dims
(outside one: placed on the devices and run as one compiled program per
:class:`CompileKey`). ``jax_impl.finalize(...)`` calls it too (the module is callable).
"""

from __future__ import annotations

import dataclasses
import sys
import types
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from meshgrad.axes import DENSE_AXES, ParallelDims
from meshgrad.config import FinalizeConfig
from meshgrad.errors import FinalizeInputError
from meshgrad.params import ParamKey, RouterSpec
from meshgrad.plan import Action, FinalizePlan, plan_finalize

from jax_impl.checks import (
    check_inputs, check_keys, check_mode, check_plan, check_present, check_stacked, is_key, is_traced, leading_dims,
    token_count,
)
from jax_impl.discover import TreeKeys, router_specs as specs_of_routers, specs_for_tree, tree_keys
from jax_impl.execute import LocalState, execute_local
from jax_impl.stacked import execute_stacked, merge, select
from jax_impl.groups import Collectives
from jax_impl.mesh import make_meshes

Array = jax.Array
Grads = dict[ParamKey, Array]
RouterStates = dict[ParamKey, dict[str, Array]]


# --------------------------------------------------------------------------- compiled stacked runs


@dataclasses.dataclass(frozen=True)
class CompileKey:
    """Everything a compiled stacked finalize depends on besides the arrays: the static
    argument of its ``jax.jit`` (one executable per key and input shapes / dtypes).

    Args:
      actions: the planned actions (token scaling included when num_tokens is given).
      dims: the parallel dimensions.
      devices: the W devices, in rank order.
    """

    actions: tuple[Action, ...]
    dims: ParallelDims
    devices: tuple[Any, ...]


def run_stacked(key: CompileKey, grads: Any, routers: Any, num_tokens: Any) -> tuple[Any, Any]:
    """Trace ``key``'s actions on stacked [W, ...] arrays (the body of the jitted function)."""
    return execute_stacked(key.actions, grads, routers, num_tokens, make_meshes(key.dims, key.devices))


def _compiled_body(grads: Any, routers: Any, num_tokens: Any, *, key: CompileKey) -> tuple[Any, Any]:
    return run_stacked(key, grads, routers, num_tokens)


# jax.jit's own cache holds one executable per (key, input shapes / dtypes).
_compiled = jax.jit(_compiled_body, static_argnames=("key",))


def _to_world(x: Any, leading: tuple[int, ...], world: int) -> Array:
    """``x`` with its leading dims folded into one world dim."""
    return jnp.reshape(x, (world,) + tuple(jnp.shape(x)[len(leading):]))


def _from_world(tree: Any, leading: tuple[int, ...]) -> Any:
    """Every leaf of ``tree`` with its world dim unfolded into ``leading``."""
    return jax.tree.map(lambda x: jnp.reshape(x, leading + tuple(jnp.shape(x)[1:])), tree)


def _traced(tree: Any) -> bool:
    return any(map(is_traced, jax.tree.leaves(tree)))


def _run_stacked_mode(
    actions: tuple[Action, ...],
    grads: Mapping[ParamKey, Any],
    routers: Mapping[ParamKey, Mapping[str, Any]],
    num_tokens: Any,
    leading: tuple[int, ...],
    dims: ParallelDims,
    devices: Sequence[Any] | None,
) -> tuple[Grads, RouterStates]:
    """Run ``actions`` on stacked inputs: compiled and placed (concrete inputs) or traced
    into the caller's jit (traced inputs)."""
    world = dims.world_size
    used_grads, used_routers, uses_tokens = select(grads, routers, actions)
    tokens = num_tokens if uses_tokens else None
    meshes = make_meshes(dims, devices)
    flat = lambda x: _to_world(x, leading, world)  # noqa: E731
    if _traced((used_grads, used_routers, tokens)):
        out = execute_stacked(actions, jax.tree.map(flat, used_grads), jax.tree.map(flat, used_routers),
                              None if tokens is None else flat(tokens), meshes)
    else:
        sharding = meshes.rank_sharding("dense")
        put = lambda x: jax.device_put(flat(jnp.asarray(x)), sharding)  # noqa: E731
        key = CompileKey(actions, dims, tuple(meshes.dense.devices.flat))
        out = _compiled(jax.tree.map(put, used_grads), jax.tree.map(put, used_routers),
                        None if tokens is None else put(tokens), key=key)
    out_grads, out_routers = out if leading == (world,) else (_from_world(out[0], leading), _from_world(out[1], leading))
    return {**grads, **out_grads}, merge(routers, out_routers)


# --------------------------------------------------------------------------- the entry


def _plan(
    plan: FinalizePlan | None, specs: Any, grads: Any, config: FinalizeConfig | None,
    router_specs: Sequence[RouterSpec] | None, routers: Mapping[ParamKey, Mapping[str, Any]],
    dims: ParallelDims, force_all_reduce: bool,
) -> FinalizePlan:
    """The given plan, or one planned from the specs (given or read from nnx metadata)."""
    if plan is not None:
        return plan
    params = specs_for_tree(specs, grads)
    if params is None or config is None:
        raise FinalizeInputError(
            "finalize needs plan=meshgrad.plan_finalize(...), or specs= (ParamSpecs, a pytree of "
            "ParamSpecs like the gradients, or an nnx Module / State) and config=; gradients that "
            "are an nnx.State carry their specs in their Variable metadata"
        )
    if router_specs is None:
        router_specs = []
        for chunk in sorted({k[0] for k in routers}):
            named = {k[1]: v for k, v in routers.items() if k[0] == chunk}
            router_specs += specs_of_routers(named, chunk=chunk)
    return plan_finalize(params, config, dims, router_specs, force_all_reduce=force_all_reduce)


def _keyed_routers(routers: Mapping[Any, Mapping[str, Any]] | None) -> tuple[RouterStates, dict[ParamKey, Any]]:
    """Router buffers keyed by (chunk, name) (a bare router name is chunk 0's), and the
    caller's key of each."""
    keyed, given = {}, {}
    for key, fields in ({} if routers is None else routers).items():
        plan_key = (0, key) if isinstance(key, str) else key
        keyed[plan_key], given[plan_key] = dict(fields), key
    return keyed, given


def finalize(
    grads: Any,
    routers: Mapping[Any, Mapping[str, Any]] | None = None,
    num_tokens: Any = None,
    *,
    dims: ParallelDims,
    plan: FinalizePlan | None = None,
    specs: Any = None,
    config: FinalizeConfig | None = None,
    router_specs: Sequence[RouterSpec] | None = None,
    stacked: bool | None = None,
    devices: Sequence[Any] | None = None,
    force_all_reduce: bool = False,
) -> tuple[Any, dict[Any, dict[str, Array]]]:
    """Finalize gradients as planned (docs/semantics.md). Pure and jittable.

    Local mode (each gradient has exactly its ParamSpec shape): call inside a
    ``jax.shard_map`` over the dense mesh (axes pp, dp, cp, gtp, tp). Stacked mode (leading
    dims ``[W]``, the dense mesh shape or the expert mesh shape, in rank order): runs its
    own ``shard_map`` calls, compiled once per plan and shapes. Both run the same checks.

    Args:
      grads: a pytree of gradients (an ``nnx.State``, nested dicts, ...; with several
        model chunks a list of one tree per chunk), each leaf keyed by its dotted path; or
        a dict keyed by ``(chunk, name)`` (:attr:`meshgrad.ParamSpec.key`).
      routers: router buffers, {router name or (chunk, name): {field: array}} with
        Megatron's field names (local_tokens_per_expert, expert_bias, qb_beta,
        qb_beta_accum, qb_beta_count; optional aux_loss_tracker); None without routers.
      num_tokens: this rank's token count (local: a scalar or a one-element array;
        stacked: one per rank); None skips the token scaling.
      dims: the parallel dimensions.
      plan: from ``meshgrad.plan_finalize`` for these dims; or leave it out and give
        ``specs`` and ``config``.
      specs: ParamSpecs, a pytree of ParamSpecs shaped like ``grads`` (renamed to their
        paths), or an nnx Module / State whose Variable metadata holds the flags; None
        with an ``nnx.State`` of gradients reads their own metadata.
      config: the finalize options, when planning here.
      router_specs: RouterSpecs when planning here (default: read from ``routers``).
      stacked: True / False to require stacked / local inputs; None infers it.
      devices: stacked mode: W devices in rank order (default: the first W).
      force_all_reduce: all-reduce even under a distributed optimizer, when planning here.

    Returns:
      (grads, routers) in the caller's structure and keys; untouched entries as given.

    Raises:
      PlanMismatchError, FinalizeInputError (ValueErrors): plan / dims / shape / mode
      mismatch; NonFiniteGradError (a ValueError): NaN / Inf with check_for_nan_in_grad
      (concrete inputs); FinalizeTypeError (a TypeError): a non-floating gradient,
      non-integer num_tokens; MissingInputError (a KeyError): a planned entry is missing.
      All from :mod:`meshgrad.errors`, before anything runs.
    """
    keyed_routers, router_keys = _keyed_routers(routers)
    layout: TreeKeys | None = None
    if isinstance(grads, Mapping) and grads and all(is_key(k) for k in grads):
        keyed = dict(grads)
    else:
        plan = _plan(plan, specs, grads, config, router_specs, keyed_routers, dims, force_all_reduce)
        chunked = max((p.chunk for p in plan.params), default=0) > 0
        layout = tree_keys(grads, chunked=chunked)
        keyed = layout.keyed(grads)
    plan = _plan(plan, specs, keyed, config, router_specs, keyed_routers, dims, force_all_reduce)
    check_plan(plan, dims)
    check_keys(keyed, keyed_routers)
    leading = leading_dims(plan, keyed, keyed_routers)
    is_stacked = check_mode(leading, stacked)
    leading = leading or ()
    if is_stacked:
        check_stacked(leading, dims)
    check_present(plan, keyed)
    check_inputs(plan, keyed, leading)
    tokens = token_count(num_tokens, leading)
    actions = plan.actions_with(tokens is not None)
    if is_stacked:
        out_grads, out_routers = _run_stacked_mode(actions, keyed, keyed_routers, tokens, leading, dims, devices)
    else:
        state = execute_local(actions, LocalState(keyed, keyed_routers, tokens), Collectives(dims, DENSE_AXES))
        out_grads, out_routers = state.grads, state.routers
    out_routers = {router_keys.get(k, k): v for k, v in out_routers.items()}
    return (out_grads if layout is None else layout.unkeyed(out_grads)), out_routers


def finalize_stacked(
    grads_stacked: Any,
    routers_stacked: Mapping[Any, Mapping[str, Any]] | None,
    num_tokens_stacked: Any | None,
    *,
    params: Any,
    routers: Sequence[RouterSpec] = (),
    config: FinalizeConfig,
    dims: ParallelDims,
    devices: Sequence[Any] | None = None,
    force_all_reduce: bool = False,
) -> tuple[Any, dict[Any, dict[str, Array]]]:
    """Deprecated: ``finalize(grads, routers, num_tokens, specs=params, router_specs=routers,
    config=config, dims=dims, stacked=True)``, which this calls."""
    warnings.warn(
        "jax_impl.finalize_stacked is deprecated: call jax_impl.finalize(..., specs=, config=, "
        "router_specs=, stacked=True)", DeprecationWarning, stacklevel=2,
    )
    return finalize(
        grads_stacked, routers_stacked, num_tokens_stacked, dims=dims, specs=params, config=config,
        router_specs=tuple(routers), stacked=True, devices=devices, force_all_reduce=force_all_reduce,
    )


class _CallableModule(types.ModuleType):
    """This module, callable as its :func:`finalize` (``jax_impl.finalize(grads, ...)``)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return finalize(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["CompileKey", "finalize", "finalize_stacked", "run_stacked"]
