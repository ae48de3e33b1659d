"""The one place ``torch_impl.audit`` reads torch_impl's internals.

Config, groups and the discovered model, resolved exactly as torch_impl's finalize does,
and the few torch_impl helpers the recorder uses. When torch_impl's call pipeline
changes, only this module is re-pointed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from meshgrad.config import FinalizeConfig
from torch_impl.call.model_state import ModelState
from torch_impl.sources.discover import FLAG_ATTRS
from torch_impl.finalize import finalize_model_grads
from torch_impl.run.grads import is_dtensor
from torch_impl.run.groups import group_ranks
from torch_impl.sources.config import CONFIG_SIZES, Requested, chunk_configs

__all__ = ["CONFIG_SIZES", "FLAG_ATTRS", "finalize_model_grads", "group_ranks", "is_dtensor", "model_state",
           "resolve_layout"]


def resolve_layout(
    model: Sequence[Any], pg_collection: Any, validated_by: tuple[Any, int] | None = None
) -> tuple[FinalizeConfig, Any, Any, Any]:
    """Config and groups exactly as torch_impl's finalize resolves them.

    The one place this module calls into torch_impl's set-up path (re-pointed when that
    moves).

    Args:
      model: the model chunks.
      pg_collection: what the finalize function is given.
      validated_by: (the model's cached finalize state, its call count before a call):
        when torch_impl's finalize ran exactly once since (its own call, or inside the
        audited function), the model it discovered and checked in that call is used
        instead of checking it again.

    Returns:
      (FinalizeConfig, TorchGroups, the raw chunk config, the discovered model).
    """
    raw, ddp_config = chunk_configs(model)
    state = model_state(model)
    source = state.group_memo.parallel_state_groups() if pg_collection is None else pg_collection
    if validated_by is not None and validated_by[0] is state and state.stats.calls == validated_by[1] + 1:
        # What finalize resolved in this very call (it does not change the config or groups).
        if isinstance(raw, FinalizeConfig) and ddp_config is None:
            config = raw
        else:
            config = state.config_memo.last_resolved_config(raw, ddp_config) or state.config_memo.config(raw, ddp_config)
        groups = state.group_memo.last_resolved_groups(source) or state.group_memo.resolve_groups(source, config, Requested.from_config(raw))
        cached = state.found.get((config.has_mtp, True))
        if cached is not None:
            return config, groups, raw, cached[1]
    config = state.config_memo.config(raw, ddp_config)
    groups = state.group_memo.resolve_groups(source, config, Requested.from_config(raw))
    _, found, _ = state.discovered(model, config)  # every parameter; cached while the model stays the same
    return config, groups, raw, found


def model_state(model: Sequence[Any]) -> Any:
    """torch_impl's cached finalize state of the chunks (created when missing)."""
    return ModelState.of(model)

