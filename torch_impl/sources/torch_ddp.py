"""What torch's own ``DistributedDataParallel`` already did to a gradient, so that finalize
does not do it again.

During backward, torch DDP all-reduced the gradient of every parameter it manages (those
not in its ``parameters_to_ignore``) over its ``process_group``, divided by that group's
size (an average), unless a comm hook replaced the reduction. That is Megatron's DP sync
when DDP's ranks are finalize's ``dp_cp`` group (``expt_dp`` for an expert parameter) and
its divisor is the DP sync's: ``dp_cp`` for a mean loss (DDP's default), 1 (a sum) with
``calculate_per_token_loss`` (:func:`torch_impl.ddp_hooks.ddp_sum_hook`).

What is read: the wrapper (found along a chunk's ``.module`` chain), its
``process_group``, its registered comm hooks (``_comm_hooks``; a C++ built-in one by the
name DDP's logger keeps), and whether the last forward prepared the backward to sync
(``require_forward_param_sync``: False after a forward under ``no_sync()`` or without
grad, whatever ``require_backward_grad_sync`` says once the context has exited). A hook,
reducer mode or layout this module cannot verify is refused by name
(:func:`synced_steps`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from meshgrad.axes import Group
from meshgrad.config import FinalizeConfig
from meshgrad.errors import FinalizeInputError
from meshgrad.params import ParamKey, ParamSpec
from meshgrad.plan import Step
from torch_impl.ddp_hooks import ddp_sum_hook
from torch_impl.run.groups import TorchGroups, group_ranks
from torch_impl.sources.wrappers import attr_or, has_attr, uncompiled


class TorchDdp(NamedTuple):
    """One chunk wrapped in torch's ``DistributedDataParallel``.

    Args:
      chunk: the chunk index.
      module: the wrapper's qualified name in the chunk ("" for the chunk itself).
      wrapper: the ``DistributedDataParallel`` object.
      megatron: the chunk's ``.module`` chain also holds a Megatron DDP (``finish_grad_sync``).
    """

    chunk: int
    module: str
    wrapper: Any
    megatron: bool


class DdpReduction(NamedTuple):
    """What one torch DDP did to its gradients in the last backward.

    Args:
      where: the wrapper, in words.
      ranks: the global ranks it reduced over.
      divide: the divisor applied to the sum.
      reduced: the last forward prepared the backward to sync (not under ``no_sync()``).
      hook: the comm hook's name ("" for none).
    """

    where: str
    ranks: frozenset[int]
    divide: float
    reduced: bool
    hook: str


def ddp_wrappers(model: Sequence[Any],
                 walks: Sequence[Sequence[tuple[str, Any]]] | None = None) -> tuple[TorchDdp, ...]:
    """Every torch ``DistributedDataParallel`` in ``model``'s (wrapped) chunks, outermost
    first: the wrapper of a chunk and any inside it (a submodule under its own DDP, e.g.
    experts over expt_dp); a ``torch.compile`` wrapper is read through.

    Args:
      model: the chunks as given.
      walks: per chunk, the unwrapped chunk's ``named_modules()`` where the caller walked it
        (discovery), else None: a chunk whose walk holds no DDP and whose modules above the
        unwrapped chunk hold none either is not walked again (:func:`_without_ddp`).
    """
    out = []
    for index, chunk in enumerate(model):
        megatron, obj = False, chunk
        for _ in range(64):  # a Megatron DDP along the .module chain
            obj = uncompiled(obj)
            megatron = megatron or callable(attr_or(obj, "finish_grad_sync", None))
            if not has_attr(obj, "module"):
                break
            obj = obj.module
        if walks is not None and _without_ddp(chunk, walks[index]):
            continue
        out += [
            TorchDdp(index, name, sub, megatron)
            for name, sub in chunk.named_modules() if isinstance(sub, DistributedDataParallel)
        ]
    return tuple(out)


def _without_ddp(chunk: Any, walk: Sequence[tuple[str, Any]]) -> bool:
    """Whether ``chunk.named_modules()`` holds no DDP, known without walking it again: ``walk``
    (the unwrapped chunk's ``named_modules()``, that chunk first) holds none, and the modules
    from ``chunk`` down to the unwrapped chunk are a path of one registered child each (the
    wrappers), none a DDP. Anything else (a wrapper with two submodules, a chain deeper than
    64): False, and the caller walks the chunk."""
    if any(isinstance(sub, DistributedDataParallel) for _, sub in walk):
        return False
    inner, node = walk[0][1], chunk
    for _ in range(64):
        if node is inner:
            return True
        if isinstance(node, DistributedDataParallel) or not isinstance(node, nn.Module):
            return False
        children = [m for m in node._modules.values() if m is not None]
        if not children:  # the path ends above inner: it was the whole tree
            return True
        if len(children) > 1:
            return False
        node = children[0]
    return False


def _builtin_hook(wrapper: Any) -> str:
    """The name of a C++ built-in comm hook (``_register_builtin_comm_hook``), else ""."""
    if getattr(wrapper, "_comm_hooks", None) or getattr(wrapper, "logger", None) is None:
        return ""
    try:
        return str(wrapper._get_ddp_logging_data().get("comm_hook") or "")
    except (AttributeError, RuntimeError):
        return ""


def settings(found: Sequence[TorchDdp]) -> tuple[Any, ...]:
    """The DDP wrappers' settings that may change between steps and change
    :func:`synced_steps`' answer (part of the plan's key:
    :meth:`~torch_impl.sources.discover.Discovered.wrapper_settings`)."""
    return tuple(
        (id(d.wrapper), bool(getattr(d.wrapper, "require_forward_param_sync", True)),
         tuple((id(h), id(s)) for h, s in getattr(d.wrapper, "_comm_hooks", ())), _builtin_hook(d.wrapper))
        for d in found
    )


def _hook_group(state: Any, where: str, name: str) -> Any:
    """The process group a torch-style hook's ``state`` names (None: the default group)."""
    import torch.distributed as dist

    if state is None:
        return dist.group.WORLD
    if isinstance(state, dist.ProcessGroup):
        return state
    raise FinalizeInputError(f"{where}: comm hook {name} has state {type(state).__name__}, not a process group")


