"""Record a finalize step on every rank, for replay against the numpy reference.

Wrap any function with Megatron's signature ``f(model, num_tokens=None,
pg_collection=None, force_all_reduce=False)`` -- :func:`torch_impl.finalize_model_grads`,
megatron-core's own, a user's -- and every call writes, on every rank, portable ``.npz``
files (no pickle: ``np.load(path, allow_pickle=False)`` reads them):

* once per rank and *plan* (what stays the same from step to step), ``plan.rankRRRRR.<id>.npz``:
  the layout (this rank's coordinates and the members of every named group, resolved by
  the code finalize uses, :func:`resolve_layout`), the config fields that matter
  (:class:`meshgrad.config.FinalizeConfig`) and the parallel sizes the (Megatron) config
  asks for, each parameter's name, chunk, flags, role, shape, dtype and numel, the
  deterministic sampled flat positions (the same on every rank for the same name and size),
  the routers and which of their buffers exist;
* per step and rank, ``stepSSSSSSSS.rankRRRRR.npz``: the id of its plan, the gradient values
  at the sampled positions before and after the call, which parameters had a gradient, the
  router buffers (``local_tokens_per_expert``, ``expert_bias``, ``qb_beta``,
  ``qb_beta_accum``, ``qb_beta_count``) whole before and after, ``num_tokens`` before and
  after, ``force_all_reduce``.

Per step the recorder does no per-parameter Python work: the sampled values are read with
one ``index_select`` per gradient storage (meshgrad's flat buffers, a DDP grad buffer) at
indices computed once, whether the gradient tensors are still the same is checked at C
speed, and the file is written by a background
thread.

Usage::

    from torch_impl import audit, finalize_model_grads

    with audit.record("runs/step100", sample=64) as finalize:   # default: torch_impl's
        finalize(model, num_tokens=n, pg_collection=groups)

    step = audit.audited(megatron_finalize_model_grads, "runs/audit", sample=64)
    step(model, n, groups)                                      # one file per rank per call

Replay with ``python -m parity_tests audit runs/step100``. The "before" values are read
before the wrapped function runs, so a Megatron DDP whose ``finish_grad_sync`` does the
DP sync is audited too (its reduction must not have started yet: no
``overlap_grad_reduce`` on the audited step).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import itertools
import json
import operator
import os
import struct
import threading
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from meshgrad.axes import Group
from meshgrad.config import FinalizeConfig
from torch_impl.model_state import ModelState
from torch_impl.discover import FLAG_ATTRS
from torch_impl.finalize import finalize_model_grads
from torch_impl.grads import is_dtensor
from torch_impl.groups import group_ranks
from torch_impl.megatron import CONFIG_SIZES, Requested, chunk_configs, parallel_state_groups

#: Version of the file layout written here (parity_tests.audit checks it).
FORMAT_VERSION = 2
#: Router buffers recorded whole.
ROUTER_FIELDS = ("local_tokens_per_expert", "expert_bias", "qb_beta", "qb_beta_accum", "qb_beta_count")
#: Parameter flags recorded (docs/semantics.md): those discovery reads.
PARAM_FLAGS = FLAG_ATTRS

FinalizeFn = Callable[..., Any]


def file_name(step: int, rank: int) -> str:
    """The file one rank writes for one step."""
    return f"step{step:08d}.rank{rank:05d}.npz"


def plan_file_name(rank: int, plan: str) -> str:
    """The file one rank writes once per plan (what its step files share)."""
    return f"plan.rank{rank:05d}.{plan}.npz"


#: The name an embedding is sampled under: the same on every stage, whatever its name there
#: (``embedding.word_embeddings.weight`` on the first stage, ``output_layer.weight`` on the last).
ROLE_KEYS = {"word_embedding": "[word embedding]", "position_embedding": "[position embedding]"}


def sample_key(name: str, role: str) -> str:
    """What a parameter's sampled positions are drawn from: its role for the embeddings
    finalize sums across pipeline stages, else its name."""
    return ROLE_KEYS.get(role, name)


def sample_positions(name: str, numel: int, sample: int) -> np.ndarray:
    """The flat positions sampled from a gradient: the same on every rank for the same
    parameter name (:func:`sample_key`) and size (all of them when ``numel <= sample``).

    Args:
      name: the parameter's sample key.
      numel: its number of elements.
      sample: how many positions to take.

    Returns:
      Sorted int64 positions, always including the first and the last element.
    """
    if numel <= sample:
        return np.arange(numel, dtype=np.int64)
    digest = hashlib.blake2b(f"{name}|{numel}".encode(), digest_size=8).digest()
    rng = np.random.default_rng(int.from_bytes(digest, "little"))
    inner = rng.choice(numel - 2, size=max(sample - 2, 0), replace=False) + 1
    return np.unique(np.concatenate([[0, numel - 1], inner]).astype(np.int64))


# --------------------------------------------------------------------------- layout


def resolve_layout(
    model: Sequence[Any], pg_collection: Any, validated_by: tuple[Any, int] | None = None
) -> tuple[FinalizeConfig, Any, Any, Any]:
    """Config and groups exactly as torch_impl's finalize resolves them.

    The one place this module calls into torch_impl's set-up path (re-pointed when that
    moves).

    Args:
      model: the model chunks.
      pg_collection: what the finalize function is given.
      validated_by: (the model's cached finalize state, its call count before a call):
        when torch_impl's finalize ran exactly once since (its own call, or inside the
        audited function), the model it discovered and checked in that call is used
        instead of checking it again.

    Returns:
      (FinalizeConfig, TorchGroups, the raw chunk config, the discovered model).
    """
    raw, ddp_config = chunk_configs(model)
    state = model_state(model)
    source = parallel_state_groups() if pg_collection is None else pg_collection
    if validated_by is not None and validated_by[0] is state and state.stats.calls == validated_by[1] + 1:
        # What finalize resolved in this very call (it does not change the config or groups).
        if isinstance(raw, FinalizeConfig) and ddp_config is None:
            config = raw
        else:
            config = state.last_resolved_config(raw, ddp_config) or state.config(raw, ddp_config)
        groups = state.last_resolved_groups(source) or state.resolve_groups(source, config, Requested.from_config(raw))
        cached = state.found.get((config.has_mtp, True))
        if cached is not None:
            return config, groups, raw, cached[1]
    config = state.config(raw, ddp_config)
    groups = state.resolve_groups(source, config, Requested.from_config(raw))
    _, found, _ = state.discovered(model, config)  # every parameter; cached while the model stays the same
    return config, groups, raw, found


def model_state(model: Sequence[Any]) -> Any:
    """torch_impl's cached finalize state of the chunks (created when missing)."""
    return ModelState.of(model)


