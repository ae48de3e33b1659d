"""Execute a meshgrad FinalizePlan with jax collectives over named mesh axes.

Every action is a pure function of per-rank *local* values (inside ``jax.shard_map``):
Reduction -> ``lax.psum`` over the group's axis names, StageReduction -> a masked psum
along ``pp``, router updates -> ``meshgrad.rules`` with ``jax.numpy``. Which gradients go
where is read from the plan, never re-derived. :data:`EXECUTORS` is the one table from
action type to executor (what it runs, what it reads and writes).

:mod:`jax_impl.stacked` runs the same executors on values stacked along a leading world
dimension (rank order), one ``shard_map`` per run of actions that fit one mesh view.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from meshgrad import rules
from meshgrad.actions import (
    Action,
    ExpertBiasUpdate,
    QbBetaUpdate,
    ReduceOp,
    Reduction,
    ResetTemporaries,
    StageReduction,
    TokenScale,
)
from meshgrad.axes import Group
from meshgrad.errors import FinalizeInputError, FinalizeTypeError, MissingInputError
from meshgrad.params import ParamKey

from jax_impl.groups import Collectives

Array = jax.Array
Grads = dict[ParamKey, Array]
RouterStates = dict[ParamKey, dict[str, Array]]
RouterField = tuple[ParamKey, str]
#: (gradient keys, (router key, field) pairs, uses num_tokens) an action reads or writes.
Touched = tuple[tuple[ParamKey, ...], tuple[RouterField, ...], bool]

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


def grad_of(grads: Mapping[ParamKey, Array], key: ParamKey, what: str) -> Array:
    """``grads[key]``; MissingInputError naming ``what`` (the step) when it is missing."""
    if key not in grads:
        raise MissingInputError(f"{what}: gradient of {key[1]!r} (chunk {key[0]}) is missing")
    return grads[key]


def apply_reduction(action: Reduction, grads: Grads, comm: Collectives) -> Grads:
    """One coalesced collective: pre-scale, SUM/AVG over the group, write to every copy.

    Other chunks' copies are summed into each key first and overwritten after. A
    reduce-scatter (``scatter``) reduces only this rank's shard (see
    ``meshgrad.layout.scatter_shard``); the rest keeps the local pre-scaled values.

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
        x = grad_of(grads, key, str(action.step))
        for c in extra:
            x = x + grad_of(grads, c, str(action.step))
        parts.append(x)
    dtypes = [p.dtype for p in parts]
    # The collective's dtype: float32 under reduce_in_fp32, else the plan's (a fused
    # reduction over several dtypes runs in their promotion, as Megatron's flatten does).
    work = jnp.dtype(action.work_dtype)
    parts = [p if p.dtype == work else p.astype(work) for p in parts]
    # Constants made once per reduction, not per leaf: every part is in ``work`` now.
    if action.pre_scale != 1.0:
        scale = jnp.asarray(action.pre_scale, work)
        parts = [p * scale for p in parts]
    size = comm.size(action.group)
    if action.scatter and size > 1:
        parts = _reduce_scatter(parts, action, comm)
    else:
        parts = comm.sum(parts, action.group)
        if action.op is ReduceOp.AVG and size > 1:
            divisor = jnp.asarray(size, work)
            parts = [p / divisor for p in parts]
    out = dict(grads)
    for key, extra, value, dtype in zip(action.keys, copies, parts, dtypes):
        value = value if value.dtype == dtype else value.astype(dtype)
        for k in (key, *extra):
            out[k] = value
    return out


