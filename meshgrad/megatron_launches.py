"""Megatron-Core's finalize on a rank, as the collectives it launches: the same plan under
Megatron's rules (:func:`megatron_launches`): no status round, coalescing within a step
only, and the DP sync as its ``DistributedDataParallel`` lays out and launches buckets
(:func:`megatron_buckets`, :func:`ddp_launches`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from meshgrad.actions import Reduction, StageReduction, Step
from meshgrad.axes import Group
from meshgrad.fusion import merge_reductions
from meshgrad.launches import Launch, launch, launches
from meshgrad.plan import FinalizePlan
from meshgrad.steps import dp_scaling

#: Megatron DDP's default bucket size with ``overlap_grad_reduce`` (elements):
#: ``max(40_000_000, 1_000_000 * dp)`` (megatron/core/distributed/distributed_data_parallel.py).
MEGATRON_BUCKET_MIN = 40_000_000


def _megatron_actions(plan: FinalizePlan) -> list[Any]:
    """The plan's actions under Megatron-Core's rules: a reduction that fuses several
    steps is split back into one per step (Megatron coalesces within a step only)."""
    out: list[Any] = []
    for a in plan.actions:
        if isinstance(a, Reduction) and a.parts and len(a.steps) > 1:
            for step in a.steps:
                out += merge_reductions([p for p in a.parts if p.step is step])
        else:
            out.append(a)
    return out


def megatron_buckets(numels: Sequence[int], bucket_size: int | None, alone: Sequence[bool], dp: int,
                     distributed_optimizer: bool) -> list[int]:
    """The buckets (elements, padding included) of one Megatron DDP buffer, as
    ``_ParamAndGradBuffer`` lays them out: parameters in reverse order, each start padded to
    64 elements and each bucket end to ``lcm(dp, 128)`` under the distributed optimizer; a
    bucket closes once it holds ``bucket_size`` elements (None: never), and a shared
    embedding (``alone``, distributed optimizer only) is a bucket of its own.

    Args:
      numels: the buffer's parameters' elements, in parameter order.
      bucket_size: elements per bucket, or None.
      alone: per parameter, whether it is a shared embedding.
      dp: the buffer's data-parallel group size.
      distributed_optimizer: ``use_distributed_optimizer``.
    """
    def pad(n: int, by: int) -> int:
        return -(-n // by) * by if distributed_optimizer else n

    out: list[int] = []
    start = bucket_start = 0
    held = False
    end_divisor = math.lcm(dp, 128)
    for numel, own in zip(reversed(numels), reversed(alone)):
        start = pad(start, 64)
        own = own and distributed_optimizer
        if own and held:
            start = pad(start, end_divisor)
            out.append(start - bucket_start)
            bucket_start, held = start, False
        end = start + numel
        held = True
        if (bucket_size is not None and end - bucket_start >= bucket_size) or own:
            start = pad(end, end_divisor)
            out.append(start - bucket_start)
            bucket_start, held = start, False
        else:
            start = end
    if held:
        out.append(pad(end, end_divisor) - bucket_start)
    return out


def ddp_launches(plan: FinalizePlan, stage: int, overlap: bool, bucket_size: int | None = None) -> tuple[Launch, ...]:
    """The DP sync as Megatron's DDP launches it (its ``finish_grad_sync``, chunk by chunk):
    one buffer per gradient dtype, dense then expert (``allreduce=False``), each in buckets
    (:func:`megatron_buckets`). Bucket size: ``bucket_size`` when given, else Megatron's
    default, ``max(40M, 1M x dp)`` elements with ``overlap_grad_reduce`` and none without;
    only pp stage 0's first chunk is bucketed (Megatron's DDP turns bucketing off on later
    stages and the interleaved schedule on later chunks). The tied word embedding of a
    pipeline (``shared_embedding``) is a bucket of its own. With overlap every bucket but
    the last of each buffer is launched during backward."""
    config, sizes = plan.config, plan.sizes
    shared = {k for a in plan.actions if isinstance(a, StageReduction) and a.step is Step.WORD_EMBEDDING
              for k in a.distinct_keys()}
    op = dp_scaling(config, sizes[Group.DP_CP], sizes[Group.EDP])[0]
    kind = "reduce_scatter" if config.use_distributed_optimizer else "all_reduce"
    out: list[Launch] = []
    for chunk in sorted({p.chunk for p in plan.params}):
        for group, expert in ((Group.DP_CP, False), (Group.EDP, True)):
            mine = [p for p in plan.params if p.chunk == chunk and p.has_grad and p.expert == expert]
            dtypes = dict.fromkeys("float32" if config.grad_reduce_in_fp32 else p.dtype for p in mine)
            for dtype in dtypes:
                held = [p for p in mine if ("float32" if config.grad_reduce_in_fp32 else p.dtype) == dtype]
                size = bucket_size
                if size is None and overlap:
                    size = max(MEGATRON_BUCKET_MIN, 1_000_000 * sizes[group])
                if stage != 0 or chunk != 0:
                    size = None
                pieces = megatron_buckets([p.numel for p in held], size, [p.key in shared for p in held],
                                          sizes[group], config.use_distributed_optimizer)
                for index, numel in enumerate(pieces):
                    item = launch(str(Step.DP_SYNC), kind, str(op), group, sizes, dtype, numel,
                                   overlap and index < len(pieces) - 1)
                    if item is not None:
                        out.append(item)
    return tuple(out)


def megatron_launches(plan: FinalizePlan, stage: int, num_tokens: bool, overlap: bool,
                      bucket_size: int | None = None) -> tuple[Launch, ...]:
    """Megatron-Core's finalize on the same rank: its DDP's DP sync (:func:`ddp_launches`),
    then the plan's other steps with Megatron's coalescing (:func:`_megatron_actions`); no
    status round."""
    rest = [a for a in _megatron_actions(plan) if not (isinstance(a, Reduction) and a.step is Step.DP_SYNC)]
    tail = (plan.token_scale,) if num_tokens else ()
    return ddp_launches(plan, stage, overlap, bucket_size) + launches(plan, stage, num_tokens, rest + list(tail))


__all__ = ["MEGATRON_BUCKET_MIN", "ddp_launches", "megatron_buckets", "megatron_launches"]
