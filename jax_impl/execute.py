"""Execute a meshgrad FinalizePlan with jax collectives over named mesh axes.

Every action is a pure function of per-rank *local* values (inside ``jax.shard_map``):
Reduction -> ``lax.psum`` over the group's axis names, StageReduction -> a masked psum
along ``pp``, router updates -> ``meshgrad.rules`` with ``jax.numpy``. Which gradients go
where is read from the plan, never re-derived.

:func:`execute_stacked` runs a list of actions on values stacked along a leading world
dimension (rank order): consecutive actions that fit one mesh view run in one
``shard_map``; dense groups on the dense view, ``expt_dp`` / ``expt_gtp_remat`` on the
expert view.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshgrad import rules
from meshgrad.axes import DENSE_AXES, GROUP_AXES, Axis, Group, ParallelDims
from meshgrad.params import ParamKey
from meshgrad.plan import (
    Action,
    ExpertBiasUpdate,
    QbBetaUpdate,
    ReduceOp,
    Reduction,
    ResetTemporaries,
    StageReduction,
    TokenScale,
)

from jax_impl.mesh import VIEWS, MeshViews

Array = jax.Array
Grads = dict[ParamKey, Array]
RouterStates = dict[ParamKey, dict[str, Array]]

#: Router state fields (names as in Megatron's router module).
TOKENS = "local_tokens_per_expert"
EXPERT_BIAS = "expert_bias"
QB_BETA = "qb_beta"
QB_ACCUM = "qb_beta_accum"
QB_COUNT = "qb_beta_count"
#: Optional field zeroed where the plan resets the global aux-loss tracker.
AUX_LOSS = "aux_loss_tracker"


@dataclasses.dataclass
class LocalState:
    """One rank's values: gradients, router buffers and the optional token count."""

    grads: Grads
    routers: RouterStates
    num_tokens: Array | None = None


@dataclasses.dataclass(frozen=True)
class Collectives:
    """Group sums for per-rank values inside a ``shard_map`` over one mesh view.

    Args:
      dims: the parallel dimensions.
      view: the axes bound by the enclosing ``shard_map`` (DENSE_AXES or EXPERT_AXES).
    """

    dims: ParallelDims
    view: tuple[Axis, ...] = DENSE_AXES

    def axes(self, group: Group) -> tuple[str, ...]:
        """The group's axes of size > 1 (size-1 axes need no communication)."""
        return tuple(a.value for a in GROUP_AXES[group] if self.dims.size(a) > 1)

    def size(self, group: Group) -> int:
        return self.dims.group_size(group)

    def stage(self) -> Array:
        """This rank's pp stage."""
        return lax.axis_index(Axis.PP.value) if self.dims.pp > 1 else jnp.zeros((), jnp.int32)

    def sum(self, x: Any, group: Group) -> Any:
        """SUM of ``x`` (an array or a list of arrays: one collective) over ``group``.

        A group whose axes are not all in the view (an expert group on the dense view) is
        summed by gathering over the view's inner axes and masking to the group.
        """
        axes = self.axes(group)
        if not axes:
            return x
        if {Axis(a) for a in axes} <= set(self.view):
            return lax.psum(x, axes)
        return jax.tree.map(lambda leaf: self._masked_sum(leaf, group), x)

    def in_view(self, group: Group) -> bool:
        """Whether every communicating axis of ``group`` is bound by this view."""
        return {Axis(a) for a in self.axes(group)} <= set(self.view)

    def member_index(self, group: Group) -> Array:
        """This rank's index in its ``group`` (members ordered by global rank)."""
        rank = jnp.zeros((), jnp.int32)
        for axis in self.view:
            rank = rank * self.dims.size(axis) + lax.axis_index(axis.value)
        table = np.zeros(self.dims.world_size, dtype=np.int32)
        for r in range(self.dims.world_size):
            table[r] = self.dims.group_ranks(group, r).index(r)
        return jnp.asarray(table)[rank]

    def _masked_sum(self, x: Array, group: Group) -> Array:
        if Axis.PP in GROUP_AXES[group]:
            raise NotImplementedError(f"group {group} varies pp and is not on the {self.view} view")
        inner_axes = tuple(a.value for a in self.view if a is not Axis.PP and self.dims.size(a) > 1)
        inner = self.dims.world_size // self.dims.pp
        member = np.zeros((inner, inner), dtype=bool)
        for i in range(inner):  # ranks of stage 0; every stage has the same pattern
            member[i, self.dims.group_ranks(group, i)] = True
        index = jnp.zeros((), jnp.int32)
        for name in inner_axes:
            index = index * self.dims.size(Axis(name)) + lax.axis_index(name)
        gathered = lax.all_gather(x, inner_axes)
        row = jnp.asarray(member)[index].reshape((inner,) + (1,) * x.ndim)
        return jnp.sum(jnp.where(row, gathered, jnp.zeros((), x.dtype)), axis=0).astype(x.dtype)