def reduction(found: TorchDdp, rank: int) -> DdpReduction:
    """What one torch DDP did to its gradients in the last backward.

    Raises:
      FinalizeInputError: a comm hook, reducer mode or wrapper layout finalize cannot verify
        (named in the message), or a Megatron DDP in the same chunk.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    ddp = found.wrapper
    where = f"rank {rank}: chunk {found.chunk} torch DistributedDataParallel {found.module or '<the chunk>'!r}"
    if found.megatron:
        raise FinalizeInputError(f"{where} is in a chunk that a Megatron DDP syncs too: use one of the two")
    if getattr(ddp, "_use_python_reducer", False):
        raise FinalizeInputError(f"{where} uses its python reducer (compiled autograd), which finalize cannot verify")
    if getattr(ddp, "_delay_all_reduce_params", None):
        raise FinalizeInputError(
            f"{where} delays the all-reduce of some parameters (delay_all_reduce_named_params), "
            "which finalize cannot verify"
        )
    hooks = list(getattr(ddp, "_comm_hooks", ()))
    builtin = _builtin_hook(ddp)
    group, divide, name = ddp.process_group, None, ""
    if builtin:
        raise FinalizeInputError(
            f"{where} has the built-in comm hook {builtin}, whose reduction finalize cannot verify; register "
            "none (an average), default_hooks.allreduce_hook or torch_impl.ddp_sum_hook (a sum)"
        )
    if len(hooks) > 1:
        raise FinalizeInputError(f"{where} has {len(hooks)} comm hooks; finalize verifies one at most")
    if hooks:
        hook, state = hooks[0]
        name = getattr(hook, "__qualname__", repr(hook))
        if hook is allreduce_hook:
            group = _hook_group(state, where, name)
        elif hook is ddp_sum_hook:
            group, divide = _hook_group(state, where, name), 1.0
        else:
            raise FinalizeInputError(
                f"{where} has the comm hook {name}, whose reduction finalize cannot verify; register none "
                "(an average), torch's default_hooks.allreduce_hook or torch_impl.ddp_sum_hook (a sum)"
            )
    ranks = frozenset(group_ranks(group))
    return DdpReduction(
        where=where,
        ranks=ranks,
        divide=float(len(ranks)) if divide is None else divide,
        reduced=bool(getattr(ddp, "require_forward_param_sync", True)),
        hook=name,
    )


def managed(wrapper: Any) -> list[Any]:
    """The parameters torch DDP reduces: its module's, less ``parameters_to_ignore``."""
    ignore = set(getattr(wrapper, "parameters_to_ignore", ()))
    return [p for n, p in wrapper.module.named_parameters() if n not in ignore and p.requires_grad]


