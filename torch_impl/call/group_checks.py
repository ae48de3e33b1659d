"""Local checks of the groups before any communication (the groups a plan needs are
:func:`meshgrad.requirements.group_requirements`): the sizes the Megatron config states and, for a
ProcessGroupCollection or a mapping, every group's members against the mesh its sizes
imply (:func:`check_layout`). A mismatch Megatron accepts is a warning, an error only in
strict mode (``config.strict_groups``)."""

from __future__ import annotations

from meshgrad.axes import Group, ParallelDims
from meshgrad.errors import FinalizeInputError
from torch_impl.run.groups import STAGE_GROUPS, TorchGroups, group_ranks, world_size
from torch_impl.sources.config import Requested
from torch_impl.run.warn import warn_user


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
    dp_cp x gtp x tp (each when the config states it: :class:`~torch_impl.sources.config.Requested`).

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


__all__ = ["check_layout"]
