"""A two-stage tied-embedding model for the pipeline cases of the torch-parallelism tests
(tests/test_torch_fsdp2.py, tests/test_torch_ddp.py), and its single-process reference."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

B, S, H, V = 4, 4, 8, 6  # batch, sequence, hidden, vocab


class Stage(torch.nn.Module):
    """One pipeline stage of a tied-embedding model: stage 0 embeds, stage 1 projects onto
    the vocabulary with its own copy of the embedding weight."""

    def __init__(self, stage: int) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.share_embeddings_and_output_weights = True
        self.weight = torch.nn.Parameter(torch.randn(V, H, dtype=torch.float64))
        self.proj = torch.nn.Linear(H, H, dtype=torch.float64)
        self.stage = stage

    def shared_embedding_or_output_weight(self) -> Any:
        return self.weight

    def forward(self, x: Any) -> Any:
        if self.stage == 0:
            return self.proj(torch.nn.functional.embedding(x, self.weight))
        return torch.nn.functional.linear(self.proj(x), self.weight)


def tokens() -> Any:
    torch.manual_seed(3)
    return torch.randint(0, V, (B, S))


def reference_pp() -> dict[str, np.ndarray]:
    first, last = Stage(0), Stage(1)
    last.weight = first.weight  # one tied weight
    last(first(tokens())).pow(2).sum().div(B * S).backward()
    return {"weight": first.weight.grad.numpy().copy(), "proj0": first.proj.weight.grad.numpy().copy(),
            "proj1": last.proj.weight.grad.numpy().copy()}
