"""Local checks before any communication: nothing communicated, nothing mutated.

Gradients (:func:`check_gradients`): a dense floating tensor of the parameter's shape,
every one on one device that the groups' backends can use (not ``meta``; CUDA under
NCCL), no element shared by two gradients or two elements of one. ``num_tokens``
(:func:`check_num_tokens`): a one-element integer or floating tensor on the gradients'
device. The groups' checks are in :mod:`torch_impl.call.group_checks`. NaN / Inf (:func:`nonfinite`,
``config.check_for_nan_in_grad``). The cross-rank rounds that make every rank raise
together live in :mod:`torch_impl.call.agree`.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from meshgrad.axes import Group
from meshgrad.config import CONSISTENCY_CHECKS, FinalizeConfig, config_get
from meshgrad.params import ParamKey
from meshgrad.errors import FinalizeInputError, FinalizeTypeError
from torch_impl.sources.ddp_layout import nonfinite_in_buffers
from torch_impl.run.grads import GradRead, all_finite
from torch_impl.run.scaling import coalesce
from torch_impl.run.groups import TorchGroups
from torch_impl.run.status import backend

#: Gradient dtypes a plan can reduce.
GRAD_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def extent_bytes(t: torch.Tensor) -> int:
    """The bytes from a strided tensor's first element to past its last (0 when empty)."""
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0) if t.numel() else 0
    return span * t.element_size()


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """Byte range [start, stop) of ``t`` within its storage."""
    start = t.storage_offset() * t.element_size()
    return start, start + extent_bytes(t)


def disjoint_ranges(starts: list[int], extents: list[int]) -> bool:
    """Whether the address ranges ``[start, start + extent)`` overlap nowhere, in C-level
    passes: then no two tensors share an element (one that did would lie in both ranges).
    Views of one buffer side by side pass; interleaved ones answer False (the full check
    of :func:`check_gradients` decides those).

    The starts and the ends are sorted apart (integers: no tuple per range): the ranges
    overlap nowhere exactly when the i-th smallest end is at most the (i+1)-th smallest
    start for every i. An address ``x`` lies in (number of starts <= x) minus (number of
    ends <= x) ranges; with k starts at or below it, the (k-1)-th smallest end is at most
    the k-th smallest start, itself at most x, so at most one range holds it (an empty
    range holds nothing either way)."""
    ends = sorted(map(operator.add, starts, extents))
    ordered = sorted(starts)
    return all(map(operator.le, ends[:-1], ordered[1:]))


