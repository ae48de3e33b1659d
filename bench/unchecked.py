"""torch_impl's finalize with its steady check skipped, for the benchmark only
(:class:`Unchecked`): what the check costs a step, timed beside the real finalize.

A steady call of ``finalize_model_grads`` first asks whether it replays the last call of
its kind (``torch_impl.call.replay.replayed``: the probes of everything the read stage read,
the plan's record, the kind of ``num_tokens``). Here, once that answer was yes for a model,
it is handed back on every later call without reading anything again. Everything after it
runs as in the real call: the status round (the same words, the token count carried), the
DDP's own sync, the plan's actions and the scale, so the gradients are the same. It is not a
safe finalize: a model changed between calls would go unseen.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class Unchecked:
    """``finalize_model_grads`` whose steady check is answered from the first yes per model.

    ``calls`` counts :meth:`finalize`'s calls, ``skipped`` those answered without the check.
    """

    def __init__(self) -> None:
        self.calls = 0
        self.skipped = 0
        self._kept: dict[int, Any] = {}  # id of the model's first chunk -> the replay the check gave
        self._active = False

    @contextmanager
    def installed(self) -> Iterator[None]:
        """The pipeline's ``replayed`` answered through :meth:`_replayed` (bench only; restored
        on exit). Other callers of the pipeline meanwhile get the real check."""
        from torch_impl.call import pipeline

        original = pipeline.replayed

        def replayed(model: Any, source: Any, request: Any) -> Any:
            if not self._active:
                return original(model, source, request)
            key = id(model[0] if isinstance(model, (list, tuple)) else model)
            kept = self._kept.get(key)
            if kept is not None:
                self.skipped += 1
                return kept
            kept = original(model, source, request)
            if kept is not None:
                self._kept[key] = kept
            return kept

        pipeline.replayed = replayed
        try:
            yield
        finally:
            pipeline.replayed = original

    def reset(self) -> None:
        """Forget every kept answer and zero the counts (a new set of models)."""
        self._kept.clear()
        self.calls = self.skipped = 0

    def finalize(self, model: list[Any], num_tokens: Any = None) -> None:
        """``torch_impl.finalize_model_grads(model, num_tokens=num_tokens)`` with the check
        skipped once it has said yes for ``model`` (inside :meth:`installed`)."""
        import torch_impl

        self.calls += 1
        self._active = True
        try:
            torch_impl.finalize_model_grads(model, num_tokens=num_tokens)
        finally:
            self._active = False


__all__ = ["Unchecked"]
