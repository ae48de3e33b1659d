"""Fusion of adjacent reductions that can share one collective.

Megatron coalesces some steps' gradients across dtypes (``_flatten_dense_tensors``: one
collective in their promoted dtype); :func:`merge_reductions` does the same where it is
exact or where Megatron does it, and records the fused parts on the result.
"""

from __future__ import annotations

import types
from collections.abc import Mapping, Sequence

from meshgrad.actions import Action, Reduction, Step

#: Steps whose gradients Megatron coalesces with ``_flatten_dense_tensors``: one collective
#: over gradients of every dtype, run in their promoted dtype.
FLATTENED_STEPS = frozenset({Step.COND_EMBEDDER, Step.ROUTER, Step.NON_TP, Step.GTP})

_FLOAT_RANK: Mapping[str, int] = types.MappingProxyType({"float16": 0, "bfloat16": 0, "float32": 1, "float64": 2})


def promote_dtypes(a: str, b: str) -> str:
    """torch / numpy type promotion of two float dtype names (bf16 with fp16 -> fp32)."""
    if a == b:
        return a
    rank = max(_FLOAT_RANK[a], _FLOAT_RANK[b], 1)
    return "float64" if rank == 2 else "float32"


def _fusable(a: Reduction, b: Reduction) -> bool:
    if (a.group, a.op, a.pre_scale, a.reduce_in_fp32) != (b.group, b.op, b.pre_scale, b.reduce_in_fp32):
        return False
    if a.scatter or b.scatter:  # the shard layout is defined per reduction
        return False
    if set(a.all_keys) & set(b.all_keys):  # a key reduced twice must stay reduced twice
        return False
    if a.dtype == b.dtype or a.reduce_in_fp32:  # same collective dtype: exact
        return True
    # Different dtypes in one collective: what Megatron does where it flattens.
    return all(s in FLATTENED_STEPS for s in a.steps + b.steps)


def _fuse(a: Reduction, b: Reduction) -> Reduction:
    copies = (a.copies or ((),) * len(a.keys)) + (b.copies or ((),) * len(b.keys))
    return Reduction(
        step=a.step,
        group=a.group,
        op=a.op,
        keys=a.keys + b.keys,
        dtype=promote_dtypes(a.dtype, b.dtype),
        pre_scale=a.pre_scale,
        scatter=False,
        reduce_in_fp32=a.reduce_in_fp32,
        copies=copies if any(copies) else (),
        parts=(a.parts or (a,)) + (b.parts or (b,)),
    )


def merge_reductions(actions: Sequence[Action]) -> tuple[Action, ...]:
    """Fuse adjacent reductions that can share one collective.

    Two reductions next to each other in the plan (nothing runs between them) become one
    when they have the same group, op, pre-scale and reduce_in_fp32 flag, neither is a
    reduce-scatter, their keys (copies included) are disjoint, and either

    * they run in the same dtype: exact (cond-embedder + router pp syncs; dtype-split
      reductions under ``grad_reduce_in_fp32``), or
    * both belong to steps Megatron coalesces across dtypes (:data:`FLATTENED_STEPS`):
      the fused collective runs in the promoted dtype, as ``_flatten_dense_tensors`` does.

    DP-sync reductions of different dtypes stay apart without ``grad_reduce_in_fp32``
    (Megatron's DDP keeps one buffer per dtype).

    Args:
      actions: planned actions, in order.

    Returns:
      The actions, fused reductions carrying their ``parts``.
    """
    out: list[Action] = []
    for action in actions:
        prev = out[-1] if out else None
        if isinstance(action, Reduction) and isinstance(prev, Reduction) and _fusable(prev, action):
            out[-1] = _fuse(prev, action)
        else:
            out.append(action)
    return tuple(out)


__all__ = ["FLATTENED_STEPS", "merge_reductions", "promote_dtypes"]