def _element_offsets(t: torch.Tensor) -> torch.Tensor:
    offsets = torch.full((), t.storage_offset(), dtype=torch.int64, device="cpu")
    for n, st in zip(t.shape, t.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(n, dtype=torch.int64, device="cpu") * st
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


def _gradient_name(chunk: int, name: str, attr: str) -> str:
    """A gradient as the errors name it."""
    return f"the gradient ({attr}) of {name!r} (chunk {chunk})"


def check_gradients(reads: Sequence[GradRead], groups: TorchGroups, config: FinalizeConfig) -> torch.device | None:
    """Every gradient finalize will touch: a dense (strided) floating tensor of its
    parameter's shape without internal overlap, all on one usable device, no two
    sharing an element.

    Args:
      reads: the gradients to check (:func:`~torch_impl.run.grads.read_grads`; None
        gradients are skipped).
      groups: this rank's groups (NCCL needs CUDA tensors).
      config: the finalize config (``use_megatron_fsdp``: local shards).

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
    by_storage: dict[tuple[Any, int], list[tuple[torch.Tensor, str]]] = {}
    for (chunk, name), param, grad, attr, dtensor, _ in reads:
        if grad is None:
            continue
        what = _gradient_name(chunk, name, attr)
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


def first_inference_tensor(reads: Sequence[GradRead], routers: Mapping[ParamKey, Any],
                           writes: Sequence[tuple[ParamKey, str]]) -> str | None:
    """The first gradient, or router buffer the plan updates in place (``writes``: router
    key, attribute), that is an inference tensor (made under ``torch.inference_mode()``),
    named as the errors name it, or None. Such a tensor can be updated in place only under
    inference mode: :func:`check_inference_mode` refuses a call made outside it."""
    for (chunk, name), _, _, attr, _, local in reads:
        if isinstance(local, torch.Tensor) and local.is_inference():
            return _gradient_name(chunk, name, attr)
    for (chunk, name), attr in writes:
        buffer = getattr(routers.get((chunk, name)), attr, None)
        if isinstance(buffer, torch.Tensor) and buffer.is_inference():
            return f"the {attr} buffer of router {name!r} (chunk {chunk})"
    return None


def check_inference_mode(inference_tensor: str, rank: int) -> None:
    """A call that updates an inference tensor in place (``inference_tensor``: its name,
    from :func:`first_inference_tensor`) runs under ``torch.inference_mode()``: outside it,
    torch refuses the update (Megatron's finalize fails there, after its first collectives).

    Raises:
      ValueError: outside inference mode, naming the tensor.
    """
    if not torch.is_inference_mode_enabled():
        raise FinalizeInputError(
            f"rank {rank}: {inference_tensor} was made under torch.inference_mode() (an inference tensor), which "
            "cannot be updated in place outside it: make it outside inference mode, or call finalize under "
            "torch.inference_mode()"
        )


def tokens_kind(num_tokens: Any) -> tuple[Any, ...] | None:
    """What of ``num_tokens`` the consistency comparison compares -- it decides the token
    collectives -- and :func:`tokens_error` checks: (dtype, numel, device); None for no tensor.
    Written out in :func:`~torch_impl.call.replay.replayed` too."""
    return (num_tokens.dtype, num_tokens.numel(), num_tokens.device) if isinstance(num_tokens, torch.Tensor) else None


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
    if not isinstance(num_tokens, torch.Tensor):
        raise FinalizeTypeError(
            f"rank {groups.rank}: num_tokens must be a one-element tensor, got {type(num_tokens).__name__}"
        )
    error = tokens_error(num_tokens, tokens_kind(num_tokens), device, groups, ddp, nccl)
    if error is not None:
        raise error


def tokens_error(
    num_tokens: torch.Tensor,
    kind: tuple[Any, ...],
    device: torch.device | None,
    groups: TorchGroups,
    ddp: Sequence[Any] = (),
    nccl: bool | None = None,
) -> Exception | None:
    """The error :func:`check_num_tokens` raises for the tensor ``num_tokens``, judged by its
    ``kind`` (:func:`tokens_kind`, read once by the caller), or None when it passes. Args as
    :func:`check_num_tokens`'s."""
    dtype, numel, here = kind
    rank = groups.rank
    if numel != 1:
        got = f"{type(num_tokens).__name__}{tuple(num_tokens.shape)}"
        return FinalizeTypeError(f"rank {rank}: num_tokens must be a one-element tensor, got {got}")
    if dtype.is_complex or dtype == torch.bool:
        return FinalizeTypeError(f"rank {rank}: num_tokens must be an integer or floating tensor, got {dtype}")
    if here.type == "meta":
        return FinalizeInputError(f"rank {rank}: num_tokens is on the meta device (it holds no data)")
    if device is not None and here != device:
        return FinalizeInputError(f"rank {rank}: num_tokens is on {here}, the gradients on {device}")
    if (uses_nccl(groups) if nccl is None else nccl) and here.type != "cuda":
        return FinalizeInputError(f"rank {rank}: num_tokens is on {here}, but the NCCL process groups need CUDA tensors")
    for obj in ddp:
        if not callable(getattr(obj, "scale_gradients", None)):
            return FinalizeTypeError(
                f"rank {rank}: {type(obj).__name__} has finish_grad_sync but no scale_gradients(); "
                "cannot scale its gradients by num_tokens"
            )
    return None


def nonfinite(reads: Sequence[GradRead]) -> list[ParamKey]:
    """The keys whose gradient (its local shard) holds NaN or Inf (one host sync for all of them).

    Raises:
      ValueError: a gradient is gone since the plan was made.
    """
    for read in reads:
        if read.local is None:
            raise FinalizeInputError(f"parameter {read.key[1]!r} (chunk {read.key[0]}) lost its gradient after planning")
    if not reads:
        return []
    spans = scan_spans(reads)
    if spans is not None and all_finite(spans):
        return []
    ok = torch.stack([torch.isfinite(r.local).all() for r in reads])  # one device: checked
    if bool(ok.all()):
        return []
    return [r.key for r, good in zip(reads, ok.tolist()) if not good]


def scan_spans(reads: Sequence[GradRead]) -> tuple[torch.Tensor, ...] | None:
    """The gradients of ``reads`` as the fewest non-empty tensors for the fused NaN / Inf
    scan (:func:`all_finite`): gradients back to back in one buffer become one span.
    None when a gradient is missing or a DTensor (its local shard is read each step)."""
    if any(r.local is None or r.dtensor for r in reads):
        return None
    return tuple(t for t in coalesce([r.local for r in reads]) if t.numel())


def _and_more(items: Sequence[Any]) -> str:
    return f" and {len(items) - 1} more" if len(items) > 1 else ""


def nonfinite_message(
    rank: int, reads: Sequence[GradRead] | Callable[[], Sequence[GradRead]], ddp: Sequence[Any],
    spans: Sequence[torch.Tensor] | None = None,
) -> str | None:
    """The error naming the gradients that hold NaN / Inf, or None when there are none:
    those meshgrad syncs (``reads``), then those in the gradient buffers of a Megatron DDP
    that would check them itself inside ``finish_grad_sync`` (its
    ``check_for_nan_in_grad`` without ``overlap_grad_reduce``: there its check raises on
    one rank while its peers enter the collective). With ``overlap_grad_reduce`` the DDP
    checked each bucket when its reduction started, in backward.

    With ``spans`` (the plan's gradients as :func:`scan_spans` made them, kept while the
    model watch sees the same gradients), a healthy step is one fused scan; ``reads``
    (or a callable giving them) is read only to name what was found."""
    if spans is not None and all_finite(spans):
        bad: list[ParamKey] = []
    else:
        bad = nonfinite(reads() if callable(reads) else reads)
    if bad:
        return (
            f"rank {rank}: NaN or Inf in the gradient of {bad[0][1]!r} (chunk {bad[0][0]}){_and_more(bad)} "
            "(check_for_nan_in_grad); found before any collective: no gradient was changed"
        )
    for obj in ddp:
        ddp_config = getattr(obj, "ddp_config", None)
        if getattr(ddp_config, "check_for_nan_in_grad", False) and not getattr(ddp_config, "overlap_grad_reduce", False):
            names = nonfinite_in_buffers(obj)
            if names:
                return (
                    f"rank {rank}: NaN or Inf in the gradient of {names[0]!r}{_and_more(names)} in the gradient buffer of "
                    f"{type(obj).__name__} (check_for_nan_in_grad); found before any collective: no gradient "
                    "was changed"
                )
    return None


def nonfinite_tokens(num_tokens: Any) -> bool:
    """Whether a floating ``num_tokens`` holds NaN or Inf (one host sync)."""
    return (
        isinstance(num_tokens, torch.Tensor) and num_tokens.is_floating_point()
        and not bool(torch.isfinite(num_tokens).all())
    )


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
    "check_modes",
    "check_num_tokens",
    "tokens_error",
    "tokens_kind",
    "nonfinite",
    "nonfinite_message",
    "nonfinite_tokens",
    "uses_nccl",
]
