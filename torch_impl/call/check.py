"""The check stage of a call: every local check of the plan's inputs, before any
collective (:func:`check_call`). Nothing is raised here: a failure of any type is held in
the :class:`Findings` for the agree stage (:mod:`torch_impl.call.agree`), so that every
rank learns of it in the one status round. The checks themselves live with what they
protect: the inputs' in :mod:`torch_impl.call.checks`, the groups' in
:mod:`torch_impl.call.group_checks`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch

from meshgrad.axes import Group
from meshgrad.config import FinalizeConfig
from meshgrad.params import ParamKey
from torch_impl.call.checks import (
    check_gradients, check_inference_mode, check_num_tokens, first_inference_tensor, nonfinite_message,
    nonfinite_tokens, scan_spans, tokens_kind, uses_nccl,
)
from torch_impl.call.group_checks import check_layout
from torch_impl.run.grads import read_grads
from torch_impl.run.groups import TorchGroups
from torch_impl.run.status import SPANNING_GROUPS, capturing
from torch_impl.sources.config import Requested
from torch_impl.sources.discover import Discovered


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
      router_writes: (router key, buffer attribute) of the router buffers the plan updates
        in place (:meth:`~meshgrad.plan.FinalizePlan.router_writes`).
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
    router_writes: tuple[tuple[ParamKey, str], ...] = ()


@dataclasses.dataclass
class PlanRecord:
    """What the once-per-plan checks found (kept by the model state, one per plan): the
    gradients' device, whether the groups use NCCL, the discovery they checked, whether
    the consistency check passed and for which num_tokens (dtype, numel, device), and the
    spans of the NaN / Inf scan (:func:`~torch_impl.call.checks.scan_spans`; None: read
    the gradients each step) and the first gradient or written router buffer that is an
    inference tensor (every call outside inference mode refuses it: the mode is the
    call's)."""

    device: torch.device | None
    nccl: bool
    found: Any = None
    consistent: bool = False
    tokens: Any = None
    nan_spans: Any = None
    inference_tensor: str | None = None


class Findings(NamedTuple):
    """What the check stage found on this rank, for the agree stage.

    Args:
      error: the local error (any type), held for the status round; None if none.
      record: the plan's record (None while no check passed).
      round_due: whether a status round runs (not with ``consistency_check="off"`` and no
        NaN check, nor under a CUDA graph capture).
      compare: a consistency comparison is due on this rank.
      tokens: the kind of ``num_tokens`` compared (dtype, numel).
      nonfinite: the message naming the gradients that hold NaN / Inf
        (``check_for_nan_in_grad``), or None.
      nonfinite_tokens: ``num_tokens`` holds NaN / Inf.
    """

    error: BaseException | None
    record: PlanRecord | None
    round_due: bool = False
    compare: bool = False
    tokens: Any = None
    nonfinite: str | None = None
    nonfinite_tokens: bool = False


def nan_checked(spec: CheckSpec, config: FinalizeConfig) -> bool:
    """Whether the calls of this plan scan their gradients for NaN / Inf."""
    return bool(config.check_for_nan_in_grad and spec.nan)


def nothing_per_step(spec: CheckSpec, config: FinalizeConfig, record: PlanRecord | None, found: Any,
                     tokens: tuple[Any, ...] | None = None) -> bool:
    """Whether :func:`check_call` for these inputs, and a ``num_tokens`` of kind ``tokens``
    (:func:`~torch_impl.call.checks.tokens_kind`; None: none) that passes
    :func:`~torch_impl.call.checks.check_num_tokens`, has nothing to look at beyond what it
    found once per plan, and so finds nothing, outside a CUDA graph capture: no NaN scan;
    not ``"every_step"``; and the record's part (:func:`record_quiet`)."""
    return config.consistency_check != "every_step" and not nan_checked(spec, config) and record_quiet(
        record, found, config.consistency_check, tokens)


def record_quiet(record: PlanRecord | None, found: Any, mode: str, tokens: tuple[Any, ...] | None) -> bool:
    """The part of :func:`nothing_per_step` that reads the plan's record, which a fresh check
    or a comparison updates in place (the rest is fixed for one plan and config): the
    record kept for ``found``, with no inference tensor, and no comparison due under
    consistency mode ``mode`` (the plan consistent, for this kind of num_tokens). Written
    out in :func:`~torch_impl.call.replay.replayed` too: a change here is one there."""
    return (
        record is not None and record.found is found and record.inference_tensor is None
        and (mode == "off" or record.consistent and record.tokens == tokens)
    )


def same_call(last: tuple[Any, Any] | None, bound: Any, tokens: tuple[Any, ...] | None) -> bool:
    """Whether a call of plan ``bound`` and kind of ``num_tokens`` ``tokens`` follows a call
    of the same entry point with the same on this model (``last``: its (plan, kind) from
    the model state's ``last_calls``, None for none). Written out in
    :func:`~torch_impl.call.replay.replayed` too."""
    return last is not None and last[0] is bound and last[1] == tokens


def check_call(spec: CheckSpec, found: Discovered, groups: TorchGroups, config: FinalizeConfig,
               num_tokens: Any, record: PlanRecord | None, switched: bool = False) -> Findings:
    """The check stage: the local checks of one call, the inputs' first, then the
    groups': gradients and layout once per binding (every step with ``"every_step"``),
    ``num_tokens`` every step and, with ``check_for_nan_in_grad``, NaN / Inf in the
    gradients and ``num_tokens``; then whether a comparison is due. Raises nothing: a
    failure of any type is held in the findings for the round. The plan's record is
    updated only when every check passed.

    Args:
      spec: what the plan's calls check.
      found: the call's discovery.
      groups: this rank's groups.
      config: the call's config.
      num_tokens: the call's num_tokens (or None).
      record: the plan's record from an earlier call (None on its first).
      switched: this call's plan or kind of ``num_tokens`` differs from the last call's of
        its entry point on this model (:func:`same_call`): a comparison is due even where
        each was compared alone before -- ranks switching on one rank only would pass a
        round of flags and then launch different collectives.

    Returns:
      The :class:`Findings`.
    """
    mode, nan_check = config.consistency_check, nan_checked(spec, config)
    round_due = not (mode == "off" and not nan_check) and not capturing()
    # A record of this discovery or of one of its renewals (Discovered.renewal: the same
    # lineage, gradients that read as those checked) holds; for a renewal only the NaN
    # scan's spans are not the call's.
    kept = record is not None and mode != "every_step"
    fresh = not kept or getattr(record.found, "lineage", None) is not found.lineage
    renewed = not fresh and record.found is not found
    nonfinite, bad_tokens = None, False
    nan_due = round_due and nan_check
    spans = None if fresh or renewed else record.nan_spans
    try:
        if renewed and nan_check:
            spans = scan_spans(read_grads(found.tensors, spec.nan_keys))
        if fresh:
            reads = read_grads(found.tensors, spec.keys)
            device = check_gradients(reads, groups, config)
            inference = first_inference_tensor(reads, found.router_modules, spec.router_writes)
            nccl = record.nccl if record is not None else uses_nccl(groups)
            spans = scan_spans(read_grads(found.tensors, spec.nan_keys)) if nan_check else None
        else:
            device, nccl, inference = record.device, record.nccl, record.inference_tensor
        if inference is not None:  # rare: no call on the usual step
            check_inference_mode(inference, groups.rank)
        if num_tokens is not None:
            check_num_tokens(num_tokens, device, groups, spec.ddp, nccl)
        if nan_due:  # one fused scan of the kept spans; the gradients are read to name a find
            nonfinite = nonfinite_message(groups.rank, lambda: read_grads(found.tensors, spec.nan_keys), spec.ddp, spans)
            bad_tokens = nonfinite_tokens(num_tokens)
        if fresh and spec.requested is not None:
            check_layout(groups, spec.requested, experts=spec.experts, collection=spec.collection, strict=config.strict_groups)
    except Exception as err:  # noqa: BLE001 -- any local failure is held for the status round
        return Findings(err, record, round_due=round_due)
    if record is None:
        record = PlanRecord(device, nccl)
    record.device, record.found = device, found
    if fresh:
        record.nan_spans, record.inference_tensor = spans, inference
    elif renewed:
        record.nan_spans = spans
    if not round_due:
        return Findings(None, record)
    # The kind of num_tokens (a change is compared: it decides the token collectives).
    tokens = tokens_kind(num_tokens)
    compare = mode != "off" and (mode == "every_step" or switched or not record.consistent or record.tokens != tokens)
    return Findings(None, record, round_due=True, compare=compare, tokens=tokens, nonfinite=nonfinite,
                    nonfinite_tokens=bad_tokens)


__all__ = ["CheckSpec", "Findings", "PlanRecord", "check_call", "nan_checked", "nothing_per_step", "record_quiet",
           "same_call"]
