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
import numbers
import re
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from meshgrad.axes import Group, ParallelDims
from meshgrad.config import CONSISTENCY_CHECKS, FinalizeConfig, config_get
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
    mesh_groups,
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


def plan_keys(plan: FinalizePlan, scale_keys: Sequence[ParamKey] | None = None) -> list[ParamKey]:
    """Every gradient key the plan reads or writes (reductions with their chunk copies,
    the stage reductions' operands, the num_tokens scale), in first-use order."""
    keys: dict[ParamKey, None] = {}
    for action in plan.actions:
        if isinstance(action, Reduction):
            keys.update(dict.fromkeys(action.all_keys))
        elif isinstance(action, StageReduction):
            keys.update(dict.fromkeys(k for k in action.keys_by_stage if k is not None))
    keys.update(dict.fromkeys(plan.token_scale.keys if scale_keys is None else scale_keys))
    return list(keys)


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """Byte range [start, stop) of ``t`` within its storage."""
    size = t.element_size()
    start = t.storage_offset() * size
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0) if t.numel() else 0
    return start, start + span * size


def _element_offsets(t: torch.Tensor) -> torch.Tensor:
    offsets = torch.full((), t.storage_offset(), dtype=torch.int64)
    for n, st in zip(t.shape, t.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * st
    return offsets.reshape(-1) * t.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one storage share an element (exact for strided views)."""
    (a0, a1), (b0, b1) = _extent(a), _extent(b)
    if a1 <= b0 or b1 <= a0:
        return False
    if a.is_contiguous() and b.is_contiguous():
        return True
    ea, eb = _element_offsets(a), _element_offsets(b)
    ia = torch.stack([ea + i for i in range(a.element_size())]).reshape(-1)
    ib = torch.stack([eb + i for i in range(b.element_size())]).reshape(-1)
    return bool(torch.isin(ia, ib).any())


def check_gradients(
    found: Discovered, groups: TorchGroups, config: FinalizeConfig, keys: Sequence[ParamKey] | None = None
) -> torch.device | None:
    """Every gradient finalize will touch: a dense (strided) floating tensor of its
    parameter's shape without internal overlap, all on one usable device, no two
    sharing an element.

    Args:
      keys: the gradients to check (default: every parameter with a gradient).

    Returns:
      The gradients' device (None when this rank has no gradient).

    Raises:
      TypeError: a gradient is not a tensor, not strided (sparse) or not of a reducible dtype.
      ValueError: wrong shape, internal overlap (stride 0), two gradients sharing memory
        (the same parameter twice, or overlapping views), a ``meta`` tensor, gradients
        on several devices, or a device the groups' backend cannot use (NCCL needs CUDA).
    """
    from torch_impl.execute import is_dtensor

    rank = groups.rank
    nccl = _uses_nccl(groups)
    device: torch.device | None = None
    first = ""
    specs = {s.key: s for s in found.params}
    chosen = [s for s in found.params if s.has_grad] if keys is None else [specs[k] for k in keys if k in specs]
    by_storage: dict[tuple[Any, int], list[tuple[torch.Tensor, str]]] = {}
    for spec in chosen:
        param = found.tensors[spec.key]
        grad = get_grad(param)
        if grad is None:
            continue
        what = f"the gradient ({grad_attr(param)}) of {spec.name!r} (chunk {spec.chunk})"
        if not isinstance(grad, torch.Tensor):
            raise TypeError(f"rank {rank}: {what} is a {type(grad).__name__}, not a tensor")
        if grad.layout is not torch.strided:
            raise TypeError(
                f"rank {rank}: {what} has layout {grad.layout}; finalize reduces dense (strided) gradients "
                "(densify it, e.g. grad.to_dense(), or use nn.Embedding(sparse=False))"
            )
        if grad.dtype not in GRAD_DTYPES:
            raise TypeError(
                f"rank {rank}: {what} has dtype {grad.dtype}; finalize reduces "
                f"{', '.join(str(d).removeprefix('torch.') for d in GRAD_DTYPES)} gradients"
            )
        dtensor = is_dtensor(grad) or is_dtensor(param)
        sharded = config.use_megatron_fsdp or dtensor
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
        if dtensor:
            continue
        if torch._debug_has_internal_overlap(grad) == 1:
            raise ValueError(
                f"rank {rank}: {what} has elements that share memory (strides {tuple(grad.stride())}, e.g. an "
                "expanded tensor); each element must be reduced once: give it its own storage (.contiguous())"
            )
        if grad.numel():
            by_storage.setdefault((grad.device, grad.untyped_storage().data_ptr()), []).append((grad, what))
    for items in by_storage.values():
        if len(items) < 2:
            continue
        items.sort(key=lambda item: _extent(item[0])[0])
        for i, (a, what_a) in enumerate(items):
            stop = _extent(a)[1]
            for b, what_b in items[i + 1 :]:
                if _extent(b)[0] >= stop:
                    break
                if _overlap(a, b):
                    same = " (the same tensor)" if a is b else ""
                    raise ValueError(
                        f"rank {rank}: {what_a} and {what_b} share memory{same}; each element must be reduced "
                        "and scaled exactly once: give each parameter its own gradient storage (a parameter "
                        "listed in two chunks must be in one only)"
                    )
    return device


def check_num_tokens(
    num_tokens: Any,
    device: torch.device | None,
    groups: TorchGroups,
    ddp: Sequence[Any] = (),
    nccl: bool | None = None,
) -> None:
    """``num_tokens``: a one-element integer or floating tensor on the gradients' device.

    Raises:
      TypeError: not a one-element tensor, a complex or bool dtype, or a DDP chunk without
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
    if num_tokens.is_complex() or num_tokens.dtype == torch.bool:
        raise TypeError(f"rank {rank}: num_tokens must be an integer or floating tensor, got {num_tokens.dtype}")
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
    """A positive size from a Megatron config (object or mapping; numpy integers too),
    None when absent or not a positive integer (its own check reports that)."""
    if config is None or isinstance(config, FinalizeConfig):
        return None
    value = config_get(config, name)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or value < 1:
        return None
    return int(value)


def collection_source(pg_collection: Any) -> bool:
    """Whether groups came from a user's ProcessGroupCollection or mapping (whose
    members are checked against the mesh), not from a DeviceMesh or resolved groups."""
    return not (
        pg_collection is None
        or isinstance(pg_collection, (TorchGroups, MeshGroups))
        or is_device_mesh(pg_collection)
    )


def _layout_mismatch(strict: bool, message: str) -> None:
    """Raise ``message`` (strict mode) or warn with it."""
    if strict:
        raise ValueError(message)
    warnings.warn(
        f"{message}. Running with the groups as given, as Megatron-Core does "
        "(config.strict_groups = True makes this an error)",
        stacklevel=5,
    )


def check_layout(
    groups: TorchGroups, raw_config: Any, *, experts: bool, collection: bool, strict: bool = False
) -> None:
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

    Megatron takes the groups as the truth, so a mismatch warns once per plan naming the
    group and what differs; with ``strict`` (``config.strict_groups``) it raises.

    Raises:
      ValueError: (``strict``) naming the rank, the group, its members and the expected ones.
    """
    rank, source = groups.rank, groups.source
    tp, pp, dpcp, gtp = groups.size(Group.TP), groups.pp_size, groups.size(Group.DP_CP), groups.size(Group.GTP)
    for group, have, attr in ((Group.TP, tp, "tensor_model_parallel_size"), (Group.PP, pp, "pipeline_model_parallel_size")):
        want = _config_int(raw_config, attr)
        if want is not None and want != have and group not in groups.missing:
            return _layout_mismatch(strict, 
                f"rank {rank}: process group {group.value!r} of the {source} has size {have}, "
                f"but config.{attr} = {want}"
            )
    cp = _config_int(raw_config, "context_parallel_size")
    if cp is not None and Group.DP_CP not in groups.missing and dpcp % cp:
        return _layout_mismatch(strict, 
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
            return _layout_mismatch(strict, 
                f"rank {rank}: process group 'expt_dp' of the {source} has size {edp}, but dp_cp x gtp x tp "
                f"= {inner} with config.expert_model_parallel_size = {ep}, expert tensor parallel {etp} and "
                f"expt_gtp_remat {egtp} implies {want if want is not None else 'no integer size'}"
            )
    if not collection:
        return
    if inner % (edp * egtp):
        return _layout_mismatch(strict, 
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
                return _layout_mismatch(strict, 
                    f"rank {rank}: process group {group.value!r} of the {source} holds ranks {have}, but "
                    f"under the sizes its groups imply ({sizes}; SPEC rank order, tp fastest) rank {rank}'s "
                    f"{group.value} peers are {want}. Build the groups in that order, or pass a DeviceMesh"
                )
        else:
            pattern = dims.group_ranks(group, 0)
            offsets = [r - have[0] for r in have]
            if offsets != pattern:
                return _layout_mismatch(strict, 
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
    # Identities, not only shapes and counts: which routers' counts are summed into each
    # other, which pp stages an embedding group spans.
    for action in plan.actions:
        if isinstance(action, (ExpertBiasUpdate, QbBetaUpdate)):
            names = ",".join(f"{chunk}:{name}" for chunk, name in action.routers)
            extra.setdefault(action.group, []).append(f"{action.step} routers [{names}]")
        elif isinstance(action, StageReduction):
            extra.setdefault(action.group, []).append(f"{action.step} stages {list(action.stages)}")
    if isinstance(num_tokens, torch.Tensor):
        wide = "float64" if num_tokens.is_floating_point() else "int64"  # reduced in this dtype
        what = f"num_tokens {wide}[{num_tokens.numel()}]"
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
    span = 1
    for group, _ in pgs:
        span *= groups.size(group)
    if span == world_size() and len(pgs) > 1:
        # The model spans the world: one all-gather over it reaches every rank at once.
        pgs = [(None, dist.group.WORLD)]
    for group, pg in pgs:
        # An all-gather and a local max (not an all_reduce): the checks' collectives stay
        # apart from the plan's all-reduces (which tests and benchmarks count).
        out = [torch.empty_like(value) for _ in range(groups.size(group) if group else world_size())]
        with collective_guard(f"{what} over {group.value if group else 'the world'!r}", groups, group):
            dist.all_gather(out, value, group=pg)
        value = torch.stack(out).amax(dim=0)
    return [int(v) for v in value.tolist()]


# =========================================================================== per call


@dataclasses.dataclass
class _PlanRecord:
    """What the once-per-plan checks found: the gradients' device, whether the groups
    use NCCL, the discovery they checked, whether the consistency check passed and for
    which num_tokens (dtype, numel)."""

    device: torch.device | None
    nccl: bool
    found: Any = None
    consistent: bool = False
    tokens: Any = None


def _capturing() -> bool:
    """Inside a CUDA graph capture (no host sync possible: the checks are skipped)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def check_modes(*sources: Any) -> tuple[str, bool]:
    """(consistency_check, check_for_nan_in_grad) read leniently from raw configs
    (objects or mappings; the later source wins), for a rank whose config did not
    resolve: it must still join the rounds its peers run."""
    mode, nan = "once", False
    for source in sources:
        if source is None:
            continue
        value = config_get(source, "consistency_check")
        if isinstance(value, str) and value in CONSISTENCY_CHECKS:
            mode = value
        flag = config_get(source, "check_for_nan_in_grad")
        if isinstance(flag, (bool, np.bool_)):
            nan = bool(flag)
    return mode, nan


def fallback_groups(source: Any) -> TorchGroups | None:
    """The groups of the status round for a rank that failed before resolving its
    groups: built from ``source`` without creating any process group, or None."""
    try:
        if source is None:
            from torch_impl.megatron import parallel_state_groups

            groups = parallel_state_groups()
            return groups if groups is not None else (TorchGroups.trivial() if world_size() == 1 else None)
        if isinstance(source, TorchGroups):
            return source
        if is_device_mesh(source) or isinstance(source, MeshGroups):
            return (mesh_groups(source) if is_device_mesh(source) else source).spanning()
        if isinstance(source, Mapping):
            return TorchGroups.from_mapping(source, source="group mapping")
        return TorchGroups.from_collection(source)
    except Exception:  # nothing to share over: the caller raises locally
        return None


def share_texts(text: str | None, groups: TorchGroups) -> dict[int, str]:
    """Error texts of every failing rank of the model (all-gathers over tp, dp_cp, gtp
    and pp in turn; run only once a status round found a failure)."""
    known = {groups.rank: text} if text else {}
    for group in SPANNING_GROUPS:
        pg = groups.group(group)
        if pg is None:
            continue
        out: list[Any] = [None] * groups.size(group)
        with collective_guard(f"finalize error report over {group.value!r}", groups, group):
            dist.all_gather_object(out, known, group=pg)
        for item in out:
            known.update(item or {})
    return known


def share_local_error(
    err: BaseException,
    groups: TorchGroups | None,
    config: FinalizeConfig | None = None,
    *,
    source: Any = None,
    raw: Sequence[Any] = (),
    first_call: bool = True,
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
      first_call: unused (kept for callers of the earlier protocol).
    """
    del first_call
    mode, nan = (config.consistency_check, config.check_for_nan_in_grad) if config is not None else check_modes(*raw)
    if (mode == "off" and not nan) or _capturing():
        return
    if groups is None and (is_device_mesh(source) or isinstance(source, MeshGroups)):
        try:
            mesh = mesh_groups(source) if is_device_mesh(source) else source
            if mesh.join_failure(_first_line(err)):  # the peers' first round: the layout agreement
                return
        except (RuntimeError, ValueError):
            return
    groups = groups if groups is not None else fallback_groups(source)
    if groups is None:
        return
    agree([_BIG - groups.rank, 0, 0], groups, "finalize status check")
    share_texts(_first_line(err), groups)


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

    Local checks of the gradients run once per binding (whenever the model watch saw
    new gradient tensors, shapes, flags or structure), those of ``num_tokens`` every
    step. Then, unless ``consistency_check="off"`` (and no NaN check), one status round
    (MAX of [local error, comparison due, NaN found] over tp, dp_cp, gtp and pp: a few
    bytes) tells every rank whether any rank failed, needs a consistency comparison
    (a new plan, another kind of num_tokens, or ``"every_step"``) or found NaN / Inf;
    every rank then takes the same path: raise, compare signatures (and agree on the
    outcome), or go on. A change on one rank only is thus compared on every rank.

    Raises:
      TypeError / ValueError: a local check failed (nothing communicated but the status).
      ConsistencyError: ranks of a group would launch different collectives, or another
        rank failed its own checks.
      NonFiniteGradError: NaN / Inf in a gradient of this or another rank.
      CollectiveError: a check's collective failed.
    """
    mode = config.consistency_check
    every = mode == "every_step"
    record: _PlanRecord | None = bound.checks.get("record")
    error: BaseException | None = None
    try:
        if record is None or every or record.found is not found:
            own = [s.key for s in found.params if s.has_grad and ddp[s.chunk] is None]
            keys = list(dict.fromkeys(own + plan_keys(bound.plan, bound.plain_scale_keys)))
            device = check_gradients(found, groups, config, keys)
            check_layout(
                groups,
                raw_config,
                experts=any(p.expert and p.has_grad for p in found.params),
                collection=collection,
                strict=config.strict_groups,
            )
            if record is None:
                record = _PlanRecord(device, _uses_nccl(groups))
                bound.checks["record"] = record
            record.device, record.found = device, found
        check_num_tokens(num_tokens, record.device, groups, bound.ddp, record.nccl)
    except (TypeError, ValueError) as err:
        error = err
    if (mode == "off" and not config.check_for_nan_in_grad) or _capturing():
        if error is not None:
            raise error
        return
    tokens = (num_tokens.dtype, num_tokens.numel()) if error is None and isinstance(num_tokens, torch.Tensor) else None
    compare = error is None and mode != "off" and (every or not record.consistent or record.tokens != tokens)
    bad: list[ParamKey] = []
    if config.check_for_nan_in_grad and error is None:
        bad = nonfinite(found, [p.key for p in found.params if p.has_grad and ddp[p.chunk] is None])
    me = _BIG - groups.rank
    failed, compare_any, nan = agree(
        [me if error is not None else 0, me if compare else 0, me if bad else 0], groups, "finalize status check"
    )
    if failed:
        texts = share_texts(_first_line(error) if error is not None else None, groups)
        if error is not None:
            raise error
        who = _BIG - failed
        raise ConsistencyError(
            f"rank {groups.rank}: rank {who} failed its own checks: {texts.get(who, '(no message)')}; "
            "found before any collective: nothing was reduced or changed"
        )
    if compare_any:
        messages = exchange_signatures(signatures(bound.plan, groups, config, num_tokens), groups)
        (mismatch,) = agree([me if messages else 0], groups, "finalize consistency status")
        if messages:
            raise ConsistencyError("\n".join(messages))
        if mismatch:
            raise ConsistencyError(
                f"rank {groups.rank}: rank {_BIG - mismatch} found ranks of one of its groups that would launch "
                "different collectives (its error names them); nothing was reduced"
            )
        record.consistent, record.tokens = True, tokens
    if bad:
        raise NonFiniteGradError(_nonfinite_message(groups.rank, bad))
    if nan:
        raise NonFiniteGradError(
            f"rank {groups.rank}: rank {_BIG - nan} has NaN or Inf in a gradient (check_for_nan_in_grad; its "
            "error names the parameter); found before any collective: no gradient was changed"
        )


__all__ = [
    "CollectiveError",
    "ConsistencyError",
    "NonFiniteGradError",
    "action_failed",
    "before_communication",
    "check_gradients",
    "check_layout",
    "check_modes",
    "check_num_tokens",
    "fallback_groups",
    "plan_keys",
    "share_local_error",
    "collective_guard",
    "describe",
    "exchange_signatures",
    "signatures",
]
