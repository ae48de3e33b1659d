"""The public reference API: the numpy reference on one's own layout, and one call that
checks a (possibly edited) plan against it in both backends (docs/jax.md, "Checking a
variant").

Stable signatures (arrays are numpy, every rank's values stacked along dim 0 in rank
order, keyed by ``(chunk, name)`` as :attr:`meshgrad.ParamSpec.key`):

* :func:`reference` ``(grads, routers=None, num_tokens=None, *, specs, config, dims,
  router_specs=(), force_all_reduce=False) -> (grads, routers)``: docs/semantics.md
  computed by ``parity_tests.reference`` (independent of meshgrad).
* :func:`check_plan` ``(plan, dims, grads, routers=None, num_tokens=None, *,
  expected=None, backends=("jax", "torch"), atol=0.0) -> PlanCheck``: runs ``plan`` in
  each backend and compares every rank's gradients and router buffers with ``expected``
  (default: :func:`reference` of the plan's own specs and config).
* :func:`run_plan_jax` / :func:`run_plan_torch` ``(plan, dims, grads, routers=None,
  num_tokens=None) -> (grads, routers)``: one backend. Both run every action type a plan
  holds (dense, expert and embedding-stage reductions, the router updates, the token
  scale); torch in a gloo world of W processes started by ``multiprocessing`` (a script
  calling it needs an ``if __name__ == "__main__":`` guard).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from meshgrad import (
    ExpertBiasUpdate, FinalizeConfig, FinalizePlan, Group, ParallelDims, ParamSpec, QbBetaUpdate, RouterSpec, TokenScale,
)
from meshgrad.errors import FinalizeInputError, MissingInputError, PlanMismatchError
from parity_tests import reference as ref
from parity_tests.scenarios import ParamLayout, RankData, RouterLayout, RouterState, Scenario

Key = tuple[int, str]
Grads = dict[Key, np.ndarray]
Routers = dict[Key, dict[str, np.ndarray]]
#: The router buffer fields, as in Megatron's router module.
ROUTER_FIELDS = ("local_tokens_per_expert", "expert_bias", "qb_beta", "qb_beta_accum", "qb_beta_count")


def _scenario(
    specs: Sequence[ParamSpec], config: FinalizeConfig, dims: ParallelDims, router_specs: Sequence[RouterSpec],
    force_all_reduce: bool,
) -> Scenario:
    """The reference's description of a layout: every chunk must hold the same params."""
    chunks = sorted({s.chunk for s in specs} | {r.chunk for r in router_specs}) or [0]
    if chunks != list(range(len(chunks))):
        raise ValueError(f"chunks {chunks} are not 0..n-1")
    per_chunk = {c: [dataclasses.replace(s, chunk=0) for s in specs if s.chunk == c] for c in chunks}
    if any(v != per_chunk[0] for v in per_chunk.values()):
        raise ValueError("the reference needs every chunk to hold the same parameters (names, shapes, flags)")
    dtypes = {s.dtype for s in specs}
    if len(dtypes) > 1:
        raise ValueError(f"the reference needs one gradient dtype, got {sorted(dtypes)}")
    defaults = FinalizeConfig()
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    changed = {k: v for k, v in values.items() if v != getattr(defaults, k)}
    unknown = sorted(set(changed) - set(ref.CONFIG_DEFAULTS))
    if unknown:
        raise ValueError(f"the reference does not model the config option(s) {unknown}")
    params = tuple(
        ParamLayout(
            s.name, s.shape, expert=s.expert, sequence_parallel=s.sequence_parallel,
            average_gradients_across_tp_domain=s.average_gradients_across_tp_domain,
            pipeline_parallel=s.pipeline_parallel, flextron_router_pp_sync=s.flextron_router_pp_sync,
            is_gtp_weight_remat=s.is_gtp_weight_remat, requires_grad=s.has_grad, role=str(s.role),
        )
        for s in per_chunk[0]
    )
    routers = tuple(
        RouterLayout(r.name, r.num_experts, training=r.training, frozen_expert_bias=r.frozen_expert_bias,
                     has_expert_bias=r.has_expert_bias, has_qb_beta=r.has_qb_beta,
                     has_aux_loss_tracker=r.has_aux_loss_tracker)
        for r in router_specs if r.chunk == 0
    )
    return Scenario(
        name="user", pp=dims.pp, dp=dims.dp, cp=dims.cp, tp=dims.tp, gtp=dims.gtp, ep=dims.ep, etp=dims.etp,
        egtp=dims.egtp, num_chunks=len(chunks), params=params, routers=routers, config=changed,
        dtype=dtypes.pop() if dtypes else "float32", force_all_reduce=force_all_reduce,
    )


