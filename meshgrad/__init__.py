"""meshgrad: gradient finalization for 3D/4D-parallel training, as a plan over named axes.

The core is framework-free (stdlib + numpy). ``torch_impl`` and ``jax_impl`` execute the
same :class:`~meshgrad.plan.FinalizePlan`.
"""

from meshgrad.axes import DENSE_AXES, EXPERT_AXES, GROUP_AXES, Axis, Group, ParallelDims, stage_set
from meshgrad.config import FinalizeConfig
from meshgrad.params import ParamKey, ParamSpec, Role, RouterSpec
from meshgrad.plan import (
    ExpertBiasUpdate,
    FinalizePlan,
    GroupSizes,
    QbBetaUpdate,
    Reduction,
    ReduceOp,
    ResetTemporaries,
    StageReduction,
    Step,
    TokenScale,
    embedding_chunk,
    plan_finalize,
    scatter_shard,
)

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
    "StageReduction",
    "Step",
    "TokenScale",
    "embedding_chunk",
    "plan_finalize",
    "scatter_shard",
    "stage_set",
]

__version__ = "0.1.0"