def _members(groups: Any, group: Group, rank: int) -> list[int]:
    """Global ranks of this rank's ``group`` ([] where it is not a member, [rank] for a
    group of size 1)."""
    pg = groups.groups.get(group)
    if pg is not None and groups.size(group) > 1:
        return [int(r) for r in group_ranks(pg)]
    if group in (Group.EMBD, Group.POS_EMBD) and groups.stages.get(group) is None:
        return []
    return [rank]


def _layout(groups: Any, rank: int) -> dict[str, Any]:
    members = {g.value: _members(groups, g, rank) for g in Group}
    members[Group.PP.value] = [int(r) for r in groups.pp_ranks]
    coords = {
        g: (sorted(m).index(rank) if rank in m else -1)
        for g, m in members.items()
        if g != Group.PP.value
    }
    coords["pp"] = int(groups.pp_stage)
    stages = {
        g.value: (None if groups.stages.get(g) is None else [int(s) for s in groups.stages[g]])
        for g in (Group.EMBD, Group.POS_EMBD)
    }
    return {
        "members": members,
        "coords": coords,
        "stages": stages,
        "missing": sorted(g.value for g in groups.missing),
    }


def _ddp_chunks(model: Sequence[Any]) -> list[bool]:
    """Per chunk: whether its ``.module`` chain has a ``finish_grad_sync`` (Megatron DDP)."""
    out = []
    for chunk in model:
        found, obj = False, chunk
        for _ in range(64):
            if callable(getattr(obj, "finish_grad_sync", None)):
                found = True
                break
            if not hasattr(obj, "module"):
                break
            obj = obj.module
        out.append(found)
    return out


def _config_dict(config: FinalizeConfig, raw: Any) -> dict[str, Any]:
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(FinalizeConfig)}
    values = {k: (list(v) if isinstance(v, tuple) else v) for k, v in values.items()}
    sizes = {}
    for name in CONFIG_SIZES:
        value = getattr(raw, name, None) if raw is not None else None
        if isinstance(value, int) and not isinstance(value, bool):
            sizes[name] = value
    return {"finalize": values, "sizes": sizes}


