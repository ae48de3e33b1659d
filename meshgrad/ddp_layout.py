"""Whether a Megatron DDP's buckets line up a cross-stage-summed parameter's shards.

With a distributed optimizer a Megatron DDP reduce-scatters each bucket: member i of the
DP group owns the i-th of ``dp_size`` equal slices of the (padded) bucket. A parameter
that a later step sums across pipeline stages (tied word embedding, position embedding,
conditional embedder, flextron router) is summed element by element with its copy on
another stage, so both copies must be sliced alike. Megatron guarantees that only for a
parameter alone in its bucket, at its start (what it does for ``shared_embedding``
parameters, Megatron-LM issue 844): the slicing then depends on the parameter's size and
the DP size alone, the same on every stage. Anywhere else the slices follow the other
parameters of the bucket, which differ between stages, and the optimizer reads a sum of a
reduced value and a local one. :func:`misaligned_cross_stage_params` finds those.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence


@dataclasses.dataclass(frozen=True)
class BucketParam:
    """One parameter's place in a bucket.

    Args:
      name: the parameter's qualified name.
      offset: its first element, counted from the bucket's start.
      numel: its number of elements.
    """

    name: str
    offset: int
    numel: int


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One DDP bucket: its parameters and its padded size.

    Args:
      params: the parameters it holds.
      numel: its size with padding (a multiple of the DP size under a distributed optimizer).
    """

    params: tuple[BucketParam, ...]
    numel: int


def misaligned_cross_stage_params(
    buckets: Sequence[Bucket], cross_stage: Collection[str], dp_size: int, *, reduce_scatter: bool = True
) -> tuple[str, ...]:
    """The cross-stage-summed parameters whose DP shards need not line up across stages.

    Args:
      buckets: this rank's DDP buckets (every buffer's).
      cross_stage: names of the parameters a later step sums across pp stages.
      dp_size: the DP group's size (the reduce-scatter's).
      reduce_scatter: the DDP reduce-scatters (distributed optimizer, not forced to all-reduce).

    Returns:
      Their names, in bucket order: each one that shares its bucket with another parameter
      or does not start it. Empty without a reduce-scatter or with ``dp_size`` 1.
    """
    if not reduce_scatter or dp_size <= 1:
        return ()
    wanted = set(cross_stage)
    out: list[str] = []
    for bucket in buckets:
        for param in bucket.params:
            if param.name in wanted and (len(bucket.params) > 1 or param.offset != 0):
                out.append(param.name)
    return tuple(dict.fromkeys(out))


def misalignment_message(names: Sequence[str], dp_size: int) -> str:
    """The warning for :func:`misaligned_cross_stage_params`'s result (Megatron's numbers stay)."""
    listed = ", ".join(repr(n) for n in names)
    return (
        f"the Megatron DDP's buckets shard {listed} differently from its copy on another "
        f"pipeline stage (reduce-scatter over {dp_size} DP ranks before a cross-stage sum): "
        f"the distributed optimizer will read wrong gradient values there (Megatron-LM issue "
        f"844). Megatron's numbers are kept. Give each such parameter a bucket of its own "
        f"(Megatron does it for parameters flagged shared_embedding=True), or use "
        f"use_distributed_optimizer=False."
    )


__all__ = ["Bucket", "BucketParam", "misaligned_cross_stage_params", "misalignment_message"]
