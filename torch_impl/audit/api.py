"""The two ways to record: a context manager and a wrapper of a finalize function."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any

from torch_impl.audit.recorder import FinalizeFn, Recorder


@contextlib.contextmanager
def record(
    directory: str | os.PathLike[str],
    sample: int = 64,
    finalize: FinalizeFn | None = None,
    start_step: int = 0,
    model: Any = None,
) -> Iterator[Recorder]:
    """Context manager giving a :class:`Recorder`: call it like the finalize function.

    Args:
      directory: where every rank writes its file.
      sample: positions sampled per gradient.
      finalize: the function to audit (default: :func:`torch_impl.finalize_model_grads`).
      start_step: the step index of the first call.
      model: the chunks, when a Megatron DDP among them has ``overlap_grad_reduce=True``:
        its bucket groups' ``start_grad_sync`` is wrapped from here to the end of the
        context, so that the first step is recorded too (see :meth:`Recorder.watch`).

    Yields:
      The recorder (``recorder(model, num_tokens, pg_collection, force_all_reduce)``).

    Raises:
      FinalizeTypeError: an overlapping DDP in ``model`` whose structure is unknown.
    """
    recorder = Recorder(directory, sample=sample, finalize=finalize, start_step=start_step)
    try:
        if model is not None:
            recorder.watch(model)
        yield recorder
    finally:
        recorder.close()


def audited(
    fn: FinalizeFn, directory: str | os.PathLike[str], sample: int = 64, start_step: int = 0, model: Any = None
) -> FinalizeFn:
    """``fn`` with every call recorded into ``directory`` (one file per rank per call).

    Args:
      fn: a function with Megatron's finalize signature.
      directory: where the files go.
      sample: positions sampled per gradient.
      start_step: the step index of the first call.
      model: as for :func:`record`; the wrappers stay until ``fn.recorder.close()``.

    Returns:
      A function with the same signature; its ``recorder`` attribute is the
      :class:`Recorder` (call ``fn.recorder.flush()`` before reading the last file).
    """
    recorder = Recorder(directory, sample=sample, finalize=fn, start_step=start_step)
    if model is not None:
        recorder.watch(model)

    @functools.wraps(fn)
    def wrapper(model: Any, num_tokens: Any = None, pg_collection: Any = None, force_all_reduce: bool | None = False) -> Any:
        return recorder(model, num_tokens=num_tokens, pg_collection=pg_collection, force_all_reduce=force_all_reduce)

    wrapper.recorder = recorder  # type: ignore[attr-defined]
    return wrapper
