"""Reliability of ``finalize_model_grads``: checks before communication, a cross-rank
consistency check, and collective failures reported by name.

Three layers, in the order a call meets them:

1. **Local checks** (no communication, nothing mutated). Gradients: a floating tensor of
   the parameter's shape, every one on one device that the groups' backends can use
   (not ``meta``; CUDA under NCCL). ``num_tokens``: a one-element integer tensor on the
   gradients' device. Groups: sizes the Megatron config asks for
   (``tensor_model_parallel_size``, ...) and, for a ProcessGroupCollection or a mapping,
   every group's members against the mesh its sizes imply (SPEC.md section 1 rank
   order). NaN / Inf (``config.check_for_nan_in_grad``). Gradients and groups are checked
   once per plan (every step with ``consistency_check="every_step"``); ``num_tokens``
   and NaN / Inf every step.
2. **Cross-rank checks** (tiny collectives before any gradient moves).
   ``config.consistency_check`` (``"off"`` | ``"once"`` per plan, the default |
   ``"every_step"``): on every group of size > 1 its members all-gather a hash of what
   they will launch on it (:meth:`~meshgrad.plan.FinalizePlan.group_signatures`, the
   config and the num_tokens collectives); only on a mismatch are the full lines
   gathered, and :class:`ConsistencyError` names the group, the ranks and the first
   differing line. Then a status (mismatch found, NaN / Inf found, each with the lowest
   rank) is MAX-reduced over tp, dp_cp, gtp and pp -- which together reach every rank of
   the model -- so that every rank raises, not only the one that found the problem
   (the others would wait for it in the next collective). The status round runs when the
   consistency check does, and every step with ``check_for_nan_in_grad``.
3. **Execution.** ``execute_ops`` (every action of ``run_actions`` and of a bound
   ``Program``, through :func:`action_failed`) and :func:`collective_guard` re-raise a failing collective -- a peer that died (gloo:
   "connection closed by peer" at once) or stalled (after the process-group timeout) --
   as :class:`CollectiveError` naming the rank, the action (step, op, group, tensor count)
   and the group's ranks.

Every rank of a model must use the same ``consistency_check`` and
``check_for_nan_in_grad``: they decide which of these collectives run. With ``"once"``,
a rank whose plan changes on its own after the first step (say it alone freezes a
parameter) is not compared again; ``"every_step"`` catches that, otherwise the
mismatched collective fails with a CollectiveError after the timeout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from meshgrad.axes import Group, ParallelDims
from meshgrad.config import FinalizeConfig
from meshgrad.params import ParamKey
from meshgrad.plan import (
    Action,
    ExpertBiasUpdate,
    FinalizePlan,
    QbBetaUpdate,
    Reduction,
    StageReduction,
)
from torch_impl.discover import Discovered, get_grad, grad_attr
from torch_impl.groups import (
    STAGE_GROUPS,
    MeshGroups,
    TorchGroups,
    group_ranks,
    is_device_mesh,
    world_rank,
    world_size,
)

#: Gradient dtypes a plan can reduce.
GRAD_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: Groups whose sequential MAX-reduction reaches every rank of a model (SPEC 1 axes).
SPANNING_GROUPS = (Group.TP, Group.DP_CP, Group.GTP, Group.PP)
_BIG = 1 << 40  # status value = _BIG - rank, so MAX picks the lowest rank


class ConsistencyError(RuntimeError):
    """Ranks of one group would launch different collectives (raised on every rank)."""


class CollectiveError(RuntimeError):
    """A collective of finalize failed: a peer died, stalled past the timeout or raised."""


class NonFiniteGradError(ValueError):
    """A gradient holds NaN or Inf (``check_for_nan_in_grad``); raised on every rank."""


# =========================================================================== describing


def _ranks_text(groups: TorchGroups, group: Group | None) -> str:
    if group is None:
        return ""
    pg = groups.group(group)
    if pg is None:
        return ""
    try:
        return f" (global ranks {group_ranks(pg)})"
    except Exception:  # pragma: no cover - a group torch no longer knows
        return ""


def describe(action: Action, groups: TorchGroups | None = None) -> str:
    """One line saying what an action communicates: step, op, group and tensor count."""

    def size(group: Group) -> str:
        return f" (size {groups.size(group)})" if groups is not None else ""

    if isinstance(action, Reduction):
        steps = "+".join(str(s) for s in getattr(action, "steps", (action.step,)))
        kind = "reduce-scatter" if action.scatter else "all-reduce"
        return (
            f"{steps}: {action.op} {kind} over group {str(action.group)!r}{size(action.group)} "
            f"of {len(action.all_keys)} {action.dtype} tensor(s), first {action.keys[0][1]!r}"
        )
    if isinstance(action, StageReduction):
        return (
            f"{action.step}: sum all-reduce over group {str(action.group)!r} (pp stages "
            f"{list(action.stages)}) of 1 {action.dtype} tensor"
        )
    if isinstance(action, ExpertBiasUpdate):
        return (
            f"{action.step}: sum all-reduce over group {str(action.group)!r}{size(action.group)} "
            f"of the token counts of {len(action.routers)} router(s)"
        )
    if isinstance(action, QbBetaUpdate):
        return (
            f"{action.step}: avg all-reduce over group {str(action.group)!r}{size(action.group)} "
            f"of the qb_beta means of {len(action.routers)} router(s)"
        )
    return f"{action.step}: {type(action).__name__} (local)"


_HINT = (
    "a peer rank may have died, stalled past the process-group timeout or raised before "
    "this collective; this step's gradients may be partly finalized"
)


def _first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"


def action_failed(action: Action, index: int, err: BaseException) -> CollectiveError:
    """The :class:`CollectiveError` for action ``index`` of a plan that raised ``err``
    (execute_ops raises it ``from err``)."""
    return CollectiveError(
        f"rank {world_rank()}: finalize action #{index + 1} ({describe(action)}) failed: "
        f"{_first_line(err)} -- {_HINT}"
    )


@contextlib.contextmanager
def collective_guard(description: str, groups: TorchGroups, group: Group | None = None) -> Iterator[None]:
    """Re-raise a RuntimeError of the collectives inside as a :class:`CollectiveError`
    that names this rank, ``description`` and the group's global ranks."""
    try:
        yield
    except (CollectiveError, ConsistencyError):
        raise
    except RuntimeError as err:
        raise CollectiveError(
            f"rank {groups.rank}: {description}{_ranks_text(groups, group)} failed: {_first_line(err)} -- {_HINT}"
        ) from err


