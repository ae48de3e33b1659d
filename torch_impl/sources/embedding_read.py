"""What an embedding helper reads (:class:`EmbeddingRead`): the chunk Megatron's rule picks
at this pp stage, its one weight (:func:`embedding_weight`), and the discovery of that
weight alone (:func:`one_weight`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from meshgrad.errors import FinalizeInputError
from meshgrad.params import Role
from meshgrad.plan import embedding_chunk
from torch_impl.sources.discover import Discovered, param_spec
from torch_impl.sources.wrappers import unwrap


class EmbeddingRead(NamedTuple):
    """What an embedding helper reads, done by the read stage.

    Args:
      role: the weight's role (word or position embedding).
      getter: returns the weight of an unwrapped chunk, or None.
      required: a missing weight is an error (else nothing is reduced).
      has_mtp: the MTP chunk rule applies (Megatron's word-embedding helper).
      pp_given: the helper was given a pp group (None: the rank counts as the first stage).
    """

    role: Role
    getter: Callable[[Any], Any]
    required: bool
    has_mtp: bool
    pp_given: bool


def embedding_weight(model: Sequence[Any], stage: int, pp: int, read: EmbeddingRead, rank: int) -> tuple[int, Any]:
    """(the chunk Megatron's rule picks at this pp stage, the weight ``read.getter`` gives
    for it).

    Raises:
      ValueError: the weight is required and the chunk has none.
    """
    index = embedding_chunk(stage, pp, len(model), read.has_mtp)
    weight = read.getter(unwrap(model[index]))
    if weight is None and read.required:
        raise FinalizeInputError(f"rank {rank}: pp stage {stage}: chunk {index} has no embedding weight to reduce")
    return index, weight


def one_weight(model: Sequence[Any], index: int, weight: torch.Tensor | None, role: Role) -> Discovered:
    """The discovery of an embedding helper: the one weight it reduces (none: nothing).

    The helper already chose chunk ``index`` (Megatron's chunk rule); the weight is
    labelled chunk 0 so that the plan's chunk rule keeps it.
    """
    if weight is None:
        return Discovered((), (), {}, {}, tuple(model))
    module = unwrap(model[index])
    name = next((n for n, p in module.named_parameters() if p is weight), "embedding.weight")
    spec = param_spec(name, 0, weight, role)
    return Discovered((spec,), (), {spec.key: weight}, {}, tuple(model))


__all__ = ["EmbeddingRead", "embedding_weight", "one_weight"]
