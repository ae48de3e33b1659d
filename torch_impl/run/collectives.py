"""The collectives meshgrad's executors run: SUM/AVG all-reduce and the
distributed-optimizer reduce-scatter over one torch.distributed group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.overrides import has_torch_function_unary

from meshgrad.plan import ReduceOp, scatter_shard
from torch_impl.run.rounds import reduce_options

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _torch_op(group: Any, op: ReduceOp) -> tuple[Any, bool]:
    """torch's reduce op for ``op`` over ``group``, and whether a division by the group's
    size follows: NCCL has ReduceOp.AVG; on other backends AVG is SUM, then a division."""
    try:
        native = op is ReduceOp.AVG and dist.get_backend(group) == "nccl"
    except (RuntimeError, ValueError):  # pragma: no cover
        native = False
    return (dist.ReduceOp.AVG if native else dist.ReduceOp.SUM), op is ReduceOp.AVG and not native


#: torch's own ``all_reduce`` and ``broadcast``, as torch defines them: meshgrad calls a
#: process group directly only while the ``torch.distributed`` function is still torch's.
_TORCH_ALL_REDUCE = c10d.all_reduce
_TORCH_BROADCAST = c10d.broadcast


def _layer_idle(current: Any, own: Any, tensor: torch.Tensor) -> bool:
    """Whether a ``torch.distributed`` collective's Python layer would only call the process
    group: ``current`` (the function ``torch.distributed`` holds now) is still torch's
    ``own`` (no wrapper installed over it) and ``tensor`` has no ``__torch_function__`` to
    honour (a subclass, an active mode)."""
    return current is own and not has_torch_function_unary(tensor)


def _blocking(options: Any) -> Any:
    """``options`` as ``torch.distributed``'s blocking calls set them: ``asyncOp`` off where
    torch has it (on NCCL the collective then runs on the current stream)."""
    if hasattr(options, "asyncOp"):
        options.asyncOp = False
    return options


def bind_all_reduce(group: Any, op: ReduceOp, size: int) -> Callable[[torch.Tensor], None]:
    """In-place SUM or AVG over ``group`` of the tensor it is given (nothing when ``group``
    is None), with what does not change between calls worked out once: the backend's
    native AVG, the reduce op and the collective's options.

    The call is ``torch.distributed.all_reduce``'s: the process group's ``allreduce`` with
    the same options, then a wait. It skips that function's Python layer (a few
    microseconds a collective) only where the layer would do nothing else: while
    ``torch.distributed.all_reduce`` is torch's own (a wrapper installed over it -- a
    counter, a fault injector, a tracer -- is called instead, as before) and the tensor
    has no ``__torch_function__`` to honour (a subclass, an active mode). A group that is
    not a ``ProcessGroup`` (torch's marker for a rank outside it) also goes through that
    function. No tensor meshgrad reduces is complex, the one case the layer converts: the
    checks refuse complex gradients, and router and token counts are reduced in real
    dtypes they are converted to first.

    Returns:
      A function of the tensor to reduce in place.
    """
    if group is None:
        return _nothing
    torch_op, divide = _torch_op(group, op)
    options = _blocking(reduce_options(torch_op))
    direct = isinstance(group, dist.ProcessGroup)

    def reduce(tensor: torch.Tensor) -> None:
        if direct and _layer_idle(dist.all_reduce, _TORCH_ALL_REDUCE, tensor):
            group.allreduce([tensor], options).wait()
        else:
            dist.all_reduce(tensor, op=torch_op, group=group)
        if divide:
            tensor.div_(size)

    return reduce


def _nothing(tensor: torch.Tensor) -> None:
    """The reduction over no group."""


def all_reduce(tensor: torch.Tensor, group: Any, op: ReduceOp, size: int) -> None:
    """In-place SUM or AVG of ``tensor`` over ``group`` (nothing when ``group`` is None), once
    (:func:`bind_all_reduce` for a reduction that runs every step)."""
    bind_all_reduce(group, op, size)(tensor)


def bind_broadcast(src: int, group: Any) -> Callable[[torch.Tensor], None]:
    """``torch.distributed.broadcast(tensor, src, group)`` (``src`` a global rank) of the
    tensor it is given, bound once: the group is called directly under
    :func:`bind_all_reduce`'s rule (while ``torch.distributed.broadcast`` is torch's own,
    ``group`` a ``ProcessGroup`` and the tensor without ``__torch_function__``), with the
    root's group rank and the options worked out here. The one tensor meshgrad broadcasts
    is the token count, in int64 or float64: none of the dtypes that function converts
    (complex, float8)."""
    direct = isinstance(group, dist.ProcessGroup)
    options = None
    if direct:
        options = _blocking(dist.BroadcastOptions())
        options.rootRank, options.rootTensor = dist.get_group_rank(group, src), 0

    def cast(tensor: torch.Tensor) -> None:
        if direct and _layer_idle(dist.broadcast, _TORCH_BROADCAST, tensor):
            group.broadcast([tensor], options).wait()
        else:
            dist.broadcast(tensor, src=src, group=group)

    return cast


def bind_reduce_scatter(group: Any, op: ReduceOp, size: int, rank: int, numel: int) -> Callable[[torch.Tensor], int]:
    """Distributed-optimizer reduce-scatter of a flat tensor of ``numel`` elements in
    place: this rank's shard (:func:`meshgrad.plan.scatter_shard`, members by ascending
    global rank) receives the reduced values; every other element keeps its local value.

    The group's layout (its members, this rank's shard, whether group ranks follow global
    ranks) is read once here: a call asks the group nothing, whatever its size (reading
    it took about 200 us per call for a group of 512).

    Returns:
      A function of the flat tensor, returning the bytes it copied on the way (padding,
      shard write-back).
    """
    members = dist.get_process_group_ranks(group)
    index = sorted(members).index(rank)
    start, stop = scatter_shard(numel, size, index)
    shard = -(-numel // size)
    ordered = members == sorted(members) and [dist.get_group_rank(group, r) for r in members] == list(range(size))
    torch_op, divide = _torch_op(group, op)
    reduce = None if ordered else bind_all_reduce(group, op, size)

    def scatter_into(flat: torch.Tensor) -> int:
        copied = (stop - start) * flat.element_size()
        if reduce is None:
            if shard * size == numel:
                padded = flat
            else:
                padded = flat.new_zeros(shard * size)
                padded[:numel].copy_(flat)
                copied += numel * flat.element_size()
            out = padded.new_empty(shard)
            # reduce_scatter_single is the newer name of reduce_scatter_tensor (deprecated in 2.13).
            scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            scatter(out, padded, op=torch_op, group=group)
            if divide:
                out.div_(size)
        else:  # group ranks not in global-rank order: reduce everything, keep our shard
            out = flat.clone()
            copied += numel * flat.element_size()
            reduce(out)
            out = out[index * shard : index * shard + shard]
        flat[start:stop].copy_(out[: stop - start])
        return copied

    return scatter_into


def reduce_scatter_into(flat: torch.Tensor, group: Any, op: ReduceOp, size: int, rank: int) -> int:
    """:func:`bind_reduce_scatter` of ``flat``, once.

    Returns:
      Bytes copied on the way (padding, shard write-back).
    """
    return bind_reduce_scatter(group, op, size, rank, flat.numel())(flat)
