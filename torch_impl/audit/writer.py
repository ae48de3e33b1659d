"""How a recorder's files are written: once per plan and per step, inline or in a thread."""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from torch_impl.audit.fileformat import _save, plan_file_name
from torch_impl.audit.plan import _Plan
from torch_impl.audit.step import step_arrays


class StepWriter:
    """Writes a recorder's files: each plan file once, a step file per call, in one
    background thread (or inline); errors of the thread come back at :meth:`flush`."""

    def __init__(self) -> None:
        self._written: set[str] = set()
        self._made_dir = False
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: list[concurrent.futures.Future[None]] = []

    def plan_path(self, directory: str, plan: _Plan) -> str | None:
        """The plan file to write with this step's file: None when it is written already.

        Args:
          directory: where the files go.
          plan: the step's plan.

        Returns:
          The path (the plan counts as written from now on), or None.
        """
        if plan.digest in self._written:
            return None
        self._written.add(plan.digest)
        return os.path.join(directory, plan_file_name(plan.rank, plan.digest))

    def submit(self, write: Callable[..., None], background: bool, *args: Any) -> None:
        """Run ``write(*args)``, in the writer thread when ``background``, else now."""
        if not background:
            write(*args)
            return
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="audit-writer", initializer=_background_priority)
        self._pending = [f for f in self._pending if not f.done() or f.exception() is not None]
        self._pending.append(self._executor.submit(write, *args))

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

    def write(self, directory: str, values: tuple[Any, ...], path: str, plan: dict[str, np.ndarray],
              plan_path: str | None) -> None:
        """Write the plan file (first time only) and the step file, each atomically.

        Args:
          directory: where the files go (created at the first write).
          values: what :func:`torch_impl.audit.step.step_values` returned: tensors the
            recorder made (nothing else holds them).
          path: the step file.
          plan, plan_path: the plan file's arrays and path (None: written already).
        """
        try:
            arrays = step_arrays(values)
            if not self._made_dir:
                os.makedirs(directory, exist_ok=True)
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
