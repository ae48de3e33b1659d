"""Checks before anything runs (the counterpart of torch_impl's input checks).

Plan against mesh, key format, leading (rank) dims, presence, dtypes and NaN / Inf: each
raises a :mod:`meshgrad.errors` type naming the entry, before any collective.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshgrad.axes import Group, ParallelDims
from meshgrad.errors import (
    FinalizeInputError,
    FinalizeTypeError,
    MissingInputError,
    NonFiniteGradError,
    PlanMismatchError,
)
from meshgrad.params import ParamKey
from meshgrad.plan import STAGE_GROUPS, FinalizePlan


_TRACER = getattr(jax.core, "Tracer", None)


def is_traced(value: Any) -> bool:
    """Whether ``value`` is a tracer (under ``jax.jit`` / ``shard_map``), not a concrete array."""
    if _TRACER is not None:
        return isinstance(value, _TRACER)
    return type(value).__name__.endswith("Tracer")  # a jax without the public jax.core.Tracer


def check_plan(plan: FinalizePlan, dims: ParallelDims) -> None:
    """Raise PlanMismatchError when ``plan`` was made for other group sizes than ``dims``.

    Only pp and the groups the plan communicates over are compared.
    """
    used = {Group.PP, *plan.required_groups()} - set(STAGE_GROUPS)
    for group in sorted(used, key=lambda g: g.value):
        if plan.sizes[group] != dims.group_size(group):
            raise PlanMismatchError(
                f"plan was made for {group} of size {plan.sizes[group]}, "
                f"but the mesh has {dims.group_size(group)} ({dims}); plan again with "
                "meshgrad.plan_finalize(specs, config, dims) for these dims"
            )
    for stages in (plan.sizes.embd_stages, plan.sizes.pos_embd_stages):
        if any(not 0 <= s < dims.pp for s in stages):
            raise PlanMismatchError(
                f"plan embedding stages {stages} outside pp = {dims.pp}; set "
                "FinalizeConfig.embedding_stages / position_embedding_stages within range(pp)"
            )


def is_key(key: Any) -> bool:
    """Whether ``key`` is a ``(int chunk, str name)`` tuple."""
    return (
        isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], int)
        and not isinstance(key[0], bool) and isinstance(key[1], str)
    )


def check_keys(grads: Mapping[Any, Any], routers: Mapping[Any, Any]) -> None:
    """Raise unless every key of ``grads`` and ``routers`` is ``(chunk, name)``.

    Args:
      grads: gradients by key.
      routers: router buffers by key.

    Raises:
      FinalizeTypeError: a key that is not a ``(int chunk, str name)`` tuple, e.g. a bare
        parameter name; the message shows the key to use instead.
    """
    for what, mapping in (("gradient", grads), ("router", routers)):
        for key in mapping:
            if not is_key(key):
                hint = f" (use (0, {key!r}) for chunk 0)" if isinstance(key, str) else ""
                raise FinalizeTypeError(
                    f"{what} key {key!r} is not (chunk, name): key {what}s by a tuple of the "
                    f"chunk index and the parameter name, as ParamSpec.key does{hint}"
                )


LOCAL = "local mode (one rank's values, inside your shard_map)"
STACKED = "stacked mode (every rank's values along leading dims, outside shard_map)"


def leading_dims(
    plan: FinalizePlan, grads: Mapping[ParamKey, Any], routers: Mapping[ParamKey, Any]
) -> tuple[int, ...] | None:
    """The gradients' and router buffers' leading (stacking) dims, checked consistent:
    ``()`` in local mode; None without inputs.

    Raises:
      FinalizeInputError: a gradient not in the plan, one whose shape does not end in its
        planned shape, or inputs that disagree on their leading dims.
    """
    shapes = {s.key: s.shape for s in plan.params}
    experts = {r.key: r.num_experts for r in plan.routers}
    found: dict[tuple[int, ...], str] = {}
    for key, value in grads.items():
        if key not in shapes:
            raise FinalizeInputError(
                f"gradient {key[1]!r} (chunk {key[0]}) is not in the plan; add a ParamSpec for it "
                "to plan_finalize, or leave it out of grads"
            )
        base = shapes[key]
        shape = tuple(jnp.shape(value))
        if len(shape) < len(base) or shape[len(shape) - len(base):] != base:
            raise FinalizeInputError(
                f"gradient {key[1]!r} (chunk {key[0]}): shape {shape} does not end in its spec shape "
                f"{base}: in {LOCAL} pass exactly {base}; in {STACKED} pass (W, *{base})"
            )
        found.setdefault(shape[: len(shape) - len(base)], f"gradient {key[1]!r}")
    for key, state in routers.items():
        if key in experts and "expert_bias" in state:
            found.setdefault(tuple(jnp.shape(state["expert_bias"]))[:-1], f"router {key[1]!r}")
    if len(found) > 1:
        raise FinalizeInputError(
            f"inputs disagree on their leading (rank) dims: {found}; in {LOCAL} give every gradient "
            f"exactly its spec shape; in {STACKED} stack every gradient and router buffer along "
            "the same leading dims ([W] or a mesh shape)"
        )
    return next(iter(found), None)


def check_mode(leading: tuple[int, ...] | None, stacked: bool | None) -> bool:
    """Whether the inputs are stacked, checked against the caller's ``stacked`` option.

    Raises:
      FinalizeInputError: ``stacked=True`` with gradients of exactly their spec shapes, or
        ``stacked=False`` with leading dims.
    """
    is_stacked = bool(leading)
    if stacked is True and not is_stacked:
        raise FinalizeInputError(
            f"stacked=True ({STACKED}) but the gradients have exactly their spec shapes; stack one "
            "row per rank along a leading dim, or pass stacked=False inside your shard_map"
        )
    if stacked is False and is_stacked:
        raise FinalizeInputError(
            f"stacked=False ({LOCAL}) but the gradients have leading dims {leading}; inside "
            "shard_map pass this rank's block without them (e.g. g[0] of a [1, ...] block)"
        )
    return is_stacked


def token_count(num_tokens: Any, leading: tuple[int, ...]) -> Any:
    """``num_tokens`` shaped like the leading dims: in local mode a scalar, from a scalar
    or a one-element array (as torch takes it); stacked, ``leading`` or ``leading + (1,)``.

    Raises:
      FinalizeInputError: any other shape, naming the mode.
      FinalizeTypeError: counts that are not integers.
    """
    if num_tokens is None:
        return None
    dtype = jnp.result_type(num_tokens)
    if not jnp.issubdtype(dtype, jnp.integer):
        raise FinalizeTypeError(f"num_tokens must hold integers, got dtype {dtype}")
    shape = tuple(jnp.shape(num_tokens))
    if shape == leading:
        return num_tokens
    if shape == leading + (1,) or (not leading and shape == (1,)):
        return jnp.reshape(num_tokens, leading)
    if leading:
        raise FinalizeInputError(
            f"num_tokens has shape {shape}; in {STACKED} with leading dims {leading} pass one count "
            f"per rank: shape {leading} (or {leading + (1,)})"
        )
    raise FinalizeInputError(
        f"num_tokens has shape {shape}; in {LOCAL} pass this rank's count as a scalar or a "
        "one-element array"
    )


def check_stacked(leading: tuple[int, ...], dims: ParallelDims) -> None:
    """Raise FinalizeInputError unless ``leading`` is ``(W,)`` or a mesh view's shape."""
    world = dims.world_size
    if leading not in ((world,), dims.dense_shape(), dims.expert_shape()):
        raise FinalizeInputError(
            f"stacked inputs have leading dims {leading}; expected ({world},), the dense "
            f"mesh shape {dims.dense_shape()} or the expert mesh shape {dims.expert_shape()}: "
            "stack one row per rank, in rank order"
        )


