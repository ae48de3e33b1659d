"""The global token-count scale: the count reduced across ranks, and gradients
multiplied by its reciprocal (bound once, on device, no host sync)."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from itertools import compress, repeat
from sys import getrefcount
from typing import Any

import torch

from meshgrad.plan import TokenScale
from torch_impl.run.errors import collective_guard
from torch_impl.run.groups import TorchGroups
from torch_impl.run.modes import fill_into, kept_host_tensor, writing_into
from torch_impl.run.token_count import host_total, on_host, token_count, token_scale_text


def global_token_scale(
    num_tokens: torch.Tensor, action: TokenScale, groups: TorchGroups, reduced: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token scaling: broadcast num_tokens from the last pp stage, SUM it over the
    planned group, and return the factor that divides every gradient (no host sync).
    ``reduced``: the SUM already computed by the call's status round
    (:func:`torch_impl.run.status.fused_tokens`), used instead of the collectives (an int:
    known on the host; :func:`scale_by_tokens` asks :func:`host_scale` for it first, and
    comes here where the host cannot be exact).

    The count is reduced in int64 (float64 for floating input), so int8..int32 counts do
    not overflow, and written back into ``num_tokens``, which holds the global count
    afterwards, as in Megatron (wrapped to its dtype if it cannot hold it). The factor is
    Megatron's ``1.0 / clamp(n, min=1)``: in ``num_tokens``' floating dtype, or the default
    float dtype (float32) for integer counts, with ``num_tokens``' shape.
    """
    if isinstance(reduced, int):
        reduced = torch.tensor(reduced, dtype=torch.int64, device=num_tokens.device)
    wide = torch.float64 if num_tokens.is_floating_point() else torch.int64
    if reduced is not None:
        total = reduced.to(device=num_tokens.device, dtype=wide).reshape(num_tokens.shape)
        with writing_into(num_tokens):
            num_tokens.detach().copy_(total)
        return torch.clamp(total, min=1).reciprocal()
    total = num_tokens.detach().to(wide, copy=True)
    token_count(action, groups).reduce(total)  # the broadcast over pp, then the SUM, bound once
    with writing_into(num_tokens):
        num_tokens.detach().copy_(total)
    counted = num_tokens.detach() if num_tokens.is_floating_point() else total
    return torch.clamp(counted, min=1).reciprocal()


#: The integer dtypes :func:`host_scale` writes a count into, with the values they hold.
_HOST_COUNTS = {dtype: (torch.iinfo(dtype).min, torch.iinfo(dtype).max) for dtype in (torch.int64, torch.int32)}
#: Counts up to this are exact in every float dtype :func:`host_scale` computes in.
_EXACT_COUNT = 1 << 24
#: The float dtypes :class:`HostFactor` makes a factor in.
_FACTOR_DTYPES = (torch.float32, torch.float64)
#: ``sys.getrefcount`` of a kept factor that no other object holds: its slot and the call's argument.
_UNSHARED = 2


