"""Local checks before any communication: nothing communicated, nothing mutated.

Gradients (:func:`check_gradients`): a dense floating tensor of the parameter's shape,
every one on one device that the groups' backends can use (not ``meta``; CUDA under
NCCL), no element shared by two gradients or two elements of one. ``num_tokens``
(:func:`check_num_tokens`): a one-element integer or floating tensor on the gradients'
device. Groups: the groups a plan needs (:func:`requirements`), sizes the Megatron config
states and, for a ProcessGroupCollection or a mapping, every group's members against the
mesh its sizes imply (:func:`check_layout`). NaN / Inf (:func:`nonfinite`,
``config.check_for_nan_in_grad``). The cross-rank rounds that make every rank raise
together live in :mod:`torch_impl.consensus`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from meshgrad.axes import Group, ParallelDims
from meshgrad.config import CONSISTENCY_CHECKS, FinalizeConfig, config_get
from meshgrad.params import ParamKey, ParamSpec
from meshgrad.plan import FinalizePlan, Reduction, StageReduction
from meshgrad.errors import FinalizeInputError, FinalizeTypeError
from torch_impl.discover import Discovered
from torch_impl.grads import GradAccess, get_grad, grad_attr, is_dtensor
from torch_impl.groups import STAGE_GROUPS, TorchGroups, group_ranks, world_size
from torch_impl.megatron import Requested
from torch_impl.status import backend
from torch_impl.warn import warn_user

#: Gradient dtypes a plan can reduce.
GRAD_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def plan_keys(plan: FinalizePlan, scale_keys: Sequence[ParamKey] | None = None) -> list[ParamKey]:
    """Every gradient key the plan reads or writes (reductions with their chunk copies,
    the stage reductions' operands, the num_tokens scale), in first-use order."""
    keys: dict[ParamKey, None] = {}
    for action in plan.actions:
        if isinstance(action, Reduction):
            keys.update(dict.fromkeys(action.all_keys))
        elif isinstance(action, StageReduction):
            keys.update(dict.fromkeys(k for k in action.keys_by_stage if k is not None))
    keys.update(dict.fromkeys(plan.token_scale.keys if scale_keys is None else scale_keys))
    return list(keys)


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """Byte range [start, stop) of ``t`` within its storage."""
    size = t.element_size()
    start = t.storage_offset() * size
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0) if t.numel() else 0
    return start, start + span * size


