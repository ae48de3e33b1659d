"""What the token-scale tests share: a stand-in for a Megatron DDP chunk's
``scale_gradients`` (:class:`ScaledDDP`) and a tensor's bytes (:func:`bits`, for bit-for-bit
comparisons)."""

from __future__ import annotations

import torch


class ScaledDDP:
    """Stands in for a Megatron DDP chunk: records the factors its ``scale_gradients`` gets."""

    def __init__(self) -> None:
        self.factors: list[torch.Tensor] = []

    def scale_gradients(self, factor: torch.Tensor) -> None:
        self.factors.append(factor)


def bits(t: torch.Tensor) -> bytes:
    """``t``'s bytes (a CPU tensor)."""
    return t.numpy().tobytes()
