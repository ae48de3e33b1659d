"""What torch's ``fully_shard`` (FSDP2) already did to a gradient, so that finalize does not
do it again.

After backward, FSDP2 has reduce-scattered each gradient it manages over its mesh's shard
dim (and all-reduced it over the replicate dim with HSDP), dividing the sum by its
gradient divide factor (the FSDP mesh's size unless ``set_gradient_divide_factor`` set
another). That is Megatron's DP sync when FSDP2's ranks are finalize's ``dp_cp`` group
(``expt_dp`` for an expert parameter) and its divisor is the DP sync's: ``dp_cp`` for a
mean loss, 1 (a sum) with ``calculate_per_token_loss``. A gradient that is a DTensor over
finalize's ``tp`` ranks was made whole over tp by DTensor's autograd (torch's tensor
parallelism), so the tp step (sequence-parallel / qk layernorm sums, tp averages) is done
as well. Anything else is refused before anything runs (:func:`synced_steps`).

The FSDP2 state read here (``FSDPModule._get_fsdp_state()``, its parameter groups' mesh
info, ``gradient_divide_factor``, ``reduce_grads`` and ``all_reduce_grads``) is torch's
internal layout of 2.5 to 2.13; a layout this module does not know is refused by name.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
from torch import nn

from meshgrad.axes import Group
from meshgrad.config import FinalizeConfig
from meshgrad.errors import FinalizeInputError
from meshgrad.params import ParamKey, ParamSpec
from meshgrad.plan import Step
from torch_impl.run.grads import get_grad, is_dtensor
from torch_impl.run.groups import TorchGroups, group_ranks


class FsdpGroup(NamedTuple):
    """One FSDP2 parameter group found in a chunk.

    Args:
      chunk: the chunk index.
      module: the FSDP module's qualified name in the chunk ("" for the chunk itself).
      group: torch's ``FSDPParamGroup``.
    """

    chunk: int
    module: str
    group: Any


class FsdpReduction(NamedTuple):
    """What FSDP2 did to the gradients of one parameter group this backward.

    Args:
      where: the FSDP module, in words.
      dims: the mesh dims it reduced over.
      ranks: the global ranks it reduced over (this rank's).
      divide: the divisor applied to the sum.
      reduced: gradient sync was on (and, with HSDP, the replicate all-reduce).
    """

    where: str
    dims: tuple[str, ...]
    ranks: frozenset[int]
    divide: float
    reduced: bool


def fsdp_groups(chunks: Sequence[nn.Module],
                walks: Sequence[Sequence[tuple[str, nn.Module]]] | None = None) -> tuple[FsdpGroup, ...]:
    """Every FSDP2 parameter group in the (unwrapped) chunks; none without FSDP2 loaded (no
    FSDP module exists before its package is imported: torch 2.6+ ``torch.distributed.fsdp``,
    2.5 ``torch.distributed._composable.fsdp``).

    Args:
      chunks: the unwrapped chunks.
      walks: per chunk, its ``named_modules()`` where the caller has them (discovery's walk),
        else None: walked here.
    """
    classes = tuple(
        cls for name in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")
        if (cls := getattr(sys.modules.get(name), "FSDPModule", None)) is not None
    )
    if not classes:
        return ()
    out = []
    for index, chunk in enumerate(chunks):
        for name, sub in (chunk.named_modules() if walks is None else walks[index]):
            if isinstance(sub, classes):
                state = sub._get_fsdp_state()
                groups = getattr(state, "_fsdp_param_groups", None)
                if groups is None:  # torch < 2.6: one group per state
                    one = getattr(state, "_fsdp_param_group", None)
                    groups = [one] if one is not None else []
                out += [FsdpGroup(index, name, g) for g in groups]
    return tuple(out)


def settings(groups: Sequence[FsdpGroup]) -> tuple[Any, ...]:
    """The FSDP2 parameter groups' settings that may change between steps and change
    :func:`synced_steps`' answer (part of the plan's key:
    :meth:`~torch_impl.sources.discover.Discovered.wrapper_settings`)."""
    return tuple(
        (getattr(g.group, "gradient_divide_factor", None), getattr(g.group, "reduce_grads", True),
         getattr(g.group, "all_reduce_grads", True))
        for g in groups
    )


def _ranks_along(mesh: Any, dims: Sequence[int]) -> frozenset[int]:
    """The global ranks of ``mesh`` that differ from this rank's coordinate only in ``dims``."""
    coord = mesh.get_coordinate()
    grid = np.asarray(mesh.mesh.cpu().numpy())
    index = tuple(slice(None) if i in dims else c for i, c in enumerate(coord))
    return frozenset(int(r) for r in np.asarray(grid[index]).reshape(-1))


def reduction(found: FsdpGroup) -> FsdpReduction:
    """What one FSDP2 parameter group did to its gradients this backward.

    Raises:
      FinalizeInputError: torch's FSDP2 state is laid out in a way this module does not know.
    """
    group = found.group
    where = f"chunk {found.chunk} FSDP module {found.module or '<the chunk>'!r}"
    info = getattr(group, "mesh_info", None)
    mesh = getattr(info, "mesh", None)
    shard, replicate = getattr(info, "shard_mesh_dim", None), getattr(info, "replicate_mesh_dim", None)
    if mesh is None or not all(d is None or isinstance(d, int) for d in (shard, replicate)):
        raise FinalizeInputError(f"{where}: this torch's FSDP2 mesh layout is not one finalize can read")
    all_reduce = bool(getattr(group, "all_reduce_grads", True))
    dims = [d for d in (replicate if all_reduce else None, shard) if d is not None]
    size = int(np.prod([mesh.size(d) for d in dims], dtype=np.int64))
    factor = getattr(group, "gradient_divide_factor", None)
    names = mesh.mesh_dim_names or tuple(f"dim {d}" for d in range(mesh.ndim))
    return FsdpReduction(
        where=where,
        dims=tuple(names[d] for d in dims),
        ranks=_ranks_along(mesh, dims),
        divide=float(factor) if factor is not None else float(size),
        reduced=bool(getattr(group, "reduce_grads", True)) and (all_reduce or replicate is None),
    )


def _members(groups: TorchGroups, group: Group) -> frozenset[int]:
    pg = groups.group(group)
    return frozenset(group_ranks(pg)) if pg is not None else frozenset({groups.rank})


def _spans(grad: Any, ranks: frozenset[int]) -> bool:
    """Whether the DTensor ``grad``'s mesh has a dim whose ranks through this rank are ``ranks``."""
    mesh = grad.device_mesh
    return len(ranks) > 1 and any(_ranks_along(mesh, (d,)) == ranks for d in range(mesh.ndim))


def synced_steps(
    params: Sequence[ParamSpec],
    tensors: Mapping[ParamKey, Any],
    groups: Sequence[FsdpGroup],
    torch_groups: TorchGroups,
    config: FinalizeConfig,
) -> dict[ParamKey, frozenset[Step]]:
    """Per FSDP2-managed parameter with a gradient, the steps torch already did for it:
    ``dp_sync`` (FSDP2's reduction) and ``non_tp`` when its gradient is a DTensor over
    the tp ranks.

    Args:
      params: the call's parameter specs.
      tensors: the parameters by key.
      groups: the FSDP2 parameter groups of the chunks (:func:`fsdp_groups`).
      torch_groups: finalize's groups.
      config: the call's config (per-token loss decides the divisor).

    Raises:
      FinalizeInputError: FSDP2 did not reduce this backward's gradients, reduced them over
        other ranks than the DP sync's group, or divided them by another factor (the
        message says what to call).
    """
    if not groups:
        return {}
    by_param: dict[int, FsdpReduction] = {}
    for found in groups:
        done = reduction(found)
        for fsdp_param in found.group.fsdp_params:
            by_param[id(fsdp_param.sharded_param)] = done
    rank, dp_cp = torch_groups.rank, torch_groups.size(Group.DP_CP)
    divisor = 1.0 if config.calculate_per_token_loss else float(dp_cp)
    members = {g: _members(torch_groups, g) for g in (Group.DP_CP, Group.EDP, Group.TP)}
    out: dict[ParamKey, frozenset[Step]] = {}
    for spec in params:
        done = by_param.get(id(tensors[spec.key]))
        if done is None or not spec.has_grad:
            continue
        what = f"rank {rank}: parameter {spec.name!r} (chunk {spec.chunk}, {done.where})"
        if not done.reduced:
            raise FinalizeInputError(
                f"{what}: FSDP2 did not reduce this backward's gradients (set_requires_gradient_sync(False) or "
                "set_requires_all_reduce(False)); call finalize after the backward that syncs them"
            )
        group = Group.EDP if spec.expert else Group.DP_CP
        if done.ranks != members[group]:
            raise FinalizeInputError(
                f"{what}: FSDP2 reduced the gradient over ranks {sorted(done.ranks)} (mesh dims {list(done.dims)}), "
                f"but finalize's {group.value} group is ranks {sorted(members[group])}; shard over the data-parallel "
                "and context-parallel ranks (torchtitan: fully_shard(mesh=world_mesh['dp_shard_cp']), HSDP "
                "world_mesh['dp_replicate', 'dp_shard_cp']) or give finalize the groups FSDP2 uses"
            )
        if done.divide != divisor:
            loss = "per-token loss (a sum)" if config.calculate_per_token_loss else f"a mean loss (dp_cp = {dp_cp})"
            raise FinalizeInputError(
                f"{what}: FSDP2 divided the summed gradient by {done.divide:g}, but with {loss} the DP sync "
                f"divides it by {divisor:g}; call set_gradient_divide_factor({divisor:g}) on every FSDP module "
                "(or set calculate_per_token_loss to match the loss)"
            )
        steps = {Step.DP_SYNC}
        grad = get_grad(tensors[spec.key])
        if is_dtensor(grad) and _spans(grad, members[Group.TP]):
            steps.add(Step.NON_TP)
        out[spec.key] = frozenset(steps)
    return out


__all__ = ["FsdpGroup", "FsdpReduction", "fsdp_groups", "reduction", "settings", "synced_steps"]
