"""One C++ call that says whether many tensors keep their metadata (:func:`metadata_guard`).

torch.compile checks its inputs' metadata between calls with a compiled guard
(``torch._C._dynamo.guards.TensorGuards``): per tensor its Python type, dispatch keys,
dtype, device, ``requires_grad``, sizes and strides, in one C++ loop. The watches use it
as a fast path for the same questions they otherwise ask one attribute at a time: where
the guard passes, nothing it checks changed; where it fails (a fact the caller does not ask
about changed, such as a parameter's strides or the thread's dispatch state), or where
torch has no such guard, the caller asks the attribute-by-attribute questions. The guard
is private to torch, so it is used only after a probe shows that it sees what the
watches need it to see.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch


def _build(guard_type: Any, tensors: Sequence[torch.Tensor], strides: bool = True) -> Any:
    """A guard on ``tensors`` as they are now: every size static, and every stride too
    with ``strides`` (else no stride is compared: None per dimension)."""
    return guard_type(
        *tensors,
        dynamic_dims_sizes=[list(t.size()) for t in tensors],
        dynamic_dims_strides=[list(t.stride()) if strides else [None] * t.dim() for t in tensors],
    )


def _sees_changes(guard_type: Any) -> bool:
    """Whether a guard built by :func:`_build` fails on each change the watches rely on it
    for (``requires_grad`` flipped, under no_grad as well; another shape; another dtype),
    and passes on the unchanged tensor."""
    param = torch.nn.Parameter(torch.zeros(2, 3, device="cpu"))
    resized = torch.nn.Parameter(torch.zeros(5, 3, device="cpu"))  # the same strides
    retyped = torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.float64, device="cpu"))
    for strides in (True, False):
        with torch.no_grad():
            guard = _build(guard_type, [param], strides)
            if not guard.check(param):
                return False
            param.requires_grad_(False)
            flipped = guard.check(param)
            param.requires_grad_(True)
        if flipped or guard.check(resized) or guard.check(retyped):
            return False
    return True


def _sees_kinds(guard_type: Any) -> bool:
    """Whether a guard built by :func:`_build` also fails on a tensor of another kind in
    the same shape and dtype: on another device (meta), in another layout (sparse), or an
    inference tensor (what a watch of new tensors against recorded facts asks)."""
    plain = torch.zeros(2, 3)
    with torch.inference_mode():
        inference = torch.zeros(2, 3)
    others = (torch.zeros(2, 3, device="meta"), plain.to_sparse(), inference)
    for strides in (True, False):
        guard = _build(guard_type, [plain], strides)
        if not guard.check(torch.zeros(2, 3)) or any(guard.check(other) for other in others):
            return False
    return True


@functools.cache
def _guard_type(kinds: bool = False) -> Any:
    """torch's compiled tensor guard, or None where this torch has none that passes the
    probe (:func:`_sees_changes`, and with ``kinds`` :func:`_sees_kinds` as well), run
    outside inference mode whatever mode the first caller is in (the answer is kept)."""
    try:
        from torch._C._dynamo.guards import TensorGuards  # noqa: PLC0415 -- private: probed before use

        with torch.inference_mode(False):
            seen = _sees_changes(TensorGuards) and (not kinds or _sees_kinds(TensorGuards))
        return TensorGuards if seen else None
    except Exception:  # noqa: BLE001 -- any failure: the attribute-by-attribute path
        return None


def metadata_guard(tensors: Sequence[torch.Tensor], strides: bool = True, kinds: bool = False) -> Any:
    """A guard whose ``check(*tensors)`` is True only while each tensor keeps its Python
    type, dtype, device, ``requires_grad``, sizes and, with ``strides``, strides (False
    also on a change the watches ignore, and always where one tensor is in ``tensors``
    twice: torch's guard requires distinct tensors).

    Args:
      tensors: the tensors, in the order ``check`` will get them.
      strides: compare their strides too (a watch that asks about strides).
      kinds: the caller relies on the guard for the tensors' devices, layouts and
        inference flags too (a watch of new tensors against recorded facts): only a guard
        shown to see those (:func:`_sees_kinds`).

    Returns:
      The guard, or None: no tensors, no usable guard in this torch, or tensors it cannot
      describe (a nested tensor has no sizes).
    """
    guard_type = _guard_type(kinds)
    if guard_type is None or not tensors:
        return None
    try:
        return _build(guard_type, tensors, strides)
    except Exception:  # noqa: BLE001 -- a tensor the guard cannot describe
        return None


#: How often a guard may fail on a fact the caller does not check and be re-armed before
#: the caller's check answers for good (tensors whose strides, or calls whose dispatch
#: state, keep changing would otherwise pay a guard's build on every check).
MAX_REARMS = 3


class GuardedCheck:
    """A check of some tensors' metadata answered by one guard call once armed, else by
    the caller's own attribute-by-attribute check: its first pass arms a guard on the
    tensors as they are then (so a check made once never pays for a guard), and a pass
    after the guard failed (a fact it checks and the caller does not: strides, a device)
    re-arms it, up to :data:`MAX_REARMS` times. Where no guard can be made, or after that,
    the caller's check answers from then on.

    Args:
      strides: the caller's check asks about strides (else its guard compares none: a
        stride change it does not ask about is then no guard failure).
      kinds: the caller's check asks about devices, layouts and inference flags too
        (:func:`metadata_guard`).
    """

    def __init__(self, strides: bool = True, kinds: bool = False) -> None:
        self.guard: Any = None
        self.usable = True
        self.rearms = 0
        self.strides = strides
        self.kinds = kinds

    def same(self, tensors: Sequence[torch.Tensor], slow_same: Callable[[], bool], asked: bool = False) -> bool:
        """Whether ``tensors`` keep what ``slow_same`` checks.

        Args:
          tensors: the tensors, always in the same order.
          slow_same: the attribute-by-attribute check (the answer where the guard fails).
          asked: the caller already asked the armed guard (a steady step's fast path, one
            call less) and it did not pass: not asked again.
        """
        if not asked and self.guard is not None and self.guard.check(*tensors):
            return True
        same = slow_same()
        if same and self.usable:
            if self.guard is not None:  # it failed where the caller's check passed
                self.rearms += 1
            self.guard = metadata_guard(tensors, self.strides, self.kinds) if self.rearms <= MAX_REARMS else None
            self.usable = self.guard is not None
        return same


__all__ = ["MAX_REARMS", "GuardedCheck", "metadata_guard"]
