"""Local checks of the groups before any communication: the groups a plan needs
(:func:`requirements`), the sizes the Megatron config states and, for a
ProcessGroupCollection or a mapping, every group's members against the mesh its sizes
imply (:func:`check_layout`). A mismatch Megatron accepts is a warning, an error only in
strict mode (``config.strict_groups``)."""

from __future__ import annotations

from collections.abc import Sequence

from meshgrad.axes import Group, ParallelDims
from meshgrad.config import FinalizeConfig
from meshgrad.params import ParamSpec
from meshgrad.errors import FinalizeInputError
from torch_impl.groups import STAGE_GROUPS, TorchGroups, group_ranks, world_size
from torch_impl.megatron_config import Requested
from torch_impl.warn import warn_user


def _layout_mismatch(strict: bool, message: str) -> None:
    """Raise ``message`` (strict mode) or warn with it."""
    if strict:
        raise FinalizeInputError(message)
    warn_user(
        f"{message}. Running with the groups as given, as Megatron-Core does "
        "(config.strict_groups = True makes this an error)"
    )



def _check_sizes(groups: TorchGroups, requested: Requested, experts: bool, strict: bool) -> bool:
    """Group sizes against the sizes the Megatron config states (:func:`check_layout`).

    Returns:
      False when a mismatch was reported (warned): the member check is skipped then.
    """
    rank, source = groups.rank, groups.source
    tp, pp, dpcp, gtp = groups.size(Group.TP), groups.pp_size, groups.size(Group.DP_CP), groups.size(Group.GTP)
    for group, have, want, attr in (
        (Group.TP, tp, requested.tp, "tensor_model_parallel_size"),
        (Group.PP, pp, requested.pp, "pipeline_model_parallel_size"),
    ):
        if want is not None and want != have and group not in groups.missing:
            _layout_mismatch(
                strict, f"rank {rank}: process group {group.value!r} of the {source} has size {have}, but config.{attr} = {want}"
            )
            return False
    cp = requested.cp
    if cp is not None and Group.DP_CP not in groups.missing and dpcp % cp:
        _layout_mismatch(
            strict,
            f"rank {rank}: process group 'dp_cp' of the {source} has size {dpcp}, not a multiple of "
            f"config.context_parallel_size = {cp}",
        )
        return False
    inner = dpcp * gtp * tp
    edp, egtp, ep = groups.size(Group.EDP), groups.size(Group.EGTP), requested.ep
    if experts and ep is not None and Group.EDP not in groups.missing:
        etp = requested.etp or tp
        want = inner // (ep * etp * egtp) if inner % (ep * etp * egtp) == 0 else None
        if want != edp:
            _layout_mismatch(
                strict,
                f"rank {rank}: process group 'expt_dp' of the {source} has size {edp}, but dp_cp x gtp x tp "
                f"= {inner} with config.expert_model_parallel_size = {ep}, expert tensor parallel {etp} and "
                f"expt_gtp_remat {egtp} implies {want if want is not None else 'no integer size'}",
            )
            return False
    return True


