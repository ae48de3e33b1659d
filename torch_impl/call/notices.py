"""The plan stage's warnings: likely mistakes and misaligned DDP shards, once per plan.

Both are decided outside this module -- :func:`meshgrad.mistakes.likely_mistakes` (the
core) and :func:`torch_impl.sources.ddp_layout.misaligned_in_ddp` (a Megatron DDP's bucket
layout) -- and given here when a plan is built, attributed to the user's line
(:func:`torch_impl.run.warn.warn_user`). The numbers stay Megatron's; the warnings can be
silenced with ``warnings.filterwarnings("ignore", category=...)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from meshgrad.config import FinalizeConfig
from meshgrad.ddp_layout import misalignment_message
from meshgrad.errors import LayoutWarning, LikelyMistakeWarning
from meshgrad.mistakes import likely_mistakes
from meshgrad.params import ParamSpec
from meshgrad.plan import FinalizePlan
from meshgrad.steps import cross_stage_keys
from torch_impl.sources.ddp_layout import ddp_layouts, misaligned_in_ddp
from torch_impl.run.warn import warn_user


def warn_plan(
    plan: FinalizePlan,
    params: Sequence[ParamSpec],
    config: FinalizeConfig,
    ddp: Sequence[Any],
    *,
    num_tokens_given: bool,
    tp_size: int,
    force_all_reduce: bool,
) -> None:
    """Warn about what a new plan will do that the user likely did not mean.

    Args:
      plan: the plan just built.
      params: this rank's parameter specs.
      config: the call's config.
      ddp: per chunk, its Megatron DDP wrapper or None.
      num_tokens_given: whether the call passes ``num_tokens``.
      tp_size: the tp group's size.
      force_all_reduce: the call's ``force_all_reduce``.
    """
    for text in likely_mistakes(params, config, num_tokens_given=num_tokens_given, tp_size=tp_size):
        warn_user(text, LikelyMistakeWarning)
    cross = cross_stage_keys(plan.actions)
    for chunk, obj in enumerate(ddp):
        if obj is None:
            continue
        names = {name.removeprefix("module.") for c, name in cross if c == chunk}
        names |= {f"module.{name}" for name in names}
        bad = misaligned_in_ddp(obj, names, force_all_reduce=force_all_reduce)
        if bad:
            dp_size = max((size for _, size in ddp_layouts(obj)), default=1)
            warn_user(f"model chunk {chunk}: " + misalignment_message(bad, dp_size), LayoutWarning)


__all__ = ["warn_plan"]