def check_present(plan: FinalizePlan, grads: Mapping[ParamKey, Any]) -> None:
    """Raise MissingInputError naming the first planned gradient missing from ``grads``."""
    for spec in plan.params:
        if spec.has_grad and spec.key not in grads:
            raise MissingInputError(
                f"gradient of {spec.name!r} (chunk {spec.chunk}) is missing: pass it under key "
                f"{spec.key!r}, or plan it with ParamSpec(..., has_grad=False)"
            )


def check_inputs(plan: FinalizePlan, grads: Mapping[ParamKey, Any], leading: tuple[int, ...] | None) -> None:
    """Dtypes always; NaN / Inf with ``config.check_for_nan_in_grad`` (concrete inputs:
    a traced value, under ``jax.jit``, cannot be inspected -- use ``jax_debug_nans``).

    Raises:
      FinalizeTypeError: a gradient that is not floating point.
      NonFiniteGradError: NaN / Inf in a gradient, naming the parameter and the first rank
        (the index along the flattened leading dims) that holds it.
    """
    for key, value in grads.items():
        dtype = jnp.result_type(value)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise FinalizeTypeError(f"gradient {key[1]!r} (chunk {key[0]}) has dtype {dtype}, not a floating type")
    if plan.config.check_for_nan_in_grad:
        _check_finite(plan, grads, leading)


def _check_finite(plan: FinalizePlan, grads: Mapping[ParamKey, Any], leading: tuple[int, ...] | None) -> None:
    width = int(np.prod(leading)) if leading else 1
    for spec in plan.params:
        value = grads.get(spec.key)
        if value is None or not spec.has_grad or is_traced(value):
            continue
        ok = np.asarray(jnp.isfinite(jnp.asarray(value)).reshape(width, -1).all(axis=1))
        if not ok.all():
            where = f"rank {int(np.argmin(ok))}: " if leading else ""
            raise NonFiniteGradError(
                f"{where}NaN or Inf in the gradient of {spec.name!r} (chunk {spec.chunk}) "
                "(check_for_nan_in_grad); nothing was finalized"
            )


__all__ = [
    "check_inputs", "check_keys", "is_traced", "check_mode", "check_plan", "check_present", "check_stacked", "leading_dims",
    "token_count",
]
