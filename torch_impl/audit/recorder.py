"""The recorder: wraps a finalize function; every call records one step on every rank."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import operator
import os
import threading
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from meshgrad.config import FinalizeConfig
from torch_impl.audit.fileformat import FORMAT_VERSION, _save, file_name, plan_file_name
from torch_impl.audit.internals import CONFIG_SIZES, FLAG_ATTRS, finalize_model_grads, model_state, resolve_layout
from torch_impl.audit.layout import _config_dict, _ddp_chunks, _layout
from torch_impl.audit.plan import _Plan, _same
from torch_impl.audit.sampling import (
    _concat64, _Entry, _host, _numpy, _router_values, _sampler, _scalar, sample_key, sample_positions,
)

#: Parameter flags recorded (docs/semantics.md): those discovery reads.
PARAM_FLAGS = FLAG_ATTRS

FinalizeFn = Callable[..., Any]


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
      run_id: the recording's id, written into every step file (the replay refuses a
        step whose files carry different ids); default: rank 0's random id, broadcast
        over the default process group at the first call.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        sample: int = 64,
        finalize: FinalizeFn | None = None,
        start_step: int = 0,
        background: bool = True,
        run_id: str | None = None,
    ) -> None:
        if isinstance(sample, bool) or not isinstance(sample, int) or sample < 1:
            raise ValueError(f"audit: sample must be an int >= 1, got {sample!r}")
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"audit: start_step must be an int >= 0, got {start_step!r}")
        if finalize is None:
            finalize = finalize_model_grads
        if not callable(finalize):
            raise TypeError(f"audit: finalize must be callable, got {type(finalize).__name__}")
        if run_id is not None and not isinstance(run_id, str):
            raise TypeError(f"audit: run_id must be a str, got {type(run_id).__name__}")
        self.directory = os.fspath(directory)
        self.run_id = run_id
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
        if self.run_id is None:
            self.run_id = agree_run_id()
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
            "run": self.run_id,
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


def agree_run_id() -> str:
    """A new recording's id, the same on every rank: rank 0's random id, broadcast over
    the default process group (every rank calls the recorder at its first step)."""
    run_id = uuid.uuid4().hex[:16]
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [run_id if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        run_id = str(box[0])
    return run_id


def _background_priority() -> None:
    """Run the writer thread at the lowest CPU priority (Linux: per thread), so that it
    uses idle time rather than delaying the training ranks."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not allowed: the default priority
        pass


