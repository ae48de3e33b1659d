"""Recording a Megatron DDP with ``overlap_grad_reduce=True``.

Such a DDP starts reducing a bucket group during backward (its hooks call the group's
``start_grad_sync``), so the local gradients are gone by the time finalize runs. While a
recorder watches the DDP, each bucket group's ``start_grad_sync`` is shadowed by an
instance attribute that reads the sampled elements of the group's gradients first; the
attribute is removed (or the previous one put back) when the recorder is closed. The
step then holds the "before" values it would hold without overlap.

Known structure (megatron-core's ``DistributedDataParallel``): the DDP (the first object
of a chunk's ``.module`` chain with ``finish_grad_sync``) has ``ddp_config`` with
``overlap_grad_reduce``, a list ``bucket_groups`` (and optionally
``expert_parallel_bucket_groups``) whose items have a callable ``start_grad_sync`` and the
parameters they reduce (``params``, or ``buckets[i].params_list`` / ``.params``), and
every parameter of the DDP that requires a gradient is in one of them. Anything else
raises :class:`~meshgrad.errors.FinalizeTypeError` naming the DDP and what is missing.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from meshgrad.errors import FinalizeTypeError
from torch_impl.audit.layout import ddp_of
from torch_impl.audit.plan import _Plan
from torch_impl.audit.sampling import _sampler, _Sampler

__all__ = ["OverlapTaps", "overlapping_bucket_groups"]

_MISSING = object()


def overlapping_bucket_groups(ddp: Any, chunk: int) -> list[tuple[Any, list[torch.Tensor]]] | None:
    """The bucket groups of a DDP that reduces during backward, with their parameters.

    Args:
      ddp: the chunk's DDP (see :func:`torch_impl.audit.layout.ddp_of`).
      chunk: its chunk index (for the error message).

    Returns:
      [(bucket group, its parameters)], or None when the DDP does not overlap
      (``ddp_config.overlap_grad_reduce`` false or absent).

    Raises:
      FinalizeTypeError: the DDP overlaps but its structure is not the known one.
    """
    if not getattr(getattr(ddp, "ddp_config", None), "overlap_grad_reduce", False):
        return None

    def unknown(what: str) -> FinalizeTypeError:
        return FinalizeTypeError(
            f"audit: cannot record chunk {chunk}'s {type(ddp).__module__}.{type(ddp).__qualname__} with "
            f"overlap_grad_reduce=True: {what}. Its reduction starts during backward, and without its bucket "
            "groups' start_grad_sync the values before it cannot be read; record it with overlap_grad_reduce=False")

    lists = [getattr(ddp, "bucket_groups", None), getattr(ddp, "expert_parallel_bucket_groups", [])]
    if not all(isinstance(x, (list, tuple)) for x in lists):
        raise unknown("it has no list `bucket_groups` (and `expert_parallel_bucket_groups`)")
    out = []
    for i, group in enumerate([g for x in lists for g in x]):
        if not callable(getattr(group, "start_grad_sync", None)):
            raise unknown(f"its bucket group {i} ({type(group).__qualname__}) has no callable `start_grad_sync`")
        params = _group_params(group)
        if params is None:
            raise unknown(f"its bucket group {i} ({type(group).__qualname__}) lists no parameters "
                          "(`params`, or `buckets` with `params_list` / `params`)")
        out.append((group, params))
    covered = {id(p) for _, params in out for p in params}
    module = ddp if callable(getattr(ddp, "named_parameters", None)) else None
    named = list(module.named_parameters()) if module is not None else []
    loose = [name for name, p in named if p.requires_grad and id(p) not in covered]
    if loose:
        raise unknown(f"parameters {loose[:4]} are in none of its bucket groups")
    return out


def _group_params(group: Any) -> list[torch.Tensor] | None:
    """A bucket group's parameters (``params``, else those of its ``buckets``), or None."""
    params = getattr(group, "params", None)
    if isinstance(params, (set, frozenset, list, tuple)) and all(isinstance(p, torch.Tensor) for p in params):
        return list(params)
    buckets = getattr(group, "buckets", None)
    if not isinstance(buckets, (list, tuple)):
        return None
    out: list[torch.Tensor] = []
    for bucket in buckets:
        found = getattr(bucket, "params_list", None)
        found = getattr(bucket, "params", None) if found is None else found
        if not isinstance(found, (set, frozenset, list, tuple)):
            return None
        out.extend(found)
    return out if all(isinstance(p, torch.Tensor) for p in out) else None


