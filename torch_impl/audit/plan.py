"""A rank's plan: what its step files share, and how to read one step."""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import numpy as np
import torch
from torch import nn

from torch_impl.audit.sampling import _Entry, _Sampler


@dataclasses.dataclass
class _Plan:
    """What the step files of one rank share, and how to read a step.

    Args:
      key: what it was made from (the discovered model, groups, configs, chunks, group
        source, wrapped function), compared by identity.
      chunk_ids, source: the chunks' ids and the group source it was made for.
      rank, fsdp: this rank; whether DTensor gradients are read as local shards.
      entries, params: per parameter its static facts and the parameter object.
      sampler: how to read the sampled values of the current gradient tensors.
      routers, router_fields: the router modules, their buffers present ([index, field, shape]).
      digest, arrays: the plan file's id and contents.
    """

    key: tuple[Any, ...]
    chunk_ids: tuple[int, ...]
    source: Any
    rank: int
    fsdp: bool
    entries: list[_Entry]
    params: list[torch.Tensor]
    sampler: _Sampler
    routers: list[nn.Module]
    router_fields: list[list[Any]]
    digest: str
    arrays: dict[str, np.ndarray]

    def fits(self, chunks: list[Any], source: Any, fields: list[list[Any]]) -> bool:
        """Whether a step on ``chunks`` with ``source`` can be read with this plan: the same
        chunk objects and group source, the same gradient tensors, the same router buffers."""
        return (
            self.chunk_ids == tuple(map(id, chunks))
            and self.source is source
            and fields == self.router_fields
            and self.sampler.watch.same()
        )

    def reads_like(self, other: "_Plan") -> bool:
        """Whether values read with ``other`` are this plan's: the same parameters, sampled
        positions and routers, in the same order."""
        return (
            len(self.params) == len(other.params)
            and all(map(operator.is_, self.params, other.params))
            and all(map(operator.is_, self.entries, other.entries))
            and len(self.routers) == len(other.routers)
            and all(map(operator.is_, self.routers, other.routers))
            and self.router_fields == other.router_fields
        )


def _same(a: Any, b: Any) -> bool:
    """Identity, or equality for plain values (the parts of a plan key)."""
    return a is b or (isinstance(a, (tuple, int, str)) and a == b)


