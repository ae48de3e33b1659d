"""Execute a meshgrad FinalizePlan with torch.distributed, mutating gradients in place.

Each :class:`~meshgrad.plan.Reduction` is one coalesced collective: the gradients of its
keys (plus their chunk copies) go through one flat buffer -- no copy at all when they
already lie back to back in one storage, in the plan's key order (meshgrad's
:mod:`torch_impl.buffers` or Megatron's grad buffers) -- are pre-scaled, all-reduced over
the planned group and written back. A group of size 1 only applies the pre-scale. Router
updates use :mod:`meshgrad.rules`, so the math is written once.

Plan once, run many: :class:`torch_impl.run.program.Program` binds a plan's actions to the gradient tensors of
one step (flat spans, staging buffers, copy lists are found once), and stays valid while
:class:`~torch_impl.call.watches.GradWatch` sees the same tensors, so a repeated step does O(collectives) Python
work. Bytes that coalescing has to copy (user-owned, non-contiguous storage) are counted
in :class:`~torch_impl.run.stats.ExecStats`. The collectives are in
:mod:`torch_impl.run.collectives`, staging in :mod:`torch_impl.run.staging`, the num_tokens scale in
:mod:`torch_impl.run.scaling`. :data:`EXECUTORS` is the one table from action type to executor.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from meshgrad import rules
from meshgrad.params import ParamKey
from meshgrad.errors import FinalizeTypeError
from meshgrad.plan import (
    Action,
    ExpertBiasUpdate,
    QbBetaUpdate,
    ReduceOp,
    Reduction,
    ResetTemporaries,
    StageReduction,
    TokenScale,
)
from torch_impl.run.collectives import TORCH_DTYPES, all_reduce, bind_all_reduce, bind_reduce_scatter
from torch_impl.run.errors import action_failed, collective_error, collective_failure
from torch_impl.run.stats import ExecStats
from torch_impl.run.grads import GradAccess, get_grad, grad_attr, is_dtensor
from torch_impl.run.groups import TorchGroups
from torch_impl.run.staging import _Staging, flat_span, nbytes

#: Largest staging buffer (bytes) a bound reduction keeps between calls; larger ones are
#: allocated per call, so user-owned gradients are never held twice.
PERSISTENT_STAGING_BYTES = 16 * 2**20


def _bind_scale_only(
    targets: list[torch.Tensor], pairs: list[tuple[torch.Tensor, torch.Tensor]], pre_scale: float
) -> Callable[[], None]:
    """A reduction without a collective (size-1 group): chunk copies summed in, the
    pre-scale applied to ``targets``, the result written to every copy."""

    def scale_only() -> None:
        for tensor, other in pairs:
            tensor.add_(other)
        if pre_scale != 1.0:
            torch._foreach_mul_(targets, pre_scale)
        for tensor, other in pairs:
            other.copy_(tensor)

    return scale_only

def apply_reduction(
    action: Reduction, grads: Mapping[ParamKey, torch.Tensor], groups: TorchGroups, stats: ExecStats
) -> Callable[[], None]:
    """One coalesced collective (semantics `dp_sync` to `gtp`) bound to its gradient tensors.

    Binding finds, once, whether the reduced gradients lie back to back in one storage
    in key order and in the collective's dtype (then the collective runs on that span in
    place, no copy) or else prepares a staging buffer (then each call copies in, reduces
    and copies back, one op each way: :class:`_Staging`, counting the bytes). A staging
    buffer of up to :data:`PERSISTENT_STAGING_BYTES` lives as long as the binding; a
    larger one is allocated per call (no second copy of a model's gradients is kept). Without a
    collective (a size-1 group) only the pre-scale runs, on the tensors themselves.

    Returns:
      A function that runs the reduction: chunk copies summed in, pre-scale, reduce,
      result written to every copy.
    """
    tensors = [grads[k] for k in action.keys]
    pairs = [(tensor, grads[k]) for tensor, keys in zip(tensors, action.copies or ()) for k in keys]
    work = TORCH_DTYPES[action.work_dtype]
    group, size = groups.group(action.group), groups.size(action.group)
    scatter = action.scatter and group is not None
    pre_scale, op, rank = action.pre_scale, action.op, groups.rank
    flat = flat_span(tensors) if all(t.dtype == work for t in tensors) else None
    if group is None and (flat is not None or all(t.dtype == work for t in tensors)):
        return _bind_scale_only([flat] if flat is not None else tensors, pairs, pre_scale)
    sizes = [t.numel() for t in tensors]
    staging = flat is None
    copied = 2 * nbytes(tensors) if staging else 0
    persistent = staging and sum(sizes) * work.itemsize <= PERSISTENT_STAGING_BYTES
    stage = _Staging(tensors, sizes, work, keep=persistent) if staging else None
    # the reduce-scatter gives the bytes it copied; the all-reduce copies none (None)
    collective = bind_reduce_scatter(group, op, size, rank, sum(sizes)) if scatter else bind_all_reduce(group, op, size)

    def run() -> None:
        for tensor, other in pairs:
            tensor.add_(other)
        buffer, staged = flat, None
        if stage is not None:
            staged = stage.copy_in()
            buffer = staged[0]
        if pre_scale != 1.0:
            buffer.mul_(pre_scale)
        extra = collective(buffer) or 0
        if staged is not None:
            stage.copy_out(staged)
        stats.bytes_copied += copied + extra
        for tensor, other in pairs:
            other.copy_(tensor)

    return run


def apply_stage_reduction(
    action: StageReduction, grads: Mapping[ParamKey, torch.Tensor], groups: TorchGroups, stats: ExecStats
) -> Callable[[], None] | None:
    """semantics `word_embedding` / `pos_embedding`: ``action.op`` (SUM) over the embedding group, only on member stages with a key.

    Returns:
      The bound reduction, or None when this rank has nothing to do.
    """
    key = action.key_for(groups.embedding_stage(action.group))
    group, size = groups.group(action.group), groups.size(action.group)
    if key is None or group is None:
        return None
    tensor = grads[key]
    reduce = bind_all_reduce(group, action.op, size)
    param = grads.params[key] if isinstance(grads, GradAccess) and grads.local_shards else None
    if param is not None and is_dtensor(get_grad(param)):
        # Megatron-FSDP: as Megatron, the reduced local shard becomes the gradient (a plain tensor).
        def run_fsdp() -> None:
            reduce(tensor)
            setattr(param, grad_attr(param), tensor)

        return run_fsdp
    if tensor.is_contiguous():
        return lambda: reduce(tensor)
    copied = 2 * nbytes([tensor])

    def run() -> None:
        flat = tensor.contiguous()
        reduce(flat)
        tensor.copy_(flat)
        stats.bytes_copied += copied

    return run


def _split(flat: torch.Tensor, lengths: Iterable[int]) -> list[torch.Tensor]:
    return list(torch.split(flat, list(lengths)))


def apply_expert_bias(action: ExpertBiasUpdate, routers: Mapping[ParamKey, nn.Module], groups: TorchGroups) -> None:
    """semantics `expert_bias`: one SUM of every router's token counts over tp_dp_cp, then the sign update."""
    modules = [routers[k] for k in action.routers]
    biases = [m.expert_bias for m in modules]
    tokens = [m.local_tokens_per_expert for m in modules]
    group, size = groups.group(action.group), groups.size(action.group)
    first = biases[0]
    if all(
        b.dim() == 1 and b.shape == first.shape and b.dtype == first.dtype and b.device == first.device
        and t.numel() == b.numel() and t.device == b.device
        for b, t in zip(biases, tokens)
    ):
        # Every router alike (the usual case): stacked [L, E], one update, as Megatron does.
        counts = torch.stack([t.reshape(-1).to(torch.float32) for t in tokens])
        all_reduce(counts, group, ReduceOp.SUM, size)
        updated = rules.expert_bias_update(torch.stack(biases), counts, action.rate, torch)
        torch._foreach_copy_(biases, list(updated.unbind(0)))
        return
    counts = torch.cat([t.reshape(-1).to(torch.float32) for t in tokens])
    all_reduce(counts, group, ReduceOp.SUM, size)
    for bias, summed in zip(biases, _split(counts, action.num_experts)):
        bias.copy_(rules.expert_bias_update(bias, summed.view(bias.shape), action.rate, torch))


def apply_qb_beta(action: QbBetaUpdate, routers: Mapping[ParamKey, nn.Module], groups: TorchGroups) -> None:
    """semantics `qb_beta`: one AVG of accum/max(count,1) over the group, EMA blend, re-centre."""
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


def apply_reset(action: ResetTemporaries, routers: Mapping[ParamKey, nn.Module]) -> None:
    """semantics `reset`: zero token counts and qb accumulators, reset the global aux-loss tracker."""
    zero = []
    for key in action.zero_tokens:
        tokens = getattr(routers[key], action.TOKENS, None)
        if tokens is not None:
            zero.append(tokens)
    for key in action.zero_qb:
        for attr in action.QB_ACCUMULATORS:
            value = getattr(routers[key], attr, None)
            if value is not None:
                zero.append(value)
    if zero:
        torch._foreach_zero_(zero)
    for key in action.reset_aux_loss:
        routers[key].reset_global_aux_loss_tracker()

def _noop() -> None:
    return None


Binder = Callable[[Any, Mapping[ParamKey, torch.Tensor], Mapping[ParamKey, nn.Module], TorchGroups, "ExecStats"], Callable[[], None]]


def apply_token_scale(action: TokenScale, *_: Any) -> Callable[[], None]:
    raise FinalizeTypeError("TokenScale needs num_tokens: use global_token_scale and scale_grads")


#: The one table from action type to executor: each entry binds an action to its
#: tensors, routers and groups and returns what runs it.
EXECUTORS: Mapping[type, Binder] = types.MappingProxyType(
    {
        Reduction: lambda a, grads, routers, groups, stats: apply_reduction(a, grads, groups, stats),
        StageReduction: lambda a, grads, routers, groups, stats: apply_stage_reduction(a, grads, groups, stats)
        or _noop,
        ExpertBiasUpdate: lambda a, grads, routers, groups, stats: lambda: apply_expert_bias(a, routers, groups),
        QbBetaUpdate: lambda a, grads, routers, groups, stats: lambda: apply_qb_beta(a, routers, groups),
        ResetTemporaries: lambda a, grads, routers, groups, stats: lambda: apply_reset(a, routers),
        TokenScale: apply_token_scale,
    }
)


def bind_action(
    action: Action,
    grads: Mapping[ParamKey, torch.Tensor],
    routers: Mapping[ParamKey, nn.Module],
    groups: TorchGroups,
    stats: "ExecStats",
) -> Callable[[], None]:
    """One planned action bound to its tensors and groups, ready to run (:data:`EXECUTORS`).

    Raises:
      TypeError: a TokenScale (it needs num_tokens) or an unknown action.
    """
    binder = EXECUTORS.get(type(action))
    if binder is None:
        raise FinalizeTypeError(f"unknown plan action {type(action).__name__}")  # pragma: no cover
    return binder(action, grads, routers, groups, stats)


def finish_ddp_sync(ddp: Sequence[Any], force_kwarg: Sequence[bool], force: bool, groups: TorchGroups) -> None:
    """Step 1 of the chunks a Megatron DDP syncs: each DDP's own ``finish_grad_sync``
    (passed ``force_all_reduce`` where it takes it)."""
    for obj, kwarg in zip(ddp, force_kwarg):
        try:  # (not a collective_guard: its name would be formatted on every step)
            if kwarg:
                obj.finish_grad_sync(force_all_reduce=force)
            else:
                obj.finish_grad_sync()
        except RuntimeError as err:
            if not collective_failure(err):
                raise
            raise collective_error(f"dp_sync: {type(obj).__name__}.finish_grad_sync()", groups, None, err) from err


def execute_ops(
    ops: Iterable[tuple[Action, Callable[[], None]]], on_step: Callable[[Action], None] | None = None
) -> None:
    """Run bound actions in order (the one loop both execution paths go through).

    A RuntimeError of an action (a collective whose peer died or stalled past the
    process-group timeout) is re-raised as :class:`torch_impl.run.errors.CollectiveError`
    naming the rank and the action: step, op, group and tensor count.
    """
    for index, (action, run) in enumerate(ops):
        if on_step is not None:
            on_step(action)
        try:
            run()
        except RuntimeError as err:
            raise action_failed(action, index, err) from err


def execute_local(
    actions: Sequence[Action],
    grads: GradAccess,
    routers: Mapping[ParamKey, nn.Module],
    groups: TorchGroups,
    on_step: Callable[[Action], None] | None = None,
    stats: ExecStats | None = None,
) -> None:
    """Run planned actions in order, under ``torch.no_grad()``, binding each one just
    before it runs (DTensor gradients are unsharded on first use).

    Args:
      actions: the plan's actions (any subset, in order).
      grads: gradient access for the plan's keys.
      routers: router modules by key.
      groups: this rank's process groups.
      on_step: called before each action (hooks, timers).
      stats: counters to add copied bytes to.
    """
    stats = stats if stats is not None else ExecStats()

    def ops() -> Iterator[tuple[Action, Callable[[], None]]]:
        for action in actions:
            yield action, bind_action(action, grads, routers, groups, stats)

    with torch.no_grad():
        execute_ops(ops(), on_step)
        grads.flush()