# =========================================================================== local checks


def check_gradients(found: Discovered, groups: TorchGroups, config: FinalizeConfig) -> torch.device | None:
    """Every gradient finalize will touch: a floating tensor of its parameter's shape,
    all on one usable device.

    Returns:
      The gradients' device (None when this rank has no gradient).

    Raises:
      TypeError: a gradient is not a floating tensor of a reducible dtype.
      ValueError: wrong shape, a ``meta`` tensor, gradients on several devices, or a
        device the groups' backend cannot use (NCCL needs CUDA).
    """
    from torch_impl.execute import is_dtensor

    rank = groups.rank
    nccl = _uses_nccl(groups)
    device: torch.device | None = None
    first = ""
    for spec in found.params:
        if not spec.has_grad:
            continue
        param = found.tensors[spec.key]
        grad = get_grad(param)
        if grad is None:
            continue
        what = f"the gradient ({grad_attr(param)}) of {spec.name!r} (chunk {spec.chunk})"
        if not isinstance(grad, torch.Tensor):
            raise TypeError(f"rank {rank}: {what} is a {type(grad).__name__}, not a tensor")
        if grad.dtype not in GRAD_DTYPES:
            raise TypeError(
                f"rank {rank}: {what} has dtype {grad.dtype}; finalize reduces "
                f"{', '.join(str(d).removeprefix('torch.') for d in GRAD_DTYPES)} gradients"
            )
        sharded = config.use_megatron_fsdp or is_dtensor(grad) or is_dtensor(param)
        if not sharded and tuple(grad.shape) != tuple(param.shape):
            raise ValueError(
                f"rank {rank}: {what} has shape {tuple(grad.shape)}, the parameter {tuple(param.shape)}"
            )
        here = grad.device
        if here.type == "meta":
            raise ValueError(f"rank {rank}: {what} is on the meta device (it holds no data)")
        if nccl and here.type != "cuda":
            raise ValueError(f"rank {rank}: {what} is on {here}, but the NCCL process groups need CUDA tensors")
        if device is None:
            device, first = here, what
        elif here != device:
            raise ValueError(
                f"rank {rank}: {what} is on {here}, but {first} is on {device}; finalize needs every "
                "gradient of a rank on one device"
            )
    return device


