"""Execute a meshgrad FinalizePlan with torch.distributed, mutating gradients in place.

Each :class:`~meshgrad.plan.Reduction` is one coalesced collective: the gradients of its
keys (plus their chunk copies) go through one flat buffer -- no copy at all when they
already lie back to back in one storage, in the plan's key order (meshgrad's
:mod:`torch_impl.buffers` or Megatron's grad buffers) -- are pre-scaled, all-reduced over
the planned group and written back. A group of size 1 only applies the pre-scale. Router
updates use :mod:`meshgrad.rules`, so the math is written once.

Plan once, run many: :class:`Program` binds a plan's actions to the gradient tensors of
one step (flat spans, staging buffers, copy lists are found once), and stays valid while
:class:`~torch_impl.grads.GradWatch` sees the same tensors, so a repeated step does O(collectives) Python
work. Bytes that coalescing has to copy (user-owned, non-contiguous storage) are counted
in :class:`ExecStats`. :data:`EXECUTORS` is the one table from action type to executor.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshgrad import rules
from meshgrad.axes import Group
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
    scatter_shard,
)
from torch_impl.errors import action_failed
from torch_impl.grads import GradAccess, get_grad, grad_attr, is_dtensor
from torch_impl.groups import TorchGroups

# --------------------------------------------------------------------------- collectives

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


#: Largest staging buffer (bytes) a bound reduction keeps between calls; larger ones are
#: allocated per call, so user-owned gradients are never held twice.
PERSISTENT_STAGING_BYTES = 16 * 2**20


@dataclasses.dataclass
class ExecStats:
    """Counters of one model's finalize calls (kept on its cached state, never global).

    Args:
      calls: finalize calls run.
      bytes_copied: gradient bytes copied to coalesce: into a staging buffer and back
        (plus reduce-scatter padding and shard write-back). 0 when every reduced
        gradient lies in place in a flat buffer in plan order.
      programs_bound: times a plan was bound to gradient tensors (rebinding happens when
        the gradient tensor objects change, e.g. ``zero_grad(set_to_none=True)``).
      plans_built: times a plan was built (the O(parameters) work).
    """

    calls: int = 0
    bytes_copied: int = 0
    programs_bound: int = 0
    plans_built: int = 0


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


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


class _Staging:
    """The copies between a reduction's gradient tensors and a flat staging buffer laid
    out in their order, one op each way.

    A buffer kept between calls: ``_foreach_copy_`` over views of it made once (the
    fastest for many small tensors). A buffer made per call (a large one): when every
    tensor is contiguous and of the buffer's dtype, ``torch.cat`` in and
    ``split_with_sizes_copy`` out over flat views of the tensors made once, so that no
    Python view is made per tensor per call; else ``_foreach_copy_`` over views of the
    buffer made per call (cast and strided as needed).

    Args:
      tensors: the gradient tensors, in buffer order.
      sizes: their numel.
      dtype: the buffer's dtype (the collective's).
      keep: the buffer is kept between calls (then so are its views).
    """

    def __init__(self, tensors: list[torch.Tensor], sizes: list[int], dtype: torch.dtype, keep: bool) -> None:
        self.tensors, self.sizes, self.dtype = tensors, sizes, dtype
        self.shapes = [t.shape for t in tensors]
        plain = not keep and all(t.dtype == dtype and t.is_contiguous() for t in tensors)
        self.flats = [t.view(-1) for t in tensors] if plain else None
        self.kept = self._new() if keep else None

    def _new(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A new (uninitialized) buffer and the views the copies use."""
        buffer = torch.empty(sum(self.sizes), dtype=self.dtype, device=self.tensors[0].device)
        if self.flats is not None:
            return buffer, self.flats
        return buffer, [v.view(s) for v, s in zip(torch.split(buffer, self.sizes), self.shapes)]

    def copy_in(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The buffer (the kept one or a new one) filled with the tensors, with the views
        :meth:`copy_out` takes."""
        buffer, views = staged = self.kept or self._new()
        if self.flats is not None:
            torch.cat(self.flats, out=buffer)
        else:
            torch._foreach_copy_(views, self.tensors)
        return staged

    def copy_out(self, staged: tuple[torch.Tensor, list[torch.Tensor]]) -> None:
        """Copy the buffer of :meth:`copy_in` back into the tensors."""
        buffer, views = staged
        if self.flats is not None:
            torch.split_with_sizes_copy(buffer, self.sizes, out=self.flats)
        else:
            torch._foreach_copy_(self.tensors, views)


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
    flat = _span(tensors) if all(t.dtype == work for t in tensors) else None
    if group is None and (flat is not None or all(t.dtype == work for t in tensors)):
        return _bind_scale_only([flat] if flat is not None else tensors, pairs, pre_scale)
    sizes = [t.numel() for t in tensors]
    staging = flat is None
    copied = 2 * _nbytes(tensors) if staging else 0
    persistent = staging and sum(sizes) * work.itemsize <= PERSISTENT_STAGING_BYTES
    stage = _Staging(tensors, sizes, work, keep=persistent) if staging else None

    def run() -> None:
        for tensor, other in pairs:
            tensor.add_(other)
        buffer, staged = flat, None
        if stage is not None:
            staged = stage.copy_in()
            buffer = staged[0]
        if pre_scale != 1.0:
            buffer.mul_(pre_scale)
        extra = 0
        if scatter:
            extra = reduce_scatter_into(buffer, group, op, size, rank)
        else:
            all_reduce(buffer, group, op, size)
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
    param = grads.params[key] if isinstance(grads, GradAccess) and grads.local_shards else None
    if param is not None and is_dtensor(get_grad(param)):
        # Megatron-FSDP: as Megatron, the reduced local shard becomes the gradient (a plain tensor).
        def run_fsdp() -> None:
            all_reduce(tensor, group, action.op, size)
            setattr(param, grad_attr(param), tensor)

        return run_fsdp
    if tensor.is_contiguous():
        return lambda: all_reduce(tensor, group, action.op, size)
    copied = 2 * _nbytes([tensor])

    def run() -> None:
        flat = tensor.contiguous()
        all_reduce(flat, group, action.op, size)
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
        tokens = getattr(routers[key], "local_tokens_per_expert", None)
        if tokens is not None:
            zero.append(tokens)
    for key in action.zero_qb:
        for attr in ("qb_beta_accum", "qb_beta_count"):
            value = getattr(routers[key], attr, None)
            if value is not None:
                zero.append(value)
    if zero:
        torch._foreach_zero_(zero)
    for key in action.reset_aux_loss:
        routers[key].reset_global_aux_loss_tracker()


def global_token_scale(num_tokens: torch.Tensor, action: TokenScale, groups: TorchGroups) -> torch.Tensor:
    """Per-token scaling: broadcast num_tokens from the last pp stage, SUM it over the
    planned group, and return the factor that divides every gradient (no host sync).

    The count is reduced in int64 (float64 for floating input), so int8..int32 counts do
    not overflow, and written back into ``num_tokens``, which holds the global count
    afterwards, as in Megatron (wrapped to its dtype if it cannot hold it). The factor is
    Megatron's ``1.0 / clamp(n, min=1)``: in ``num_tokens``' floating dtype, or the default
    float dtype (float32) for integer counts, with ``num_tokens``' shape.
    """
    wide = torch.float64 if num_tokens.is_floating_point() else torch.int64
    total = num_tokens.detach().to(wide, copy=True)
    pp = groups.group(Group.PP)
    if groups.token_broadcast is not None:
        group, source = groups.token_broadcast
        dist.broadcast(total, src=source, group=group)
    elif pp is not None:
        dist.broadcast(total, src=groups.pp_last_rank, group=pp)
    all_reduce(total, groups.group(action.group), ReduceOp.SUM, groups.size(action.group))
    num_tokens.detach().copy_(total)
    counted = num_tokens.detach() if num_tokens.is_floating_point() else total
    return torch.clamp(counted, min=1).reciprocal()


def scale_grads(tensors: Sequence[torch.Tensor], scale: torch.Tensor) -> None:
    """Multiply every tensor in place by the 0-d float32 ``scale`` (on device)."""
    bind_scale(tensors)(scale)


def coalesce(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The fewest tensors covering ``tensors``: contiguous tensors that lie back to back
    in one storage are merged into one 1-D span (overlapping ones are kept apart)."""
    spans: list[tuple[Any, int, torch.Tensor]] = []
    other: list[torch.Tensor] = []
    for t in tensors:
        try:
            ptr = t.untyped_storage().data_ptr() if t.is_contiguous() else None
        except (RuntimeError, NotImplementedError):
            ptr = None
        if ptr is None or t.numel() == 0:
            other.append(t)
        else:
            spans.append(((ptr, t.dtype, t.device), t.storage_offset(), t))
    spans.sort(key=lambda item: (str(item[0]), item[1]))
    out: list[torch.Tensor] = []
    run: list[torch.Tensor] = []
    end = None
    for where, offset, t in spans:
        if run and (where, offset) == end:
            run.append(t)
        else:
            if run:
                out.append(_merge(run))
            run = [t]
        end = (where, offset + t.numel())
    if run:
        out.append(_merge(run))
    return out + other


def _merge(run: list[torch.Tensor]) -> torch.Tensor:
    if len(run) == 1:
        return run[0]
    first = run[0]
    total = sum(t.numel() for t in run)
    return first.as_strided((total,), (1,), first.storage_offset())


def bind_scale(tensors: Sequence[torch.Tensor]) -> Callable[[torch.Tensor], None]:
    """Multiplication of ``tensors`` by a 0-d float32 factor, bound once: back-to-back
    gradients (a flat buffer) become one span, one ``_foreach_mul_`` per device and dtype.
    The factor stays on device (no host sync)."""
    by_kind: dict[tuple[Any, Any], list[torch.Tensor]] = {}
    for t in coalesce(tensors):
        by_kind.setdefault((t.device, t.dtype), []).append(t)
    kinds = [(device, group) for (device, _), group in by_kind.items()]

    def run(scale: torch.Tensor) -> None:
        for device, group in kinds:
            factor = scale if scale.device == device else scale.to(device)
            if factor.dim() == 0 or torch.result_type(group[0], factor) == group[0].dtype:
                torch._foreach_mul_(group, factor.reshape(()))
            else:  # a wider one-element factor (float64 num_tokens): multiply as Megatron's `*=`
                for t in group:
                    t.copy_((t * factor).reshape(t.shape))

    return run


# --------------------------------------------------------------------------- plan


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


def execute_ops(
    ops: Iterable[tuple[Action, Callable[[], None]]], on_step: Callable[[Action], None] | None = None
) -> None:
    """Run bound actions in order (the one loop both execution paths go through).

    A RuntimeError of an action (a collective whose peer died or stalled past the
    process-group timeout) is re-raised as :class:`torch_impl.errors.CollectiveError`
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


class Program:
    """A plan's actions bound to one set of gradient tensors.

    Everything that depends only on the plan and the tensors -- flat spans, staging
    buffers and their views, copy lists, the groups of each collective, the spans the
    num_tokens scale multiplies -- is computed here once; :meth:`run` then does
    O(collectives) work. Valid while the parameters hold the same gradient tensors
    (:class:`~torch_impl.grads.GradWatch`); not for DTensor gradients (they are unsharded per step).

    Args:
      actions: the actions to run (TokenScale excluded).
      grads: gradient tensor by key (plain tensors).
      routers: router modules by key.
      groups: this rank's process groups.
      stats: counters (copied bytes).
      scale_keys: the gradients :meth:`scale` multiplies.
    """

    def __init__(
        self,
        actions: Sequence[Action],
        grads: Mapping[ParamKey, torch.Tensor],
        routers: Mapping[ParamKey, nn.Module],
        groups: TorchGroups,
        stats: ExecStats,
        scale_keys: Sequence[ParamKey] = (),
    ) -> None:
        self.ops = [(a, bind_action(a, grads, routers, groups, stats)) for a in actions]
        self._scale = bind_scale([grads[k] for k in scale_keys])
        stats.programs_bound += 1

    def run(self, on_step: Callable[[Action], None] | None = None) -> None:
        """Run every bound action in order, under ``torch.no_grad()``."""
        if not torch.is_grad_enabled():  # finalize already runs it under no_grad
            execute_ops(self.ops, on_step)
            return
        with torch.no_grad():
            execute_ops(self.ops, on_step)

    def scale(self, factor: torch.Tensor) -> None:
        """Multiply the bound gradients by the 0-d float32 ``factor`` (num_tokens scale)."""
        with torch.no_grad():
            self._scale(factor)
