"""A minimal Megatron-DDP-like chunk: what ``finalize_model_grads`` needs from a DDP.

Megatron's ``DistributedDataParallel`` keeps ``main_grad`` of every trainable parameter
in a contiguous grad buffer (parameters in reverse order, dense and expert apart),
``finish_grad_sync`` reduces each buffer over its data-parallel group and
``scale_gradients`` multiplies the buffers. This class does exactly that with one bucket
per buffer, so megatron-core's finalize (and meshgrad's drop-in path) can run on it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class MiniDDP(nn.Module):
    """Wraps a model chunk; owns its gradient buffers.

    Args:
      module: the model chunk (its ``config`` / ``ddp_config`` are exposed).
      dp_group: dense data-parallel group (None: size 1, no collective).
      expert_dp_group: expert data-parallel group (None: size 1).
      device: where the buffers live.
      lazy: allocate with ``torch.empty`` (pages committed on first touch).
      dtype: gradient buffer dtype (None: each parameter's dtype, a buffer per dtype).
    """

    def __init__(
        self,
        module: nn.Module,
        dp_group: Any,
        expert_dp_group: Any = None,
        *,
        device: Any = "cpu",
        lazy: bool = True,
        dtype: torch.dtype | None = torch.float32,
    ) -> None:
        super().__init__()
        self.module = module
        self.config = module.config
        self.ddp_config = module.ddp_config
        params = [p for p in module.parameters() if p.requires_grad][::-1]
        self.grad_buffers: list[tuple[torch.Tensor, Any]] = []
        # One buffer per (dense / expert, gradient dtype), as Megatron's DDP keeps one per
        # (param dtype, grad dtype): float32 grads by default, else the parameter's dtype.
        for expert, group in ((False, dp_group), (True, expert_dp_group)):
            members = [p for p in params if (not getattr(p, "allreduce", True)) == expert]
            kinds: dict[torch.dtype, list[nn.Parameter]] = {}
            for p in members:
                kinds.setdefault(dtype if dtype is not None else p.dtype, []).append(p)
            for kind, chosen in kinds.items():
                total = sum(p.numel() for p in chosen)
                flat = (torch.empty if lazy else torch.zeros)(total, dtype=kind, device=device)
                offset = 0
                for p in chosen:
                    p.main_grad = flat[offset : offset + p.numel()].view(p.shape)
                    offset += p.numel()
                self.grad_buffers.append((flat, group))

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        for flat, group in self.grad_buffers:
            if group is not None:
                dist.all_reduce(flat, group=group)

    def scale_gradients(self, scaling_factor: Any) -> None:
        for flat, _ in self.grad_buffers:
            flat.mul_(scaling_factor)

    def zero_grad_buffer(self) -> None:
        for flat, _ in self.grad_buffers:
            flat.zero_()
