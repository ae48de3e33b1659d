"""Record a finalize step on every rank, for replay against the numpy reference.

Wrap any function with Megatron's signature ``f(model, num_tokens=None,
pg_collection=None, force_all_reduce=False)`` -- :func:`torch_impl.finalize_model_grads`,
megatron-core's own, a user's -- and every call writes, on every rank, one portable
``.npz`` file (no pickle: ``np.load(path, allow_pickle=False)`` reads it) holding:

* the layout: this rank's coordinates and the members of every named group, resolved by
  the same code finalize uses (:func:`resolve_layout`);
* the config fields that matter (:class:`meshgrad.config.FinalizeConfig`) and the
  parallel sizes the (Megatron) config asks for;
* each parameter's name, chunk, flags, role, shape, dtype and numel, and its gradient at
  the same deterministic sampled flat positions on every rank, before and after the call;
* the router buffers (``local_tokens_per_expert``, ``expert_bias``, ``qb_beta``,
  ``qb_beta_accum``, ``qb_beta_count``) whole, before and after;
* ``num_tokens`` before and after, the step index, ``force_all_reduce``.

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

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from meshgrad.axes import Group
from meshgrad.config import FinalizeConfig

#: Version of the file layout written here (parity_tests.audit checks it).
FORMAT_VERSION = 1
#: Router buffers recorded whole.
ROUTER_FIELDS = ("local_tokens_per_expert", "expert_bias", "qb_beta", "qb_beta_accum", "qb_beta_count")
#: Parameter flags recorded (SPEC.md section 2).
PARAM_FLAGS = (
    "sequence_parallel",
    "average_gradients_across_tp_domain",
    "pipeline_parallel",
    "flextron_router_pp_sync",
    "is_gtp_weight_remat",
)
#: Parallel sizes read from a Megatron config, when it has them.
CONFIG_SIZES = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "gtp_weight_remat_size",
    "expert_gtp_weight_remat_size",
)

FinalizeFn = Callable[..., Any]


def file_name(step: int, rank: int) -> str:
    """The file one rank writes for one step."""
    return f"step{step:08d}.rank{rank:05d}.npz"


def sample_positions(name: str, numel: int, sample: int) -> np.ndarray:
    """The flat positions sampled from a gradient: the same on every rank for the same
    parameter name and size (all of them when ``numel <= sample``).

    Args:
      name: the parameter's name.
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


def resolve_layout(model: Sequence[Any], pg_collection: Any) -> tuple[FinalizeConfig, Any, Any, Any]:
    """Config and groups exactly as torch_impl's finalize resolves them.

    The one place this module calls into torch_impl's set-up path (re-pointed when that
    moves).

    Args:
      model: the model chunks.
      pg_collection: what the finalize function is given.

    Returns:
      (FinalizeConfig, TorchGroups, the raw chunk config, the discovered model).
    """
    from torch_impl.finalize import ModelState, Requested, chunk_configs, parallel_state_groups

    raw, ddp_config = chunk_configs(model)
    state = ModelState.of(model)
    config = state.config(raw, ddp_config)
    source = parallel_state_groups() if pg_collection is None else pg_collection
    groups = state.resolve_groups(source, config, Requested.from_config(raw))
    _, found = state.discovered(model, config)  # cached while the gradients stay the same
    return config, groups, raw, found


def _members(groups: Any, group: Group, rank: int) -> list[int]:
    """Global ranks of this rank's ``group`` ([] where it is not a member, [rank] for a
    group of size 1)."""
    from torch_impl.groups import group_ranks

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
    index: torch.Tensor | None