def _rank_data(scenario: Scenario, grads: Grads, routers: Routers, num_tokens: Any, rank: int) -> RankData:
    keys = [(c, p.name) for c in range(scenario.num_chunks) for p in scenario.params]
    router_keys = [(c, r.name) for c in range(scenario.num_chunks) for r in scenario.routers]
    states = {}
    for key in router_keys:
        fields = routers.get(key, {})
        size = next(r.num_experts for r in scenario.routers if r.name == key[1])
        value = lambda f: np.asarray(fields[f][rank], np.float32) if f in fields else np.zeros(  # noqa: E731
            () if f == "qb_beta_count" else (size,), np.float32)
        states[key] = RouterState(**{f: value(f) for f in ROUTER_FIELDS})
    return RankData(
        grads={k: (np.asarray(grads[k][rank], np.float32) if k in grads else None) for k in keys},
        routers=states,
        num_tokens=None if num_tokens is None else int(np.asarray(num_tokens).reshape(-1)[rank]),
    )


def reference(
    grads: Mapping[Key, np.ndarray],
    routers: Mapping[Key, Mapping[str, np.ndarray]] | None = None,
    num_tokens: Any = None,
    *,
    specs: Sequence[ParamSpec],
    config: FinalizeConfig,
    dims: ParallelDims,
    router_specs: Sequence[RouterSpec] = (),
    force_all_reduce: bool = False,
) -> tuple[Grads, Routers]:
    """docs/semantics.md on every rank's values, by the independent numpy reference.

    Args:
      grads: (chunk, name) -> [W, *shape] (row r = rank r), for every spec with has_grad.
      routers: (chunk, name) -> {field: [W, ...]}; missing fields start at zero.
      num_tokens: [W] per-rank token counts, or None.
      specs, config, dims, router_specs, force_all_reduce: the layout, as for
        ``meshgrad.plan_finalize``. Every chunk must hold the same parameters.

    Returns:
      (grads, routers) stacked like the inputs (router fields: the five buffers).

    Raises:
      ValueError: a layout the reference cannot describe, or inputs that do not fit it.
    """
    routers = {} if routers is None else routers
    scenario = _scenario(specs, config, dims, router_specs, force_all_reduce)
    inputs = [_rank_data(scenario, dict(grads), dict(routers), num_tokens, r) for r in range(dims.world_size)]
    outputs = ref.reference_finalize(scenario, inputs, force_all_reduce=force_all_reduce).outputs
    out_grads = {k: np.stack([o.grads[k] for o in outputs]) for k in grads}
    out_routers = {k: {f: np.stack([getattr(o.routers[k], f) for o in outputs]) for f in ROUTER_FIELDS}
                   for k in outputs[0].routers}
    return out_grads, out_routers


def run_plan_jax(
    plan: FinalizePlan, dims: ParallelDims, grads: Mapping[Key, np.ndarray],
    routers: Mapping[Key, Mapping[str, np.ndarray]] | None = None, num_tokens: Any = None,
) -> tuple[Grads, Routers]:
    """Run ``plan`` with ``jax_impl.finalize`` on stacked values (W fake CPU devices:
    call ``jax_impl.mesh.ensure_host_devices(W)`` before jax is first imported)."""
    from jax_impl.finalize import finalize

    out, new = finalize(dict(grads), routers, num_tokens, plan=plan, dims=dims, stacked=True)
    return {k: np.asarray(v, np.float32) for k, v in out.items()}, {
        k: {f: np.asarray(v) for f, v in s.items()} for k, s in new.items()}