def _get(grads: Mapping[ParamKey, Array], key: ParamKey, what: str) -> Array:
    if key not in grads:
        raise KeyError(f"{what}: gradient of {key[1]!r} (chunk {key[0]}) is missing")
    return grads[key]


def apply_reduction(action: Reduction, grads: Grads, comm: Collectives) -> Grads:
    """One coalesced collective: pre-scale, SUM/AVG over the group, write to every copy.

    Other chunks' copies are summed into each key first and overwritten after. A
    reduce-scatter (``scatter``) reduces only this rank's shard (see
    ``meshgrad.plan.scatter_shard``); the rest keeps the local pre-scaled values.

    Args:
      action: the planned reduction.
      grads: local gradients by key.
      comm: collectives of the enclosing view.

    Returns:
      New gradients (unchanged keys kept).
    """
    copies = action.copies or ((),) * len(action.keys)
    parts = []
    for key, extra in zip(action.keys, copies):
        x = _get(grads, key, str(action.step))
        for c in extra:
            x = x + _get(grads, c, str(action.step))
        parts.append(x)
    dtypes = [p.dtype for p in parts]
    # The collective's dtype: float32 under reduce_in_fp32, else the plan's (a fused
    # reduction over several dtypes runs in their promotion, as Megatron's flatten does).
    work = jnp.dtype(action.work_dtype)
    parts = [p if p.dtype == work else p.astype(work) for p in parts]
    if action.pre_scale != 1.0:
        parts = [p * jnp.asarray(action.pre_scale, p.dtype) for p in parts]
    size = comm.size(action.group)
    if action.scatter and size > 1:
        parts = _reduce_scatter(parts, action, comm)
    else:
        parts = comm.sum(parts, action.group)
        if action.op is ReduceOp.AVG and size > 1:
            parts = [p / jnp.asarray(size, p.dtype) for p in parts]
    out = dict(grads)
    for key, extra, value, dtype in zip(action.keys, copies, parts, dtypes):
        for k in (key, *extra):
            out[k] = value.astype(dtype)
    return out