def _check_members(groups: TorchGroups, strict: bool) -> None:
    """Every group's members against the mesh the group sizes imply (:func:`check_layout`)."""
    rank, source = groups.rank, groups.source
    tp, pp, dpcp, gtp = groups.size(Group.TP), groups.pp_size, groups.size(Group.DP_CP), groups.size(Group.GTP)
    inner, edp, egtp = dpcp * gtp * tp, groups.size(Group.EDP), groups.size(Group.EGTP)
    if inner % (edp * egtp):
        return _layout_mismatch(
            strict,
            f"rank {rank}: process groups 'expt_dp' (size {edp}) x 'expt_gtp_remat' (size {egtp}) of the "
            f"{source} do not divide dp_cp x gtp x tp = {inner}",
        )
    dims = ParallelDims(pp=pp, dp=dpcp, cp=1, gtp=gtp, tp=tp, ep=inner // (edp * egtp), etp=1, egtp=egtp)
    spans = dims.world_size == world_size()
    sizes = f"pp={pp}, dp_cp={dpcp}, gtp={gtp}, tp={tp}, expt_dp={edp}, expt_gtp_remat={egtp}"
    for group in Group:
        pg = groups.groups.get(group)
        if group in STAGE_GROUPS or pg is None or groups.size(group) <= 1:
            continue
        have = sorted(group_ranks(pg))
        implied = f"under the sizes its groups imply ({sizes}; meshgrad's rank order, tp fastest)"
        if spans and have != dims.group_ranks(group, rank):
            return _layout_mismatch(
                strict,
                f"rank {rank}: process group {group.value!r} of the {source} holds ranks {have}, but "
                f"{implied} rank {rank}'s {group.value} peers are {dims.group_ranks(group, rank)}. Build the "
                "groups in that order, or pass a DeviceMesh",
            )
        offsets, pattern = [r - have[0] for r in have], dims.group_ranks(group, 0)
        if not spans and offsets != pattern:
            return _layout_mismatch(
                strict,
                f"rank {rank}: process group {group.value!r} of the {source} holds ranks {have}, but "
                f"{implied} its members must lie at offsets {pattern} from the first, not {offsets}",
            )
    return None


def check_layout(
    groups: TorchGroups, requested: Requested, *, experts: bool, collection: bool, strict: bool = False
) -> None:
    """Group sizes against the Megatron config, and members against the mesh.

    Sizes: ``tensor_model_parallel_size`` = tp, ``pipeline_model_parallel_size`` = pp,
    ``context_parallel_size`` divides dp_cp and, with expert parameters,
    ``expert_model_parallel_size`` x ``expert_tensor_parallel_size`` x egtp x expt_dp =
    dp_cp x gtp x tp (each when the config states it: :class:`~torch_impl.megatron_config.Requested`).

    Members (``collection``): the sizes of tp, pp, dp_cp, gtp, expt_dp and
    expt_gtp_remat imply a mesh (docs/semantics.md (ranks, axes and groups) rank order: tp fastest, then gtp,
    cp, dp, pp; experts etp, ep, egtp, edp, pp). When it spans the world, every group
    must hold exactly this rank's peers on that mesh; on a model over part of the world,
    every group must have the mesh's shape (its members' offsets from the smallest).

    Megatron takes the groups as the truth, so a mismatch warns once per plan naming the
    group and what differs; with ``strict`` (``config.strict_groups``) it raises.

    Raises:
      ValueError: (``strict``) naming the rank, the group, its members and the expected ones.
    """
    if _check_sizes(groups, requested, experts, strict) and collection:
        _check_members(groups, strict)


def requirements(
    config: FinalizeConfig,
    params: Sequence[ParamSpec],
    groups: TorchGroups,
    requested: Requested,
    *,
    plain_dp_sync: bool,
    num_tokens: bool,
    megatron_groups: bool,
) -> tuple[dict[Group, str], dict[Group, tuple[int, str]]]:
    """The groups ``finalize_model_grads`` needs, for :meth:`TorchGroups.check`.

    Groups read the Megatron way (``megatron_groups``) were already resolved or refused
    by Megatron's rules; meshgrad's own sources must name every group a step reads. Sizes
    the config states are expectations: a mismatch warns (raises with
    ``config.strict_groups``), since Megatron takes the groups as the truth.

    Returns:
      (required groups with reasons, expected sizes with reasons).
    """
    required: dict[Group, str] = {}
    gtp_reason = "GTP-remat is active and num_tokens / qb_beta reduce over dp_cp x gtp"
    gtp_reduces = groups.size(Group.GTP) > 1 and (num_tokens or config.quantile_balancing)
    if not megatron_groups:
        for g in (Group.TP, Group.PP, Group.EMBD, Group.POS_EMBD, Group.DP_CP):
            required[g] = "finalize_model_grads always needs it"
        if config.moe_router_enable_expert_bias:
            required[Group.TP_DP_CP] = "moe_router_enable_expert_bias is set"
        if gtp_reduces:
            required[Group.DP_CP_GTP] = gtp_reason
    if plain_dp_sync:
        required[Group.DP_CP] = "meshgrad runs the DP sync of chunks without a DDP wrapper"
        if any(p.expert and p.has_grad for p in params):
            required[Group.EDP] = "expert parameters (allreduce=False) are synced over expert data parallel"
    expected: dict[Group, tuple[int, str]] = {}
    if requested.gtp > 1:
        expected[Group.GTP] = (requested.gtp, "config.gtp_weight_remat_size")
    if requested.egtp > 1:
        expected[Group.EGTP] = (requested.egtp, "config.expert_gtp_weight_remat_size")
    if gtp_reduces:
        expected[Group.DP_CP_GTP] = (groups.size(Group.DP_CP) * groups.size(Group.GTP), gtp_reason)
    return required, expected


__all__ = ["check_layout", "requirements"]
