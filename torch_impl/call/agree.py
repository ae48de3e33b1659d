"""The agree stage of a call: every rank raises together, or none, before any gradient moves.

``config.consistency_check`` (``"off"`` | ``"once"`` per plan, the default |
``"every_step"``). Each call runs one **status round** (:func:`agree_call` over
:func:`torch_impl.run.status.status_round`: a few integers SUM-reduced by one all-reduce
over the world, or over the call's spanning groups in turn -- tp, dp_cp, gtp and pp for
``finalize_model_grads``, the helper's own groups for a seed helper) saying whether any
rank failed a local check (:mod:`torch_impl.call.check`), needs a comparison (a new plan,
another kind of num_tokens, ``"every_step"``) or found NaN / Inf. Every rank then takes
the same path: raise, compare, or go on. In a **comparison**
(:func:`torch_impl.run.status.compare_round`) the members of every group of size > 1
all-gather a hash of what they will launch on it
(:func:`torch_impl.call.signatures.signatures`); only on a mismatch are the full lines
gathered, and :class:`~meshgrad.errors.ConsistencyError` names the group, the ranks and
the first differing line. A rank that failed before its groups resolved still joins the
round (:func:`share_local_error`), so that its peers raise at once.

Every rank of a model must use the same ``consistency_check`` and
``check_for_nan_in_grad``: they decide which of these collectives run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from meshgrad.axes import Group
from meshgrad.config import FinalizeConfig, doubtful_values
from meshgrad.errors import FinalizeInputError
from meshgrad.plan import FinalizePlan
from torch_impl.call.signatures import signatures
from torch_impl.call.check import CheckSpec, Findings
from torch_impl.call.checks import check_modes
from torch_impl.run.errors import NonFiniteGradError
from torch_impl.run.groups import TorchGroups, world_rank, world_size
from torch_impl.sources.group_sources import MESH_KINDS, source_kind, status_groups
from torch_impl.run.status import (
    COMPARE,
    NONFINITE,
    SPANNING_GROUPS,
    capturing,
    fused_tokens,
    lowest_flagged,
    share_error,
    status_round,
    status_route,
    world_route,
)

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


def config_doubt(config: FinalizeConfig, rank: int) -> FinalizeInputError | None:
    """This rank's config values that Megatron accepts but that are most likely typos
    (:func:`meshgrad.config.doubtful_values`; a warning alone), as the error this rank
    raises when they make the ranks disagree (the status round's comparison)."""
    doubts = doubtful_values(config)
    if not doubts:
        return None
    return FinalizeInputError(
        f"rank {rank}: " + "; ".join(f"FinalizeConfig.{d}" for d in doubts)
        + " -- and the ranks differ (they would launch different collectives)"
    )


def agree_call(findings: Findings, spec: CheckSpec, plan: FinalizePlan, groups: TorchGroups,
               config: FinalizeConfig, num_tokens: Any) -> Any:
    """The agree stage: one status round per call, after the local checks.

    Unless no round is due (:attr:`Findings.round_due`: ``consistency_check="off"`` without
    the NaN check, or a CUDA graph capture), one status round (SUM of [local error,
    comparison due, NaN found, layout digest] over ``spec.over``) tells every rank whether
    any rank failed, needs a consistency comparison (a new plan, another kind of
    num_tokens, or ``"every_step"``) or found NaN / Inf; every rank then takes the same
    path: raise, compare signatures (and agree on the outcome), or go on. A change on one
    rank only is thus compared on every rank.

    When the round's route is the token count's own group (:func:`fused_tokens`: pure
    data parallelism, for one), the round also carries ``num_tokens`` (SUM), and the run
    stage uses its result instead of a collective of its own.

    Returns:
      The global token count when the round carried it (an int when it was encoded on
      the host, else a 0-d int64 tensor on the round's device), else None.

    Raises:
      TypeError / ValueError: this rank's local check failed (its own error, after the round).
      ConsistencyError: ranks of a group would launch different collectives, or another
        rank failed its own checks.
      NonFiniteGradError: NaN / Inf in a gradient or num_tokens of this or another rank.
      CollectiveError: a round's collective failed.
    """
    error, record = findings.error, findings.record
    if not findings.round_due:
        if error is not None:
            raise error
        return None
    group = plan.token_scale.group if plan.token_scale is not None and spec.over == SPANNING_GROUPS else None
    tokens = fused_tokens(groups, spec.over, group, num_tokens) if error is None and num_tokens is not None else None
    nonfinite = findings.nonfinite is not None or findings.nonfinite_tokens
    reduced, total = status_round(
        groups, spec.over, error=error, compare=findings.compare, nonfinite=nonfinite,
        lines=lambda: signatures(plan, groups, config, num_tokens), compared=spec.compared, tokens=tokens,
        doubt=lambda: config_doubt(config, groups.rank),
    )
    if reduced[COMPARE]:
        record.consistent, record.tokens = True, findings.tokens
    elsewhere = None
    if reduced[NONFINITE]:  # every rank counted it: every rank asks who
        elsewhere = lowest_flagged(nonfinite, status_route(groups, spec.over), groups.rank, "finalize NaN check")
    if findings.nonfinite is not None:
        raise NonFiniteGradError(findings.nonfinite)
    if findings.nonfinite_tokens:
        raise NonFiniteGradError(
            f"rank {groups.rank}: num_tokens is {num_tokens.item()!r}, not finite (check_for_nan_in_grad); found "
            "before any collective: no gradient was changed"
        )
    if elsewhere is not None:
        raise NonFiniteGradError(
            f"rank {groups.rank}: rank {elsewhere} has NaN or Inf in a gradient or num_tokens "
            "(check_for_nan_in_grad; its error names the parameter); found before any collective: no gradient was "
            "changed"
        )
    return total


__all__ = [
    "agree_call",
    "config_doubt",
    "share_local_error",
]
