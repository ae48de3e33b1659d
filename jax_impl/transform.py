"""An optax GradientTransformation that finalizes gradients (docs/jax.md, "optax").

``optax.chain(jax_impl.finalize_gradients(config=..., dims=...), optax.adamw(1e-3))`` is
the whole change to a training loop whose step runs inside ``jax.shard_map``: its update
finalizes the local gradients (the same call as :func:`jax_impl.finalize.finalize`) and
keeps the MoE router buffers in its state, the optax way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from meshgrad.axes import ParallelDims
from meshgrad.config import FinalizeConfig
from meshgrad.params import RouterSpec
from meshgrad.plan import FinalizePlan

from jax_impl.execute import EXPERT_BIAS, QB_ACCUM, QB_BETA, QB_COUNT, TOKENS
from jax_impl.finalize import finalize


class FinalizeState(NamedTuple):
    """The transformation's state: router buffers, {router: {field: array}}, keyed as
    given (router name, or (chunk, name)); updated by each ``update``."""

    routers: dict[Any, dict[str, jax.Array]]


def initial_router_buffers(specs: Sequence[RouterSpec]) -> dict[Any, dict[str, jax.Array]]:
    """Megatron's initial buffers of each router: zeros (float32), keyed by router name
    for chunk 0 and ``(chunk, name)`` otherwise."""
    out: dict[Any, dict[str, jax.Array]] = {}
    for spec in specs:
        zeros = jnp.zeros((spec.num_experts,), jnp.float32)
        fields: dict[str, jax.Array] = {}
        if spec.has_expert_bias:
            fields.update({TOKENS: zeros, EXPERT_BIAS: zeros})
        if spec.has_qb_beta:
            fields.update({QB_BETA: zeros, QB_ACCUM: zeros, QB_COUNT: jnp.zeros((), jnp.float32)})
        out[spec.name if spec.chunk == 0 else spec.key] = fields
    return out


def finalize_gradients(
    *,
    dims: ParallelDims,
    plan: FinalizePlan | None = None,
    specs: Any = None,
    config: FinalizeConfig | None = None,
    router_specs: Sequence[RouterSpec] = (),
    routers: Mapping[Any, Mapping[str, Any]] | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Finalize gradients as the first transformation of an optax chain.

    Args:
      dims: the parallel dimensions of the enclosing ``shard_map``'s mesh.
      plan: from ``meshgrad.plan_finalize``; or give ``config`` (and ``specs`` unless the
        gradients are an ``nnx.State`` whose Variable metadata holds the flags).
      specs, config, router_specs: as for :func:`jax_impl.finalize.finalize`; the plan is
        then made when the step is traced.
      routers: initial router buffers (default: Megatron's zeros for ``router_specs``).

    Returns:
      A transformation whose ``init(params)`` holds the router buffers and whose
      ``update(grads, state, params=None, *, num_tokens=None, routers=None)`` returns the
      finalized gradients in the gradients' structure. ``routers`` (extra argument) gives
      this step's buffers (e.g. ``{name: {"local_tokens_per_expert": counts}}``); its
      fields replace the state's for this update. ``num_tokens`` (extra argument): this
      rank's token count with a per-token loss. The updated buffers (new expert bias,
      reset counts) are the new state's: read them with :func:`router_buffers`.
    """
    if routers is None:
        start = initial_router_buffers(plan.routers if plan is not None else router_specs)
    else:
        start = {k: dict(v) for k, v in routers.items()}
    specs_of_routers = tuple(plan.routers) if plan is not None else tuple(router_specs) or None

    def init(params: Any) -> FinalizeState:
        del params
        return FinalizeState(jax.tree.map(jnp.asarray, start))

    def update(
        updates: Any, state: FinalizeState, params: Any = None, *, num_tokens: Any = None,
        routers: Mapping[Any, Mapping[str, Any]] | None = None, **extra: Any,
    ) -> tuple[Any, FinalizeState]:
        del params, extra
        current = {k: dict(v) for k, v in state.routers.items()}
        for key, fields in (routers or {}).items():
            current.setdefault(key, {}).update(fields)
        grads, new = finalize(
            updates, current or None, num_tokens, dims=dims, plan=plan, specs=specs, config=config,
            router_specs=specs_of_routers, stacked=False,
        )
        return grads, FinalizeState({k: dict(new[k]) for k in current})

    return optax.GradientTransformationExtraArgs(init, update)


def router_buffers(opt_state: Any) -> dict[Any, dict[str, jax.Array]]:
    """The router buffers held by the :class:`FinalizeState` inside ``opt_state`` (a
    chain's state, or the FinalizeState itself).

    Raises:
      meshgrad.errors.MissingInputError: ``opt_state`` holds no FinalizeState.
    """
    from meshgrad.errors import MissingInputError

    found = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, FinalizeState))
             if isinstance(s, FinalizeState)]
    if not found:
        raise MissingInputError("the optimizer state holds no jax_impl FinalizeState (finalize_gradients)")
    return found[0].routers


__all__ = ["FinalizeState", "finalize_gradients", "initial_router_buffers", "router_buffers"]
