"""Cross-rank rounds before any gradient moves: every rank raises together, or none.

``config.consistency_check`` (``"off"`` | ``"once"`` per plan, the default |
``"every_step"``). Each call starts with one **status round** (:func:`agree`: a few
integers MAX-reduced by one all-reduce over the world, or over the call's spanning
groups in turn -- tp, dp_cp, gtp and pp for ``finalize_model_grads``, the helper's own
groups for a seed helper) saying
whether any rank failed a local check (:mod:`torch_impl.checks`), needs a comparison (a
new plan, another kind of num_tokens, ``"every_step"``) or found NaN / Inf. Every rank
then takes the same path: raise, compare, or go on. In a **comparison**
(:func:`exchange_signatures`) the members of every group of size > 1 all-gather a hash
of what they will launch on it (:func:`signatures`); only on a mismatch are the full
lines gathered, and :class:`~torch_impl.errors.ConsistencyError` names the group, the
ranks and the first differing line. A rank that failed before its groups resolved still
joins the round (:func:`share_local_error`), so that its peers raise at once.

Every rank of a model must use the same ``consistency_check`` and
``check_for_nan_in_grad``: they decide which of these collectives run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from meshgrad.axes import Group
from meshgrad.config import FinalizeConfig
from meshgrad.params import ParamKey
from meshgrad.plan import FinalizePlan
from torch_impl.signatures import exchange_signatures, signatures
from torch_impl.checks import check_gradients, check_modes, check_num_tokens, nonfinite, nonfinite_message, uses_nccl
from torch_impl.group_checks import check_layout
from torch_impl.discover import Discovered
from torch_impl.errors import ConsistencyError, NonFiniteGradError
from torch_impl.groups import TorchGroups, world_rank, world_size
from torch_impl.mesh_groups import timeout_of
from torch_impl.group_sources import MESH_KINDS, source_kind, status_groups
from torch_impl.megatron_config import Requested
from torch_impl.status import (
    COMPARE,
    ERROR,
    NONFINITE,
    Hop,
    device_for,
    flagged_rank,
    gather_texts,
    reduce_max,
    settle,
    share_error,
    status_vector,
    world_route,
)

#: Groups whose sequential MAX-reduction reaches every rank of a model (docs/semantics.md (ranks, axes and groups) axes).
SPANNING_GROUPS = (Group.TP, Group.DP_CP, Group.GTP, Group.PP)


def _distinct(groups: TorchGroups, over: Sequence[Group]) -> list[tuple[Group, Any]]:
    """The process groups of ``over`` of size > 1, each process group once."""
    out: list[tuple[Group, Any]] = []
    for group in over:
        pg = groups.group(group)
        if pg is not None and all(pg is not seen for _, seen in out):
            out.append((group, pg))
    return out


def status_route(groups: TorchGroups, over: Sequence[Group] = SPANNING_GROUPS) -> list[Hop]:
    """The hops a status round MAX-reduces over, in turn (computed once per groups and
    ``over``): the world at once for groups built from a DeviceMesh (their layout round
    runs over the world: the same kind of round), or when the spanning groups together
    reach every rank of it and the world's timeout is no longer than theirs (or no
    backend tells any timeout); else the distinct groups of ``over`` of size > 1."""
    key = tuple(over)
    route = groups.routes.get(key)
    if route is None:
        route = groups.routes[key] = _route(groups, key)
    return route


def _route(groups: TorchGroups, over: tuple[Group, ...]) -> list[Hop]:
    pgs = _distinct(groups, over)
    own = [(group.value, pg, device_for(pg), groups.size(group)) for group, pg in pgs]
    if groups.layout and over == SPANNING_GROUPS and world_size() > 1:
        return world_route()
    if len(pgs) < 2 or over != SPANNING_GROUPS:
        return own
    span = 1
    for group, _ in pgs:
        span *= groups.size(group)
    if span != world_size():
        return own
    limit, timeouts = timeout_of(dist.group.WORLD), [timeout_of(pg) for _, pg in pgs]
    unknown = limit is None and all(t is None for t in timeouts)  # no backend tells: as good as any
    no_longer = limit is not None and None not in timeouts and limit <= min(timeouts)
    return world_route() if unknown or no_longer else own


def agree(status: Sequence[int], groups: TorchGroups, what: str, over: Sequence[Group] = SPANNING_GROUPS) -> list[int]:
    """MAX-reduce small integers over :func:`status_route` (default: tp, dp_cp, gtp and
    pp, or the world: the result is the maximum over every rank of the model)."""
    return reduce_max(status, status_route(groups, over), groups.rank, what)


def share_texts(text: str | None, groups: TorchGroups, over: Sequence[Group] = SPANNING_GROUPS) -> dict[int, str]:
    """Error texts of every failing rank of the model (all-gathered over the status
    round's route; run only once a status round found a failure)."""
    return gather_texts(text, status_route(groups, over), groups.rank, "finalize status check")


def capturing() -> bool:
    """Inside a CUDA graph capture (no host sync possible: the checks are skipped)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def share_local_error(
    err: BaseException,
    groups: TorchGroups | None,
    config: FinalizeConfig | None = None,
    *,
    source: Any = None,
    raw: Sequence[Any] = (),
    over: Sequence[Group] = SPANNING_GROUPS,
) -> None:
    """Join the status round the other ranks run before their first collective, so that
    a check that failed on this rank alone makes every rank raise at once instead of
    waiting for it. The caller re-raises ``err`` afterwards.

    Args:
      err: the local error.
      groups: this rank's groups, or None when they did not resolve (then groups are
        taken from ``source`` without creating any).
      config: the finalize config, or None when it did not resolve (then the check
        modes are read leniently from ``raw``).
      source: the call's ``pg_collection``.
      raw: the raw config objects (Megatron config, DDP config).
      over: the groups of the status round.
    """
    mode, nan = (config.consistency_check, config.check_for_nan_in_grad) if config is not None else check_modes(*raw)
    if (mode == "off" and not nan) or capturing():
        return
    if groups is None and source_kind(source) in MESH_KINDS:
        if world_size() > 1:  # the peers' round (a layout round or a status round) runs over the world
            share_error(err, world_route(), world_rank(), "finalize status check")
        return
    groups = groups if groups is not None else status_groups(source)
    if groups is None:
        return
    share_error(err, status_route(groups, over), groups.rank, "finalize status check")


@dataclasses.dataclass(frozen=True)
class CheckSpec:
    """What the calls of one plan check before communicating (fixed per plan).

    Args:
      keys: gradients checked once per binding (what the plan reads or writes).
      nan_keys: gradients looked at for NaN / Inf every step (``check_for_nan_in_grad``).
      nan: whether the NaN check applies at all (not for Megatron's seed helpers).
      ddp: DDP objects of the chunks (with num_tokens they need ``scale_gradients``).
      requested: the config's sizes to check the groups against (None: not checked).
      experts: whether expert parameters have gradients (for the layout check).
      collection: groups from a collection or mapping (members checked against the mesh).
      over: the groups of the status round (together they reach every rank of the call).
      compared: the groups whose signatures are compared (None: every group of size > 1).
    """

    keys: tuple[ParamKey, ...]
    nan_keys: tuple[ParamKey, ...] = ()
    nan: bool = True
    ddp: tuple[Any, ...] = ()
    requested: Requested | None = None
    experts: bool = False
    collection: bool = False
    over: tuple[Group, ...] = SPANNING_GROUPS
    compared: tuple[Group, ...] | None = None


@dataclasses.dataclass
class PlanRecord:
    """What the once-per-plan checks found (kept by the model state, one per plan): the
    gradients' device, whether the groups use NCCL, the discovery they checked, whether
    the consistency check passed and for which num_tokens (dtype, numel)."""

    device: torch.device | None
    nccl: bool
    found: Any = None
    consistent: bool = False
    tokens: Any = None


def _local_checks(
    spec: CheckSpec,
    found: Discovered,
    groups: TorchGroups,
    config: FinalizeConfig,
    num_tokens: Any,
    record: PlanRecord | None,
) -> tuple[BaseException | None, PlanRecord | None]:
    """The local checks of one call: gradients and layout once per binding (every step
    with ``"every_step"``), ``num_tokens`` every step.

    Returns:
      (the local error or None, the plan's record).
    """
    try:
        if record is None or config.consistency_check == "every_step" or record.found is not found:
            device = check_gradients(found, groups, config, spec.keys)
            if spec.requested is not None:
                check_layout(
                    groups, spec.requested, experts=spec.experts, collection=spec.collection, strict=config.strict_groups
                )
            if record is None:
                record = PlanRecord(device, uses_nccl(groups))
            record.device, record.found = device, found
        check_num_tokens(num_tokens, record.device, groups, spec.ddp, record.nccl)
    except Exception as err:  # noqa: BLE001 -- any local failure is held for the status round
        return err, record
    return None, record


def _compare(spec: CheckSpec, plan: FinalizePlan, groups: TorchGroups, config: FinalizeConfig, num_tokens: Any) -> None:
    """The comparison of signatures and the agreement on its outcome (every rank raises)."""
    messages = exchange_signatures(signatures(plan, groups, config, num_tokens), groups, spec.compared)
    (mismatch,) = agree([status_vector(groups.rank, error=bool(messages))[ERROR]], groups,
                        "finalize consistency status", spec.over)
    if messages:
        raise ConsistencyError("\n".join(messages))
    if mismatch:
        raise ConsistencyError(
            f"rank {groups.rank}: rank {flagged_rank(mismatch)} found ranks of one of its groups that would launch "
            "different collectives (its error names them); nothing was reduced"
        )


def _nonfinite_tokens(num_tokens: Any) -> bool:
    """Whether a floating ``num_tokens`` holds NaN or Inf (one host sync)."""
    return (
        isinstance(num_tokens, torch.Tensor) and num_tokens.is_floating_point()
        and not bool(torch.isfinite(num_tokens).all())
    )


def before_communication(
    spec: CheckSpec,
    plan: FinalizePlan,
    found: Discovered,
    groups: TorchGroups,
    config: FinalizeConfig,
    num_tokens: Any,
    record: PlanRecord | None,
) -> PlanRecord | None:
    """Every check a call runs before its first collective.

    Local checks (:func:`_local_checks`), then, unless ``consistency_check="off"`` (and no
    NaN check), one status round (MAX of [local error, comparison due, NaN found] over
    ``spec.over``) tells every rank whether any rank failed, needs a consistency
    comparison (a new plan, another kind of num_tokens, or ``"every_step"``) or found NaN
    / Inf; every rank then takes the same path: raise, compare signatures (and agree on
    the outcome), or go on. A change on one rank only is thus compared on every rank.

    Returns:
      The plan's record, to keep for the next call (None while no check passed).

    Raises:
      TypeError / ValueError: a local check failed (nothing communicated but the status).
      ConsistencyError: ranks of a group would launch different collectives, or another
        rank failed its own checks.
      NonFiniteGradError: NaN / Inf in a gradient of this or another rank.
      CollectiveError: a check's collective failed.
    """
    mode, nan_check = config.consistency_check, config.check_for_nan_in_grad and spec.nan
    error, record = _local_checks(spec, found, groups, config, num_tokens, record)
    if (mode == "off" and not nan_check) or capturing():
        if error is not None:
            raise error
        return record
    tokens = (num_tokens.dtype, num_tokens.numel()) if error is None and isinstance(num_tokens, torch.Tensor) else None
    compare = error is None and mode != "off" and (mode == "every_step" or not record.consistent or record.tokens != tokens)
    bad = nonfinite(found, spec.nan_keys) if nan_check and error is None else []
    bad_tokens = nan_check and error is None and _nonfinite_tokens(num_tokens)
    status = status_vector(groups.rank, error=error is not None, compare=compare, nonfinite=bool(bad) or bad_tokens,
                           layout=groups.layout)
    route = status_route(groups, spec.over)
    reduced = reduce_max(status, route, groups.rank, "finalize status check")
    settle(reduced, route, groups.rank, "finalize status check", error=error, layout_text=groups.layout_text)
    compare_any, nan = reduced[COMPARE], reduced[NONFINITE]
    if compare_any:
        _compare(spec, plan, groups, config, num_tokens)
        record.consistent, record.tokens = True, tokens
    if bad:
        raise NonFiniteGradError(nonfinite_message(groups.rank, bad))
    if bad_tokens:
        raise NonFiniteGradError(
            f"rank {groups.rank}: num_tokens is {num_tokens.item()!r}, not finite (check_for_nan_in_grad); found "
            "before any collective: no gradient was changed"
        )
    if nan:
        raise NonFiniteGradError(
            f"rank {groups.rank}: rank {flagged_rank(nan)} has NaN or Inf in a gradient or num_tokens (check_for_nan_in_grad; its "
            "error names the parameter); found before any collective: no gradient was changed"
        )
    return record


__all__ = [
    "SPANNING_GROUPS",
    "CheckSpec",
    "PlanRecord",
    "agree",
    "before_communication",
    "capturing",
    "share_local_error",
    "share_texts",
]
