"""The one place where torch_impl reads Megatron-Core's modules.

Megatron is never imported here: its modules can only matter once the user's process has
imported them, so they are found in ``sys.modules``. This module reads
``parallel_state`` (:func:`parallel_state`, :func:`parallel_state_values`,
:func:`parallel_state_groups`): the groups of an initialized Megatron job, by meshgrad
name, including the GTP-remat ones; and the GTP fence (:func:`gtp_fence`):
``gtp_api.wait_for_gtp_grad_reduction_on_current_stream``.

What Megatron's objects mean is read elsewhere, with the same rules: a
``ProcessGroupCollection`` in :mod:`torch_impl.sources.pg_collection`, a helper's None group in
:mod:`torch_impl.sources.helper_groups`, configs and DDP chunks in :mod:`torch_impl.sources.config`,
a group source of any kind in :mod:`torch_impl.sources.group_sources`.
"""

from __future__ import annotations

import inspect
import operator
import sys
from collections.abc import Callable, Container
from functools import partial
from typing import Any, NamedTuple

import torch.distributed as dist

from meshgrad.axes import Group
from torch_impl.call.probes import Probes
from torch_impl.run.groups import TorchGroups
from torch_impl.sources.global_reads import GlobalReads

ProcessGroup = Any

PARALLEL_STATE = "megatron.core.parallel_state"
GTP_API = "megatron.core.tensor_parallel.gtp_api"
GTP_FENCE = "wait_for_gtp_grad_reduction_on_current_stream"


# =========================================================================== modules


def loaded_parallel_state() -> Any | None:
    """Megatron's ``parallel_state`` module when the process imported it, else None."""
    return sys.modules.get(PARALLEL_STATE)


def parallel_state() -> Any | None:
    """Megatron-Core's ``parallel_state`` when its model-parallel groups are initialized
    in this process, else None."""
    ps = loaded_parallel_state()
    if ps is None:
        return None
    try:
        return ps if ps.model_parallel_is_initialized() else None
    except Exception:  # an older or partial parallel_state: treat as not initialized
        return None


def gtp_fence() -> Callable[[], None] | None:
    """Megatron's ``wait_for_gtp_grad_reduction_on_current_stream`` when its ``gtp_api``
    module is loaded, else None (looked up at every call, so a patched one is used)."""
    fence = getattr(sys.modules.get(GTP_API), GTP_FENCE, None)
    return fence if callable(fence) else None


# =========================================================================== parallel_state

#: How each named group is read from Megatron's ``parallel_state``: getter, keywords, and
#: keywords an older Megatron lacks (dropped when the getter does not take them).
#: DP_CP is the replicate group (the gradient sync); DP_CP_GTP the full data group
#: (num_tokens and qb_beta), which is what ``get_data_parallel_group`` returns by default.
PARALLEL_STATE_GETTERS: dict[Group, tuple[str, dict[str, Any], tuple[str, ...]]] = {
    Group.TP: ("get_tensor_model_parallel_group", {}, ()),
    Group.PP: ("get_pipeline_model_parallel_group", {}, ()),
    Group.EMBD: ("get_embedding_group", {"check_initialized": False}, ()),
    Group.POS_EMBD: ("get_position_embedding_group", {"check_initialized": False}, ()),
    Group.DP_CP: ("get_data_parallel_group", {"with_context_parallel": True, "with_gtp_remat": False}, ("with_gtp_remat",)),
    Group.DP_CP_GTP: ("get_data_parallel_group", {"with_context_parallel": True}, ()),
    Group.EDP: ("get_expert_data_parallel_group", {"with_gtp_remat": False}, ("with_gtp_remat",)),
    Group.TP_DP_CP: ("get_tensor_and_data_parallel_group", {"with_context_parallel": True}, ()),
    Group.GTP: ("get_gtp_weight_remat_group", {"check_initialized": False}, ()),
    Group.EGTP: ("get_expert_gtp_weight_remat_group", {"check_initialized": False}, ()),
}
UNDEFINED = object()
#: The functions of ``parallel_state`` a read calls: the getters and
#: ``model_parallel_is_initialized``; a memo holds while the globals they read hold.
READ_ENTRIES = ("model_parallel_is_initialized", *sorted({name for name, _, _ in PARALLEL_STATE_GETTERS.values()}))


def _parameter_names(getter: Callable[..., Any]) -> Container[str] | None:
    """The parameter names of ``getter`` (None: unknown). A plain function's come from its
    code object (every step reads the groups: ``inspect.signature`` costs tens of
    microseconds); a wrapper's or another callable's from its signature."""
    code = getattr(getter, "__code__", None)
    if code is not None and not hasattr(getter, "__wrapped__"):
        return code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    try:
        return inspect.signature(getter).parameters
    except (TypeError, ValueError):
        return None


def _accepted(getter: Callable[..., Any], kwargs: dict[str, Any], optional: tuple[str, ...]) -> dict[str, Any]:
    """``kwargs`` less the ``optional`` ones that ``getter`` does not take."""
    if not optional:
        return kwargs
    names = _parameter_names(getter)
    if names is None:
        return kwargs
    return {k: v for k, v in kwargs.items() if k in names or k not in optional}


