"""jax_impl: execute a meshgrad FinalizePlan inside ``jax.shard_map`` (the numerical oracle).

Submodules (mirroring torch_impl's file names): ``mesh`` (dense / expert Mesh views, fake
host devices), ``groups`` (named groups as collectives over mesh axes), ``discover``
(ParamSpecs from spec trees / flax.nnx metadata), ``checks`` (input checks before
anything runs), ``execute`` (one pure executor per action type, in one table), ``stacked`` (the
executors on stacked values, one ``shard_map`` per mesh view),
``finalize`` (the one pure, jittable entry: pytrees in and out, local or stacked),
``transform`` (the optax GradientTransformation). Errors are :mod:`meshgrad.errors` types.

Names are imported lazily so that ``jax_impl.mesh.ensure_host_devices`` can run before
jax itself is imported; ``dir(jax_impl)`` lists them (``__all__``) without importing jax.
``jax_impl.finalize`` is the submodule, callable as its function
(``jax_impl.finalize(grads, ...)`` is ``jax_impl.finalize.finalize(grads, ...)``).
Gradients are any pytree (leaves named by their dotted paths) or a dict keyed by
``(chunk, name)`` (:attr:`meshgrad.ParamSpec.key`). See docs/jax.md.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ensure_host_devices": "jax_impl.mesh",
    "make_meshes": "jax_impl.mesh",
    "MeshViews": "jax_impl.mesh",
    "specs_from_tree": "jax_impl.discover",
    "specs_from_nnx": "jax_impl.discover",
    "router_specs": "jax_impl.discover",
    "execute_local": "jax_impl.execute",
    "execute_stacked": "jax_impl.stacked",
    "Collectives": "jax_impl.groups",
    "finalize_stacked": "jax_impl.finalize",
    "finalize_gradients": "jax_impl.transform",
    "FinalizeState": "jax_impl.transform",
    "router_buffers": "jax_impl.transform",
    "initial_router_buffers": "jax_impl.transform",
    "tree_keys": "jax_impl.discover",
    "check_keys": "jax_impl.checks",
}

#: Submodules, listed by ``dir(jax_impl)`` too.
SUBMODULES = ("checks", "discover", "execute", "finalize", "groups", "mesh", "stacked", "transform")

__all__ = sorted(_EXPORTS)


def __dir__() -> list[str]:
    """The public names (``__all__``) and the submodules, without importing jax."""
    return sorted(set(__all__) | set(SUBMODULES))


def __getattr__(name: str) -> Any:
    """Import a public name (or a submodule) on first use."""
    if name in SUBMODULES:
        return importlib.import_module(f"jax_impl.{name}")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jax_impl' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
