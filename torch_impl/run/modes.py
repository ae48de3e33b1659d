"""Where meshgrad makes the tensors it keeps between calls (:func:`outside_inference_mode`)."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch


def outside_inference_mode() -> ContextManager[Any]:
    """The context in which to allocate a tensor meshgrad keeps between calls (a bound
    program's staging buffers, a status round's wire, a token factor, the buffers of
    ``attach_grad_buffers``): ``torch.inference_mode(False)`` when the call runs under
    ``torch.inference_mode()``, else nothing to enter. A tensor allocated in inference
    mode cannot be updated in place outside it and has no version counter: a plan first
    bound under ``torch.inference_mode()`` failed every later call made outside it. Made
    outside, the kept tensors serve calls in either mode. Views of normal tensors and
    tensors made and dropped within one call follow the caller's mode (as Megatron's do):
    torch lets both be used in either mode."""
    return torch.inference_mode(False) if torch.is_inference_mode_enabled() else contextlib.nullcontext()


__all__ = ["outside_inference_mode"]
