"""ParamSpecs and RouterSpecs from explicit spec trees or flax.nnx Variable metadata.

Flags use ParamSpec's field names (``sequence_parallel``, ``expert``, ``role``, ...);
Megatron's spellings ``allreduce`` (False = expert) and ``requires_grad`` (= has_grad) are
accepted too. Nested trees are flattened with "." between path parts, like torch names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

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
      ValueError: ``allreduce`` and ``expert`` contradict each other.
    """
    out: dict[str, Any] = {}
    for k, v in flags.items():
        k = _ALIASES.get(k, k)
        if k in _FLAGS:
            out[k] = v
    if "allreduce" in flags:
        expert = not bool(flags["allreduce"])
        if "expert" in out and bool(out["expert"]) != expert:
            raise ValueError(f"{where}: allreduce={flags['allreduce']} contradicts expert={out['expert']}")
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
      ValueError: a flag entry names no array.
    """
    leaves = flatten(arrays)
    flat_flags = _flatten_flags(flags or {})
    unknown = set(flat_flags) - set(leaves)
    if unknown:
        raise ValueError(f"flags given for unknown parameter(s) {sorted(unknown)}")
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
      ValueError: a router has neither ``expert_bias`` nor ``qb_beta``.
    """
    frozen = set(frozen_expert_bias)
    out = []
    for name, fields in states.items():
        ref = fields.get("expert_bias", fields.get("qb_beta"))
        if ref is None:
            raise ValueError(f"router {name!r} has neither expert_bias nor qb_beta")
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
