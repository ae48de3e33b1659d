"""Execute a meshgrad FinalizePlan with torch.distributed, mutating gradients in place.

Each :class:`~meshgrad.plan.Reduction` is one coalesced collective: the gradients of its
keys (plus their chunk copies) go through one flat buffer -- no copy at all when they
already lie back to back in one storage, as Megatron's grad buffers do -- are pre-scaled,
all-reduced over the planned group and written back. A group of size 1 only applies the
pre-scale. Router updates use :mod:`meshgrad.rules`, so the math is written once.
"""

from __future__ import annotations

import sys

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshgrad import rules
from meshgrad.axes import Group
from meshgrad.params import ParamKey
from meshgrad.plan import (
    Action,
    ExpertBiasUpdate,
    QbBetaUpdate,
    ReduceOp,
    Reduction,
    ResetTemporaries,
    StageReduction,
    TokenScale,
    scatter_shard,
)
from torch_impl.discover import get_grad
from torch_impl.groups import TorchGroups

# --------------------------------------------------------------------------- DTensor


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor (without importing the slow DTensor package: no
    DTensor can exist before ``torch.distributed.tensor`` is imported)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def unshard(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor made whole (``full_tensor()``); any other tensor unchanged."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


def reshard(tensor: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``tensor`` sharded like the DTensor ``reference`` (no communication: every rank
    holds the whole tensor), keeping the attributes set on ``reference``."""
    from torch.distributed.tensor import distribute_tensor

    out = distribute_tensor(tensor, reference.device_mesh, reference.placements, src_data_rank=None)
    for name, value in vars(reference).items():
        if not name.startswith("_"):
            setattr(out, name, value)
    return out


class GradAccess:
    """Per-step access to gradients by key.

    Plain tensors are used in place. A DTensor gradient is unsharded on first use and
    written back into its local shard by :meth:`flush`; with ``local_shards`` (Megatron
    FSDP) its local shard is used directly.

    Args:
      params: parameter objects by key.
      local_shards: reduce DTensor local shards instead of whole tensors.
    """

    def __init__(self, params: Mapping[ParamKey, torch.Tensor], local_shards: bool = False) -> None:
        self.params = params
        self.local_shards = local_shards
        self._work: dict[ParamKey, torch.Tensor] = {}
        self._dtensors: dict[ParamKey, torch.Tensor] = {}

    def __getitem__(self, key: ParamKey) -> torch.Tensor:
        work = self._work.get(key)
        if work is None:
            grad = get_grad(self.params[key])
            if grad is None:
                raise ValueError(f"parameter {key[1]!r} (chunk {key[0]}) lost its gradient after planning")
            if is_dtensor(grad):
                if self.local_shards:
                    work = grad.to_local()
                else:
                    work = grad.full_tensor()
                    self._dtensors[key] = grad
            else:
                work = grad
            self._work[key] = work
        return work

    def flush(self) -> None:
        """Write unsharded DTensor gradients back into their local shards."""
        for key, grad in self._dtensors.items():
            grad.to_local().copy_(reshard(self._work[key], grad).to_local())
        self._dtensors.clear()
        self._work.clear()


# --------------------------------------------------------------------------- collectives

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


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


def reduce_scatter_into(flat: torch.Tensor, group: Any, op: ReduceOp, size: int, rank: int) -> None:
    """Distributed-optimizer reduce-scatter of ``flat`` in place: this rank's shard
    (:func:`meshgrad.plan.scatter_shard`, members by ascending global rank) receives the
    reduced values; every other element keeps its local value."""
    members = dist.get_process_group_ranks(group)
    index = sorted(members).index(rank)
    start, stop = scatter_shard(flat.numel(), size, index)
    shard = -(-flat.numel() // size)
    if members == sorted(members) and [dist.get_group_rank(group, r) for r in members] == list(range(size)):
        padded = flat.new_zeros(shard * size)
        padded[: flat.numel()].copy_(flat)
        out = padded.new_empty(shard)
        native = op is ReduceOp.AVG and _native_avg(group)
        # reduce_scatter_single is the newer name of reduce_scatter_tensor (deprecated in 2.13).
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        scatter(out, padded, op=dist.ReduceOp.AVG if native else dist.ReduceOp.SUM, group=group)
        if op is ReduceOp.AVG and not native:
            out.div_(size)
    else:  # group ranks not in global-rank order: reduce everything, keep our shard
        out = flat.clone()
        all_reduce(out, group, op, size)
        out = out[index * shard : index * shard + shard]
    flat[start:stop].copy_(out[: stop - start])


def _span(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A 1-D view covering ``tensors`` when they lie back to back in one storage."""
    first = tensors[0]
    if not all(t.is_contiguous() for t in tensors):
        return None
    try:
        storage = first.untyped_storage().data_ptr()
        offset = first.storage_offset()
        for t in tensors:
            if t.dtype != first.dtype or t.device != first.device:
                return None
            if t.untyped_storage().data_ptr() != storage or t.storage_offset() != offset:
                return None
            offset += t.numel()
    except (RuntimeError, NotImplementedError):
        return None
    total = offset - first.storage_offset()
    return first.as_strided((total,), (1,), first.storage_offset())


def run_reduction(action: Reduction, grads: GradAccess, groups: TorchGroups) -> None:
    """One coalesced collective (SPEC 2.1-2.5): local copies in, pre-scale, reduce, out."""
    tensors = [grads[k] for k in action.keys]
    copies = [[grads[k] for k in keys] for keys in action.copies] if action.copies else []
    for tensor, extra in zip(tensors, copies):
        for other in extra:
            tensor.add_(other)
    work_dtype = torch.float32 if action.reduce_in_fp32 else tensors[0].dtype
    flat = _span(tensors) if work_dtype == tensors[0].dtype else None
    if flat is None:
        flat = torch.cat([t.reshape(-1).to(work_dtype) for t in tensors])
        in_place = False
    else:
        in_place = True
    if action.pre_scale != 1.0:
        flat.mul_(action.pre_scale)
    group, size = groups.group(action.group), groups.size(action.group)
    if action.scatter and group is not None:
        reduce_scatter_into(flat, group, action.op, size, groups.rank)
    else:
        all_reduce(flat, group, action.op, size)
    if not in_place:
        offset = 0
        for tensor in tensors:
            n = tensor.numel()
            tensor.copy_(flat[offset : offset + n].view(tensor.shape))
            offset += n
    for tensor, extra in zip(tensors, copies):
        for other in extra:
            other.copy_(tensor)


def run_stage_reduction(action: StageReduction, grads: GradAccess, groups: TorchGroups) -> None:
    """SPEC 2.6 / 2.7: SUM over the embedding group, only on member stages with a key."""
    key = action.key_for(groups.pp_stage)
    group = groups.group(action.group)
    if key is None or group is None:
        return
    tensor = grads[key]
    if tensor.is_contiguous():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    else:
        flat = tensor.contiguous()
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        tensor.copy_(flat)


def _split(flat: torch.Tensor, lengths: Iterable[int]) -> list[torch.Tensor]:
    return list(torch.split(flat, list(lengths)))


def run_expert_bias(action: ExpertBiasUpdate, routers: Mapping[ParamKey, nn.Module], groups: TorchGroups) -> None:
    """SPEC 2.8: one SUM of every router's token counts over tp_dp_cp, then the sign update."""
    modules = [routers[k] for k in action.routers]
    counts = torch.cat([m.local_tokens_per_expert.reshape(-1).to(torch.float32) for m in modules])
    all_reduce(counts, groups.group(action.group), ReduceOp.SUM, groups.size(action.group))
    for module, tokens in zip(modules, _split(counts, action.num_experts)):
        bias = module.expert_bias
        bias.copy_(rules.expert_bias_update(bias, tokens.view(bias.shape), action.rate, torch))


def run_qb_beta(action: QbBetaUpdate, routers: Mapping[ParamKey, nn.Module], groups: TorchGroups) -> None:
    """SPEC 2.9: one AVG of accum/max(count,1) over the group, EMA blend, re-centre."""
    modules = [routers[k] for k in action.routers]
    local = torch.cat(
        [
            rules.qb_local(m.qb_beta_accum.to(torch.float32), m.qb_beta_count.to(torch.float32), torch).reshape(-1)
            for m in modules
        ]
    )
    all_reduce(local, groups.group(action.group), ReduceOp.AVG, groups.size(action.group))
    for module, mean in zip(modules, _split(local, action.num_experts)):
        qb = module.qb_beta
        qb.copy_(rules.qb_beta_update(qb.to(torch.float32), mean.view(qb.shape), action.ema))


def run_reset(action: ResetTemporaries, routers: Mapping[ParamKey, nn.Module]) -> None:
    """SPEC 2.10: zero token counts and qb accumulators, reset the global aux-loss tracker."""
    for key in action.zero_tokens:
        tokens = getattr(routers[key], "local_tokens_per_expert", None)
        if tokens is not None:
            tokens.zero_()
    for key in action.zero_qb:
        for attr in ("qb_beta_accum", "qb_beta_count"):
            value = getattr(routers[key], attr, None)
            if value is not None:
                value.zero_()
    for key in action.reset_aux_loss:
        routers[key].reset_global_aux_loss_tracker()


def global_token_scale(num_tokens: torch.Tensor, action: TokenScale, groups: TorchGroups) -> torch.Tensor:
    """SPEC 2.11: broadcast num_tokens from the last pp stage, SUM over the planned group,
    return ``1 / max(n, 1)`` as a float32 tensor on num_tokens' device (no host sync)."""
    total = num_tokens.detach().clone()
    pp = groups.group(Group.PP)
    if pp is not None:
        dist.broadcast(total, src=groups.pp_last_rank, group=pp)
    all_reduce(total, groups.group(action.group), ReduceOp.SUM, groups.size(action.group))
    return rules.token_scale(total, torch).to(torch.float32)


def scale_grads(tensors: Sequence[torch.Tensor], scale: torch.Tensor) -> None:
    """Multiply every tensor in place by the 0-d float32 ``scale`` (on device)."""
    by_kind: dict[tuple[Any, Any], list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.device, t.dtype), []).append(t)
    for (device, _), group in by_kind.items():
        factor = scale if scale.device == device else scale.to(device)
        torch._foreach_mul_(group, factor)


# --------------------------------------------------------------------------- plan


def run_actions(
    actions: Sequence[Action],
    grads: GradAccess,
    routers: Mapping[ParamKey, nn.Module],
    groups: TorchGroups,
    on_step: Callable[[Action], None] | None = None,
) -> None:
    """Run planned actions in order, under ``torch.no_grad()``.

    Args:
      actions: the plan's actions (any subset, in order).
      grads: gradient access for the plan's keys.
      routers: router modules by key.
      groups: this rank's process groups.
      on_step: called before each action (hooks, timers).
    """
    with torch.no_grad():
        for action in actions:
            if on_step is not None:
                on_step(action)
            if isinstance(action, Reduction):
                run_reduction(action, grads, groups)
            elif isinstance(action, StageReduction):
                run_stage_reduction(action, grads, groups)
            elif isinstance(action, ExpertBiasUpdate):
                run_expert_bias(action, routers, groups)
            elif isinstance(action, QbBetaUpdate):
                run_qb_beta(action, routers, groups)
            elif isinstance(action, ResetTemporaries):
                run_reset(action, routers)
            elif isinstance(action, TokenScale):
                raise TypeError("TokenScale needs num_tokens: use global_token_scale and scale_grads")
            else:  # pragma: no cover
                raise TypeError(f"unknown plan action {type(action).__name__}")
        grads.flush()