def _reduce_scatter(parts: list[Array], action: Reduction, comm: Collectives) -> list[Array]:
    """Reduce-scatter with meshgrad's shard layout (``meshgrad.plan.scatter_shard``).

    The parts are flattened into one zero-padded buffer; this rank's shard is reduced
    (``lax.psum_scatter`` when the group is on this view), every other element keeps the
    local (pre-scaled) value.
    """
    size = comm.size(action.group)
    flat = jnp.concatenate([p.reshape(-1) for p in parts])
    total = flat.shape[0]
    shard = -(-total // size)
    padded = jnp.pad(flat, (0, shard * size - total))
    index = comm.member_index(action.group)
    if comm.in_view(action.group):
        mine = lax.psum_scatter(padded, comm.axes(action.group), scatter_dimension=0, tiled=True)
    else:
        mine = lax.dynamic_slice(comm.sum(padded, action.group), (index * shard,), (shard,))
    if action.op is ReduceOp.AVG:
        mine = mine / jnp.asarray(size, mine.dtype)
    merged = lax.dynamic_update_slice(padded, mine.astype(padded.dtype), (index * shard,))
    out, offset = [], 0
    for p in parts:
        out.append(merged[offset : offset + p.size].reshape(p.shape))
        offset += p.size
    return out


def apply_stage_reduction(action: StageReduction, grads: Grads, comm: Collectives) -> Grads:
    """SUM along pp over the member stages; each stage contributes its own chunk's key.

    Non-member stages contribute zero and keep their values.
    """
    keys: list[ParamKey] = []
    for key in action.keys_by_stage:
        if key is not None and key not in keys:
            keys.append(key)
    if not keys:
        return dict(grads)
    shapes = {_get(grads, k, str(action.step)).shape for k in keys}
    if len(shapes) > 1:
        raise ValueError(f"{action.step}: gradients {keys} differ in shape {sorted(shapes)}")
    stage = comm.stage()
    masks = {}
    contribution = jnp.zeros_like(grads[keys[0]])
    for key in keys:
        stages = [s for s, k in enumerate(action.keys_by_stage) if k == key]
        masks[key] = jnp.any(stage == jnp.asarray(stages, jnp.int32))
        contribution = jnp.where(masks[key], grads[key], contribution)
    total = comm.sum(contribution, action.group)
    out = dict(grads)
    for key in keys:
        out[key] = jnp.where(masks[key], total, grads[key])
    return out


def _router_field(routers: RouterStates, key: ParamKey, field: str, num_experts: int | None) -> Array:
    state = routers.get(key)
    if state is None or field not in state:
        raise KeyError(f"router {key[1]!r} (chunk {key[0]}) has no {field!r}")
    value = state[field]
    if num_experts is not None and tuple(value.shape) != (num_experts,):
        raise ValueError(
            f"router {key[1]!r} (chunk {key[0]}): {field} has shape {tuple(value.shape)}, "
            f"planned ({num_experts},)"
        )
    return value


def _with(routers: RouterStates, key: ParamKey, **fields: Array) -> RouterStates:
    out = dict(routers)
    out[key] = {**routers[key], **fields}
    return out


def apply_expert_bias(action: ExpertBiasUpdate, routers: RouterStates, comm: Collectives) -> RouterStates:
    """Expert bias step (docs/semantics.md): one SUM of every router's token counts over
    tp_dp_cp, then the sign update of each bias."""
    counts = [_router_field(routers, k, TOKENS, e) for k, e in zip(action.routers, action.num_experts)]
    totals = comm.sum(counts, action.group)
    out = routers
    for key, e, tokens in zip(action.routers, action.num_experts, totals):
        bias = _router_field(routers, key, EXPERT_BIAS, e)
        out = _with(out, key, **{EXPERT_BIAS: rules.expert_bias_update(bias, tokens, action.rate, jnp)})
    return out


def apply_qb_beta(action: QbBetaUpdate, routers: RouterStates, comm: Collectives) -> RouterStates:
    """Quantile-balancing step: AVG of accum/max(count, 1) over the group (one
    collective), EMA, re-centre."""
    local = [
        rules.qb_local(_router_field(routers, k, QB_ACCUM, e), _router_field(routers, k, QB_COUNT, None), jnp)
        for k, e in zip(action.routers, action.num_experts)
    ]
    totals = comm.sum(local, action.group)
    size = comm.size(action.group)
    out = routers
    for key, e, total in zip(action.routers, action.num_experts, totals):
        m = total / size if size > 1 else total
        beta = _router_field(routers, key, QB_BETA, e)
        out = _with(out, key, **{QB_BETA: rules.qb_beta_update(beta, m.astype(beta.dtype), action.ema)})
    return out


def apply_reset(action: ResetTemporaries, routers: RouterStates) -> RouterStates:
    """Reset step: zero token counts and qb accumulators; zero ``aux_loss_tracker`` if present."""
    out = routers
    for key in action.zero_tokens:
        out = _with(out, key, **{TOKENS: jnp.zeros_like(_router_field(out, key, TOKENS, None))})
    for key in action.zero_qb:
        fields = {f: jnp.zeros_like(_router_field(out, key, f, None)) for f in (QB_ACCUM, QB_COUNT)}
        out = _with(out, key, **fields)
    for key in action.reset_aux_loss:
        if AUX_LOSS in out.get(key, {}):
            out = _with(out, key, **{AUX_LOSS: jnp.zeros_like(out[key][AUX_LOSS])})
    return out


def apply_token_scale(action: TokenScale, grads: Grads, num_tokens: Array, comm: Collectives) -> Grads:
    """Per-token scaling step: num_tokens from the last pp stage, SUM over the group,
    scale by 1/max(n,1).

    The scale is float32; gradients are scaled as ``(g.astype(f32) * scale).astype(g.dtype)``.
    """
    n = jnp.asarray(num_tokens)
    pp = comm.dims.pp
    if pp > 1:
        n = comm.sum(jnp.where(comm.stage() == pp - 1, n, jnp.zeros_like(n)), Group.PP)
    n = comm.sum(n, action.group)
    scale = rules.token_scale(n.astype(jnp.float32), jnp)
    out = dict(grads)
    for key in action.keys:
        g = _get(grads, key, str(action.step))
        out[key] = (g.astype(jnp.float32) * scale).astype(g.dtype)
    return out


def apply_action(action: Action, state: LocalState, comm: Collectives) -> LocalState:
    """Apply one planned action to one rank's local state (inside shard_map)."""
    if isinstance(action, Reduction):
        return dataclasses.replace(state, grads=apply_reduction(action, state.grads, comm))
    if isinstance(action, StageReduction):
        return dataclasses.replace(state, grads=apply_stage_reduction(action, state.grads, comm))
    if isinstance(action, ExpertBiasUpdate):
        return dataclasses.replace(state, routers=apply_expert_bias(action, state.routers, comm))
    if isinstance(action, QbBetaUpdate):
        return dataclasses.replace(state, routers=apply_qb_beta(action, state.routers, comm))
    if isinstance(action, ResetTemporaries):
        return dataclasses.replace(state, routers=apply_reset(action, state.routers))
    if isinstance(action, TokenScale):
        if state.num_tokens is None:
            raise ValueError("TokenScale action but num_tokens is None")
        return dataclasses.replace(state, grads=apply_token_scale(action, state.grads, state.num_tokens, comm))
    raise TypeError(f"unknown plan action {type(action).__name__}")


def execute_local(actions: Sequence[Action], state: LocalState, comm: Collectives) -> LocalState:
    """Apply ``actions`` in order to one rank's local values (inside shard_map)."""
    for action in actions:
        state = apply_action(action, state, comm)
    return state


# --------------------------------------------------------------------------- stacked


def action_groups(action: Action) -> tuple[Group, ...]:
    """The groups an action communicates over."""
    if isinstance(action, ResetTemporaries):
        return ()
    if isinstance(action, TokenScale):
        return (Group.PP, action.group)
    return (action.group,)


def view_of(action: Action, dims: ParallelDims) -> str | None:
    """"dense", "expert", or None when the action fits either view."""
    axes = {a for g in action_groups(action) for a in GROUP_AXES[g] if dims.size(a) > 1}
    fits = [name for name, view in VIEWS.items() if axes <= set(view)]
    if not fits:
        raise ValueError(f"{type(action).__name__} mixes dense and expert axes {sorted(axes)}")
    return None if len(fits) == len(VIEWS) else fits[0]


RouterField = tuple[ParamKey, str]


def touched(action: Action) -> tuple[tuple[ParamKey, ...], tuple[RouterField, ...], bool]:
    """(gradient keys, (router key, field) pairs, uses num_tokens) read or written.

    ``aux_loss_tracker`` fields are listed for every router whose tracker is reset; they
    are optional in the router state.
    """
    if isinstance(action, Reduction):
        return action.all_keys, (), False
    if isinstance(action, StageReduction):
        return tuple(dict.fromkeys(k for k in action.keys_by_stage if k is not None)), (), False
    if isinstance(action, ExpertBiasUpdate):
        return (), tuple((k, f) for k in action.routers for f in (TOKENS, EXPERT_BIAS)), False
    if isinstance(action, QbBetaUpdate):
        return (), tuple((k, f) for k in action.routers for f in (QB_ACCUM, QB_COUNT, QB_BETA)), False
    if isinstance(action, ResetTemporaries):
        fields = [(k, TOKENS) for k in action.zero_tokens]
        fields += [(k, f) for k in action.zero_qb for f in (QB_ACCUM, QB_COUNT)]
        fields += [(k, AUX_LOSS) for k in action.reset_aux_loss]
        return (), tuple(fields), False
    if isinstance(action, TokenScale):
        return action.keys, (), True
    raise TypeError(f"unknown plan action {type(action).__name__}")


def touched_all(actions: Sequence[Action]) -> tuple[tuple[ParamKey, ...], tuple[RouterField, ...], bool]:
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


def select(
    grads: Mapping[ParamKey, Any],
    routers: Mapping[ParamKey, Mapping[str, Any]],
    actions: Sequence[Action],
) -> tuple[dict[ParamKey, Any], dict[ParamKey, dict[str, Any]], bool]:
    """The gradients and router fields ``actions`` use (optional aux-loss fields if present).

    Raises:
      KeyError: a planned gradient, router or required router field is missing.
    """
    grad_keys, fields, tokens = touched_all(actions)
    sub_grads = {k: _get(grads, k, "finalize") for k in grad_keys}
    sub_routers: dict[ParamKey, dict[str, Any]] = {}
    for key, field in fields:
        state = routers.get(key)
        if state is None and field == AUX_LOSS:  # optional: absent router state is fine
            continue
        if state is None:
            raise KeyError(f"router {key[1]!r} (chunk {key[0]}) is missing")
        if field in state:
            sub_routers.setdefault(key, {})[field] = state[field]
        elif field != AUX_LOSS:
            raise KeyError(f"router {key[1]!r} (chunk {key[0]}) has no {field!r}")
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
