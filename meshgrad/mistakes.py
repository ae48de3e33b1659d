"""Likely mistakes that Megatron accepts silently: the messages, decided from the specs.

A backend warns with each message (:class:`meshgrad.errors.LikelyMistakeWarning`) once per
plan and keeps Megatron's numbers; nothing here changes what finalization does.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshgrad.config import FinalizeConfig
from meshgrad.params import ParamSpec
from meshgrad.steps import is_qk_layernorm

#: Parameter names a message lists before it says how many more there are.
NAMES_SHOWN = 4


def _names(specs: Sequence[ParamSpec]) -> str:
    shown = ", ".join(f"{s.name!r} (chunk {s.chunk})" for s in specs[:NAMES_SHOWN])
    more = len(specs) - NAMES_SHOWN
    return shown + (f" and {more} more" if more > 0 else "")


def _num_tokens_without_per_token_loss(config: FinalizeConfig, num_tokens_given: bool) -> tuple[str, ...]:
    if not num_tokens_given or config.calculate_per_token_loss:
        return ()
    return (
        "num_tokens was passed while config.calculate_per_token_loss=False: the DP sync "
        "already averages the gradients over data parallelism, and they are then divided by "
        "the global token count as well (every gradient shrinks by that count). Pass "
        "num_tokens only with calculate_per_token_loss=True (summed token losses), or "
        "num_tokens=None with a mean loss.",
    )


def _sequence_parallel_flags_ignored(
    params: Sequence[ParamSpec], config: FinalizeConfig, tp_size: int | None
) -> tuple[str, ...]:
    if config.sequence_parallel or (tp_size is not None and tp_size <= 1):
        return ()
    ignored = [
        p for p in params
        if p.has_grad and p.sequence_parallel and not p.average_gradients_across_tp_domain
        and not (config.qk_layernorm and is_qk_layernorm(p.name))
    ]
    if not ignored:
        return ()
    return (
        f"parameters flagged sequence_parallel=True while config.sequence_parallel is False "
        f"get no tensor-parallel sum (each tp rank keeps its partial gradient): {_names(ignored)}. "
        f"Set sequence_parallel=True in the config if the model runs sequence parallel, or "
        f"clear the parameters' flag.",
    )


def likely_mistakes(
    params: Sequence[ParamSpec], config: FinalizeConfig, *, num_tokens_given: bool, tp_size: int | None = None
) -> tuple[str, ...]:
    """The messages for common mistakes in a finalize call that Megatron accepts silently.

    Args:
      params: this rank's parameter specs.
      config: the finalize config.
      num_tokens_given: whether the call passes ``num_tokens``.
      tp_size: the tp group's size, when known: with 1 a flag that changes nothing is not
        reported.

    Returns:
      One message per mistake found (empty when none), each naming the config field and
      the parameters concerned.
    """
    return _num_tokens_without_per_token_loss(config, num_tokens_given) + _sequence_parallel_flags_ignored(
        params, config, tp_size
    )


__all__ = ["NAMES_SHOWN", "likely_mistakes"]
