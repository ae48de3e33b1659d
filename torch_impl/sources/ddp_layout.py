"""Read a Megatron DDP's bucket layout, and name the cross-stage-summed parameters it
shards differently across pipeline stages.

Also the read-only NaN / Inf pre-check of its gradient buffers (:func:`nonfinite_in_buffers`).

Read only: the DDP's ``buffers`` / ``expert_parallel_buffers`` (each with ``params``,
``param_index_map``: param -> (start, end, bucket id) in the buffer, ``bucket_indices``:
bucket id -> (start, end), ``data_parallel_world_size``) and its ``ddp_config``. The
decision itself is :func:`meshgrad.ddp_layout.misaligned_cross_stage_params`; the caller
warns with :func:`meshgrad.ddp_layout.misalignment_message` (category
:class:`meshgrad.errors.LayoutWarning`) once per plan and keeps Megatron's numbers.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch

from meshgrad.ddp_layout import Bucket, BucketParam, misaligned_cross_stage_params
from torch_impl.run.grads import all_finite
from torch_impl.sources.wrappers import uncompiled_name

#: One buffer's buckets and the size of the DP group it reduce-scatters over.
BufferLayout = tuple[tuple[Bucket, ...], int]


def _param_names(ddp: Any) -> dict[int, str]:
    """``id(param)`` -> its name in the DDP's module, as the uncompiled model names it."""
    module = getattr(ddp, "module", ddp)
    return {id(p): uncompiled_name(name) for name, p in module.named_parameters()}


def buffer_layout(buffer: Any, names: Mapping[int, str]) -> BufferLayout:
    """One ``_ParamAndGradBuffer``'s buckets, each parameter's offset counted from its bucket.

    Args:
      buffer: a Megatron DDP buffer.
      names: ``id(param)`` -> the parameter's name.

    Returns:
      (buckets in bucket-id order, the buffer's DP world size).
    """
    by_bucket: dict[int, list[BucketParam]] = {}
    for param, (start, stop, bucket_id) in buffer.param_index_map.items():
        bucket_start = buffer.bucket_indices[bucket_id][0]
        name = names.get(id(param), f"<unnamed {tuple(param.shape)}>")
        by_bucket.setdefault(bucket_id, []).append(BucketParam(name, start - bucket_start, stop - start))
    buckets = []
    for bucket_id, (start, stop) in enumerate(buffer.bucket_indices):
        params = sorted(by_bucket.get(bucket_id, []), key=lambda p: p.offset)
        buckets.append(Bucket(tuple(params), stop - start))
    return tuple(buckets), int(buffer.data_parallel_world_size)


def gradient_buffers(ddp: Any) -> list[Any]:
    """A Megatron ``DistributedDataParallel``'s gradient buffers (dense, then expert); empty
    for a DDP-like module without them."""
    return [b for attr in ("buffers", "expert_parallel_buffers") for b in _buffer_list(ddp, attr)]


def ddp_layouts(ddp: Any) -> tuple[BufferLayout, ...]:
    """Every buffer's layout of a Megatron ``DistributedDataParallel`` (dense, then expert)."""
    buffers = gradient_buffers(ddp)
    if not buffers:
        return ()
    names = _param_names(ddp)
    return tuple(buffer_layout(b, names) for b in buffers)


def nonfinite_in_buffers(ddp: Any) -> list[str]:
    """The parameters of a Megatron DDP whose gradient (in its gradient buffers) holds NaN
    or Inf, read only: one fused max-norm over its non-empty buffers and one host sync;
    each parameter's range (``param_index_map``) is read only when a buffer holds one.

    Args:
      ddp: a Megatron ``DistributedDataParallel`` chunk.

    Returns:
      The names (as in ``ddp.module.named_parameters()``), in buffer order.
    """
    buffers = [b for b in gradient_buffers(ddp) if getattr(b, "grad_data", None) is not None]
    if not buffers:
        return []
    if all_finite(b.grad_data for b in buffers if b.grad_data.numel()):
        return []
    finite = torch.stack([torch.isfinite(b.grad_data).all() for b in buffers]).tolist()
    names = _param_names(ddp)
    bad: list[str] = []
    for buffer, ok in zip(buffers, finite):
        if ok:
            continue
        for param, (start, stop, _) in buffer.param_index_map.items():
            if not bool(torch.isfinite(buffer.grad_data[start:stop]).all()):
                bad.append(names.get(id(param), f"<unnamed {tuple(param.shape)}>"))
    return bad


def _buffer_list(ddp: Any, attr: str) -> list[Any]:
    """``ddp.<attr>`` when it is a list of Megatron gradient buffers, else nothing (a DDP-like
    module without them: ``nn.Module.buffers`` is a method, not a list)."""
    found = vars(ddp).get(attr) if hasattr(ddp, "__dict__") else None
    if not isinstance(found, (list, tuple)):
        return []
    return [b for b in found if hasattr(b, "param_index_map") and hasattr(b, "bucket_indices")]


def misaligned_in_ddp(ddp: Any, cross_stage: Collection[str], *, force_all_reduce: bool = False) -> tuple[str, ...]:
    """The parameters of ``cross_stage`` (names as in ``ddp.module.named_parameters()``)
    whose DP shards in this DDP need not line up with their copies on other stages.

    Args:
      ddp: a Megatron ``DistributedDataParallel`` chunk.
      cross_stage: names of the parameters a later step sums across pp stages.
      force_all_reduce: the sync is forced to an all-reduce (nothing is sharded).

    Returns:
      Their names in bucket order (empty without a distributed optimizer).
    """
    config = getattr(ddp, "ddp_config", None)
    scatter = bool(getattr(config, "use_distributed_optimizer", False)) and not force_all_reduce
    out: list[str] = []
    for buckets, dp_size in ddp_layouts(ddp):
        out += misaligned_cross_stage_params(buckets, cross_stage, dp_size, reduce_scatter=scatter)
    return tuple(dict.fromkeys(out))


__all__ = ["BufferLayout", "buffer_layout", "ddp_layouts", "gradient_buffers", "misaligned_in_ddp", "nonfinite_in_buffers"]