class HostFactor:
    """The last factor :func:`host_scale` made for one model, kept for the next calls.

    The factor is a tensor over a small host buffer of meshgrad's own, with a memoryview of
    that buffer (:func:`~torch_impl.run.modes.kept_host_tensor`, as a status round's wire): the next
    call with the same shape and float dtype gets the same tensor, and a count that
    changed is written into it through the memoryview, rounded to the dtype as
    ``torch.full`` rounds it -- no torch operation, where making a tensor each step costs
    one (each one comes back cold inside a step). A count that changes every step, as in
    training, then makes one tensor operation for its scale (writing the count into
    ``num_tokens``), as a steady count does.

    A new tensor is made instead when the kept one may not be rewritten: another shape or
    dtype, a write into it since (its version counter moved), or, for another count, an
    object that still holds it besides this one (a DDP's ``scale_gradients`` that kept its
    argument: ``sys.getrefcount``). Megatron's DDPs multiply by the factor at once; a view
    of it kept by a DDP past its call would read the next call's count.
    """

    __slots__ = ("form", "total", "factor", "view", "version")

    def __init__(self) -> None:
        self.form: tuple[torch.Size, torch.dtype] | None = None  # the factor's shape and dtype
        self.total: int | None = None  # the count it holds the factor of
        self.factor: torch.Tensor | None = None
        self.view: memoryview | None = None  # the factor's one element, written in place
        self.version = -1

    def scale(self, num_tokens: torch.Tensor, total: int) -> torch.Tensor | None:
        """:func:`host_scale` with this model's kept factor: one method on a steady step
        (each function a step enters comes back cold from memory, a few microseconds)."""
        dtype = torch.get_default_dtype()
        bounds = _HOST_COUNTS.get(num_tokens.dtype)
        if bounds is None or not bounds[0] <= total <= bounds[1] or total > _EXACT_COUNT:
            return None
        if dtype not in _FACTOR_DTYPES or num_tokens.device.type != "cpu":
            return None
        # fill_into, written out for a normal tensor (one function fewer per step); an integer
        # tensor cannot require grad
        if num_tokens.is_inference():
            fill_into(num_tokens, total)
        else:
            num_tokens.fill_(total)
        form = (num_tokens.shape, dtype)
        kept = self.form == form and self.factor is not None and self.factor._version == self.version
        if kept and self.total == total:
            return self.factor
        if not kept or getrefcount(self.factor) > _UNSHARED:  # else rewritten in place: no one else holds it
            self.factor, self.view = kept_host_tensor(dtype, form[0])  # kept between calls, in and out of inference mode
            self.form, self.version = form, self.factor._version
        self.view[0] = 1.0 / max(total, 1)  # type: ignore[index]
        self.total = total
        return self.factor


def host_scale(num_tokens: torch.Tensor, total: int, kept: HostFactor | None = None) -> torch.Tensor | None:
    """The factor of :func:`global_token_scale` from a global count known on the host
    (the status round read it back), with ``total`` written into ``num_tokens``: the
    factor ``1 / max(total, 1)`` in the default float dtype, with ``num_tokens``' shape,
    made on the host without the device path's conversions (``kept``'s own tensor, reused
    and rewritten in place: :class:`HostFactor`). None where the device path must answer
    instead (a count its dtype or the float dtype cannot hold exactly).

    The factor equals the device path's bit for bit: ``1 / max(n, 1)`` is computed in
    float64 and rounded once more to float32, and a double rounding of a quotient is the
    correctly rounded quotient when the wider format has at least 2 * 24 + 2 bits
    (float64 has 53); the device path rounds the same quotient once. Every count up to
    2**24 is exact in float32.
    """
    return (kept if kept is not None else HostFactor()).scale(num_tokens, total)


def scale_by_tokens(
    num_tokens: torch.Tensor,
    action: TokenScale,
    groups: TorchGroups,
    ddp: Sequence[Any],
    apply: Callable[[torch.Tensor], None] | None,
    reduced: int | torch.Tensor | None = None,
    kept: HostFactor | None = None,
) -> None:
    """Step 11 of a call: the global token count (:func:`global_token_scale`) and
    ``1 / max(n, 1)`` on every gradient: each Megatron DDP's own ``scale_gradients``, then
    ``apply`` (the bound program's scale, or :func:`bind_scale` of the other gradients).

    Args:
      num_tokens: this rank's count (holds the global count afterwards).
      action: the plan's TokenScale.
      groups: this rank's groups.
      ddp: the Megatron DDP objects of the chunks they sync.
      apply: multiplies the gradients meshgrad scales by the factor (None: none to scale).
      reduced: the global count when the status round carried it (no collective here;
        an int when known on the host); None: reduced here, on a host word for a CPU
        integer count (:func:`~torch_impl.run.token_count.host_total`).
      kept: the model's last host factor (:class:`HostFactor`), or None.
    """
    # A count on the host that no round carried: its collectives on a host word (the same
    # ones the device path runs). A count known on the host (an int): the host factor where it
    # is exact; else the device path (which reduces the count itself when still not reduced).
    if reduced is None and on_host(num_tokens):
        reduced = host_total(num_tokens, action, groups)
    scale = None
    if isinstance(reduced, int):  # the kept factor's own method where there is one: no host_scale between
        scale = kept.scale(num_tokens, reduced) if kept is not None else host_scale(num_tokens, reduced)
    if scale is None:
        with collective_guard(token_scale_text(action), groups):
            scale = global_token_scale(num_tokens, action, groups, reduced)
    for obj in ddp:
        obj.scale_gradients(scale)
    if apply is not None:
        apply(scale)