#: Router buffers each router update reads or writes (the reset zeroes those present).
_UPDATE_FIELDS = {
    ExpertBiasUpdate: ("local_tokens_per_expert", "expert_bias"),
    QbBetaUpdate: ("qb_beta", "qb_beta_accum", "qb_beta_count"),
}


class _TorchRouter:
    """One rank's buffers of one router, as torch_impl's router updates read them
    (attributes named as Megatron's router module's buffers)."""

    def __init__(self, buffers: Mapping[str, Any]) -> None:
        for field, tensor in buffers.items():
            setattr(self, field, tensor)

    def reset_global_aux_loss_tracker(self) -> None:
        """The reset step's tracker reset: zero ``aux_loss_tracker`` when given (as jax_impl)."""
        tracker = getattr(self, "aux_loss_tracker", None)
        if tracker is not None:
            tracker.zero_()


def _torch_rank(rank: int, world_size: int, payload: tuple[Any, ...], sink: Any) -> None:
    """One gloo rank of :func:`run_plan_torch`: this rank's gradients as ``param.grad`` and
    its router buffers, every planned action run over a DeviceMesh's groups (expert and
    embedding groups included), then the token scale when ``num_tokens`` is given."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from torch_impl import MeshGroups

    # Below torch_impl's public names (it has no public "run this plan" entry, and its
    # token scale runs only inside finalize_model_grads): rewire here when it gets one.
    from torch_impl.run.execute import execute_local
    from torch_impl.run.grads import GradAccess
    from torch_impl.run.scaling import global_token_scale, scale_grads

    plan, dims, grads, routers, num_tokens = payload
    names = tuple(a for a in ("pp", "dp", "cp", "gtp", "tp") if getattr(dims, a) > 1) or ("dp",)
    mesh = init_device_mesh("cpu", tuple(getattr(dims, a) for a in names), mesh_dim_names=names)
    groups = MeshGroups(mesh).resolve(ep=dims.ep, etp=dims.etp, egtp=dims.egtp,
                                      embedding_stages=plan.sizes.embd_stages,
                                      position_embedding_stages=plan.sizes.pos_embd_stages)
    dtypes = {s.key: getattr(torch, s.dtype) for s in plan.params}
    params = {}
    for key, stacked in grads.items():
        grad = torch.from_numpy(np.array(stacked[rank])).to(dtypes.get(key, torch.float32))
        param = torch.nn.Parameter(torch.zeros_like(grad))
        param.grad = grad
        params[key] = param
    access = GradAccess(params)
    modules = {key: _TorchRouter({f: torch.from_numpy(np.array(v[rank])) for f, v in fields.items()})
               for key, fields in routers.items()}
    tokens = None if num_tokens is None else torch.from_numpy(np.array(num_tokens[rank]).reshape(1))
    pending: list[Any] = []
    for action in plan.actions_with(tokens is not None):
        if not isinstance(action, TokenScale):
            pending.append(action)
            continue
        execute_local(pending, access, modules, groups)
        pending = []
        with torch.no_grad():
            scale_grads([access[k] for k in action.keys], global_token_scale(tokens.clone(), action, groups))
    execute_local(pending, access, modules, groups)
    sink.put("grads", {k: p.grad.float().numpy().copy() for k, p in params.items()})
    sink.put("routers", {key: {f: getattr(module, f).numpy().copy() for f in routers[key]}
                         for key, module in modules.items()})


def _check_torch_inputs(
    plan: FinalizePlan, dims: ParallelDims, grads: Mapping[Key, np.ndarray], routers: Routers, num_tokens: Any,
) -> Any:
    """Raise before any process starts where the stacked inputs do not fit ``plan`` and
    ``dims``; returns ``num_tokens`` as ``[W, 1]`` (or None).

    Raises:
      PlanMismatchError: the plan was made for other group sizes than ``dims``.
      MissingInputError: a planned gradient or router buffer is missing.
      FinalizeInputError: a leading dim is not W, or num_tokens is not W counts.
    """
    world = dims.world_size
    for group in plan.required_groups(num_tokens is not None):
        if group not in (Group.EMBD, Group.POS_EMBD) and plan.sizes[group] != dims.group_size(group):
            raise PlanMismatchError(f"plan was made for {group} of size {plan.sizes[group]}, but {dims} has "
                                    f"{dims.group_size(group)}")
    for spec in plan.params:
        if spec.has_grad and spec.key not in grads:
            raise MissingInputError(f"no gradient for {spec.name!r} (chunk {spec.chunk})")
    for action in plan.actions:
        for field in _UPDATE_FIELDS.get(type(action), ()):
            for key in action.routers:
                if field not in routers.get(key, {}):
                    raise MissingInputError(f"router {key[1]!r} (chunk {key[0]}) has no {field!r}")
    stacked = [(f"gradient {k[1]!r} (chunk {k[0]})", v) for k, v in grads.items()]
    stacked += [(f"router {k[1]!r} (chunk {k[0]}) {f}", v) for k, fields in routers.items() for f, v in fields.items()]
    for what, value in stacked:
        if np.ndim(value) < 1 or np.shape(value)[0] != world:
            raise FinalizeInputError(f"{what}: leading dim of shape {np.shape(value)} is not the world size {world}")
    if num_tokens is None:
        return None
    tokens = np.asarray(num_tokens)
    if tokens.size != world:
        raise FinalizeInputError(f"num_tokens of shape {tokens.shape}: expected {world} counts, one per rank")
    return tokens.reshape(world, 1)


def run_plan_torch(
    plan: FinalizePlan, dims: ParallelDims, grads: Mapping[Key, np.ndarray],
    routers: Mapping[Key, Mapping[str, np.ndarray]] | None = None, num_tokens: Any = None, *,
    timeout: float = 600.0,
) -> tuple[Grads, Routers]:
    """Run ``plan`` with torch_impl in a gloo world of W processes on this machine.

    Every action type runs: gradient reductions over dense and expert groups (a
    DeviceMesh's groups, with ``dims``' expert factoring), the embedding stage reductions,
    the router updates (expert bias, qb_beta, reset) and, when ``num_tokens`` is given,
    the plan's token scale (broadcast from the last pp stage, sum, 1 / max(n, 1)).

    Args:
      plan, dims, grads, routers, num_tokens: as for :func:`run_plan_jax`.
      timeout: seconds before the world is killed.

    Returns:
      (grads, routers) stacked like the inputs, gradients as float32; each router with
      the fields it was given.

    Raises:
      PlanMismatchError, FinalizeInputError, MissingInputError: before any process starts,
        for inputs that do not fit the plan.
      RuntimeError: a rank failed or the world timed out (with the first rank's error).
    """
    from parity_tests.process_world import spawn_world

    routers = {k: dict(v) for k, v in (routers or {}).items()}
    tokens = _check_torch_inputs(plan, dims, grads, routers, num_tokens)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    payload = (plan, dims, {k: np.asarray(v, np.float32) for k, v in grads.items()},  # then each spec's dtype
               {k: {f: np.asarray(v, np.float32) for f, v in fields.items()} for k, fields in routers.items()}, tokens)
    outcome = spawn_world(_torch_rank, dims.world_size, payload, timeout)
    failed = [r for r in range(dims.world_size) if "grads" not in outcome.results[r]]
    if failed:
        why = next((f for f in outcome.fatal if f), None) or (
            outcome.why() if outcome.timed_out or outcome.crashed() else f"exit codes {outcome.exitcodes} (a script "
            "that calls this needs an `if __name__ == '__main__':` guard: the ranks are started by multiprocessing)")
        raise RuntimeError(f"run_plan_torch: ranks {failed} did not finish: {why}")
    ranks = outcome.results
    out_grads = {k: np.stack([r["grads"][k] for r in ranks]).astype(np.float32) for k in grads}
    out_routers = {k: {f: np.stack([r["routers"][k][f] for r in ranks]) for f in fields}
                   for k, fields in routers.items()}
    return out_grads, out_routers


#: Backend name -> runner.
RUNNERS: Mapping[str, Callable[..., tuple[Grads, Routers]]] = {"jax": run_plan_jax, "torch": run_plan_torch}


@dataclasses.dataclass(frozen=True)
class PlanCheck:
    """What :func:`check_plan` found.

    Args:
      diffs: backend -> {entry: max abs difference over every rank}; entries are
        ``"grad <chunk>:<name>"`` and ``"router <chunk>:<name>.<field>"``.
      atol: the tolerance.
    """

    diffs: Mapping[str, Mapping[str, float]]
    atol: float = 0.0

    def worst(self, backend: str) -> float:
        """The largest difference of ``backend``."""
        return max(self.diffs[backend].values(), default=0.0)

    @property
    def ok(self) -> bool:
        """Every backend within ``atol`` everywhere."""
        return all(self.worst(b) <= self.atol for b in self.diffs)


def _diffs(got: tuple[Grads, Routers], want: tuple[Grads, Routers]) -> dict[str, float]:
    out = {f"grad {k[0]}:{k[1]}": float(np.abs(np.asarray(got[0][k], np.float64) - want[0][k]).max())
           for k in want[0]}
    for key, fields in got[1].items():
        for field, value in fields.items():
            if field in want[1].get(key, {}):
                diff = np.abs(np.asarray(value, np.float64) - want[1][key][field])
                out[f"router {key[0]}:{key[1]}.{field}"] = float(diff.max(initial=0.0))
    return out


def check_plan(
    plan: FinalizePlan,
    dims: ParallelDims,
    grads: Mapping[Key, np.ndarray],
    routers: Mapping[Key, Mapping[str, np.ndarray]] | None = None,
    num_tokens: Any = None,
    *,
    expected: tuple[Grads, Routers] | Callable[..., tuple[Grads, Routers]] | None = None,
    backends: Sequence[str] = ("jax", "torch"),
    atol: float = 0.0,
) -> PlanCheck:
    """Run a (possibly edited) ``plan`` in each backend and compare it with the expectation.

    Args:
      plan: from ``meshgrad.plan_finalize``, possibly edited with ``dataclasses.replace``.
      dims: the parallel dimensions.
      grads, routers, num_tokens: stacked inputs, as for :func:`reference`.
      expected: (grads, routers) to compare with, or a callable ``(grads, routers,
        num_tokens) -> (grads, routers)`` (one's own variant of the reference); default:
        :func:`reference` of the plan's specs and config (the unedited semantics).
      backends: which of ``RUNNERS`` to run.
      atol: allowed absolute difference (0: bit-exact, for integer-valued data).

    Returns:
      A :class:`PlanCheck` (``.ok``, ``.diffs``, ``.worst(backend)``).
    """
    if expected is None:
        want = reference(grads, routers, num_tokens, specs=plan.params, config=plan.config, dims=dims,
                         router_specs=plan.routers)
    elif callable(expected):
        want = expected(grads, routers, num_tokens)
    else:
        want = expected
    diffs = {b: _diffs(RUNNERS[b](plan, dims, grads, routers, num_tokens), want) for b in backends}
    return PlanCheck(diffs, atol)


__all__ = ["PlanCheck", "RUNNERS", "check_plan", "reference", "run_plan_jax", "run_plan_torch"]