def check_num_tokens(
    num_tokens: Any,
    device: torch.device | None,
    groups: TorchGroups,
    ddp: Sequence[Any] = (),
    nccl: bool | None = None,
) -> None:
    """``num_tokens``: a one-element integer tensor on the gradients' device.

    Raises:
      TypeError: not a one-element tensor, not an integer dtype, or a DDP chunk without
        ``scale_gradients``.
      ValueError: on the meta device, on another device than the gradients, or not on
        CUDA under NCCL.
    """
    if num_tokens is None:
        return
    rank = groups.rank
    if not isinstance(num_tokens, torch.Tensor) or num_tokens.numel() != 1:
        shape = tuple(num_tokens.shape) if isinstance(num_tokens, torch.Tensor) else ""
        raise TypeError(f"rank {rank}: num_tokens must be a one-element tensor, got {type(num_tokens).__name__}{shape}")
    if num_tokens.is_floating_point() or num_tokens.is_complex() or num_tokens.dtype == torch.bool:
        raise TypeError(f"rank {rank}: num_tokens must be an integer tensor, got {num_tokens.dtype}")
    here = num_tokens.device
    if here.type == "meta":
        raise ValueError(f"rank {rank}: num_tokens is on the meta device (it holds no data)")
    if device is not None and here != device:
        raise ValueError(f"rank {rank}: num_tokens is on {here}, the gradients on {device}")
    if (_uses_nccl(groups) if nccl is None else nccl) and here.type != "cuda":
        raise ValueError(f"rank {rank}: num_tokens is on {here}, but the NCCL process groups need CUDA tensors")
    for obj in ddp:
        if not callable(getattr(obj, "scale_gradients", None)):
            raise TypeError(
                f"rank {rank}: {type(obj).__name__} has finish_grad_sync but no scale_gradients(); "
                "cannot scale its gradients by num_tokens"
            )


def nonfinite(found: Discovered, keys: Sequence[ParamKey], local_shards: bool = True) -> list[ParamKey]:
    """The keys whose gradient holds NaN or Inf (one host sync for all of them)."""
    from torch_impl.execute import GradAccess

    grads = GradAccess(found.tensors, local_shards=local_shards)
    tensors = [grads[k] for k in keys]
    if not tensors:
        return []
    ok = torch.stack([torch.isfinite(t).all() for t in tensors])  # one device: checked
    if bool(ok.all()):
        return []
    return [k for k, good in zip(keys, ok.tolist()) if not good]


def _nonfinite_message(rank: int, bad: Sequence[ParamKey]) -> str:
    more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
    return (
        f"rank {rank}: NaN or Inf in the gradient of {bad[0][1]!r} (chunk {bad[0][0]}){more} "
        "(check_for_nan_in_grad); found before any collective: no gradient was changed"
    )


# --------------------------------------------------------------------------- groups


def _config_int(config: Any, name: str) -> int | None:
    value = getattr(config, name, None) if config is not None and not isinstance(config, FinalizeConfig) else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return None
    return value


def collection_source(pg_collection: Any) -> bool:
    """Whether groups came from a user's ProcessGroupCollection or mapping (whose
    members are checked against the mesh), not from a DeviceMesh or resolved groups."""
    return not (
        pg_collection is None
        or isinstance(pg_collection, (TorchGroups, MeshGroups))
        or is_device_mesh(pg_collection)
    )


