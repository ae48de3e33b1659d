"""The collectives meshgrad's executors run: SUM/AVG all-reduce and the
distributed-optimizer reduce-scatter over one torch.distributed group."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from meshgrad.plan import ReduceOp, scatter_shard

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _native_avg(group: Any) -> bool:
    """NCCL has ReduceOp.AVG; for other backends AVG is SUM followed by a division."""
    try:
        return dist.get_backend(group) == "nccl"
    except (RuntimeError, ValueError):  # pragma: no cover
        return False


def all_reduce(tensor: torch.Tensor, group: Any, op: ReduceOp, size: int) -> None:
    """In-place SUM or AVG of ``tensor`` over ``group`` (nothing when ``group`` is None)."""
    if group is None:
        return
    if op is ReduceOp.AVG and _native_avg(group):
        dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=group)
        return
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    if op is ReduceOp.AVG:
        tensor.div_(size)


def reduce_scatter_into(flat: torch.Tensor, group: Any, op: ReduceOp, size: int, rank: int) -> int:
    """Distributed-optimizer reduce-scatter of ``flat`` in place: this rank's shard
    (:func:`meshgrad.plan.scatter_shard`, members by ascending global rank) receives the
    reduced values; every other element keeps its local value.

    Returns:
      Bytes copied on the way (padding, shard write-back).
    """
    members = dist.get_process_group_ranks(group)
    index = sorted(members).index(rank)
    start, stop = scatter_shard(flat.numel(), size, index)
    shard = -(-flat.numel() // size)
    copied = (stop - start) * flat.element_size()
    if members == sorted(members) and [dist.get_group_rank(group, r) for r in members] == list(range(size)):
        if shard * size == flat.numel():
            padded = flat
        else:
            padded = flat.new_zeros(shard * size)
            padded[: flat.numel()].copy_(flat)
            copied += flat.numel() * flat.element_size()
        out = padded.new_empty(shard)
        native = op is ReduceOp.AVG and _native_avg(group)
        # reduce_scatter_single is the newer name of reduce_scatter_tensor (deprecated in 2.13).
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        scatter(out, padded, op=dist.ReduceOp.AVG if native else dist.ReduceOp.SUM, group=group)
        if op is ReduceOp.AVG and not native:
            out.div_(size)
    else:  # group ranks not in global-rank order: reduce everything, keep our shard
        out = flat.clone()
        copied += flat.numel() * flat.element_size()
        all_reduce(out, group, op, size)
        out = out[index * shard : index * shard + shard]
    flat[start:stop].copy_(out[: stop - start])
    return copied
