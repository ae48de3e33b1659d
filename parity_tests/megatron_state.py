"""Megatron's ``parallel_state`` for a test layout, shared by the megatron-core oracles.

Megatron is a black box here: only its public ``initialize_model_parallel`` is called.
"""

from __future__ import annotations

import warnings
from typing import Any


def initialize_parallel_state(ps: Any, layout: Any, **extra: Any) -> None:
    """``ps.initialize_model_parallel`` for ``layout`` (its tp, pp, cp, ep, etp sizes and,
    where set, the pp stages of the embedding groups), Megatron's warnings silenced.

    Args:
      ps: megatron's ``parallel_state`` module (of whichever version the process imported).
      layout: an object with ``tp``, ``pp``, ``cp``, ``ep``, ``etp`` and optional ``embd`` /
        ``pos`` (tuples of pp stages, None = Megatron's default).
      extra: further keywords of that version's ``initialize_model_parallel``.
    """
    kwargs: dict[str, Any] = dict(extra)
    for key, stages in (("get_embedding_ranks", getattr(layout, "embd", None)), ("get_position_embedding_ranks", layout.pos)):
        if stages is not None:
            kwargs[key] = lambda pp_ranks, split=None, stages=stages: [pp_ranks[s] for s in stages]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ps.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            context_parallel_size=layout.cp,
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.etp,
            create_gloo_process_groups=False,
            **kwargs,
        )
