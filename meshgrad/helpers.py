"""What each of Megatron-Core's helper functions does when called on its own.

``finalize_model_grads`` checks the config before each step; the helpers (the
``_allreduce_*`` / ``_update_*`` functions of its module) do not (docs/semantics.md,
"Current Megatron-Core behaviour"): ``_allreduce_router_grads`` ignores ``config.flextron``,
``_update_router_expert_bias`` runs without ``moe_router_enable_expert_bias``,
``_update_router_qb_beta`` ignores the balancing type, the embedding helpers reduce the
weight they are given whatever ``share_embeddings_and_output_weights`` says, and the GTP
helper takes ``calculate_per_token_loss`` as an argument. :func:`plan_helper` is the part
of a plan built with those rules; a backend runs it as it runs any plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from meshgrad.config import FinalizeConfig
from meshgrad.params import ParamSpec, RouterSpec
from meshgrad.plan import FinalizePlan, GroupSizes, Step, plan_finalize

#: Per step, the config a helper of that step plans with in place of the gate it skips.
HELPER_RULES: Mapping[Step, Mapping[str, Any]] = {
    Step.ROUTER: {"flextron": True},
    Step.EXPERT_BIAS: {"moe_router_enable_expert_bias": True},
    Step.QB_BETA: {"moe_router_load_balancing_type": "quantile_balancing"},
    Step.WORD_EMBEDDING: {"share_embeddings_and_output_weights": True},
    Step.POS_EMBEDDING: {"share_embeddings_and_output_weights": True},
}


def helper_config(
    config: FinalizeConfig, steps: Sequence[Step], *, calculate_per_token_loss: bool | None = None
) -> FinalizeConfig:
    """The config a helper of ``steps`` plans with: its rules applied, and no configured
    embedding stage sets (a helper is given its embedding group; no finalize step runs).

    Args:
      config: the config the helper was given (or its chunks').
      steps: the helper's steps.
      calculate_per_token_loss: the GTP helper's argument (None: the config's).

    Returns:
      The helper's config.
    """
    changes: dict[str, Any] = {}
    for step in steps:
        changes.update(HELPER_RULES.get(step, {}))
    if calculate_per_token_loss is not None:
        changes["calculate_per_token_loss"] = bool(calculate_per_token_loss)
    if config.embedding_stages is not None or config.position_embedding_stages is not None:
        changes.update(embedding_stages=None, position_embedding_stages=None)
    return dataclasses.replace(config, **changes) if changes else config


def plan_helper(
    params: Sequence[ParamSpec],
    config: FinalizeConfig,
    sizes: GroupSizes,
    routers: Sequence[RouterSpec],
    steps: Sequence[Step],
) -> FinalizePlan:
    """A helper's plan: the actions of ``steps`` (no DP sync) of a plan built with the
    helper's config (:func:`helper_config`).

    Args:
      params: the parameters of the helper's model chunks.
      config: the helper's config (:func:`helper_config`).
      sizes: the sizes of the helper's groups.
      routers: the router modules of its chunks.
      steps: the helper's steps.

    Returns:
      The plan, with only the helper's actions.
    """
    plan = plan_finalize(params, config, sizes, routers, dp_sync=False)
    return dataclasses.replace(plan, actions=plan.for_step(*steps))


__all__ = ["HELPER_RULES", "helper_config", "plan_helper"]