def _reduce_scatter(parts: list[Array], action: Reduction, comm: Collectives) -> list[Array]:
    """Reduce-scatter with meshgrad's shard layout (``meshgrad.layout.scatter_shard``).

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
    """SUM (or AVG, per ``action.op``) along pp over the member stages; each stage
    contributes its own chunk's key.

    Non-member stages contribute zero and keep their values.
    """
    keys = action.distinct_keys()
    if not keys:
        return dict(grads)
    shapes = {grad_of(grads, k, str(action.step)).shape for k in keys}
    if len(shapes) > 1:
        raise FinalizeInputError(f"{action.step}: gradients {list(keys)} differ in shape {sorted(shapes)}")
    stage = comm.stage()
    masks = {}
    contribution = jnp.zeros_like(grads[keys[0]])
    for key in keys:
        stages = [s for s, k in enumerate(action.keys_by_stage) if k == key]
        masks[key] = jnp.any(stage == jnp.asarray(stages, jnp.int32))
        contribution = jnp.where(masks[key], grads[key], contribution)
    total = comm.sum(contribution, action.group)
    if action.op is ReduceOp.AVG and len(action.stages) > 1:
        total = total / jnp.asarray(len(action.stages), total.dtype)
    out = dict(grads)
    for key in keys:
        out[key] = jnp.where(masks[key], total, grads[key])
    return out


def _router_field(routers: RouterStates, key: ParamKey, field: str, num_experts: int | None) -> Array:
    state = routers.get(key)
    if state is None or field not in state:
        raise MissingInputError(f"router {key[1]!r} (chunk {key[0]}) has no {field!r}")
    value = state[field]
    if num_experts is not None and tuple(value.shape) != (num_experts,):
        raise FinalizeInputError(
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
        g = grad_of(grads, key, str(action.step))
        out[key] = (g.astype(jnp.float32) * scale).astype(g.dtype)
    return out



# --------------------------------------------------------------------------- the table


@dataclasses.dataclass(frozen=True)
class Executor:
    """How this backend runs one action type.

    Args:
      run: (action, one rank's state, collectives) -> the new state.
      touches: action -> what it reads or writes (:data:`Touched`).
    """

    run: Callable[[Any, LocalState, Collectives], LocalState]
    touches: Callable[[Any], Touched]


def _run_reduction(action: Reduction, state: LocalState, comm: Collectives) -> LocalState:
    return dataclasses.replace(state, grads=apply_reduction(action, state.grads, comm))


def _run_stage_reduction(action: StageReduction, state: LocalState, comm: Collectives) -> LocalState:
    return dataclasses.replace(state, grads=apply_stage_reduction(action, state.grads, comm))


def _run_expert_bias(action: ExpertBiasUpdate, state: LocalState, comm: Collectives) -> LocalState:
    return dataclasses.replace(state, routers=apply_expert_bias(action, state.routers, comm))


def _run_qb_beta(action: QbBetaUpdate, state: LocalState, comm: Collectives) -> LocalState:
    return dataclasses.replace(state, routers=apply_qb_beta(action, state.routers, comm))


def _run_reset(action: ResetTemporaries, state: LocalState, comm: Collectives) -> LocalState:
    return dataclasses.replace(state, routers=apply_reset(action, state.routers))


def _run_token_scale(action: TokenScale, state: LocalState, comm: Collectives) -> LocalState:
    if state.num_tokens is None:
        raise FinalizeInputError("TokenScale action but num_tokens is None")
    return dataclasses.replace(state, grads=apply_token_scale(action, state.grads, state.num_tokens, comm))


def _router_fields(keys: Sequence[ParamKey], fields: Sequence[str]) -> tuple[RouterField, ...]:
    return tuple((k, f) for k in keys for f in fields)


def _reset_fields(action: ResetTemporaries) -> Touched:
    fields = _router_fields(action.zero_tokens, (TOKENS,)) + _router_fields(action.zero_qb, (QB_ACCUM, QB_COUNT))
    return (), fields + _router_fields(action.reset_aux_loss, (AUX_LOSS,)), False


#: Action type -> executor: the one place this backend switches on the action type.
EXECUTORS: Mapping[type, Executor] = types.MappingProxyType({
    Reduction: Executor(_run_reduction, lambda a: (a.all_keys, (), False)),
    StageReduction: Executor(_run_stage_reduction, lambda a: (a.distinct_keys(), (), False)),
    ExpertBiasUpdate: Executor(_run_expert_bias, lambda a: ((), _router_fields(a.routers, (TOKENS, EXPERT_BIAS)), False)),
    QbBetaUpdate: Executor(
        _run_qb_beta, lambda a: ((), _router_fields(a.routers, (QB_ACCUM, QB_COUNT, QB_BETA)), False)
    ),
    ResetTemporaries: Executor(_run_reset, _reset_fields),
    TokenScale: Executor(_run_token_scale, lambda a: (a.keys, (), True)),
})


def executor(action: Action) -> Executor:
    """The executor of ``action``'s type.

    Raises:
      FinalizeTypeError: an action type this backend has no executor for.
    """
    found = EXECUTORS.get(type(action))
    if found is None:
        raise FinalizeTypeError(f"unknown plan action {type(action).__name__}")
    return found


def apply_action(action: Action, state: LocalState, comm: Collectives) -> LocalState:
    """Apply one planned action to one rank's local state (inside shard_map)."""
    return executor(action).run(action, state, comm)


def execute_local(actions: Sequence[Action], state: LocalState, comm: Collectives) -> LocalState:
    """Apply ``actions`` in order to one rank's local values (inside shard_map)."""
    for action in actions:
        state = apply_action(action, state, comm)
    return state


def touched(action: Action) -> Touched:
    """(gradient keys, (router key, field) pairs, uses num_tokens) read or written.

    ``aux_loss_tracker`` fields are listed for every router whose tracker is reset; they
    are optional in the router state.
    """
    return executor(action).touches(action)
