"""The recorder: wraps a finalize function; every call records one step on every rank.

Its parts: :mod:`.options` (argument checks), :mod:`.planner` (how samples are chosen),
:mod:`.step` (what is read and written per step), :mod:`.writer` (writing the files).
"""

from __future__ import annotations

import os
import uuid
import warnings
from typing import Any

import numpy as np
import torch
from torch import nn

from torch_impl.audit.fileformat import file_name
from torch_impl.audit.internals import model_state, resolve_layout
from torch_impl.audit.options import FinalizeFn, check_options
from torch_impl.audit.overlap import OverlapTaps, unwatched_reason
from torch_impl.audit.plan import _Plan
from torch_impl.audit.planner import PARAM_FLAGS, Planner
from torch_impl.audit.sampling import _Entry, _router_values
from torch_impl.audit.step import read_after, read_before, step_meta, step_values
from torch_impl.audit.writer import StepWriter

__all__ = ["PARAM_FLAGS", "FinalizeFn", "Recorder", "agree_run_id"]


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
        finalize = check_options(sample, start_step, finalize, run_id)
        self.directory = os.fspath(directory)
        self.run_id = run_id
        self.sample = sample
        self.finalize = finalize
        self.step = start_step
        self.files: list[str] = []
        self.background = background
        self._planner = Planner()
        self._writer = StepWriter()
        self._overlap = OverlapTaps(lambda: self._planner.plan)

    @property
    def plans_made(self) -> int:
        """How many plans were made (one per model, layout or wrapped function seen)."""
        return self._planner.made

    @plans_made.setter
    def plans_made(self, value: int) -> None:
        self._planner.made = value

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
        unwatched = self._overlap.watch(chunks)
        if self.run_id is None:
            self.run_id = agree_run_id()
        state = model_state(chunks)
        calls = state.stats.calls
        plan = self._planner.plan
        fields, buffers = ([], []) if plan is None else _router_values(plan.routers)
        if plan is None or not plan.fits(chunks, pg_collection, fields):
            plan = self._current_plan(chunks, pg_collection, resolve_layout(chunks, pg_collection))
            fields, buffers = _router_values(plan.routers)
        before = read_before(plan, fields, buffers, num_tokens)
        started, lost = self._overlap.merge(plan, before.values)  # bucket groups that reduced in backward
        try:
            result = self.finalize(chunks, num_tokens=num_tokens, pg_collection=pg_collection,
                                   force_all_reduce=force_all_reduce)
        finally:
            self._overlap.arm()
        checked = self._current_plan(chunks, pg_collection, resolve_layout(chunks, pg_collection, (state, calls)), check=False)
        if checked is not plan:
            if not checked.reads_like(plan):
                return self._skip(result, "the model changed in a way only the call could see "
                                          "(parameters or routers added or removed)")
            plan = checked
        if unwatched or lost:
            return self._skip(result, lost or unwatched_reason(unwatched))
        after = read_after(plan, num_tokens, before.tokens)
        meta = step_meta(self.step, plan, self.run_id, num_tokens, after.tokens, force_all_reduce)
        if started:
            meta["before_at_grad_sync"] = started
        if after.fields != plan.router_fields:
            meta["router_fields_after"] = after.fields
        self._submit(plan, step_values(meta, before, after))
        return result

    def watch(self, model: Any) -> None:
        """Read ``model``'s overlapping Megatron DDPs' gradients as their buckets start to
        reduce, until :meth:`close` (call it before the first recorded backward). Raises
        FinalizeTypeError for a DDP with ``overlap_grad_reduce=True`` of unknown structure."""
        self._overlap.watch([model] if isinstance(model, nn.Module) else list(model))

    def _skip(self, result: Any, why: str) -> Any:
        """Leave this step unrecorded (a warning says why) and return the call's result."""
        warnings.warn(f"audit: step {self.step} not recorded: {why}; the next step is recorded",
                      RuntimeWarning, stacklevel=3)
        self.step += 1
        return result

    def _current_plan(self, chunks: list[Any], source: Any, facts: tuple[Any, Any, Any, Any], check: bool = True) -> _Plan:
        """The plan for these facts (see :meth:`Planner.current`)."""
        return self._planner.current(chunks, source, facts, self.finalize, self.sample, check)

    def _entry(self, spec: Any, param: torch.Tensor) -> _Entry:
        """One parameter's static facts and sampled positions (see :meth:`Planner.entry`)."""
        return self._planner.entry(spec, param, self.sample)

    def _submit(self, plan: _Plan, values: tuple[Any, ...]) -> None:
        """Write this step's file (and the plan's, the first time), in the background
        thread unless ``background`` is off."""
        path = os.path.join(self.directory, file_name(self.step, plan.rank))
        plan_path = self._writer.plan_path(self.directory, plan)
        self.files.append(path)
        self.step += 1
        self._writer.submit(self._write, self.background, values, path, plan.arrays, plan_path)

    def _write(self, values: tuple[Any, ...], path: str, plan: dict[str, np.ndarray], plan_path: str | None) -> None:
        """Write the plan file (first time only) and the step file (see :meth:`StepWriter.write`)."""
        self._writer.write(self.directory, values, path, plan, plan_path)

    def flush(self) -> None:
        """Wait until every file is written (re-raises the first error of the writer)."""
        self._writer.flush()

    def close(self) -> None:
        """Remove the wrappers of overlapping DDPs' bucket groups, flush and stop the writer thread."""
        self._overlap.close()
        self._writer.close()

    def wrap(self, fn: FinalizeFn) -> FinalizeFn:
        """A recorder of ``fn`` with this one's directory, sample and step counter."""
        self.finalize = fn
        return self


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
