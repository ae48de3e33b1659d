"""The small array math of finalization, written once for numpy, torch and jax arrays.

Each function uses only operators and methods that the three array types share
(arithmetic, ``sign``, ``maximum``/``clamp`` via the namespace ``xp``), so backends call
the same rule instead of re-deriving it.
"""

from __future__ import annotations

from typing import Any

Array = Any


def row_mean(x: Array) -> Array:
    """Mean over the last dimension, kept as a trailing size-1 dim."""
    return x.mean(-1)[..., None]


def expert_bias_update(bias: Array, tokens: Array, rate: float, xp: Any) -> Array:
    """semantics `expert_bias`: ``bias + rate * sign(mean(tokens) - tokens)`` per row (sign(0) = 0).

    Args:
      bias: expert bias, [..., E].
      tokens: globally summed tokens per expert, [..., E].
      rate: moe_router_bias_update_rate.
      xp: the array namespace (numpy, torch or jax.numpy).

    Returns:
      The new bias, in ``bias``'s dtype.
    """
    offset = xp.sign(row_mean(tokens) - tokens) * rate
    return bias + cast(offset, bias)


def cast(x: Array, like: Array) -> Array:
    """``x`` in ``like``'s dtype (torch tensors use ``.to``, numpy/jax ``.astype``)."""
    return x.to(like.dtype) if hasattr(x, "to") else x.astype(like.dtype)


def qb_local(accum: Array, count: Array, xp: Any) -> Array:
    """semantics `qb_beta`: this rank's quantile estimate ``accum / max(count, 1)``."""
    return accum / xp.maximum(count, xp.ones_like(count))


def qb_beta_update(qb_beta: Array, mean_local: Array, ema: float) -> Array:
    """semantics `qb_beta`: ``ema*qb_beta + (1-ema)*mean_local``, minus its mean over the last dim."""
    new = qb_beta * ema + mean_local * (1.0 - ema)
    return new - row_mean(new)


def token_scale(num_tokens: Array, xp: Any) -> Array:
    """semantics `token_scale`: ``1 / max(num_tokens, 1)`` as an array (no host sync)."""
    return 1.0 / xp.maximum(num_tokens, xp.ones_like(num_tokens))
