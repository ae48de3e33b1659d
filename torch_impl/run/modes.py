"""The inference mode meshgrad makes its kept tensors in (:func:`outside_inference_mode`,
:func:`kept_host_tensor`) and updates the caller's tensors in (:func:`writing_into`,
:func:`fill_into`)."""

from __future__ import annotations

import contextlib
import math
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


#: The memoryview format of each dtype :func:`kept_host_tensor` makes (native byte order).
_FORMATS = {torch.int64: "q", torch.float32: "f", torch.float64: "d"}


def kept_host_tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[torch.Tensor, memoryview]:
    """A zeroed host tensor meshgrad keeps between calls, over memory of its own, and a flat
    memoryview of that memory: its elements written and read in plain Python, with no torch
    operation (inside a step each one comes back cold). Made outside inference mode
    (:func:`outside_inference_mode`). The owner writes only while no collective or other
    object still uses the tensor.

    Args:
      dtype: int64, float32 or float64.
      shape: the tensor's shape.
    """
    memory = bytearray(math.prod(shape) * dtype.itemsize)  # zeros; malloc'd, so aligned for the dtype
    with outside_inference_mode():
        tensor = torch.frombuffer(memory, dtype=dtype)
        if tensor.shape != shape:
            tensor = tensor.reshape(shape)
    return tensor, memoryview(memory).cast(_FORMATS[dtype])


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
    inside a step: only an inference tensor can need one). Written out in
    :meth:`~torch_impl.run.scaling.HostFactor.scale`."""
    if not tensor.is_inference():
        tensor.fill_(value)
        return
    with writing_into(tensor):
        tensor.fill_(value)


__all__ = ["fill_into", "kept_host_tensor", "outside_inference_mode", "writing_into"]