# --------------------------------------------------------------------------- sampling


def _grad_tensor(param: torch.Tensor, fsdp: bool) -> torch.Tensor | None:
    """The gradient finalize works on, as a plain tensor (a DTensor made whole, or its
    local shard under Megatron-FSDP)."""
    grad = getattr(param, "main_grad", None) if hasattr(param, "main_grad") else param.grad
    if grad is None or not param.requires_grad:
        return None
    if hasattr(grad, "full_tensor") and hasattr(grad, "to_local"):
        return grad.to_local() if fsdp else grad.full_tensor()
    return grad


@dataclasses.dataclass
class _Entry:
    """One parameter's static facts and its sampled positions."""

    info: dict[str, Any]
    positions: np.ndarray


_MAIN_GRAD = operator.attrgetter("main_grad")
_GRAD = operator.attrgetter("grad")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


class _Watch:
    """Whether the parameters still have the same gradient tensors, at C speed (a few
    ``map`` calls over fixed lists, no per-parameter Python): ``requires_grad``, which of
    ``main_grad`` / ``grad`` is read, the gradient objects and their data pointers.

    Args:
      params: the parameters, in a fixed order.
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        self.requires = list(map(_REQUIRES_GRAD, self.params))
        self.main = [p for p in self.params if hasattr(p, "main_grad")]
        self.plain = [p for p in self.params if not hasattr(p, "main_grad")]
        self.grads = list(map(_MAIN_GRAD, self.main)) + list(map(_GRAD, self.plain))
        self.tensors = [g for g in self.grads if isinstance(g, torch.Tensor)]
        self.ptrs = list(map(torch.Tensor.data_ptr, self.tensors))

    def same(self) -> bool:
        """True while every parameter reads the same gradient tensor, at the same address."""
        try:
            grads = list(map(_MAIN_GRAD, self.main)) + list(map(_GRAD, self.plain))
        except AttributeError:  # a main_grad was deleted
            return False
        return (
            all(map(operator.is_, grads, self.grads))
            and not any(map(hasattr, self.plain, itertools.repeat("main_grad")))
            and list(map(_REQUIRES_GRAD, self.params)) == self.requires
            and list(map(torch.Tensor.data_ptr, self.tensors)) == self.ptrs
        )

    def same_tensors(self) -> bool:
        """True while every parameter holds the same gradient tensor at the same address
        (what reading the values with the sampler needs; after the call)."""
        try:
            grads = list(map(_MAIN_GRAD, self.main)) + list(map(_GRAD, self.plain))
        except AttributeError:
            return False
        return all(map(operator.is_, grads, self.grads)) and list(map(torch.Tensor.data_ptr, self.tensors)) == self.ptrs


#: How a sampling op reads: from a storage's flat view, from a tensor, from a DTensor's parameter.
_STORAGE, _TENSOR, _DTENSOR = 0, 1, 2


@dataclasses.dataclass
class _Sampler:
    """How to read every sampled value of one set of gradient tensors, in slot order.

    Args:
      watch: tells whether the parameters still have these gradient tensors.
      ops: (kind, source, flat indices, dtype to cast to or None) per storage or tensor.
      perm: slot -> index into the concatenated op results (+ one NaN at the end), or None
        where they already are in slot order.
      present: per parameter, whether it had a gradient of its recorded size.
      dtype: the dtype the values are kept in (float64 only for float64 gradients).
    """

    watch: Any
    ops: list[tuple[int, Any, torch.Tensor, torch.dtype | None]]
    perm: torch.Tensor | None
    present: np.ndarray
    dtype: torch.dtype
    total: int

    def read(self, fsdp: bool) -> torch.Tensor:
        """The sampled values (a new tensor: later changes of the gradients do not show)."""
        pieces = []
        for kind, source, index, cast in self.ops:
            if kind == _STORAGE:
                piece = source.index_select(0, index)
            elif kind == _TENSOR:
                piece = torch.take(source, index)
            else:
                piece = torch.take(_grad_tensor(source, fsdp), index)
            pieces.append(piece if cast is None else piece.to(cast))
        if self.perm is None:
            if len(pieces) == 1:
                return pieces[0]
            return torch.cat(pieces) if pieces else torch.zeros(0, dtype=self.dtype)
        device = self.perm.device
        pieces.append(torch.full((1,), float("nan"), dtype=self.dtype, device=device))
        return torch.cat(pieces).index_select(0, self.perm)


def _sampler(entries: list[_Entry], params: list[torch.Tensor], fsdp: bool) -> _Sampler:
    """Group the sampled positions by gradient storage (one ``index_select`` each)."""
    dtype = torch.float64 if any(e.info["dtype"] == "float64" for e in entries) else torch.float32
    watch = _Watch(params)
    groups: dict[Any, tuple[torch.Tensor, list[np.ndarray], list[np.ndarray]]] = {}
    ops: list[tuple[int, Any, torch.Tensor, torch.dtype | None]] = []
    order: list[np.ndarray] = []
    present: list[bool] = []
    start = 0
    device = None
    for entry, param in zip(entries, params):
        n = entry.positions.size
        slots = np.arange(start, start + n, dtype=np.int64)
        start += n
        raw = getattr(param, "main_grad", None) if hasattr(param, "main_grad") else param.grad
        grad = _grad_tensor(param, fsdp)
        ok = grad is not None and grad.numel() == entry.info["numel"]
        present.append(ok)
        if not ok:
            continue
        device = grad.device if device is None else device
        cast = None if grad.dtype == dtype else dtype
        if is_dtensor(raw):
            ops.append((_DTENSOR, param, torch.from_numpy(entry.positions).to(grad.device), cast))
            order.append(slots)
            continue
        key = None
        if grad.is_contiguous() and grad.layout is torch.strided:
            try:
                key = (grad.untyped_storage().data_ptr(), grad.dtype, grad.device)
            except (RuntimeError, NotImplementedError):
                key = None
        if key is None:
            ops.append((_TENSOR, grad, torch.from_numpy(entry.positions).to(grad.device), cast))
            order.append(slots)
            continue
        if key not in groups:
            base = torch.empty(0, dtype=grad.dtype, device=grad.device).set_(grad.untyped_storage())
            groups[key] = (base, [], [])
        groups[key][1].append(entry.positions + grad.storage_offset())
        groups[key][2].append(slots)
    for base, index, slots in groups.values():
        cast = None if base.dtype == dtype else dtype
        ops.append((_STORAGE, base, torch.from_numpy(np.concatenate(index)).to(base.device), cast))
        order.append(np.concatenate(slots))
    flat = np.concatenate(order) if order else np.zeros(0, np.int64)
    perm = None
    if flat.size != start or not np.array_equal(flat, np.arange(start)):
        inverse = np.full(start, flat.size, dtype=np.int64)  # absent: the NaN after the values
        inverse[flat] = np.arange(flat.size)
        perm = torch.from_numpy(inverse).to(device if device is not None else "cpu")
    return _Sampler(watch, ops, perm, np.asarray(present, dtype=bool), dtype, start)


@dataclasses.dataclass
class _Plan:
    """What the step files of one rank share, and how to read a step.

    Args:
      key: what it was made from (the discovered model, groups, configs, chunks, group
        source, wrapped function), compared by identity.
      chunk_ids, source: the chunks' ids and the group source it was made for.
      rank, fsdp: this rank; whether DTensor gradients are read as local shards.
      entries, params: per parameter its static facts and the parameter object.
      sampler: how to read the sampled values of the current gradient tensors.
      routers, router_fields: the router modules, their buffers present ([index, field, shape]).
      digest, arrays: the plan file's id and contents.
    """

    key: tuple[Any, ...]
    chunk_ids: tuple[int, ...]
    source: Any
    rank: int
    fsdp: bool
    entries: list[_Entry]
    params: list[torch.Tensor]
    sampler: _Sampler
    routers: list[nn.Module]
    router_fields: list[list[Any]]
    digest: str
    arrays: dict[str, np.ndarray]

    def fits(self, chunks: list[Any], source: Any, fields: list[list[Any]]) -> bool:
        """Whether a step on ``chunks`` with ``source`` can be read with this plan: the same
        chunk objects and group source, the same gradient tensors, the same router buffers."""
        return (
            self.chunk_ids == tuple(map(id, chunks))
            and self.source is source
            and fields == self.router_fields
            and self.sampler.watch.same()
        )

    def reads_like(self, other: "_Plan") -> bool:
        """Whether values read with ``other`` are this plan's: the same parameters, sampled
        positions and routers, in the same order."""
        return (
            len(self.params) == len(other.params)
            and all(map(operator.is_, self.params, other.params))
            and all(map(operator.is_, self.entries, other.entries))
            and len(self.routers) == len(other.routers)
            and all(map(operator.is_, self.routers, other.routers))
            and self.router_fields == other.router_fields
        )


def _router_values(routers: list[nn.Module]) -> tuple[list[list[Any]], list[torch.Tensor]]:
    """(fields: [router index, field, shape] of every buffer present, their tensors)."""
    fields: list[list[Any]] = []
    tensors: list[torch.Tensor] = []
    for i, module in enumerate(routers):
        for field in ROUTER_FIELDS:
            buffer = getattr(module, field, None)
            if isinstance(buffer, torch.Tensor):
                fields.append([i, field, list(buffer.shape)])
                tensors.append(buffer)
    return fields, tensors


def _concat64(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensors flattened into one new float64 tensor (None when there are none)."""
    if not tensors:
        return None
    return torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])