def parallel_state_group(ps: Any, group: Group) -> Any:
    """One named group from ``parallel_state``; ``UNDEFINED`` when its getter is absent
    or asserts (not initialized), None where Megatron holds none for this rank."""
    name, kwargs, optional = PARALLEL_STATE_GETTERS[group]
    getter = getattr(ps, name, None)
    if not callable(getter):
        return UNDEFINED
    try:
        return getter(**_accepted(getter, kwargs, optional))
    except (AssertionError, RuntimeError, TypeError, AttributeError):
        return None if group in (Group.EMBD, Group.POS_EMBD, Group.GTP, Group.EGTP) else UNDEFINED


def parallel_state_values(ps: Any) -> dict[Group, ProcessGroup | None]:
    """The groups Megatron's ``parallel_state`` defines, by meshgrad name (a getter that is
    absent or raises leaves its group out)."""
    values = {g: parallel_state_group(ps, g) for g in PARALLEL_STATE_GETTERS}
    return {g: v for g, v in values.items() if v is not UNDEFINED}


def parallel_state_groups(ps: Any | None = None) -> TorchGroups | None:
    """This rank's :class:`TorchGroups` from Megatron's initialized ``parallel_state``
    (a new one; :func:`parallel_state_keyed` keeps one while the groups stay the same),
    or None when it is not initialized."""
    found = parallel_state_keyed(ps)
    return found.groups if found is not None else None


class ParallelStateRead(NamedTuple):
    """One read of ``parallel_state`` (:func:`parallel_state_keyed`): the groups' identities
    (``key``), their TorchGroups, and the module with the globals its getters read then
    (:data:`READ_ENTRIES`)."""

    key: tuple[Any, ...]
    groups: TorchGroups
    module: Any
    reads: GlobalReads


def parallel_state_keyed(ps: Any | None = None, memo: ParallelStateRead | None = None) -> ParallelStateRead | None:
    """This rank's :class:`TorchGroups` from Megatron's initialized ``parallel_state``, as
    ``finalize_model_grads(pg_collection=None)`` reads it.

    Args:
      ps: the ``parallel_state`` module (default: Megatron's, when imported).
      memo: a previous result: returned again, without calling a getter, while the
        globals the getters read are what they were (:class:`GlobalReads`: the getters
        themselves, the groups they return, whatever else their code reads); its
        TorchGroups kept while the getters return the same objects (the caller keeps it --
        the model state -- so a loop passing ``pg_collection=None`` reuses one TorchGroups,
        and one cached plan, every step).

    Returns:
      The :class:`ParallelStateRead`, or None when there is no ``parallel_state``.
    """
    ps = parallel_state() if ps is None else ps
    if ps is None:
        return None
    if memo is not None and _still_read(ps, memo):
        return memo
    reads = GlobalReads(ps, READ_ENTRIES)
    values = parallel_state_values(ps)
    key = tuple((g, id(v)) for g, v in values.items())
    if memo is not None and memo.key == key:
        return ParallelStateRead(key, memo.groups, ps, reads)
    groups = TorchGroups.from_mapping(values, source="Megatron parallel_state")  # it keeps the groups alive
    return ParallelStateRead(key, groups, ps, reads)


def parallel_state_current(memo: ParallelStateRead) -> bool:
    """Whether :func:`parallel_state_keyed` with ``memo`` would return ``memo`` itself: the
    same initialized module, the globals its getters read what they were."""
    ps = loaded_parallel_state()
    return ps is memo.module and memo.reads.same(ps) and parallel_state() is ps


_INITIALIZED = operator.methodcaller("model_parallel_is_initialized")


def probe_parallel_state(probes: Probes, memo: ParallelStateRead | None) -> None:
    """Write down as probes, while it holds, that :func:`parallel_state_current` holds
    for ``memo`` (the module loaded, its read globals the same, initialized), or, with no
    memo, that :func:`parallel_state` is still None (the module not loaded, or loaded and
    not initialized)."""
    ps = loaded_parallel_state() if memo is None else memo.module
    probes.same(partial(sys.modules.get, PARALLEL_STATE), ps)
    if ps is None:
        return
    if memo is not None:
        memo.reads.probe(ps, probes)
    probes.same(partial(_INITIALIZED, ps), ps.model_parallel_is_initialized())


def _still_read(ps: Any, memo: ParallelStateRead) -> bool:
    """Whether ``memo`` was read from the module ``ps``, whose globals that the getters
    read are what they were."""
    return memo.module is ps and memo.reads.same(ps)


def default_group() -> ProcessGroup | None:
    """What a None group passed to a torch.distributed collective means: the world."""
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


__all__ = [
    "GTP_API",
    "GTP_FENCE",
    "PARALLEL_STATE",
    "PARALLEL_STATE_GETTERS",
    "UNDEFINED",
    "default_group",
    "gtp_fence",
    "loaded_parallel_state",
    "parallel_state",
    "parallel_state_group",
    "parallel_state_groups",
    "ParallelStateRead",
    "parallel_state_current",
    "parallel_state_keyed",
    "parallel_state_values",
]
