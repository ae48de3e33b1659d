"""Megatron-Core's ``finalize_model_grads`` API, executed from a meshgrad plan.

Every function of Megatron-Core's `finalize_model_grads` module is here with its name and signature; each is a thin
entry point over the one call pipeline, :func:`torch_impl.call.pipeline.call` (read, plan,
check, agree, run; what a call read and planned is cached on the model). A seed helper plans only its steps over its own groups and
gets the same protection as :func:`finalize_model_grads`: its checks and the cross-rank
consistency check run once per plan, the status round (over the helper's groups) every
call, and a bad input raises on every rank before anything changes.

Groups: helpers take Megatron's explicit groups; a ``None`` group means what it means in
Megatron's helper (:func:`torch_impl.sources.helper_groups.helper_group`). :func:`finalize_model_grads`
takes a ``ProcessGroupCollection`` (or any object with its attribute names, or a
mapping), a torch ``DeviceMesh`` with meshgrad dim names, a
:class:`~torch_impl.sources.mesh_groups.MeshGroups`, a :class:`~torch_impl.run.groups.TorchGroups`, or
``None`` (``parallel_state``, or no communication in a world of one rank).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from meshgrad.axes import Group
from meshgrad.plan import Step
from torch_impl.call.pipeline import call
from torch_impl.call.read import Request, as_chunks
from torch_impl.helpers import embedding_grad, run_helper
from torch_impl.call.model_state import ModelState
from torch_impl.sources.discover import position_embedding, shared_word_embedding
from torch_impl.run.errors import MegatronAssertionError
from torch_impl.run.stats import ExecStats
from torch_impl.run.grads import grad_attr, is_dtensor, reshard, unshard
from torch_impl.run.groups import group_ranks, world_rank
from torch_impl.sources.helper_groups import helper_group
from torch_impl.sources.wrappers import eager_under_compile
from torch_impl.sources.config import resolve_config

ProcessGroup = Any


@eager_under_compile
def invalidate_plans(model: Any) -> None:
    """Make the next call re-read ``model`` entirely (e.g. after changing flags or
    ``requires_grad`` of parameters of a Megatron-DDP chunk that no meshgrad step
    touches, which are read once per plan)."""
    ModelState.of(as_chunks(model)).invalidate()


@eager_under_compile
def execution_stats(model: Any) -> ExecStats:
    """The counters kept on ``model``'s cached finalize state: calls, plans built, plans
    bound to gradient tensors, and gradient bytes copied to coalesce (0 when every
    reduced gradient lives in a meshgrad buffer, :mod:`torch_impl.buffers`)."""
    return ModelState.of(as_chunks(model)).stats


# =========================================================================== entry point


@eager_under_compile
def finalize_model_grads(
    model: list[nn.Module],
    num_tokens: torch.Tensor | None = None,
    pg_collection: Any = None,
    force_all_reduce: bool | None = False,
    *,
    gtp_fence: Callable[[], None] | None = None,
) -> None:
    """Finalize gradients: DP sync, pipeline/tensor-parallel fix-ups, router updates,
    temporaries reset and num_tokens scaling (docs/semantics.md, every step).

    Args:
      model: this rank's model chunks (virtual pipeline chunks), possibly wrapped in
        Megatron DDP (then its ``finish_grad_sync`` / ``scale_gradients`` are used).
      num_tokens: pass it only with a per-token loss: a one-element integer or floating
        tensor holding this rank's token count (the last pipeline stage's counts); it is
        broadcast over pp and summed over dp x cp (x gtp) in place, so it holds the
        global count afterwards, and every gradient is multiplied by
        ``1 / max(global count, 1)`` (no host sync). Reduced in int64 / float64, so small
        integer dtypes do not overflow while summing. None: no scaling.
      pg_collection: a ProcessGroupCollection (or any object with its attribute names),
        a torch DeviceMesh with meshgrad dim names, a MeshGroups or a TorchGroups. None:
        Megatron's parallel_state, or a world of one rank.
      force_all_reduce: all-reduce instead of a distributed optimizer's reduce-scatter.
      gtp_fence: keyword-only extension: called before the DP sync when the config's
        ``gtp_weight_remat_size`` or ``expert_gtp_weight_remat_size`` is > 1. Default:
        Megatron's ``gtp_api.wait_for_gtp_grad_reduction_on_current_stream`` when that
        module is loaded, else nothing.

    Raises:
      TypeError / ValueError: before any communication or mutation, naming the rank and
        the group or parameter at fault (:mod:`torch_impl.call.checks`).
      torch_impl.run.errors.ConsistencyError: ranks of a group would launch different
        collectives (``config.consistency_check``); nothing was reduced.
      torch_impl.run.errors.NonFiniteGradError: NaN / Inf on some rank
        (``config.check_for_nan_in_grad``); nothing was reduced.
      torch_impl.run.errors.CollectiveError: a collective failed (a peer died or stalled
        past the process-group timeout), naming the action.
    """
    request = Request(num_tokens=num_tokens, force_all_reduce=bool(force_all_reduce))
    call(model, pg_collection, request, fence=gtp_fence)


# =========================================================================== seed helpers


def _get_main_grad_attr(param: nn.Parameter) -> str:
    """Name of the gradient attribute to use: ``"main_grad"`` if the parameter has one,
    else ``"grad"``."""
    return grad_attr(param)


def _unshard_if_dtensor(tensor: torch.Tensor) -> torch.Tensor:
    """Unshards the input tensor if it is a DTensor and otherwise returns it unmodified.

    Args:
      tensor: the tensor to potentially unshard.

    Returns:
      The whole tensor of a DTensor, or ``tensor`` itself.
    """
    return unshard(tensor)


def _reshard_if_dtensor(tensor_to_shard: torch.Tensor, reference_tensor: torch.Tensor) -> torch.Tensor:
    """Reshards ``tensor_to_shard`` like ``reference_tensor`` if that is a DTensor.

    Args:
      tensor_to_shard: the whole tensor (identical on every rank of the DTensor's mesh).
      reference_tensor: the reference for mesh and placements.

    Returns:
      A DTensor with the reference's mesh, placements and attributes, or
      ``reference_tensor`` itself when it is not a DTensor.
    """
    if not is_dtensor(reference_tensor):
        return reference_tensor
    return reshard(tensor_to_shard, reference_tensor)


@eager_under_compile
def _allreduce_conditional_embedding_grads(
    model: list[nn.Module], config: Any, pp_group: ProcessGroup | None = None
) -> None:
    """All-reduce conditional embedding grads (params flagged ``pipeline_parallel``) over
    the pipeline stages, summing this rank's virtual-chunk copies first; only with
    ``config.has_cond_embedder``. A None ``pp_group`` is parallel_state's, as in Megatron."""
    pp = helper_group(Group.PP, pp_group, "lookup", "_allreduce_conditional_embedding_grads(pp_group)")
    run_helper(model, {Group.PP: pp}, Request(steps=(Step.COND_EMBEDDER,), config=config, over=(Group.PP,)))


@eager_under_compile
def _allreduce_router_grads(
    model: list[nn.Module], config: Any, *, pp_group: ProcessGroup | None = None
) -> None:
    """All-reduce router grads (params flagged ``flextron_router_pp_sync``) over the
    pipeline stages. As Megatron's helper, it does not check ``config.flextron`` (only
    :func:`finalize_model_grads` does).

    Args:
      model: the model chunks.
      config: transformer config.
      pp_group: keyword-only extension: the pipeline group (default: Megatron's
        parallel_state's, which is what Megatron's helper always uses).
    """
    pp = helper_group(Group.PP, pp_group, "lookup", "_allreduce_router_grads: the pipeline group")
    request = Request(steps=(Step.ROUTER,), config=config, over=(Group.PP,))
    run_helper(model, {Group.PP: pp}, request)


@eager_under_compile
def _allreduce_non_tensor_model_parallel_grads(
    model: list[nn.Module], config: Any, tp_group: ProcessGroup | None = None
) -> None:
    """All-reduce layernorm grads (sequence parallel, qk-layernorm) and
    ``average_gradients_across_tp_domain`` grads over the tensor-parallel group. A None
    ``tp_group`` is parallel_state's, as in Megatron."""
    tp = helper_group(Group.TP, tp_group, "lookup", "_allreduce_non_tensor_model_parallel_grads(tp_group)")
    run_helper(model, {Group.TP: tp}, Request(steps=(Step.NON_TP,), config=config, over=(Group.TP,)))


_allreduce_layernorm_grads = _allreduce_non_tensor_model_parallel_grads


@eager_under_compile
def _allreduce_replicated_grads_over_gtp_remat_group(
    model: list[nn.Module],
    gtp_remat_group: ProcessGroup | None,
    egtp_remat_group: ProcessGroup | None,
    calculate_per_token_loss: bool = False,
) -> None:
    """Complete the gtp_remat / egtp_remat reduction of replicated (not
    ``is_gtp_weight_remat``) params: SUM with per-token loss, else AVG; one collective per
    group over the promoted dtype. No-op when both groups are None or of size 1."""
    request = Request(steps=(Step.GTP,), config_default=True, per_token_loss=bool(calculate_per_token_loss))
    run_helper(model, {Group.GTP: gtp_remat_group, Group.EGTP: egtp_remat_group}, request)


def _get_shared_word_embedding_weight(model_module: nn.Module, config: Any) -> nn.Parameter | None:
    """Return the shared word-embedding weight if it is duplicated across stages.

    Args:
      model_module: the (unwrapped) model chunk.
      config: transformer config (``mtp_num_layers``).

    Returns:
      ``shared_embedding_or_output_weight()`` when the module shares embeddings and
      output weights or MTP is on; otherwise None.
    """
    return shared_word_embedding(model_module, bool(getattr(config, "mtp_num_layers", None)))


def _get_position_embedding_weight(model_module: nn.Module) -> nn.Parameter:
    """Return ``model_module.position_embeddings.weight``.

    Raises:
      AttributeError: the module has no position embedding.
    """
    weight = position_embedding(model_module)
    if weight is None:
        raise AttributeError(f"{type(model_module).__name__} has no position_embeddings.weight")
    return weight


@eager_under_compile
def _allreduce_embedding_grad(
    model: list[nn.Module],
    embd_group: ProcessGroup,
    pp_group: ProcessGroup,
    weight_getter: Callable[[nn.Module], nn.Parameter | None],
    skip_if_none: bool = True,
    config: Any = None,
) -> None:
    """All-reduce one embedding parameter over ``embd_group`` (members of a group of size
    > 1 only).

    The chunk used is ``model[0]`` on the first stage of ``pp_group`` (also when it is
    None), ``model[-1]`` on the last, and on middle stages ``model[-1]`` when
    ``config.mtp_num_layers`` > 0, else ``model[0]``.

    Args:
      model: the model chunks (PP/VPP).
      embd_group: the group to reduce over (None: nothing to do).
      pp_group: the pipeline group (stage detection).
      weight_getter: returns the parameter of the unwrapped chunk, or None.
      skip_if_none: quietly return when the parameter or its gradient is None; else raise.
      config: transformer config (``mtp_num_layers``); None: no MTP rule.

    Raises:
      ValueError: ``skip_if_none`` is False and the parameter or its gradient is None.
    """
    has_mtp = bool(getattr(config, "mtp_num_layers", None) or 0)
    embedding_grad(model, embd_group, pp_group, weight_getter, skip_if_none, config, has_mtp)


@eager_under_compile
def _allreduce_word_embedding_grads(
    model: list[nn.Module],
    config: Any,
    embd_group: ProcessGroup | None = None,
    pp_group: ProcessGroup | None = None,
) -> None:
    """All-reduce the tied word-embedding gradient across the stages of ``embd_group``
    (first and last by default).

    As in Megatron, a None ``embd_group`` is parallel_state's embedding group (none: nothing
    to do), and then ``pp_group`` must be None too: parallel_state's is used.

    Raises:
      MegatronAssertionError: ``embd_group`` is None, parallel_state's embedding group has
        several ranks, and ``pp_group`` was given (Megatron asserts).
    """
    if embd_group is None:
        embd_group = helper_group(Group.EMBD, None, "lookup_optional", "embd_group")
        if embd_group is not None and len(group_ranks(embd_group)) > 1:
            if pp_group is not None:
                raise MegatronAssertionError(
                    f"rank {world_rank()}: _allreduce_word_embedding_grads: embd_group is None, so "
                    "parallel_state's embedding group is used, and then pp_group must be None too "
                    "(Megatron-Core asserts); pass both groups or neither"
                )
            pp_group = helper_group(Group.PP, None, "lookup", "_allreduce_word_embedding_grads(pp_group)")
    has_mtp = bool(getattr(config, "mtp_num_layers", None) or 0)

    def getter(module: nn.Module) -> nn.Parameter | None:
        return _get_shared_word_embedding_weight(module, config)

    embedding_grad(model, embd_group, pp_group, getter, True, config, has_mtp)


@eager_under_compile
def _allreduce_position_embedding_grads(
    model: list[nn.Module], config: Any, pos_emb_group: ProcessGroup, pp_group: ProcessGroup
) -> None:
    """All-reduce the position-embedding gradient over ``pos_emb_group`` (None: nothing to
    do); a missing gradient on a member stage is an error. Middle stages use ``model[0]``."""
    embedding_grad(model, pos_emb_group, pp_group, _get_position_embedding_weight, False, config, False)


@eager_under_compile
def _update_router_expert_bias(
    model: list[nn.Module], config: Any, tp_dp_cp_group: ProcessGroup | None = None
) -> None:
    """Update trained routers' expert bias from token counts summed over tp x gtp x dp x cp
    (one collective for all routers).

    As in Megatron, ``config.moe_router_enable_expert_bias`` gates this step inside
    :func:`finalize_model_grads` only: called directly, the helper always updates.

    Args:
      model: the model chunks.
      config: transformer config (``moe_router_bias_update_rate``).
      tp_dp_cp_group: the tp x dp x cp group (None: Megatron's parallel_state's, as
        Megatron's helper).
    """
    group = helper_group(Group.TP_DP_CP, tp_dp_cp_group, "lookup", "_update_router_expert_bias(tp_dp_cp_group)")
    request = Request(steps=(Step.EXPERT_BIAS,), config=config)
    run_helper(model, {Group.TP_DP_CP: group}, request)


@eager_under_compile
def _update_router_qb_beta(model: list[nn.Module], config: Any, dp_cp_group: ProcessGroup | None = None) -> None:
    """Update the quantile-balancing bias once per global batch: AVG of
    ``qb_beta_accum / max(qb_beta_count, 1)`` over ``dp_cp_group``, EMA blend, re-centre.

    As Megatron's helper, it does not check ``moe_router_load_balancing_type`` (only
    :func:`finalize_model_grads` does), and a None ``dp_cp_group`` is torch.distributed's
    default group (the world), to which Megatron passes it on.
    """
    group = helper_group(Group.DP_CP_GTP, dp_cp_group, "world", "_update_router_qb_beta(dp_cp_group)")
    request = Request(steps=(Step.QB_BETA,), config=config)
    run_helper(model, {Group.DP_CP: group, Group.DP_CP_GTP: group}, request)


@eager_under_compile
def reset_model_temporary_tensors(config: Any, model: list[nn.Module]) -> None:
    """Reset the temporary tensors of the model: token counts, qb accumulators, the global
    aux-loss tracker (semantics `reset`)."""
    request = Request(steps=(Step.RESET,), config=resolve_config(config), merge_ddp_config=False)
    run_helper(model, {}, request)  # no groups: nothing is communicated
