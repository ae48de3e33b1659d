"""The recorder's options, checked before anything is recorded."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshgrad.errors import FinalizeInputError, FinalizeTypeError
from torch_impl.audit.internals import finalize_model_grads

FinalizeFn = Callable[..., Any]


def check_options(sample: Any, start_step: Any, finalize: Any, run_id: Any) -> FinalizeFn:
    """Check the recorder's arguments.

    Args:
      sample: positions sampled per gradient (an int >= 1).
      start_step: step index of the first call (an int >= 0).
      finalize: the function to wrap, or None for :func:`torch_impl.finalize_model_grads`.
      run_id: the recording's id (a str), or None.

    Returns:
      The function to wrap.

    Raises:
      FinalizeInputError: ``sample`` or ``start_step`` out of range or not an int.
      FinalizeTypeError: ``finalize`` not callable, ``run_id`` not a str.
    """
    if isinstance(sample, bool) or not isinstance(sample, int) or sample < 1:
        raise FinalizeInputError(f"audit: sample must be an int >= 1, got {sample!r}")
    if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
        raise FinalizeInputError(f"audit: start_step must be an int >= 0, got {start_step!r}")
    if finalize is None:
        finalize = finalize_model_grads
    if not callable(finalize):
        raise FinalizeTypeError(f"audit: finalize must be callable, got {type(finalize).__name__}")
    if run_id is not None and not isinstance(run_id, str):
        raise FinalizeTypeError(f"audit: run_id must be a str, got {type(run_id).__name__}")
    return finalize