@dataclasses.dataclass
class _Tap:
    """The wrapper of one bucket group's ``start_grad_sync`` and what it replaced."""

    index: int
    group: Any
    params: list[torch.Tensor]
    previous: Any  # the instance attribute shadowed, or _MISSING
    name: str
    wrapper: Callable[..., Any] | None = None
    active: bool = True


@dataclasses.dataclass
class _Capture:
    """What one bucket group's gradients held when its reduction started: the sampled
    values read with ``plan`` (``values`` at ``slots``) or, with no fitting plan yet,
    copies of the whole gradients (``clones``: parameter id -> proxy with ``main_grad``)."""

    plan: _Plan | None = None
    slots: torch.Tensor | None = None
    values: torch.Tensor | None = None
    clones: dict[int, Any] | None = None


def _slots(plan: _Plan, keep: Sequence[int]) -> torch.Tensor:
    """The positions in a step's sampled vector of the parameters ``keep`` (plan indices)."""
    sizes = np.array([e.positions.size for e in plan.entries], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]) if sizes.size else sizes
    parts = [np.arange(starts[i], starts[i] + sizes[i]) for i in keep]
    return torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, np.int64))


def _sub_reader(plan: _Plan, objects: dict[int, Any]) -> tuple[_Sampler, torch.Tensor] | None:
    """A sampler of the plan's parameters found in ``objects`` (parameter id -> what to read
    it from) and their slots; None when the plan has none of them."""
    keep = [i for i, p in enumerate(plan.params) if id(p) in objects]
    if not keep:
        return None
    sampler = _sampler([plan.entries[i] for i in keep], [objects[id(plan.params[i])] for i in keep], plan.fsdp)
    return sampler, _slots(plan, keep)