def _members(groups: TorchGroups, group: Group) -> frozenset[int]:
    pg = groups.group(group)
    return frozenset(group_ranks(pg)) if pg is not None else frozenset({groups.rank})


def synced_steps(
    params: Sequence[ParamSpec],
    tensors: Mapping[ParamKey, Any],
    found: Sequence[TorchDdp],
    torch_groups: TorchGroups,
    config: FinalizeConfig,
) -> dict[ParamKey, frozenset[Step]]:
    """Per torch-DDP-managed parameter with a gradient, the steps torch already did for it
    (``dp_sync``).

    Args:
      params: the call's parameter specs.
      tensors: the parameters by key.
      found: the torch DDP wrappers of the chunks (:func:`ddp_wrappers`).
      torch_groups: finalize's groups.
      config: the call's config (per-token loss decides the divisor).

    Raises:
      FinalizeInputError: DDP did not reduce the last backward's gradients, reduced them
        over other ranks than the DP sync's group or divided them by another factor, or
        finalize cannot verify what it did (the message says what to change).
    """
    if not found:
        return {}
    rank, dp_cp = torch_groups.rank, torch_groups.size(Group.DP_CP)
    by_param: dict[int, DdpReduction] = {}
    for ddp in found:
        done = reduction(ddp, rank)
        for param in managed(ddp.wrapper):
            if by_param.setdefault(id(param), done) is not done:
                raise FinalizeInputError(
                    f"{done.where}: a parameter is managed by two torch DDP wrappers (reduced twice); "
                    "ignore it in one (DistributedDataParallel._set_params_and_buffers_to_ignore_for_model)"
                )
    divisor = 1.0 if config.calculate_per_token_loss else float(dp_cp)
    members = {g: _members(torch_groups, g) for g in (Group.DP_CP, Group.EDP)}
    out: dict[ParamKey, frozenset[Step]] = {}
    for spec in params:
        tensor = tensors[spec.key]
        done = by_param.get(id(tensor))
        if done is None or not spec.has_grad:
            continue
        what = f"{done.where}: parameter {spec.name!r}"
        if not done.reduced:
            raise FinalizeInputError(
                f"{what}: DDP did not reduce the last backward's gradients (its last forward ran under no_sync() "
                "or without grad); run the last micro-batch's forward and backward outside no_sync(), then "
                "call finalize"
            )
        if hasattr(tensor, "main_grad"):
            raise FinalizeInputError(
                f"{what}: DDP reduced param.grad, but finalize reads this parameter's main_grad; "
                "drop main_grad (or the torch DDP wrapper)"
            )
        group = Group.EDP if spec.expert else Group.DP_CP
        if done.ranks != members[group]:
            raise FinalizeInputError(
                f"{what}: DDP reduced the gradient over ranks {sorted(done.ranks)}, but finalize's "
                f"{group.value} group is ranks {sorted(members[group])}; build DDP with "
                f"process_group = the {group.value} group (or give finalize the group DDP uses)"
            )
        if done.divide != divisor:
            if config.calculate_per_token_loss:
                fix = ("register the summing hook: ddp.register_comm_hook(ddp.process_group, "
                       "torch_impl.ddp_sum_hook) (or set calculate_per_token_loss to match the loss)")
                loss = "per-token loss (a sum)"
            elif spec.expert:
                fix = ("no torch DDP reduction averages over expt_dp by dp_cp: leave expert parameters out of "
                       "DDP (DistributedDataParallel._set_params_and_buffers_to_ignore_for_model) and finalize "
                       "syncs them")
                loss = f"a mean loss (dp_cp = {dp_cp})"
            else:
                fix = ("register no comm hook, or torch's default_hooks.allreduce_hook (or set "
                       "calculate_per_token_loss to match the loss)")
                loss = f"a mean loss (dp_cp = {dp_cp})"
            how = f"comm hook {done.hook}" if done.hook else "its default all-reduce"
            raise FinalizeInputError(
                f"{what}: DDP ({how} over ranks {sorted(done.ranks)}, finalize's {group.value} group) divided "
                f"the summed gradient by {done.divide:g}, but with {loss} the DP sync divides it by "
                f"{divisor:g}; {fix}"
            )
        out[spec.key] = frozenset({Step.DP_SYNC})
    return out


__all__ = ["DdpReduction", "TorchDdp", "ddp_wrappers", "managed", "reduction", "settings", "synced_steps"]
