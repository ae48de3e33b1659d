"""torch backend of meshgrad: run a FinalizePlan with torch.distributed.

The public entry point mirrors Megatron-Core's ``core.distributed.finalize_model_grads``
module (same function names and signatures), so Megatron users can swap it in.
"""

from torch_impl.buffers import GradBuffers, attach_grad_buffers
from torch_impl.ddp_hooks import ddp_sum_hook
from torch_impl.sources.discover import Discovered, discover
from torch_impl.finalize import (
    _allreduce_conditional_embedding_grads,
    _allreduce_embedding_grad,
    _allreduce_layernorm_grads,
    _allreduce_non_tensor_model_parallel_grads,
    _allreduce_position_embedding_grads,
    _allreduce_replicated_grads_over_gtp_remat_group,
    _allreduce_router_grads,
    _allreduce_word_embedding_grads,
    _get_main_grad_attr,
    _get_position_embedding_weight,
    _get_shared_word_embedding_weight,
    _reshard_if_dtensor,
    _unshard_if_dtensor,
    _update_router_expert_bias,
    _update_router_qb_beta,
    execution_stats,
    invalidate_plans,
    finalize_model_grads,
    reset_model_temporary_tensors,
)
from torch_impl.run.groups import TorchGroups
from torch_impl.sources.mesh_groups import MeshGroups, mesh_groups

__all__ = [
    "Discovered",
    "GradBuffers",
    "MeshGroups",
    "TorchGroups",
    "attach_grad_buffers",
    "ddp_sum_hook",
    "discover",
    "execution_stats",
    "invalidate_plans",
    "finalize_model_grads",
    "mesh_groups",
    "reset_model_temporary_tensors",
    "_allreduce_conditional_embedding_grads",
    "_allreduce_embedding_grad",
    "_allreduce_layernorm_grads",
    "_allreduce_non_tensor_model_parallel_grads",
    "_allreduce_position_embedding_grads",
    "_allreduce_replicated_grads_over_gtp_remat_group",
    "_allreduce_router_grads",
    "_allreduce_word_embedding_grads",
    "_get_main_grad_attr",
    "_get_position_embedding_weight",
    "_get_shared_word_embedding_weight",
    "_reshard_if_dtensor",
    "_unshard_if_dtensor",
    "_update_router_expert_bias",
    "_update_router_qb_beta",
]
