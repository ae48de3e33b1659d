"""ParamSpecs and RouterSpecs from explicit spec trees or flax.nnx Variable metadata, and
the map between a user's gradient pytree and the plan's ``(chunk, name)`` keys.

Flags use ParamSpec's field names (``sequence_parallel``, ``expert``, ``role``, ...);
Megatron's spellings ``allreduce`` (False = expert) and ``requires_grad`` (= has_grad) are
accepted too. Nested trees are flattened with "." between path parts, like torch names.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from meshgrad.errors import FinalizeInputError
from meshgrad.params import ParamKey, ParamSpec, RouterSpec

_FLAGS = frozenset(f.name for f in dataclasses.fields(ParamSpec) if f.init) - {"name", "chunk", "shape", "dtype"}
_ALIASES = {"requires_grad": "has_grad"}


def flatten(tree: Mapping[Any, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested mappings into {"a.b.c": leaf} (mappings are the only inner nodes)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        name = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            out.update(flatten(v, name))
        else:
            out[name] = v
    return out


def keyed(tree: Mapping[Any, Any], chunk: int = 0) -> dict[ParamKey, Any]:
    """{(chunk, "a.b"): leaf} from a nested tree of arrays (e.g. one chunk's gradients)."""
    return {(chunk, name): v for name, v in flatten(tree).items()}


def _dtype_name(value: Any) -> str:
    return np.dtype(getattr(value, "dtype", np.float32)).name


def flags_to_kwargs(flags: Mapping[str, Any], where: str) -> dict[str, Any]:
    """ParamSpec keyword arguments from metadata flags; unknown keys are ignored.

    Raises:
      FinalizeInputError: ``allreduce`` and ``expert`` contradict each other.
    """
    out: dict[str, Any] = {}
    for k, v in flags.items():
        k = _ALIASES.get(k, k)
        if k in _FLAGS:
            out[k] = v
    if "allreduce" in flags:
        expert = not bool(flags["allreduce"])
        if "expert" in out and bool(out["expert"]) != expert:
            raise FinalizeInputError(f"{where}: allreduce={flags['allreduce']} contradicts expert={out['expert']}")
        out["expert"] = expert
    return out


def specs_from_tree(
    arrays: Mapping[Any, Any],
    flags: Mapping[Any, Any] | None = None,
    *,
    chunk: int = 0,
    dtype: str | None = None,
) -> list[ParamSpec]:
    """ParamSpecs of one chunk from a (nested) tree of arrays and a matching flag tree.

    Args:
      arrays: name -> array (or ShapeDtypeStruct); gives shape and dtype.
      flags: name -> {flag: value} (a ParamSpec, or a nested tree whose leaves are
        flag mappings, keyed like ``arrays``); missing names get default flags.
      chunk: the chunk index.
      dtype: gradient dtype name overriding the arrays' (e.g. main_grad in float32).

    Returns:
      One ParamSpec per array, in the arrays' order.

    Raises:
      FinalizeInputError: a flag entry names no array.
    """
    leaves = flatten(arrays)
    flat_flags = _flatten_flags(flags or {})
    unknown = set(flat_flags) - set(leaves)
    if unknown:
        raise FinalizeInputError(f"flags given for unknown parameter(s) {sorted(unknown)}")
    specs = []
    for name, value in leaves.items():
        entry = flat_flags.get(name, {})
        if isinstance(entry, ParamSpec):
            entry = {f: getattr(entry, f) for f in _FLAGS}
        specs.append(
            ParamSpec(
                name=name,
                chunk=chunk,
                shape=tuple(np.shape(value)) if not hasattr(value, "shape") else tuple(value.shape),
                dtype=dtype or _dtype_name(value),
                **flags_to_kwargs(entry, f"parameter {name!r}"),
            )
        )
    return specs


def _flatten_flags(tree: Mapping[Any, Any], prefix: str = "") -> dict[str, Any]:
    """Like :func:`flatten`, but a mapping whose keys are all flag names is a leaf."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        name = f"{prefix}.{k}" if prefix else str(k)
        is_flags = isinstance(v, Mapping) and all(
            _ALIASES.get(f, f) in _FLAGS or f == "allreduce" for f in v
        )
        if isinstance(v, Mapping) and v and not is_flags:
            out.update(_flatten_flags(v, name))
        else:
            out[name] = v
    return out


def specs_from_nnx(module: Any, *, chunk: int = 0, dtype: str | None = None, variable_type: Any = None) -> list[ParamSpec]:
    """ParamSpecs from a flax.nnx Module (or State): one per Variable of ``variable_type``.

    A Variable's metadata keys named like ParamSpec flags (``nnx.Param(w,
    sequence_parallel=True)``) set those flags.

    Args:
      module: an ``nnx.Module`` or an ``nnx.State``.
      chunk: the chunk index.
      dtype: gradient dtype name overriding the values'.
      variable_type: Variable filter (default ``nnx.Param``).

    Returns:
      One ParamSpec per Variable, in nnx's (sorted path) order.
    """
    from flax import nnx

    state = module if isinstance(module, nnx.State) else nnx.state(module, variable_type or nnx.Param)
    specs = []
    for path, var in nnx.to_flat_state(state):
        name = ".".join(str(p) for p in path)
        value = var.get_value() if hasattr(var, "get_value") else var.value
        meta = var.get_metadata() if hasattr(var, "get_metadata") else {}
        specs.append(
            ParamSpec(
                name=name,
                chunk=chunk,
                shape=tuple(value.shape),
                dtype=dtype or _dtype_name(value),
                **flags_to_kwargs(meta, f"nnx variable {name!r}"),
            )
        )
    return specs


def router_specs(
    states: Mapping[str, Mapping[str, Any]],
    *,
    chunk: int = 0,
    training: bool = True,
    frozen_expert_bias: Iterable[str] = (),
    has_aux_loss_tracker: bool = True,
) -> list[RouterSpec]:
    """RouterSpecs from router buffers: name -> {field: array}.

    ``has_expert_bias`` / ``has_qb_beta`` follow the fields present; ``num_experts`` is
    the length of ``expert_bias`` (or ``qb_beta``).

    Raises:
      FinalizeInputError: a router has neither ``expert_bias`` nor ``qb_beta``.
    """
    frozen = set(frozen_expert_bias)
    out = []
    for name, fields in states.items():
        ref = fields.get("expert_bias", fields.get("qb_beta"))
        if ref is None:
            raise FinalizeInputError(f"router {name!r} has neither expert_bias nor qb_beta")
        out.append(
            RouterSpec(
                name=name,
                chunk=chunk,
                num_experts=int(np.shape(ref)[-1]),
                training=training,
                has_expert_bias="expert_bias" in fields,
                frozen_expert_bias=name in frozen,
                has_qb_beta="qb_beta" in fields,
                qb_accum_present=fields.get("qb_beta_accum") is not None,
                has_aux_loss_tracker=has_aux_loss_tracker,
            )
        )
    return out


# --------------------------------------------------------------------------- pytrees


def _path_part(entry: Any) -> str:
    """One pytree path entry as a name part: dict key, attribute name or index."""
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def path_name(path: Sequence[Any]) -> str:
    """A pytree path as a dotted name, as torch's ``named_parameters()`` and
    ``specs_from_nnx`` spell it (an nnx Variable's trailing ``.value`` is dropped)."""
    parts = [_path_part(p) for p in path]
    if len(parts) > 1 and isinstance(path[-1], jax.tree_util.GetAttrKey) and parts[-1] == "value":
        parts = parts[:-1]
    return ".".join(parts)


def _is_spec(x: Any) -> bool:
    return isinstance(x, ParamSpec)


@dataclasses.dataclass(frozen=True)
class TreeKeys:
    """How a user's gradient pytree maps to ``(chunk, name)`` keys and back.

    Args:
      treedef: the tree's structure.
      keys: per leaf, in leaf order, its key: chunk 0 and the dotted path, or (with
        ``chunked``) the top-level list index and the path below it.
    """

    treedef: Any
    keys: tuple[ParamKey, ...]

    def keyed(self, tree: Any) -> dict[ParamKey, Any]:
        """{key: leaf} of ``tree`` (which has this structure)."""
        return dict(zip(self.keys, self.treedef.flatten_up_to(tree)))

    def unkeyed(self, values: Mapping[ParamKey, Any]) -> Any:
        """The tree of this structure holding ``values[key]`` at each key's leaf."""
        return self.treedef.unflatten([values[k] for k in self.keys])


def tree_keys(tree: Any, *, chunked: bool = False, what: str = "gradient") -> TreeKeys:
    """The :class:`TreeKeys` of a pytree (e.g. an ``nnx.State``, a dict of arrays).

    Args:
      tree: the pytree; leaves are arrays (or ParamSpecs, for a spec tree).
      chunked: the top level is a list with one tree per model chunk.
      what: what the leaves are, for the error.

    Raises:
      FinalizeInputError: ``chunked`` but the top level is not a list / tuple, or two
        leaves have the same dotted name.
    """
    if chunked and not isinstance(tree, (list, tuple)):
        raise FinalizeInputError(
            f"the plan has several model chunks, so the {what} tree must be a list with one "
            f"tree per chunk (got {type(tree).__name__})"
        )
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_spec)
    keys = []
    for path, _ in flat:
        if chunked:
            keys.append((int(_path_part(path[0])), path_name(path[1:])))
        else:
            keys.append((0, path_name(path)))
    if len(set(keys)) != len(keys):
        seen: set[ParamKey] = set()
        dup = next(k for k in keys if k in seen or seen.add(k))
        raise FinalizeInputError(f"two {what} leaves have the same path {dup[1]!r} (chunk {dup[0]})")
    return TreeKeys(treedef, tuple(keys))


