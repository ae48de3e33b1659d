"""Execute actions on per-rank values stacked along a leading world dimension (rank order).

Consecutive actions that fit one mesh view run in one ``shard_map`` of
:func:`jax_impl.execute.execute_local`: dense groups on the dense view, ``expt_dp`` /
``expt_gtp_remat`` on the expert view. Only the entries the actions use are passed in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax

from meshgrad.actions import Action
from meshgrad.axes import ParallelDims
from meshgrad.errors import MissingInputError
from meshgrad.params import ParamKey

from jax_impl.execute import AUX_LOSS, Grads, LocalState, RouterField, RouterStates, Touched, execute_local, grad_of, touched
from jax_impl.groups import Collectives, view_for
from jax_impl.mesh import VIEWS, MeshViews

Array = jax.Array


def touched_all(actions: Sequence[Action]) -> Touched:
    """Union of :func:`touched` over ``actions``, in first-use order."""
    grad_keys: dict[ParamKey, None] = {}
    fields: dict[RouterField, None] = {}
    tokens = False
    for action in actions:
        g, r, t = touched(action)
        grad_keys.update(dict.fromkeys(g))
        fields.update(dict.fromkeys(r))
        tokens = tokens or t
    return tuple(grad_keys), tuple(fields), tokens


def view_of(action: Action, dims: ParallelDims) -> str | None:
    """"dense", "expert", or None when the action fits either view."""
    return view_for(action.groups(), dims, type(action).__name__)


def select(
    grads: Mapping[ParamKey, Any],
    routers: Mapping[ParamKey, Mapping[str, Any]],
    actions: Sequence[Action],
) -> tuple[dict[ParamKey, Any], dict[ParamKey, dict[str, Any]], bool]:
    """The gradients and router fields ``actions`` use (optional aux-loss fields if present).

    Raises:
      MissingInputError: a planned gradient, router or required router field is missing.
    """
    grad_keys, fields, tokens = touched_all(actions)
    sub_grads = {k: grad_of(grads, k, "finalize") for k in grad_keys}
    sub_routers: dict[ParamKey, dict[str, Any]] = {}
    for key, field in fields:
        state = routers.get(key)
        if state is None and field == AUX_LOSS:  # optional: absent router state is fine
            continue
        if state is None:
            raise MissingInputError(f"router {key[1]!r} (chunk {key[0]}) is missing")
        if field in state:
            sub_routers.setdefault(key, {})[field] = state[field]
        elif field != AUX_LOSS:
            raise MissingInputError(f"router {key[1]!r} (chunk {key[0]}) has no {field!r}")
    return sub_grads, sub_routers, tokens


def merge(
    routers: Mapping[ParamKey, Mapping[str, Any]], updates: Mapping[ParamKey, Mapping[str, Any]]
) -> dict[ParamKey, dict[str, Any]]:
    """Router states with ``updates``' fields replacing theirs."""
    out = {k: dict(v) for k, v in routers.items()}
    for key, fields in updates.items():
        out.setdefault(key, {}).update(fields)
    return out


def segments(actions: Sequence[Action], dims: ParallelDims) -> list[tuple[str, tuple[Action, ...]]]:
    """Split ``actions`` into maximal runs that fit one view, in order."""
    out: list[tuple[str, list[Action]]] = []
    for action in actions:
        view = view_of(action, dims)
        if out and view in (None, out[-1][0]):
            out[-1][1].append(action)
        else:
            out.append((view or "dense", [action]))
    return [(view, tuple(acts)) for view, acts in out]


def _run_segment(
    view: str, actions: tuple[Action, ...], state: LocalState, meshes: MeshViews
) -> LocalState:
    grads, routers, tokens = select(state.grads, state.routers, actions)
    num_tokens = state.num_tokens if tokens else None
    comm = Collectives(meshes.dims, VIEWS[view])
    spec = meshes.rank_spec(view)

    def body(g: Grads, r: RouterStates, n: Any) -> tuple[Grads, RouterStates]:
        squeeze = lambda x: x[0]  # noqa: E731  (local block of one rank: [1, ...])
        local = LocalState(
            jax.tree.map(squeeze, g), jax.tree.map(squeeze, r), None if n is None else n[0]
        )
        local = execute_local(actions, local, comm)
        expand = lambda x: x[None]  # noqa: E731
        return jax.tree.map(expand, local.grads), jax.tree.map(expand, local.routers)

    mapped = jax.shard_map(
        body, mesh=meshes.mesh(view), in_specs=(spec, spec, spec), out_specs=(spec, spec), check_vma=False
    )
    new_grads, new_routers = mapped(grads, routers, num_tokens)
    return LocalState({**state.grads, **new_grads}, merge(state.routers, new_routers), state.num_tokens)


def execute_stacked(
    actions: Sequence[Action],
    grads: Mapping[ParamKey, Array],
    routers: Mapping[ParamKey, Mapping[str, Array]],
    num_tokens: Array | None,
    meshes: MeshViews,
) -> tuple[Grads, RouterStates]:
    """Apply ``actions`` to per-rank values stacked along a leading world dimension.

    Args:
      actions: plan actions in order.
      grads: (chunk, name) -> [W, *shape] (row r = rank r).
      routers: (chunk, name) -> {field: [W, ...]}.
      num_tokens: [W] per-rank token counts, or None.
      meshes: the two mesh views of the world.

    Returns:
      (grads, routers), stacked like the inputs; entries no action touches are returned
      as given.
    """
    state = LocalState(dict(grads), {k: dict(v) for k, v in routers.items()}, num_tokens)
    for view, acts in segments(actions, meshes.dims):
        state = _run_segment(view, acts, state, meshes)
    return state.grads, state.routers


__all__ = ["execute_stacked", "merge", "segments", "select", "touched_all", "view_of"]