def _scalar(t: torch.Tensor) -> float:
    """A one-element tensor's value (the first element of a larger one)."""
    return float(t) if t.numel() == 1 else float(t.reshape(-1)[0])


def _host(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` on the host, copied in this thread (in stream order) when it is on a device."""
    return t if t is None or t.device.type == "cpu" else t.cpu()


def _numpy(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.detach().cpu().numpy()


class Recorder:
    """Wraps a finalize function; every call records one step on every rank.

    Args:
      directory: where the files go (created).
      sample: positions sampled per gradient.
      finalize: the wrapped function (default: :func:`torch_impl.finalize_model_grads`).
      start_step: step index of the first call; each call adds one.
      background: write the files in a thread (the call returns once the values are
        copied); :meth:`flush` (or leaving :func:`record`, or the interpreter's exit)
        waits for it.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        sample: int = 64,
        finalize: FinalizeFn | None = None,
        start_step: int = 0,
        background: bool = True,
    ) -> None:
        if isinstance(sample, bool) or not isinstance(sample, int) or sample < 1:
            raise ValueError(f"audit: sample must be an int >= 1, got {sample!r}")
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"audit: start_step must be an int >= 0, got {start_step!r}")
        if finalize is None:
            finalize = finalize_model_grads
        if not callable(finalize):
            raise TypeError(f"audit: finalize must be callable, got {type(finalize).__name__}")
        self.directory = os.fspath(directory)
        self.sample = sample
        self.finalize = finalize
        self.step = start_step
        self.files: list[str] = []
        self.background = background
        self._entries: dict[tuple[Any, ...], _Entry] = {}
        self._plan: _Plan | None = None
        self.plans_made = 0
        self._written: set[str] = set()
        self._made_dir = False
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: list[concurrent.futures.Future[None]] = []

    # ------------------------------------------------------------------ call
    def __call__(
        self,
        model: Any,
        num_tokens: torch.Tensor | None = None,
        pg_collection: Any = None,
        force_all_reduce: bool | None = False,
    ) -> Any:
        """Record, run the wrapped finalize, record again, write this rank's file.

        Per step, while the model, its gradient tensors and the group source stay the
        same, the last plan is used without re-resolving anything before the call; after
        it, the layout is resolved again (for free when torch_impl's finalize ran: it
        just checked the model) and a changed plan is written anew.

        Returns:
          What the wrapped function returned.
        """
        chunks = [model] if isinstance(model, nn.Module) else list(model)
        state = model_state(chunks)
        calls = state.stats.calls
        plan = self._plan
        fields, buffers = ([], []) if plan is None else _router_values(plan.routers)
        if plan is None or not plan.fits(chunks, pg_collection, fields):
            plan = self._current_plan(chunks, pg_collection, resolve_layout(chunks, pg_collection))
            fields, buffers = _router_values(plan.routers)
        with torch.no_grad():
            before = plan.sampler.read(plan.fsdp)
            present_before = plan.sampler.present
            routers_before = _concat64(buffers)
            tokens_before = None if num_tokens is None else num_tokens.detach().clone()
        result = self.finalize(chunks, num_tokens=num_tokens, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
        checked = self._current_plan(chunks, pg_collection, resolve_layout(chunks, pg_collection, (state, calls)), check=False)
        if checked is not plan:
            if not checked.reads_like(plan):
                warnings.warn(
                    f"audit: step {self.step} not recorded: the model changed in a way only the call could see "
                    "(parameters or routers added or removed); the next step is recorded", RuntimeWarning, stacklevel=2)
                self.step += 1
                return result
            plan = checked
        with torch.no_grad():
            sampler = plan.sampler if plan.sampler.watch.same_tensors() else _sampler(plan.entries, plan.params, plan.fsdp)
            after = sampler.read(plan.fsdp)
            fields_after, buffers = _router_values(plan.routers)
            routers_after = _concat64(buffers)
            tokens = None if tokens_before is None else (_scalar(tokens_before), _scalar(num_tokens))
        meta = self._meta(plan, num_tokens, tokens, force_all_reduce)
        if fields_after != plan.router_fields:
            meta["router_fields_after"] = fields_after
        before, after, routers_before, routers_after = map(_host, (before, after, routers_before, routers_after))
        self._submit(plan, (meta, before, after, present_before, sampler.present, routers_before, routers_after))
        return result

    def _meta(self, plan: Any, num_tokens: Any, tokens: Any, force_all_reduce: Any) -> dict[str, Any]:
        """The step file's header: format, step, rank, plan digest and num_tokens."""
        return {
            "format": FORMAT_VERSION,
            "step": self.step,
            "rank": plan.rank,
            "plan": plan.digest,
            "force_all_reduce": bool(force_all_reduce),
            "num_tokens": {
                "before": None if tokens is None else tokens[0],
                "after": None if tokens is None else tokens[1],
                "dtype": None if num_tokens is None else str(num_tokens.dtype).removeprefix("torch."),
            },
        }

    def _submit(self, plan: Any, values: tuple[Any, ...]) -> None:
        """Write this step's file (and the plan's, the first time), in the background
        thread unless ``background`` is off."""
        path = os.path.join(self.directory, file_name(self.step, plan.rank))
        plan_path = None
        if plan.digest not in self._written:
            self._written.add(plan.digest)
            plan_path = os.path.join(self.directory, plan_file_name(plan.rank, plan.digest))
        self.files.append(path)
        self.step += 1
        if not self.background:
            self._write(values, path, plan.arrays, plan_path)
            return
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="audit-writer", initializer=_background_priority)
        self._pending = [f for f in self._pending if not f.done() or f.exception() is not None]
        self._pending.append(self._executor.submit(self._write, values, path, plan.arrays, plan_path))

    def flush(self) -> None:
        """Wait until every file is written (re-raises the first error of the writer)."""
        pending, self._pending = self._pending, []
        errors = [f.exception() for f in pending]
        error = next((e for e in errors if e is not None), None)
        if error is not None:
            raise error

    def close(self) -> None:
        """Flush and stop the writer thread."""
        try:
            self.flush()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    def wrap(self, fn: FinalizeFn) -> FinalizeFn:
        """A recorder of ``fn`` with this one's directory, sample and step counter."""
        self.finalize = fn
        return self

    # ------------------------------------------------------------------ plan
    def _current_plan(self, chunks: list[Any], source: Any, facts: tuple[FinalizeConfig, Any, Any, Any],
                      check: bool = True) -> _Plan:
        """The plan for these facts: the last one while nothing it was made from changed
        (with ``check``, also its gradient tensors and router buffers: new gradient tensors
        of the same parameters only re-bind the sampler)."""
        config, groups, raw, found = facts
        sizes = tuple(getattr(raw, name, None) if raw is not None else None for name in CONFIG_SIZES)
        key = (found, groups, config, raw, sizes, tuple(map(id, chunks)), source, tuple(_ddp_chunks(chunks)), self.finalize)
        plan = self._plan
        if plan is None or len(plan.key) != len(key) or not all(map(_same, plan.key, key)):
            return self._new_plan(key, chunks, source, config, groups, raw, found)
        if not check:
            return plan
        if _router_values(plan.routers)[0] != plan.router_fields:
            return self._new_plan(key, chunks, source, config, groups, raw, found)
        if not plan.sampler.watch.same():
            entries = [self._entry(spec, param) for spec, param in zip(found.params, plan.params)]
            if not all(map(operator.is_, entries, plan.entries)):
                return self._new_plan(key, chunks, source, config, groups, raw, found)
            self._plan = plan = dataclasses.replace(plan, sampler=_sampler(plan.entries, plan.params, plan.fsdp))
        return plan

    def _new_plan(self, key: tuple[Any, ...], chunks: list[Any], source: Any, config: FinalizeConfig, groups: Any,
                  raw: Any, found: Any) -> _Plan:
        self._plan = plan = self._make_plan(key, chunks, source, config, groups, raw, found)
        self.plans_made += 1
        return plan

    def _make_plan(self, key: tuple[Any, ...], chunks: list[Any], source: Any, config: FinalizeConfig, groups: Any,
                   raw: Any, found: Any) -> _Plan:
        """Entries (cached per parameter), sampler, the static facts and their digest."""
        fsdp = bool(config.use_megatron_fsdp)
        params = [found.tensors[spec.key] for spec in found.params]
        entries = [self._entry(spec, param) for spec, param in zip(found.params, params)]
        sampler = _sampler(entries, params, fsdp)
        routers = [found.router_modules[spec.key] for spec in found.routers]
        fields, _ = _router_values(routers)
        rank = int(groups.rank)
        finalize = self.finalize
        static = {
            "format": FORMAT_VERSION,
            "rank": rank,
            "world_size": int(torch.distributed.get_world_size()) if torch.distributed.is_initialized() else 1,
            "sample": self.sample,
            "finalize": f"{getattr(finalize, '__module__', '?')}.{getattr(finalize, '__qualname__', type(finalize).__name__)}",
            "num_chunks": len(chunks),
            "ddp_chunks": _ddp_chunks(chunks),
            "config": _config_dict(config, raw),
            "layout": _layout(groups, rank),
            "routers": [
                {"name": spec.name, "chunk": spec.chunk, "training": spec.training,
                 "frozen_expert_bias": spec.frozen_expert_bias, "num_experts": spec.num_experts,
                 "has_aux_loss_tracker": spec.has_aux_loss_tracker}
                for spec in found.routers
            ],
            "router_fields": fields,
            "params": [e.info for e in entries],
        }
        positions = np.concatenate([e.positions for e in entries]) if entries else np.zeros(0, np.int64)
        if not positions.size or int(positions.max()) < 2**31:
            positions = positions.astype(np.int32)
        text = json.dumps(static, sort_keys=True).encode()
        digest = hashlib.blake2b(text + positions.tobytes(), digest_size=8).hexdigest()
        arrays = {"plan": np.frombuffer(text, dtype=np.uint8), "positions": positions}
        return _Plan(key, tuple(map(id, chunks)), source, rank, fsdp, entries, params, sampler, routers, fields, digest, arrays)

    def _entry(self, spec: Any, param: torch.Tensor) -> _Entry:
        grad = getattr(param, "main_grad", None) if hasattr(param, "main_grad") else param.grad
        shape = tuple(grad.shape) if grad is not None and not hasattr(grad, "to_local") else tuple(param.shape)
        dtype = str((grad if grad is not None else param).dtype).removeprefix("torch.")
        key = (spec.chunk, spec.name, shape, dtype, spec.role, spec.expert, tuple(getattr(spec, f) for f in PARAM_FLAGS))
        entry = self._entries.get(key)
        if entry is None:
            numel = int(np.prod(shape, dtype=np.int64))
            positions = sample_positions(sample_key(spec.name, str(spec.role)), numel, self.sample)
            info = {
                "name": spec.name,
                "chunk": int(spec.chunk),
                "shape": list(shape),
                "numel": numel,
                "dtype": dtype,
                "expert": bool(spec.expert),
                "role": str(spec.role),
                "samples": int(positions.size),
                **{f: bool(getattr(spec, f)) for f in PARAM_FLAGS},
            }
            entry = _Entry(info, positions)
            self._entries[key] = entry
        return entry

    # ------------------------------------------------------------------ write
    def _write(self, values: tuple[Any, ...], path: str, plan: dict[str, np.ndarray], plan_path: str | None) -> None:
        """Write the plan file (first time only) and the step file, each atomically.

        Args:
          values: (meta, values before, values after, has_grad before, has_grad after,
            router buffers before, after): tensors this recorder made (nothing else
            holds them).
        """
        try:
            meta, before, after, present_before, present_after, routers_before, routers_after = values
            arrays: dict[str, np.ndarray] = {
                "meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
                "grads_before": _numpy(before),
                "grads_after": _numpy(after),
                "has_grad": np.stack([present_before, present_after]),
            }
            if routers_before is not None:
                arrays["routers_before"] = _numpy(routers_before)
            if routers_after is not None:
                arrays["routers_after"] = _numpy(routers_after)
            if not self._made_dir:
                os.makedirs(self.directory, exist_ok=True)
                self._made_dir = True
            if plan_path is not None:
                _save(plan_path, plan)
            _save(path, arrays)
        except Exception as err:  # reported by flush()
            raise OSError(f"audit: could not write {path}: {type(err).__name__}: {err}") from err


def _background_priority() -> None:
    """Run the writer thread at the lowest CPU priority (Linux: per thread), so that it
    uses idle time rather than delaying the training ranks."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not allowed: the default priority
        pass


def _same(a: Any, b: Any) -> bool:
    """Identity, or equality for plain values (the parts of a plan key)."""
    return a is b or (isinstance(a, (tuple, int, str)) and a == b)


def _npy(array: np.ndarray) -> bytes:
    """One array in the ``.npy`` format, version 1.0 (what ``np.load`` reads)."""
    array = np.asarray(array, order="C")
    header = "{'descr': %r, 'fortran_order': False, 'shape': %r, }" % (
        np.lib.format.dtype_to_descr(array.dtype), tuple(array.shape))
    pad = 64 - (10 + len(header) + 1) % 64
    header = (header + " " * pad + "\n").encode("latin1")
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + array.tobytes()


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """An uncompressed ``.npz`` (a stored ZIP of ``.npy`` members), built in one pass:
    ``np.load(..., allow_pickle=False)`` reads it like ``np.savez``'s."""
    local: list[bytes] = []
    central: list[bytes] = []
    offset = 0
    for key, array in arrays.items():
        name = f"{key}.npy".encode()
        data = _npy(array)
        crc = zlib.crc32(data)
        head = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0x21, crc, len(data), len(data), len(name), 0)
        local += (head, name, data)
        central.append(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 0, 0, 0x21, crc, len(data), len(data),
                                   len(name), 0, 0, 0, 0, 0o644 << 16, offset) + name)
        offset += len(head) + len(name) + len(data)
    directory = b"".join(central)
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(central), len(central), len(directory), offset, 0)
    return b"".join(local) + directory + end


def _save(path: str, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` as ``path`` (.npz), atomically (a temporary name, then renamed)."""
    data = npz_bytes(arrays)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    os.replace(tmp, path)


@contextlib.contextmanager
def record(
    directory: str | os.PathLike[str],
    sample: int = 64,
    finalize: FinalizeFn | None = None,
    start_step: int = 0,
) -> Iterator[Recorder]:
    """Context manager giving a :class:`Recorder`: call it like the finalize function.

    Args:
      directory: where every rank writes its file.
      sample: positions sampled per gradient.
      finalize: the function to audit (default: :func:`torch_impl.finalize_model_grads`).
      start_step: the step index of the first call.

    Yields:
      The recorder (``recorder(model, num_tokens, pg_collection, force_all_reduce)``).
    """
    recorder = Recorder(directory, sample=sample, finalize=finalize, start_step=start_step)
    try:
        yield recorder
    finally:
        recorder.close()


def audited(
    fn: FinalizeFn, directory: str | os.PathLike[str], sample: int = 64, start_step: int = 0
) -> FinalizeFn:
    """``fn`` with every call recorded into ``directory`` (one file per rank per call).

    Args:
      fn: a function with Megatron's finalize signature.
      directory: where the files go.
      sample: positions sampled per gradient.
      start_step: the step index of the first call.

    Returns:
      A function with the same signature; its ``recorder`` attribute is the
      :class:`Recorder` (call ``fn.recorder.flush()`` before reading the last file).
    """
    recorder = Recorder(directory, sample=sample, finalize=fn, start_step=start_step)

    @functools.wraps(fn)
    def wrapper(model: Any, num_tokens: Any = None, pg_collection: Any = None, force_all_reduce: bool | None = False) -> Any:
        return recorder(model, num_tokens=num_tokens, pg_collection=pg_collection, force_all_reduce=force_all_reduce)

    wrapper.recorder = recorder  # type: ignore[attr-defined]
    return wrapper