class Recorder:
    """Wraps a finalize function; every call records one step on every rank.

    Args:
      directory: where the files go (created).
      sample: positions sampled per gradient.
      finalize: the wrapped function (default: :func:`torch_impl.finalize_model_grads`).
      start_step: step index of the first call; each call adds one.
      background: write each file in a thread (the call returns once the values are
        copied); :meth:`flush` (or leaving :func:`record`) waits for it.
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
            from torch_impl.finalize import finalize_model_grads

            finalize = finalize_model_grads
        if not callable(finalize):
            raise TypeError(f"audit: finalize must be callable, got {type(finalize).__name__}")
        self.directory = os.fspath(directory)
        self.sample = sample
        self.finalize = finalize
        self.step = start_step
        self.files: list[str] = []
        self._entries: dict[tuple[Any, ...], _Entry] = {}
        self.background = background
        self._writer: threading.Thread | None = None
        self._error: Exception | None = None
        self._model: tuple[Any, list[_Entry], list[torch.Tensor], bytes] | None = None
        self._plan: tuple[tuple[int, ...], list[Any], np.ndarray, list[bool]] | None = None

    # ------------------------------------------------------------------ call
    def __call__(
        self,
        model: Any,
        num_tokens: torch.Tensor | None = None,
        pg_collection: Any = None,
        force_all_reduce: bool | None = False,
    ) -> Any:
        """Record, run the wrapped finalize, record again, write this rank's file.

        Returns:
          What the wrapped function returned.
        """
        chunks = [model] if isinstance(model, nn.Module) else list(model)
        config, groups, raw, found = resolve_layout(chunks, pg_collection)
        rank = int(groups.rank)
        fsdp = bool(config.use_megatron_fsdp)
        if self._model is None or self._model[0] is not found:
            entries = [self._entry(spec, found.tensors[spec.key]) for spec in found.params]
            info = json.dumps([e.info for e in entries]).encode()
            self._model = (found, entries, [found.tensors[spec.key] for spec in found.params], info)
        _, entries, params, params_json = self._model
        routers = list(found.router_modules.items())
        with torch.no_grad():
            before, present = self._gather(entries, params, fsdp)
            routers_before = self._routers(routers)
            tokens_before = None if num_tokens is None else float(num_tokens.detach().reshape(-1)[0].item())
        result = self.finalize(chunks, num_tokens=num_tokens, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
        with torch.no_grad():
            after, present_after = self._gather(entries, params, fsdp)
            routers_after = self._routers(routers)
            tokens_after = None if num_tokens is None else float(num_tokens.detach().reshape(-1)[0].item())
        meta = {
            "format": FORMAT_VERSION,
            "step": self.step,
            "rank": rank,
            "world_size": int(torch.distributed.get_world_size()) if torch.distributed.is_initialized() else 1,
            "sample": self.sample,
            "finalize": f"{getattr(self.finalize, '__module__', '?')}.{getattr(self.finalize, '__qualname__', type(self.finalize).__name__)}",
            "force_all_reduce": bool(force_all_reduce),
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
            "num_tokens": {
                "before": tokens_before,
                "after": tokens_after,
                "dtype": None if num_tokens is None else str(num_tokens.dtype).removeprefix("torch."),
            },
        }
        arrays: dict[str, np.ndarray] = {
            "meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
            "params": np.frombuffer(params_json, dtype=np.uint8),
            "has_grad": np.asarray(present, dtype=bool),
            "has_grad_after": np.asarray(present_after, dtype=bool),
            "grad_before": before,
            "grad_after": after,
            "positions": self._positions(entries),
        }
        for i, (b, a) in enumerate(zip(routers_before, routers_after)):
            for field in ROUTER_FIELDS:
                if b[field] is not None:
                    arrays[f"router{i}.{field}.before"] = b[field]
                if a[field] is not None:
                    arrays[f"router{i}.{field}.after"] = a[field]
        if not any(e.info["dtype"] == "float64" for e in entries):  # every value fits float32 exactly
            arrays["grad_before"] = arrays["grad_before"].astype(np.float32)
            arrays["grad_after"] = arrays["grad_after"].astype(np.float32)
        if arrays["positions"].size and int(arrays["positions"].max()) < 2**31:
            arrays["positions"] = arrays["positions"].astype(np.int32)
        self.flush()  # one write in flight at a time
        path = os.path.join(self.directory, file_name(self.step, rank))
        self.files.append(path)
        if self.background:
            self._writer = threading.Thread(target=self._write, args=(arrays, path), daemon=False)
            self._writer.start()
        else:
            self._write(arrays, path)
        self.step += 1
        return result

    def flush(self) -> None:
        """Wait until the last file is written (re-raises an error of the writer)."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def wrap(self, fn: FinalizeFn) -> FinalizeFn:
        """A recorder of ``fn`` with this one's directory, sample and step counter."""
        self.finalize = fn
        return self

    # ------------------------------------------------------------------ helpers
    def _entry(self, spec: Any, param: torch.Tensor) -> _Entry:
        grad = getattr(param, "main_grad", None) if hasattr(param, "main_grad") else param.grad
        shape = tuple(grad.shape) if grad is not None and not hasattr(grad, "to_local") else tuple(param.shape)
        dtype = str((grad if grad is not None else param).dtype).removeprefix("torch.")
        key = (spec.chunk, spec.name, shape, dtype, spec.role, spec.expert, tuple(getattr(spec, f) for f in PARAM_FLAGS))
        entry = self._entries.get(key)
        if entry is None:
            numel = int(np.prod(shape, dtype=np.int64))
            positions = sample_positions(spec.name, numel, self.sample)
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
            entry = _Entry(info, positions, None)
            self._entries[key] = entry
        return entry

    def _positions(self, entries: list[_Entry]) -> np.ndarray:
        return np.concatenate([e.positions for e in entries]) if entries else np.zeros(0, np.int64)

    def _gather(self, entries: list[_Entry], params: list[torch.Tensor], fsdp: bool) -> tuple[np.ndarray, list[bool]]:
        """The sampled values of every gradient, float64, concatenated (NaN where absent).

        Gradients that are contiguous views of one storage (meshgrad's buffers, a Megatron
        DDP's grad buffer) are sampled with one ``index_select`` per storage; the plan is
        kept while the gradient tensors stay the same objects.
        """
        grads = [_grad_tensor(p, fsdp) for p in params]
        ident = tuple(0 if g is None else id(g) for g in grads)
        if self._plan is None or self._plan[0] != ident:
            self._plan = self._sampling_plan(entries, grads, ident)
        _, ops, order, present = self._plan
        total = sum(e.positions.size for e in entries)
        if not ops:
            return np.full(total, np.nan), present
        pieces = [base.index_select(0, index).to(torch.float64) for base, index in ops]
        values = torch.cat(pieces).cpu().numpy() if len(pieces) > 1 else pieces[0].cpu().numpy()
        out = np.full(total, np.nan)
        out[order] = values
        return out, present

    def _sampling_plan(
        self, entries: list[_Entry], grads: list[torch.Tensor | None], ident: tuple[int, ...]
    ) -> tuple[tuple[int, ...], list[Any], np.ndarray, list[bool]]:
        groups: dict[Any, tuple[torch.Tensor, list[np.ndarray], list[np.ndarray]]] = {}
        ops: list[Any] = []
        order: list[np.ndarray] = []
        present: list[bool] = []
        start = 0
        for entry, grad in zip(entries, grads):
            n = entry.positions.size
            slots = np.arange(start, start + n)
            start += n
            ok = grad is not None and grad.numel() == entry.info["numel"]
            present.append(ok)
            if not ok:
                continue
            try:
                key = (grad.untyped_storage().data_ptr(), grad.dtype, grad.device) if grad.is_contiguous() else None
            except (RuntimeError, NotImplementedError):
                key = None
            if key is None:
                ops.append((grad.reshape(-1), torch.from_numpy(entry.positions).to(grad.device)))
                order.append(slots)
                continue
            if key not in groups:
                base = torch.empty(0, dtype=grad.dtype, device=grad.device).set_(grad.untyped_storage())
                groups[key] = (base, [], [])
            groups[key][1].append(entry.positions + grad.storage_offset())
            groups[key][2].append(slots)
        for base, index, slots in groups.values():
            ops.append((base, torch.from_numpy(np.concatenate(index)).to(base.device)))
            order.append(np.concatenate(slots))
        flat = np.concatenate(order) if order else np.zeros(0, np.int64)
        return ident, ops, flat, present

    @staticmethod
    def _routers(routers: list[tuple[Any, nn.Module]]) -> list[dict[str, np.ndarray | None]]:
        out = []
        for _, module in routers:
            values: dict[str, np.ndarray | None] = {}
            for field in ROUTER_FIELDS:
                buffer = getattr(module, field, None)
                values[field] = (
                    buffer.detach().to(torch.float64).cpu().numpy().copy() if isinstance(buffer, torch.Tensor) else None
                )
            out.append(values)
        return out

    def _write(self, arrays: dict[str, np.ndarray], path: str) -> None:
        try:
            os.makedirs(self.directory, exist_ok=True)
            tmp = path + ".tmp.npz"
            np.savez(tmp, **arrays)
            os.replace(tmp, path)
        except Exception as err:  # reported by flush()
            self._error = OSError(f"audit: could not write {path}: {type(err).__name__}: {err}")


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
        recorder.flush()


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
