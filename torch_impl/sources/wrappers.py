"""The user's objects read through their wrappers: the ``.module`` chain of a model chunk
(Megatron's DDP, Float16Module, ...) and ``torch.compile``'s ``OptimizedModule``.

* :func:`attr_or` / :func:`has_attr`: attribute reads that skip ``nn.Module``'s slow miss.
* :func:`unwrap` / :func:`find_attr`: down the ``.module`` chain to the model, or to the
  first object holding an attribute (a ``torch.compile`` wrapper on the way read through).
* :func:`uncompiled`: the module a ``torch.compile(module)`` wrapper compiled, so that
  discovery names parameters as the uncompiled model does (no ``_orig_mod.`` prefix).
* :func:`uncompiled_name`: the same for a name read from above such a wrapper (a Megatron
  DDP wrapping a compiled module names its parameters ``_orig_mod.*``).
* :class:`ReadRecorder`: an :func:`attr_or` that writes each read down as a probe
  (:class:`~torch_impl.call.probes.Probes`), for the walks that take a ``read``.
* :func:`param_name`: a parameter's name as ``named_parameters()`` gives it, from its
  module's prefix and its key (discovery makes one only for the parameters it keeps).
* :func:`eager_under_compile`: the public entry points' decorator (it also prefixes a
  ValueError / TypeError with this rank). Called while
  dynamo traces (``torch.compile`` of a training step), the call is a graph break and runs
  eagerly, untraced (``torch.compiler.disable``); called eagerly, it is a plain call. It
  never imports ``torch._dynamo`` itself (about a second and a half): tracing has
  imported it already.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

import torch
from torch import nn

from torch_impl.call.probes import Probes
from torch_impl.run.errors import raise_ranked

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


class ReadRecorder:
    """:func:`attr_or` that also writes each read down as a probe: the same read again,
    the same object expected (:meth:`~torch_impl.call.probes.Probes.read`). Given as
    ``read`` to the walks down a ``.module`` chain, it records what they read; a walk
    that gives the same result again reads the same objects while every probe holds.

    ``compiled`` turns True when a chunk or a ``module`` read is a ``torch.compile``
    wrapper: the walks read through it (:func:`uncompiled`) without a probe.

    Args:
      probes: where the reads are written.
    """

    def __init__(self, probes: Probes) -> None:
        self.probes = probes
        self.seen: set[tuple[int, str]] = set()  # (id, name): each object is held by its probes
        self.compiled = False

    def start(self, chunk: Any) -> None:
        """Note a walk's first object (a wrapper there is read through)."""
        self.compiled |= uncompiled(chunk) is not chunk

    def __call__(self, obj: Any, name: str, default: Any = None) -> Any:
        value = attr_or(obj, name, NO_ATTR)
        if (id(obj), name) not in self.seen:
            self.seen.add((id(obj), name))
            # A plain attribute (the instance's or its class's) is read again by getattr itself,
            # which gives what attr_or gives in every case; a module's store or a miss by attr_or.
            plain = value is not NO_ATTR and (name in getattr(obj, "__dict__", ()) or hasattr(type(obj), name))
            self.probes.read(partial(getattr if plain else attr_or, obj, name, NO_ATTR), value)
        if name == "module" and value is not NO_ATTR:
            self.compiled |= uncompiled(value) is not value
        return default if value is NO_ATTR else value


def uncompiled_name(name: str) -> str:
    """A parameter name as the uncompiled model gives it: every ``_orig_mod`` component
    (a ``torch.compile`` wrapper on the way) dropped (``module._orig_mod.w`` -> ``module.w``)."""
    return name if "_orig_mod" not in name else ".".join(p for p in name.split(".") if p != "_orig_mod")


def eager_under_compile(fn: F) -> F:
    """The public entry points' one wrapper: ``fn`` run eagerly when called from code that
    dynamo traces (a graph break around the call, nothing of ``fn`` traced), a plain call
    otherwise; a ValueError / TypeError raised below it gets this rank's prefix when it
    lacks one (:func:`~torch_impl.run.errors.raise_ranked`).

    Finalize reads Python objects (parameter ``__dict__``s, process groups, a DeviceMesh),
    keeps state on the model and launches collectives: none of it belongs in a graph. One
    wrapper, not two stacked: the entry points run it on every step.
    """

    @functools.wraps(fn)
    def entry(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return torch.compiler.disable(entry)(*args, **kwargs)
        try:
            return fn(*args, **kwargs)
        except (ValueError, TypeError) as err:
            raise_ranked(err)
            raise

    return entry  # type: ignore[return-value]


_MODULE_GETATTR = nn.Module.__getattr__
#: The default that tells a missing attribute from one set to None (:func:`attr_or`).
NO_ATTR = object()


def attr_or(obj: Any, name: str, default: Any = None) -> Any:
    """``getattr(obj, name, default)``. For an ``nn.Module`` that keeps torch's
    ``__getattr__``, a name that is neither an instance nor a class attribute is looked up
    in its parameters, buffers and submodules, in torch's order, without calling that
    ``__getattr__`` (which formats an error message for each miss; the wrapper chains of
    a model are walked every step)."""
    cls = type(obj)
    if getattr(cls, "__getattr__", None) is _MODULE_GETATTR:
        state = obj.__dict__
        if name not in state and not hasattr(cls, name):
            store = state["_parameters"]  # torch's order: parameters, buffers, submodules
            if name in store:
                return store[name]
            store = state["_buffers"]
            if name in store:
                return store[name]
            return state["_modules"].get(name, default)
    return getattr(obj, name, default)


def has_attr(obj: Any, name: str) -> bool:
    """``hasattr(obj, name)``, a miss answered as :func:`attr_or` does."""
    return attr_or(obj, name, NO_ATTR) is not NO_ATTR


def unwrap(module: Any, attr: str = "pre_process", read: Callable[..., Any] = attr_or) -> Any:
    """Follow ``.module`` wrappers (DDP, Float16Module, ...) down to the model; a
    ``torch.compile`` wrapper on the way is read through (:func:`uncompiled`).

    Args:
      module: a model chunk, possibly wrapped.
      attr: stop at the first object that has this attribute.
      read: reads an attribute as :func:`attr_or` does (a :class:`ReadRecorder`).

    Returns:
      The first object in the ``.module`` chain with ``attr``, else the innermost one.
    """
    module = uncompiled(module)
    for _ in range(64):
        if read(module, attr, NO_ATTR) is not NO_ATTR:
            return module
        inner = read(module, "module", NO_ATTR)
        if inner is NO_ATTR:
            return module
        module = uncompiled(inner)
    return module


def find_attr(module: Any, attr: str, read: Callable[..., Any] = attr_or) -> Any:
    """The first ``attr`` found along the ``.module`` chain of ``module`` (None if absent;
    ``read`` as in :func:`unwrap`)."""
    for _ in range(64):
        module = uncompiled(module)
        value = read(module, attr, NO_ATTR)
        if value is not NO_ATTR:
            return value
        inner = read(module, "module", NO_ATTR)
        if inner is NO_ATTR:
            return None
        module = inner
    return None


def param_name(prefix: str, key: str) -> str:
    """A parameter's name as ``named_parameters()`` gives it."""
    return f"{prefix}.{key}" if prefix else key


__all__ = [
    "NO_ATTR", "attr_or", "eager_under_compile", "find_attr", "has_attr", "param_name",
    "uncompiled", "uncompiled_name", "unwrap",
]
