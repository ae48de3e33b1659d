"""``torch.compile`` seen from meshgrad: compiled modules read through, entry points run
eagerly inside a compiled step.

* :func:`uncompiled`: the module a ``torch.compile(module)`` wrapper (``OptimizedModule``)
  compiled, so that discovery names parameters as the uncompiled model does (no
  ``_orig_mod.`` prefix) and reads its attributes directly.
* :func:`uncompiled_name`: the same for a name read from above such a wrapper (a Megatron
  DDP wrapping a compiled module names its parameters ``_orig_mod.*``).
* :func:`eager_under_compile`: a decorator for the public entry points. Called while
  dynamo traces (``torch.compile`` of a training step), the call is a graph break and runs
  eagerly, untraced (``torch.compiler.disable``); called eagerly, it is a plain call. It
  never imports ``torch._dynamo`` itself (about a second and a half): tracing has
  imported it already.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def uncompiled(module: Any) -> Any:
    """The module a ``torch.compile(module)`` wrapper (``OptimizedModule``, nested too)
    compiled, else ``module`` itself.

    The wrapper holds that module as ``_orig_mod`` (its parameters are the same objects,
    named with an ``_orig_mod.`` prefix) and forwards attribute reads to it. No wrapper
    exists while ``torch._dynamo`` was never imported.
    """
    if "_orig_mod" not in getattr(module, "_modules", ()):  # no wrapper here: the common case, one dict look-up
        return module
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    wrapper = getattr(eval_frame, "OptimizedModule", None)
    if wrapper is None:
        return module
    for _ in range(64):
        if not isinstance(module, wrapper):
            break
        module = module._orig_mod
    return module


def uncompiled_name(name: str) -> str:
    """A parameter name as the uncompiled model gives it: every ``_orig_mod`` component
    (a ``torch.compile`` wrapper on the way) dropped (``module._orig_mod.w`` -> ``module.w``)."""
    return name if "_orig_mod" not in name else ".".join(p for p in name.split(".") if p != "_orig_mod")


def eager_under_compile(fn: F) -> F:
    """``fn`` run eagerly when called from code that dynamo traces (a graph break around
    the call, nothing of ``fn`` traced), a plain call otherwise.

    Finalize reads Python objects (parameter ``__dict__``s, process groups, a DeviceMesh),
    keeps state on the model and launches collectives: none of it belongs in a graph.
    """

    @functools.wraps(fn)
    def entry(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return torch.compiler.disable(fn)(*args, **kwargs)
        return fn(*args, **kwargs)

    return entry  # type: ignore[return-value]


__all__ = ["eager_under_compile", "uncompiled", "uncompiled_name"]
