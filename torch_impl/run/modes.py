"""The inference mode meshgrad makes its kept tensors in (:func:`outside_inference_mode`) and
updates the caller's tensors in (:func:`writing_into`, :func:`fill_into`)."""

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


def writing_into(tensor: torch.Tensor) -> ContextManager[Any]:
    """The context in which to update the caller's ``tensor`` in place (the global token
    count written back into ``num_tokens``): ``torch.inference_mode()`` for an inference
    tensor in a call made outside it (torch updates one in place only there; Megatron's
    all-reduce writes the count into it in either mode), else nothing to enter."""
    if tensor.is_inference() and not torch.is_inference_mode_enabled():
        return torch.inference_mode()
    return contextlib.nullcontext()


def fill_into(tensor: torch.Tensor, value: int) -> None:
    """``tensor.fill_(value)`` in the context :func:`writing_into` gives, with no context
    entered for a normal tensor (one call where the context manager makes four, each cold
    inside a step: only an inference tensor can need one)."""
    if not tensor.is_inference():
        tensor.fill_(value)
        return
    with writing_into(tensor):
        tensor.fill_(value)


__all__ = ["fill_into", "outside_inference_mode", "writing_into"]