def specs_for_tree(specs: Any, grads: Any) -> list[ParamSpec] | None:
    """ParamSpecs for a gradient pytree, from a ``specs`` argument of one of the forms
    ``jax_impl.finalize`` accepts; None when ``specs`` is None and ``grads`` carries no
    metadata (not an ``nnx.State``).

    Args:
      specs: None (read ``grads``' nnx Variable metadata), a sequence of ParamSpecs
        (taken as they are), an ``nnx.Module`` / ``nnx.State`` (its Param metadata) or a
        pytree of ParamSpecs of the gradients' structure (each renamed to its path).
      grads: the gradient pytree.
    """
    if specs is None:
        if not _is_nnx(grads):
            return None
        from flax import nnx

        if not all(isinstance(v, nnx.Variable) for _, v in nnx.to_flat_state(grads)):
            raise FinalizeInputError(
                "the gradients are a pure nnx.State (arrays, no Variable metadata: nnx.Optimizer "
                "passes them so), so they carry no flags; give specs=model (the nnx Module, or "
                "nnx.state(model, nnx.Param)) to read the flags from"
            )
        return specs_from_nnx(grads)
    if _is_nnx(specs):
        return specs_from_nnx(specs)
    spec_leaves, spec_def = jax.tree_util.tree_flatten(specs, is_leaf=_is_spec)
    if spec_leaves and all(map(_is_spec, spec_leaves)) and spec_def == jax.tree_util.tree_structure(grads):
        chunked = isinstance(grads, (list, tuple)) and len(grads) > 1
        layout = tree_keys(specs, chunked=chunked, what="spec")
        return [dataclasses.replace(s, chunk=k[0], name=k[1]) for k, s in zip(layout.keys, spec_leaves)]
    return list(specs)


def _is_nnx(x: Any) -> bool:
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(x, (nnx.State, nnx.Module))