class OverlapTaps:
    """Wrappers of the ``start_grad_sync`` of every overlapping DDP a recorder watches.

    Args:
      current_plan: gives the recorder's current plan (or None before the first step).
    """

    def __init__(self, current_plan: Callable[[], _Plan | None]) -> None:
        self._plan = current_plan
        self._watched: dict[int, Any] = {}  # id -> DDP (kept alive: ids stay unique)
        self._taps: list[_Tap] = []
        self._readers: dict[int, tuple[_Plan, tuple[_Sampler, torch.Tensor] | None]] = {}
        self._captured: dict[int, _Capture | str] = {}
        self._armed = True

    def watch(self, chunks: Sequence[Any]) -> list[str]:
        """Wrap the bucket groups of every overlapping DDP of ``chunks`` not watched yet.

        Returns:
          The DDPs newly wrapped that overlap ("chunk i's ClassName"): a step whose
          backward ran before they were wrapped cannot be recorded.

        Raises:
          FinalizeTypeError: an overlapping DDP of unknown structure (nothing is wrapped).
        """
        found = []
        for i, chunk in enumerate(chunks):
            ddp = ddp_of(chunk)
            if ddp is not None and id(ddp) not in self._watched:
                groups = overlapping_bucket_groups(ddp, i)
                found.append((ddp, f"chunk {i}'s {type(ddp).__qualname__}", groups))
        fresh = []
        for ddp, name, groups in found:
            self._watched[id(ddp)] = ddp
            for group, params in groups or ():
                self._install(group, params, name)
            if groups:
                fresh.append(name)
        return fresh

    def _install(self, group: Any, params: list[torch.Tensor], name: str) -> None:
        """Shadow ``group.start_grad_sync`` with a wrapper that reads its gradients first."""
        tap = _Tap(len(self._taps), group, params, vars(group).get("start_grad_sync", _MISSING), name)
        original = group.start_grad_sync

        def start_grad_sync(*args: Any, **kwargs: Any) -> Any:
            if tap.active:
                self._capture(tap)
            return original(*args, **kwargs)

        tap.wrapper = start_grad_sync
        self._taps.append(tap)
        group.start_grad_sync = start_grad_sync

    def _capture(self, tap: _Tap) -> None:
        """Read a bucket group's sampled values: at its first start of each step only."""
        index = tap.index
        if not self._armed or index in self._captured:
            return
        try:
            with torch.no_grad():
                plan = self._plan()
                reader = None if plan is None else self._reader(index, plan)
                if reader is not None:
                    sampler, slots = reader
                    self._captured[index] = _Capture(plan, slots, sampler.read(plan.fsdp))
                else:
                    self._captured[index] = _Capture(clones=_clones(tap.params))
        except Exception as err:  # noqa: BLE001 -- the training step goes on; this step is not recorded
            self._captured[index] = (f"reading {tap.name}'s gradients as its bucket group {index} started to "
                                     f"reduce failed ({type(err).__name__}: {err})")

    def _reader(self, index: int, plan: _Plan) -> tuple[_Sampler, torch.Tensor] | None:
        """The sampler of bucket group ``index``'s parameters under ``plan`` (cached)."""
        cached = self._readers.get(index)
        if cached is None or cached[0] is not plan or (cached[1] is not None and not cached[1][0].watch.same()):
            cached = (plan, _sub_reader(plan, {id(p): p for p in self._taps[index].params}))
            self._readers[index] = cached
        return cached[1]

    def merge(self, plan: _Plan, values: torch.Tensor) -> tuple[int, str | None]:
        """Put the values read as bucket groups started reducing into a step's "before"
        values (in place) and stop reading until :meth:`arm`.

        Returns:
          (how many bucket groups had started, why the step cannot be recorded or None).
        """
        captured, self._captured = self._captured, {}
        self._armed = False
        problem = None
        for index, capture in captured.items():
            if isinstance(capture, str):
                problem = capture
                continue
            if capture.clones is not None:
                reader = _sub_reader(plan, capture.clones)
                if reader is None:
                    continue
                sampler, slots = reader
                read = sampler.read(plan.fsdp)
            elif capture.plan is plan or plan.reads_like(capture.plan):
                slots, read = capture.slots, capture.values
            else:
                problem = (f"{self._taps[index].name}'s bucket group {index} started to reduce before the "
                           "recorder's plan changed")
                continue
            values.index_copy_(0, slots.to(values.device), read.to(device=values.device, dtype=values.dtype))
        return len(captured), problem

    def arm(self) -> None:
        """Read the bucket groups again as they start (after a finalize call)."""
        self._armed = True

    def close(self) -> None:
        """Remove every wrapper (putting back what it shadowed); a wrapper someone wrapped
        again is left in place, passing through."""
        self._armed = False
        for tap in reversed(self._taps):
            tap.active = False
            if vars(tap.group).get("start_grad_sync") is tap.wrapper:
                if tap.previous is _MISSING:
                    del tap.group.start_grad_sync
                else:
                    tap.group.start_grad_sync = tap.previous
        self._taps, self._watched, self._readers, self._captured = [], {}, {}, {}


def _clones(params: list[torch.Tensor]) -> dict[int, Any]:
    """Copies of the gradients the sampler reads (``main_grad``, else ``grad``), as
    objects a sampler reads like parameters."""
    out = {}
    for p in params:
        grad = p.main_grad if hasattr(p, "main_grad") else p.grad
        if isinstance(grad, torch.Tensor):
            out[id(p)] = types.SimpleNamespace(main_grad=grad.detach().clone(), requires_grad=p.requires_grad)
    return out


def unwatched_reason(names: Sequence[str]) -> str:
    """Why a step whose overlapping DDPs were not watched during its backward is not recorded."""
    return (f"{', '.join(names)} has overlap_grad_reduce=True and was not watched during this step's backward "
            "(its buckets may have started reducing already); pass model= to audit.record / audited, or call "
            "recorder.watch(model), before the first recorded backward")