def _element_offsets(t: torch.Tensor) -> torch.Tensor:
    offsets = torch.full((), t.storage_offset(), dtype=torch.int64)
    for n, st in zip(t.shape, t.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * st
    return offsets.reshape(-1) * t.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one storage share an element (exact for strided views)."""
    (a0, a1), (b0, b1) = _extent(a), _extent(b)
    if a1 <= b0 or b1 <= a0:
        return False
    if a.is_contiguous() and b.is_contiguous():
        return True
    ea, eb = _element_offsets(a), _element_offsets(b)
    ia = torch.stack([ea + i for i in range(a.element_size())]).reshape(-1)
    ib = torch.stack([eb + i for i in range(b.element_size())]).reshape(-1)
    return bool(torch.isin(ia, ib).any())


def _check_grad(grad: Any, param: torch.Tensor, what: str, rank: int, sharded: bool) -> None:
    """One gradient: a dense tensor of a reducible dtype and of its parameter's shape.

    Raises:
      TypeError: not a tensor, not strided, or of another dtype.
      ValueError: another shape (unless ``sharded``), or on the meta device.
    """
    if not isinstance(grad, torch.Tensor):
        raise FinalizeTypeError(f"rank {rank}: {what} is a {type(grad).__name__}, not a tensor")
    if grad.layout is not torch.strided:
        raise FinalizeTypeError(
            f"rank {rank}: {what} has layout {grad.layout}; finalize reduces dense (strided) gradients "
            "(densify it, e.g. grad.to_dense(), or use nn.Embedding(sparse=False))"
        )
    if grad.dtype not in GRAD_DTYPES:
        raise FinalizeTypeError(
            f"rank {rank}: {what} has dtype {grad.dtype}; finalize reduces "
            f"{', '.join(str(d).removeprefix('torch.') for d in GRAD_DTYPES)} gradients"
        )
    if not sharded and tuple(grad.shape) != tuple(param.shape):
        raise FinalizeInputError(f"rank {rank}: {what} has shape {tuple(grad.shape)}, the parameter {tuple(param.shape)}")
    if grad.device.type == "meta":
        raise FinalizeInputError(f"rank {rank}: {what} is on the meta device (it holds no data)")


def _check_disjoint(by_storage: Mapping[Any, list[tuple[torch.Tensor, str]]], rank: int) -> None:
    """No two gradients of one storage share an element.

    Raises:
      ValueError: naming both gradients.
    """
    for items in by_storage.values():
        if len(items) < 2:
            continue
        spans = sorted((start, i, stop) for i, (start, stop) in enumerate(_extent(t) for t, _ in items))
        for n, (_, i, stop) in enumerate(spans):
            for m in range(n + 1, len(spans)):  # the later starts before this one's stop
                start_b, j, _ = spans[m]
                if start_b >= stop:
                    break
                (a, what_a), (b, what_b) = items[i], items[j]
                if _overlap(a, b):
                    same = " (the same tensor)" if a is b else ""
                    raise FinalizeInputError(
                        f"rank {rank}: {what_a} and {what_b} share memory{same}; each element must be reduced "
                        "and scaled exactly once: give each parameter its own gradient storage (a parameter "
                        "listed in two chunks must be in one only)"
                    )


def check_gradients(
    found: Discovered, groups: TorchGroups, config: FinalizeConfig, keys: Sequence[ParamKey] | None = None
) -> torch.device | None:
    """Every gradient finalize will touch: a dense (strided) floating tensor of its
    parameter's shape without internal overlap, all on one usable device, no two
    sharing an element.

    Args:
      found: the discovered model.
      groups: this rank's groups (NCCL needs CUDA tensors).
      config: the finalize config (``use_megatron_fsdp``: local shards).
      keys: the gradients to check (default: every parameter with a gradient).

    Returns:
      The gradients' device (None when this rank has no gradient).

    Raises:
      TypeError: a gradient is not a tensor, not strided (sparse) or not of a reducible dtype.
      ValueError: wrong shape, internal overlap (stride 0), two gradients sharing memory
        (the same parameter twice, or overlapping views), a ``meta`` tensor, gradients
        on several devices, or a device the groups' backend cannot use (NCCL needs CUDA).
    """
    rank, nccl = groups.rank, uses_nccl(groups)
    device: torch.device | None = None
    first = ""
    specs = {s.key: s for s in found.params}
    chosen: list[ParamSpec] = [s for s in found.params if s.has_grad] if keys is None else [specs[k] for k in keys if k in specs]
    by_storage: dict[tuple[Any, int], list[tuple[torch.Tensor, str]]] = {}
    for spec in chosen:
        param = found.tensors[spec.key]
        grad = get_grad(param)
        if grad is None:
            continue
        what = f"the gradient ({grad_attr(param)}) of {spec.name!r} (chunk {spec.chunk})"
        dtensor = isinstance(grad, torch.Tensor) and (is_dtensor(grad) or is_dtensor(param))
        _check_grad(grad, param, what, rank, config.use_megatron_fsdp or dtensor)
        here = grad.device
        if nccl and here.type != "cuda":
            raise FinalizeInputError(f"rank {rank}: {what} is on {here}, but the NCCL process groups need CUDA tensors")
        if device is None:
            device, first = here, what
        elif here != device:
            raise FinalizeInputError(
                f"rank {rank}: {what} is on {here}, but {first} is on {device}; finalize needs every "
                "gradient of a rank on one device"
            )
        if dtensor:
            continue
        if torch._debug_has_internal_overlap(grad) == 1:
            raise FinalizeInputError(
                f"rank {rank}: {what} has elements that share memory (strides {tuple(grad.stride())}, e.g. an "
                "expanded tensor); each element must be reduced once: give it its own storage (.contiguous())"
            )
        if grad.numel():
            by_storage.setdefault((grad.device, grad.untyped_storage().data_ptr()), []).append((grad, what))
    _check_disjoint(by_storage, rank)
    return device


def check_num_tokens(
    num_tokens: Any,
    device: torch.device | None,
    groups: TorchGroups,
    ddp: Sequence[Any] = (),
    nccl: bool | None = None,
) -> None:
    """``num_tokens``: a one-element integer or floating tensor on the gradients' device.

    Raises:
      TypeError: not a one-element tensor, a complex or bool dtype, or a DDP chunk without
        ``scale_gradients``.
      ValueError: on the meta device, on another device than the gradients, or not on
        CUDA under NCCL.
    """
    if num_tokens is None:
        return
    rank = groups.rank
    if not isinstance(num_tokens, torch.Tensor) or num_tokens.numel() != 1:
        shape = tuple(num_tokens.shape) if isinstance(num_tokens, torch.Tensor) else ""
        raise FinalizeTypeError(f"rank {rank}: num_tokens must be a one-element tensor, got {type(num_tokens).__name__}{shape}")
    if num_tokens.is_complex() or num_tokens.dtype == torch.bool:
        raise FinalizeTypeError(f"rank {rank}: num_tokens must be an integer or floating tensor, got {num_tokens.dtype}")
    here = num_tokens.device
    if here.type == "meta":
        raise FinalizeInputError(f"rank {rank}: num_tokens is on the meta device (it holds no data)")
    if device is not None and here != device:
        raise FinalizeInputError(f"rank {rank}: num_tokens is on {here}, the gradients on {device}")
    if (uses_nccl(groups) if nccl is None else nccl) and here.type != "cuda":
        raise FinalizeInputError(f"rank {rank}: num_tokens is on {here}, but the NCCL process groups need CUDA tensors")
    for obj in ddp:
        if not callable(getattr(obj, "scale_gradients", None)):
            raise FinalizeTypeError(
                f"rank {rank}: {type(obj).__name__} has finish_grad_sync but no scale_gradients(); "
                "cannot scale its gradients by num_tokens"
            )


def nonfinite(found: Discovered, keys: Sequence[ParamKey], local_shards: bool = True) -> list[ParamKey]:
    """The keys whose gradient holds NaN or Inf (one host sync for all of them)."""
    grads = GradAccess(found.tensors, local_shards=local_shards)
    tensors = [grads[k] for k in keys]
    if not tensors:
        return []
    ok = torch.stack([torch.isfinite(t).all() for t in tensors])  # one device: checked
    if bool(ok.all()):
        return []
    return [k for k, good in zip(keys, ok.tolist()) if not good]


def nonfinite_message(rank: int, bad: Sequence[ParamKey]) -> str:
    more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
    return (
        f"rank {rank}: NaN or Inf in the gradient of {bad[0][1]!r} (chunk {bad[0][0]}){more} "
        "(check_for_nan_in_grad); found before any collective: no gradient was changed"
    )


# --------------------------------------------------------------------------- groups


def _layout_mismatch(strict: bool, message: str) -> None:
    """Raise ``message`` (strict mode) or warn with it."""
    if strict:
        raise FinalizeInputError(message)
    warn_user(
        f"{message}. Running with the groups as given, as Megatron-Core does "
        "(config.strict_groups = True makes this an error)"
    )



def _check_sizes(groups: TorchGroups, requested: Requested, experts: bool, strict: bool) -> bool:
    """Group sizes against the sizes the Megatron config states (:func:`check_layout`).

    Returns:
      False when a mismatch was reported (warned): the member check is skipped then.
    """
    rank, source = groups.rank, groups.source
    tp, pp, dpcp, gtp = groups.size(Group.TP), groups.pp_size, groups.size(Group.DP_CP), groups.size(Group.GTP)
    for group, have, want, attr in (
        (Group.TP, tp, requested.tp, "tensor_model_parallel_size"),
        (Group.PP, pp, requested.pp, "pipeline_model_parallel_size"),
    ):
        if want is not None and want != have and group not in groups.missing:
            _layout_mismatch(
                strict, f"rank {rank}: process group {group.value!r} of the {source} has size {have}, but config.{attr} = {want}"
            )
            return False
    cp = requested.cp
    if cp is not None and Group.DP_CP not in groups.missing and dpcp % cp:
        _layout_mismatch(
            strict,
            f"rank {rank}: process group 'dp_cp' of the {source} has size {dpcp}, not a multiple of "
            f"config.context_parallel_size = {cp}",
        )
        return False
    inner = dpcp * gtp * tp
    edp, egtp, ep = groups.size(Group.EDP), groups.size(Group.EGTP), requested.ep
    if experts and ep is not None and Group.EDP not in groups.missing:
        etp = requested.etp or tp
        want = inner // (ep * etp * egtp) if inner % (ep * etp * egtp) == 0 else None
        if want != edp:
            _layout_mismatch(
                strict,
                f"rank {rank}: process group 'expt_dp' of the {source} has size {edp}, but dp_cp x gtp x tp "
                f"= {inner} with config.expert_model_parallel_size = {ep}, expert tensor parallel {etp} and "
                f"expt_gtp_remat {egtp} implies {want if want is not None else 'no integer size'}",
            )
            return False
    return True


def _check_members(groups: TorchGroups, strict: bool) -> None:
    """Every group's members against the mesh the group sizes imply (:func:`check_layout`)."""
    rank, source = groups.rank, groups.source
    tp, pp, dpcp, gtp = groups.size(Group.TP), groups.pp_size, groups.size(Group.DP_CP), groups.size(Group.GTP)
    inner, edp, egtp = dpcp * gtp * tp, groups.size(Group.EDP), groups.size(Group.EGTP)
    if inner % (edp * egtp):
        return _layout_mismatch(
            strict,
            f"rank {rank}: process groups 'expt_dp' (size {edp}) x 'expt_gtp_remat' (size {egtp}) of the "
            f"{source} do not divide dp_cp x gtp x tp = {inner}",
        )
    dims = ParallelDims(pp=pp, dp=dpcp, cp=1, gtp=gtp, tp=tp, ep=inner // (edp * egtp), etp=1, egtp=egtp)
    spans = dims.world_size == world_size()
    sizes = f"pp={pp}, dp_cp={dpcp}, gtp={gtp}, tp={tp}, expt_dp={edp}, expt_gtp_remat={egtp}"
    for group in Group:
        pg = groups.groups.get(group)
        if group in STAGE_GROUPS or pg is None or groups.size(group) <= 1:
            continue
        have = sorted(group_ranks(pg))
        implied = f"under the sizes its groups imply ({sizes}; meshgrad's rank order, tp fastest)"
        if spans and have != dims.group_ranks(group, rank):
            return _layout_mismatch(
                strict,
                f"rank {rank}: process group {group.value!r} of the {source} holds ranks {have}, but "
                f"{implied} rank {rank}'s {group.value} peers are {dims.group_ranks(group, rank)}. Build the "
                "groups in that order, or pass a DeviceMesh",
            )
        offsets, pattern = [r - have[0] for r in have], dims.group_ranks(group, 0)
        if not spans and offsets != pattern:
            return _layout_mismatch(
                strict,
                f"rank {rank}: process group {group.value!r} of the {source} holds ranks {have}, but "
                f"{implied} its members must lie at offsets {pattern} from the first, not {offsets}",
            )
    return None


def check_layout(
    groups: TorchGroups, requested: Requested, *, experts: bool, collection: bool, strict: bool = False
) -> None:
    """Group sizes against the Megatron config, and members against the mesh.

    Sizes: ``tensor_model_parallel_size`` = tp, ``pipeline_model_parallel_size`` = pp,
    ``context_parallel_size`` divides dp_cp and, with expert parameters,
    ``expert_model_parallel_size`` x ``expert_tensor_parallel_size`` x egtp x expt_dp =
    dp_cp x gtp x tp (each when the config states it: :class:`~torch_impl.megatron.Requested`).

    Members (``collection``): the sizes of tp, pp, dp_cp, gtp, expt_dp and
    expt_gtp_remat imply a mesh (docs/semantics.md (ranks, axes and groups) rank order: tp fastest, then gtp,
    cp, dp, pp; experts etp, ep, egtp, edp, pp). When it spans the world, every group
    must hold exactly this rank's peers on that mesh; on a model over part of the world,
    every group must have the mesh's shape (its members' offsets from the smallest).

    Megatron takes the groups as the truth, so a mismatch warns once per plan naming the
    group and what differs; with ``strict`` (``config.strict_groups``) it raises.

    Raises:
      ValueError: (``strict``) naming the rank, the group, its members and the expected ones.
    """
    if _check_sizes(groups, requested, experts, strict) and collection:
        _check_members(groups, strict)


def requirements(
    config: FinalizeConfig,
    params: Sequence[ParamSpec],
    groups: TorchGroups,
    requested: Requested,
    *,
    plain_dp_sync: bool,
    num_tokens: bool,
    megatron_groups: bool,
) -> tuple[dict[Group, str], dict[Group, tuple[int, str]]]:
    """The groups ``finalize_model_grads`` needs, for :meth:`TorchGroups.check`.

    Groups read the Megatron way (``megatron_groups``) were already resolved or refused
    by Megatron's rules; meshgrad's own sources must name every group a step reads. Sizes
    the config states are expectations: a mismatch warns (raises with
    ``config.strict_groups``), since Megatron takes the groups as the truth.

    Returns:
      (required groups with reasons, expected sizes with reasons).
    """
    required: dict[Group, str] = {}
    gtp_reason = "GTP-remat is active and num_tokens / qb_beta reduce over dp_cp x gtp"
    gtp_reduces = groups.size(Group.GTP) > 1 and (num_tokens or config.quantile_balancing)
    if not megatron_groups:
        for g in (Group.TP, Group.PP, Group.EMBD, Group.POS_EMBD, Group.DP_CP):
            required[g] = "finalize_model_grads always needs it"
        if config.moe_router_enable_expert_bias:
            required[Group.TP_DP_CP] = "moe_router_enable_expert_bias is set"
        if gtp_reduces:
            required[Group.DP_CP_GTP] = gtp_reason
    if plain_dp_sync:
        required[Group.DP_CP] = "meshgrad runs the DP sync of chunks without a DDP wrapper"
        if any(p.expert and p.has_grad for p in params):
            required[Group.EDP] = "expert parameters (allreduce=False) are synced over expert data parallel"
    expected: dict[Group, tuple[int, str]] = {}
    if requested.gtp > 1:
        expected[Group.GTP] = (requested.gtp, "config.gtp_weight_remat_size")
    if requested.egtp > 1:
        expected[Group.EGTP] = (requested.egtp, "config.expert_gtp_weight_remat_size")
    if gtp_reduces:
        expected[Group.DP_CP_GTP] = (groups.size(Group.DP_CP) * groups.size(Group.GTP), gtp_reason)
    return required, expected


def check_modes(*sources: Any) -> tuple[str, bool]:
    """(consistency_check, check_for_nan_in_grad) read leniently from raw configs
    (objects or mappings; the later source wins), for a rank whose config did not
    resolve: it must still join the rounds its peers run."""
    mode, nan = "once", False
    for source in sources:
        if source is None:
            continue
        value = config_get(source, "consistency_check")
        if isinstance(value, str) and value in CONSISTENCY_CHECKS:
            mode = value
        flag = config_get(source, "check_for_nan_in_grad")
        if isinstance(flag, (bool, np.bool_)):
            nan = bool(flag)
    return mode, nan


def uses_nccl(groups: TorchGroups) -> bool:
    """Whether any of the groups runs on NCCL (gradients must then be CUDA tensors)."""
    return any(pg is not None and backend(pg) == "nccl" for pg in map(groups.group, Group))


__all__ = [
    "GRAD_DTYPES",
    "check_gradients",
    "check_layout",
    "check_modes",
    "check_num_tokens",
    "nonfinite",
    "nonfinite_message",
    "plan_keys",
    "requirements",
    "uses_nccl",
]