def scale_grads(tensors: Sequence[torch.Tensor], scale: torch.Tensor) -> None:
    """Multiply every tensor in place by the 0-d float32 ``scale`` (on device)."""
    bind_scale(tensors)(scale)


def coalesce(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The fewest tensors covering ``tensors``: contiguous tensors that lie back to back
    in one storage are merged into one 1-D span (overlapping ones are kept apart).
    Spans come storage by storage (in the order each storage first appears), each by
    offset; the tensors that cannot merge (not contiguous, empty, without storage)
    follow, in their order. Each tensor's facts are read in C-level passes (an FSDP2 or
    torch DDP step binds its new gradients with it), one by one only where a tensor
    refuses one. Two cases merge nothing and skip the merge loop:
    - no tensor is a view (gradients allocated one by one: a torch DDP step's new
      ``.grad`` tensors): there is no buffer to find spans in, and they come back as they
      are, in their order, after one C-level pass (merging is only ever a saving: a caller
      covers every element either way);
    - no storage holds two of the tensors that could merge: those come back as they are,
      in their order, the others after them."""
    if all(map(operator.is_, map(_BASE, tensors), repeat(None))):
        return list(tensors)
    try:
        ptrs = list(map(_STORAGE_PTR, map(torch.Tensor.untyped_storage, tensors)))
        numels = list(map(torch.Tensor.numel, tensors))
        mergeable = list(map(operator.and_, map(torch.Tensor.is_contiguous, tensors), map(bool, numels)))
    except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, ...)
        facts = list(map(_facts, tensors))
    else:
        if len(set(compress(ptrs, mergeable))) == sum(mergeable):
            return [*compress(tensors, mergeable), *compress(tensors, map(operator.not_, mergeable))]
        facts = list(zip(tensors, ptrs, mergeable, numels, map(torch.Tensor.storage_offset, tensors),
                         map(_DTYPE, tensors), map(_DEVICE, tensors)))
    by_storage: dict[tuple[Any, torch.dtype, torch.device], list[tuple[int, int, torch.Tensor]]] = {}
    other: list[torch.Tensor] = []
    for t, ptr, can_merge, numel, offset, dtype, device in facts:
        if ptr is None or not can_merge:
            other.append(t)
        else:
            by_storage.setdefault((ptr, dtype, device), []).append((offset, numel, t))
    out: list[torch.Tensor] = []
    for spans in by_storage.values():
        spans.sort(key=_OFFSET)
        run: list[torch.Tensor] = []
        start = end = 0
        for offset, numel, t in spans:
            if run and offset != end:
                out.append(_merge(run, start, end))
                run = []
            if not run:
                start = offset
            run.append(t)
            end = offset + numel
        out.append(_merge(run, start, end))
    return out + other


_STORAGE_PTR = torch.UntypedStorage.data_ptr
#: The tensor a view was made from (None: not a view).
_BASE = operator.attrgetter("_base")
_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")
#: A span's sort key: its offset in its storage.
_OFFSET = operator.itemgetter(0)


def _facts(t: torch.Tensor) -> tuple[Any, ...]:
    """:func:`coalesce`'s facts of one tensor (tensor, storage pointer, contiguous and not
    empty, elements, storage offset, dtype, device); a tensor that refuses its storage or
    contiguity has no storage pointer (None)."""
    try:
        if t.is_contiguous():
            return t, t.untyped_storage().data_ptr(), t.numel() != 0, t.numel(), t.storage_offset(), t.dtype, t.device
    except (RuntimeError, NotImplementedError):
        pass
    return t, None, False, 0, 0, None, None


def _merge(run: list[torch.Tensor], start: int, end: int) -> torch.Tensor:
    """The tensors of ``run``, back to back from ``start`` to ``end`` in one storage, as
    one 1-D span (a lone tensor as it is)."""
    if len(run) == 1:
        return run[0]
    return run[0].as_strided((end - start,), (1,), start)


def bind_scale(tensors: Sequence[torch.Tensor]) -> Callable[[torch.Tensor], None]:
    """Multiplication of ``tensors`` by a 0-d float32 factor, bound once: back-to-back
    gradients (a flat buffer) become one span (:func:`coalesce`), one ``_foreach_mul_``
    per device and dtype. The factor stays on device (no host sync)."""
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
