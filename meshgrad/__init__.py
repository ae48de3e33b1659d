"""meshgrad: gradient finalization for 3D/4D-parallel training, as a plan over named axes.

The core is framework-free (stdlib + numpy). ``torch_impl`` and ``jax_impl`` execute the
same :class:`~meshgrad.plan.FinalizePlan`. Modules: ``axes`` (mesh axes, groups, rank
order), ``config``, ``params`` (ParamSpec / RouterSpec), ``actions`` (the action types),
``steps`` (one planner per step), ``fusion``, ``layout``, ``plan`` (plan_finalize),
``rules`` (the array math), ``errors`` (shared exception types); ``presets``, ``explain``,
``cost`` and ``at_scale`` size a run before it exists (``python -m meshgrad explain``).
"""

from meshgrad.axes import DENSE_AXES, EXPERT_AXES, GROUP_AXES, Axis, Group, ParallelDims, stage_set
from meshgrad.config import FinalizeConfig
from meshgrad.params import ParamKey, ParamSpec, Role, RouterSpec
from meshgrad.actions import (
    ExpertBiasUpdate,
    QbBetaUpdate,
    Reduction,
    ReduceOp,
    ResetTemporaries,
    Signature,
    StageReduction,
    Step,
    TokenScale,
)
from meshgrad.layout import scatter_shard
from meshgrad.plan import FinalizePlan, GroupSizes, plan_finalize
from meshgrad.steps import embedding_chunk

__all__ = [
    "Axis",
    "DENSE_AXES",
    "EXPERT_AXES",
    "ExpertBiasUpdate",
    "FinalizeConfig",
    "FinalizePlan",
    "GROUP_AXES",
    "Group",
    "GroupSizes",
    "ParallelDims",
    "ParamKey",
    "ParamSpec",
    "QbBetaUpdate",
    "Reduction",
    "ReduceOp",
    "ResetTemporaries",
    "Role",
    "RouterSpec",
    "Signature",
    "StageReduction",
    "Step",
    "TokenScale",
    "embedding_chunk",
    "plan_finalize",
    "scatter_shard",
    "stage_set",
]

__version__ = "0.1.0"