def check_layout(groups: TorchGroups, raw_config: Any, *, experts: bool, collection: bool) -> None:
    """Group sizes against the Megatron config, and members against the mesh.

    Sizes: ``tensor_model_parallel_size`` = tp, ``pipeline_model_parallel_size`` = pp,
    ``context_parallel_size`` divides dp_cp and, with expert parameters,
    ``expert_model_parallel_size`` x ``expert_tensor_parallel_size`` x egtp x expt_dp =
    dp_cp x gtp x tp (each when the config sets it).

    Members (``collection``): the sizes of tp, pp, dp_cp, gtp, expt_dp and
    expt_gtp_remat imply a mesh (SPEC.md section 1 rank order: tp fastest, then gtp,
    cp, dp, pp; experts etp, ep, egtp, edp, pp). When it spans the world, every group
    must hold exactly this rank's peers on that mesh; on a model over part of the world,
    every group must have the mesh's shape (its members' offsets from the smallest).

    Raises:
      ValueError: naming the rank, the group, its members and the expected ones.
    """
    rank, source = groups.rank, groups.source
    tp, pp, dpcp, gtp = groups.size(Group.TP), groups.pp_size, groups.size(Group.DP_CP), groups.size(Group.GTP)
    for group, have, attr in ((Group.TP, tp, "tensor_model_parallel_size"), (Group.PP, pp, "pipeline_model_parallel_size")):
        want = _config_int(raw_config, attr)
        if want is not None and want != have and group not in groups.missing:
            raise ValueError(
                f"rank {rank}: process group {group.value!r} of the {source} has size {have}, "
                f"but config.{attr} = {want}"
            )
    cp = _config_int(raw_config, "context_parallel_size")
    if cp is not None and Group.DP_CP not in groups.missing and dpcp % cp:
        raise ValueError(
            f"rank {rank}: process group 'dp_cp' of the {source} has size {dpcp}, not a multiple of "
            f"config.context_parallel_size = {cp}"
        )
    inner = dpcp * gtp * tp
    edp, egtp = groups.size(Group.EDP), groups.size(Group.EGTP)
    ep = _config_int(raw_config, "expert_model_parallel_size")
    if experts and ep is not None and Group.EDP not in groups.missing:
        etp = _config_int(raw_config, "expert_tensor_parallel_size") or tp
        want = inner // (ep * etp * egtp) if inner % (ep * etp * egtp) == 0 else None
        if want != edp:
            raise ValueError(
                f"rank {rank}: process group 'expt_dp' of the {source} has size {edp}, but dp_cp x gtp x tp "
                f"= {inner} with config.expert_model_parallel_size = {ep}, expert tensor parallel {etp} and "
                f"expt_gtp_remat {egtp} implies {want if want is not None else 'no integer size'}"
            )
    if not collection:
        return
    if inner % (edp * egtp):
        raise ValueError(
            f"rank {rank}: process groups 'expt_dp' (size {edp}) x 'expt_gtp_remat' (size {egtp}) of the "
            f"{source} do not divide dp_cp x gtp x tp = {inner}"
        )
    dims = ParallelDims(pp=pp, dp=dpcp, cp=1, gtp=gtp, tp=tp, ep=inner // (edp * egtp), etp=1, egtp=egtp)
    spans = dims.world_size == world_size()
    sizes = f"pp={pp}, dp_cp={dpcp}, gtp={gtp}, tp={tp}, expt_dp={edp}, expt_gtp_remat={egtp}"
    for group in Group:
        pg = groups.groups.get(group)
        if group in STAGE_GROUPS or pg is None or groups.size(group) <= 1:
            continue
        have = sorted(group_ranks(pg))
        if spans:
            want = dims.group_ranks(group, rank)
            if have != want:
                raise ValueError(
                    f"rank {rank}: process group {group.value!r} of the {source} holds ranks {have}, but "
                    f"under the sizes its groups imply ({sizes}; SPEC rank order, tp fastest) rank {rank}'s "
                    f"{group.value} peers are {want}. Build the groups in that order, or pass a DeviceMesh"
                )
        else:
            pattern = dims.group_ranks(group, 0)
            offsets = [r - have[0] for r in have]
            if offsets != pattern:
                raise ValueError(
                    f"rank {rank}: process group {group.value!r} of the {source} holds ranks {have}, but "
                    f"under the sizes its groups imply ({sizes}; SPEC rank order, tp fastest) its members "
                    f"must lie at offsets {pattern} from the first, not {offsets}"
                )


def _uses_nccl(groups: TorchGroups) -> bool:
    for group in Group:
        pg = groups.group(group)
        if pg is not None and _backend(pg) == "nccl":
            return True
    return False


def _backend(pg: Any) -> str:
    try:
        return str(dist.get_backend(pg))
    except Exception:  # pragma: no cover - a fake or foreign group
        return ""


def _device_for(pg: Any) -> torch.device:
    if _backend(pg) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# =========================================================================== cross-rank


_NAME_BEFORE_SHAPE = re.compile(r"(?<=[\[,])[^\[\],]+(?=\[)")


def signatures(
    plan: FinalizePlan, groups: TorchGroups, config: FinalizeConfig, num_tokens: Any
) -> dict[Group, tuple[str, ...]]:
    """Per group of size > 1, what this rank will launch on it, one line per item: the
    config (one line per field), the plan's collectives and the num_tokens collectives.

    Over pp (whose members hold different layers) parameter names are dropped: the
    coalesced pp reductions need equal shapes and order, not equal names.
    """
    config_lines = tuple(f"config.{f.name} = {getattr(config, f.name)!r}" for f in dataclasses.fields(config))
    planned = plan.group_signatures(groups.pp_stage)
    extra: dict[Group, list[str]] = {}
    if num_tokens is not None:
        what = f"num_tokens {str(num_tokens.dtype).removeprefix('torch.')}[{num_tokens.numel()}]"
        extra.setdefault(Group.PP, []).append(f"token_scale broadcast {what} from the last stage")
        extra.setdefault(plan.token_scale.group, []).append(f"token_scale sum {what}")
    out: dict[Group, tuple[str, ...]] = {}
    for group in Group:
        if groups.group(group) is None:
            continue
        lines = list(planned.get(group, ())) + extra.get(group, [])
        if group is Group.PP:
            lines = [_NAME_BEFORE_SHAPE.sub("", line) for line in lines]
        out[group] = config_lines + tuple(lines)
    return out


def _digest(lines: Sequence[str]) -> int:
    raw = hashlib.blake2b("\n".join(lines).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


def _mismatch(group: Group, ranks: Sequence[int], gathered: Sequence[Sequence[str]], rank: int) -> str:
    """The error text for one group whose members' lines differ."""
    variants: dict[tuple[str, ...], list[int]] = {}
    for r, lines in zip(ranks, gathered):
        variants.setdefault(tuple(lines), []).append(r)
    ordered = sorted(variants.items(), key=lambda item: (-len(item[1]), item[1][0]))
    (lines_a, ranks_a), (lines_b, ranks_b) = ordered[0], ordered[1]
    index = next(
        (i for i, (a, b) in enumerate(zip(lines_a, lines_b)) if a != b), min(len(lines_a), len(lines_b))
    )
    line_a = lines_a[index] if index < len(lines_a) else "(nothing more)"
    line_b = lines_b[index] if index < len(lines_b) else "(nothing more)"
    more = f" (and {len(ordered) - 2} more variant(s))" if len(ordered) > 2 else ""
    return (
        f"rank {rank}: the ranks of group {group.value!r} (global ranks {list(ranks)}) would launch "
        f"different collectives: ranks {ranks_a} vs ranks {ranks_b}{more}; first difference, line "
        f"{index + 1}: ranks {ranks_a}: {line_a!r}; ranks {ranks_b}: {line_b!r}. Nothing was reduced"
    )


def exchange_signatures(lines: Mapping[Group, Sequence[str]], groups: TorchGroups) -> list[str]:
    """All-gather a hash of ``lines`` in every group (Group order); gather the full lines
    of the groups whose hashes differ.

    Returns:
      One :func:`_mismatch` message per group of this rank whose members differ.
    """
    differing: list[Group] = []
    for group in Group:
        pg = groups.group(group)
        if pg is None:
            continue
        mine = tuple(lines.get(group, ()))
        local = torch.tensor([_digest(mine), len(mine)], dtype=torch.int64, device=_device_for(pg))
        out = [torch.empty_like(local) for _ in range(groups.size(group))]
        with collective_guard(f"consistency check over {group.value!r}", groups, group):
            dist.all_gather(out, local, group=pg)
        if len({tuple(t.tolist()) for t in out}) > 1:
            differing.append(group)
    messages = []
    for group in differing:
        pg = groups.group(group)
        gathered: list[Any] = [None] * groups.size(group)
        with collective_guard(f"consistency check (details) over {group.value!r}", groups, group):
            dist.all_gather_object(gathered, tuple(lines.get(group, ())), group=pg)
        messages.append(_mismatch(group, group_ranks(pg), gathered, groups.rank))
    return messages


def agree(status: Sequence[int], groups: TorchGroups, what: str) -> list[int]:
    """MAX-reduce small integers over tp, dp_cp, gtp and pp in turn: the result is the
    maximum over every rank of the model (all-gathers: a few bytes per rank)."""
    pgs = [(g, groups.group(g)) for g in SPANNING_GROUPS if groups.group(g) is not None]
    if not pgs:
        return list(status)
    value = torch.tensor(list(status), dtype=torch.int64, device=_device_for(pgs[0][1]))
    for group, pg in pgs:
        # An all-gather and a local max (not an all_reduce): the checks' collectives stay
        # apart from the plan's all-reduces (which tests and benchmarks count).
        out = [torch.empty_like(value) for _ in range(groups.size(group))]
        with collective_guard(f"{what} over {group.value!r}", groups, group):
            dist.all_gather(out, value, group=pg)
        value = torch.stack(out).amax(dim=0)
    return [int(v) for v in value.tolist()]


# =========================================================================== per call


@dataclasses.dataclass
class _PlanRecord:
    """What the once-per-plan checks found: the gradients' device, whether the groups
    use NCCL, and whether the consistency check passed."""

    device: torch.device | None
    nccl: bool
    consistent: bool = False


def share_local_error(err: BaseException, groups: TorchGroups, config: FinalizeConfig, *, first_call: bool) -> None:
    """Join the status rounds the other ranks run before their first collective, so that
    a check that failed on this rank alone makes every rank raise instead of hang.

    Mirrors :func:`before_communication`: the signature exchange (when a consistency
    check is due) with one line naming this rank's error, then the status agreement.
    The caller re-raises ``err`` afterwards.

    Args:
      err: the local error.
      groups: this rank's groups.
      config: the finalize config.
      first_call: the plan has not passed a consistency check yet on this rank.
    """
    compare = config.consistency_check != "off" and (config.consistency_check == "every_step" or first_call)
    if not (compare or config.check_for_nan_in_grad):
        return
    if compare:
        line = f"rank {groups.rank} failed its own checks: {type(err).__name__}: {_first_line(err)}"
        exchange_signatures({g: (line,) for g in Group}, groups)
    agree([_BIG - groups.rank, 0], groups, "finalize status check")


def before_communication(
    bound: Any,
    found: Discovered,
    groups: TorchGroups,
    config: FinalizeConfig,
    num_tokens: Any,
    *,
    ddp: Sequence[Any],
    raw_config: Any = None,
    collection: bool = False,
) -> None:
    """Every check ``finalize_model_grads`` runs before its first collective.

    Args:
      bound: the (cached) BoundPlan: ``plan`` and ``ddp`` (DDP objects).
      found: the discovered model.
      groups: this rank's groups.
      config: the finalize config.
      num_tokens: the call's num_tokens or None.
      ddp: per chunk, its DDP object or None (NaN / Inf is checked on the others).
      raw_config: the Megatron config (sizes it asks for), or None.
      collection: the groups came from a collection or mapping (members are checked).

    Raises:
      TypeError / ValueError: a local check failed (nothing communicated).
      ConsistencyError: ranks of a group would launch different collectives.
      NonFiniteGradError: NaN / Inf in a gradient of this or another rank.
      CollectiveError: a check's collective failed.
    """
    every = config.consistency_check == "every_step"
    record: _PlanRecord | None = bound.checks.get("record")
    try:
        if record is None or every:
            device = check_gradients(found, groups, config)
            check_layout(
                groups, raw_config, experts=any(p.expert and p.has_grad for p in found.params), collection=collection
            )
            if record is None:
                record = _PlanRecord(device, _uses_nccl(groups))
                bound.checks["record"] = record
            record.device = device
        check_num_tokens(num_tokens, record.device, groups, bound.ddp, record.nccl)
    except (TypeError, ValueError) as err:
        share_local_error(err, groups, config, first_call=record is None or not record.consistent)
        raise
    bad: list[ParamKey] = []
    if config.check_for_nan_in_grad:
        keys = [p.key for p in found.params if p.has_grad and ddp[p.chunk] is None]
        bad = nonfinite(found, keys)
    compare = config.consistency_check != "off" and (every or not record.consistent)
    messages = exchange_signatures(signatures(bound.plan, groups, config, num_tokens), groups) if compare else []
    if compare or config.check_for_nan_in_grad:
        mismatch, nan = agree(
            [_BIG - groups.rank if messages else 0, _BIG - groups.rank if bad else 0], groups, "finalize status check"
        )
    else:
        mismatch = nan = 0
    if messages:
        raise ConsistencyError("\n".join(messages))
    if mismatch:
        raise ConsistencyError(
            f"rank {groups.rank}: rank {_BIG - mismatch} found ranks of one of its groups that would launch "
            "different collectives (its error names them); nothing was reduced"
        )
    if bad:
        raise NonFiniteGradError(_nonfinite_message(groups.rank, bad))
    if nan:
        raise NonFiniteGradError(
            f"rank {groups.rank}: rank {_BIG - nan} has NaN or Inf in a gradient (check_for_nan_in_grad; its "
            "error names the parameter); found before any collective: no gradient was changed"
        )
    if compare:
        record.consistent = True


__all__ = [
    "CollectiveError",
    "ConsistencyError",
    "NonFiniteGradError",
    "action_failed",
    "before_communication",
    "check_gradients",
    "check_layout",
    "check_num_tokens",
    "collective_guard",
    "describe",
    "exchange_signatures",
    "signatures",
]
