"""The reference on sampled values: the numpy reference (:mod:`parity_tests.reference`) run
on the recorded "before" values, with a distributed optimizer's reduce-scatter layout
applied to the sampled positions, and the JAX oracle on the same inputs.

The reference works elementwise, so sampled elements are enough, with one addition made
here: the reduce-scatter layout of a distributed optimizer (meshgrad's documented layout,
applied to the sampled positions from each gradient's full size and order).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np

from parity_tests import reference as ref
from parity_tests.audit_files import FLAGS, ROUTER_FIELDS, RankFile
from parity_tests.audit_view import View, index_in
from parity_tests.scenarios import Key, RankData, Scenario, to_dtype

#: owned(reference rank, key, expert) -> the mask of sampled elements the rank's shard owns, or None.
ShardFn = Callable[[int, Key, bool], "np.ndarray | None"]


def sampled_reference(
    scenario: Scenario, inputs: list[RankData], force: bool, shard: ShardFn
) -> tuple[list[RankData], dict[str, set[Any]]]:
    """The steps of docs/semantics.md (dp_sync ... token_scale) on sampled values.

    The reference's step functions, run in order on copies of the inputs as
    ``reference.reference_finalize`` runs them (the same checks; the gradients copied as
    float32 arrays, the router states copied, not the whole inputs deep-copied). Under a
    distributed optimizer the DP sync keeps, at sampled positions outside a rank's own
    shard, its pre-scaled local value.

    Args:
      scenario: mesh, parameters, routers, config and dtype.
      inputs: per reference rank; not changed.
      force: ``force_all_reduce`` of the recorded call.
      shard: ``shard(rank, key, expert) -> owned mask or None`` (used under a distributed optimizer).

    Returns:
      (per-rank outputs, step name -> what it touched).
    """
    cfg = ref.Config.from_scenario(scenario)
    mesh = ref.Mesh.from_scenario(scenario)
    ref._check_inputs(scenario, mesh, inputs)
    force = force or scenario.force_all_reduce
    outputs = [RankData({k: None if g is None else np.array(g, np.float32) for k, g in d.grads.items()},
                        {k: copy.deepcopy(s) for k, s in d.routers.items()}, d.num_tokens) for d in inputs]
    if cfg.check_for_nan_in_grad:
        ref._check_finite(outputs)
    ctx = ref.Context(scenario=scenario, cfg=cfg, mesh=mesh, outputs=outputs)
    if not cfg.use_distributed_optimizer or force:
        touched: dict[str, set[Any]] = {"dp_sync": ref.step_dp_sync(ctx, force_all_reduce=force)}
        for name in ref.STEPS[1:]:
            touched[name] = getattr(ref, f"step_{name}")(ctx)
        return outputs, touched
    local = [dict(o.grads) for o in outputs]
    touched = {"dp_sync": ref.step_dp_sync(ctx, force_all_reduce=True)}
    coll_dtype = None if cfg.grad_reduce_in_fp32 else scenario.dtype
    dp_cp = mesh.dp * mesh.cp
    for p in scenario.params:
        if cfg.calculate_per_token_loss:
            pre = 1.0
        elif cfg.average_in_collective:
            pre = mesh.edp / dp_cp if p.expert else 1.0
        else:
            pre = 1.0 / dp_cp
        for r in range(mesh.world):
            for c in range(scenario.num_chunks):
                key = (c, p.name)
                owned = shard(r, key, p.expert)
                if owned is None or local[r][key] is None:
                    continue
                kept = to_dtype(ref._scale(local[r][key], pre, coll_dtype), scenario.dtype)
                g = ctx.grad(r, key).copy()
                g[~owned] = kept[~owned]
                ctx.set_grad(r, key, g)
    for name in ref.STEPS[1:]:
        touched[name] = getattr(ref, f"step_{name}")(ctx)
    return outputs, touched


def shard_fn(files: list[RankFile], view: View, per_rank: list[dict[int, str]], scen: Scenario) -> ShardFn:
    """owned(virtual rank, key, expert) for plain chunks under a distributed optimizer, for
    the parameters of ``scen`` (one dtype): meshgrad's layout (docs/semantics.md,
    "Reduce-scatter layout"): per group one shared buffer in plan order without the
    cross-stage-summed gradients (``reference.cross_stage_keys``), then one buffer of its
    own for each of those; shards by global rank."""
    ctx = ref.Context(scenario=scen, cfg=ref.Config.from_scenario(scen), mesh=ref.Mesh.from_scenario(scen), outputs=[])
    alone = ref.cross_stage_keys(ctx)
    names = {p.name for p in scen.params}
    masks: dict[tuple[int, Key], np.ndarray] = {}
    for f in files:
        r, lay, params = f.rank, f.meta["layout"]["members"], f.meta["params"]
        plain = [not d for d in f.meta["ddp_chunks"]]
        starts = np.cumsum([0] + [p["samples"] for p in params])
        for expert, group in ((False, "dp_cp"), (True, "expt_dp")):
            members = lay[group] if group not in f.meta["layout"]["missing"] else [r]
            if len(members) <= 1:
                continue
            chosen = [i for i, p in enumerate(params) if per_rank[r][i] in names and p["expert"] == expert
                      and p["has_grad"] and plain[p["chunk"]]]
            own = [i for i in chosen if (params[i]["chunk"], per_rank[r][i]) in alone]
            buffers = [[i for i in chosen if i not in own]] + [[i] for i in own]
            for buffer in buffers:
                _buffer_masks(f, buffer, view.virtual[r], per_rank[r], len(members), index_in(members, r), starts, masks)
    return lambda rank, key, expert: masks.get((rank, key))


def _buffer_masks(f: RankFile, buffer: list[int], vrank: int, names: dict[int, str], n: int, index: int,
                  starts: np.ndarray, masks: dict[tuple[int, Key], np.ndarray]) -> None:
    """The owned sampled elements of one buffer's parameters (indices into the plan's
    params, in buffer order) for the member ``index`` of a group of ``n``."""
    params = f.meta["params"]
    total = sum(params[i]["numel"] for i in buffer)
    s = -(-total // n)
    lo, hi = index * s, min((index + 1) * s, total)
    offset = 0
    for i in buffer:
        p = params[i]
        pos = f.arrays["positions"][starts[i]:starts[i] + p["samples"]] + offset
        masks[(vrank, (p["chunk"], names[i]))] = (pos >= lo) & (pos < hi)
        offset += p["numel"]



def run_jax(scen: Scenario, inputs: list[RankData], view: View, force: bool) -> dict[Key, np.ndarray] | None:
    """The JAX oracle on the same sampled inputs (zeros where a rank lacks a gradient)."""
    from jax_impl.mesh import ensure_host_devices

    ensure_host_devices(len(inputs))
    import jax
    import jax.numpy as jnp

    from jax_impl.finalize import finalize_stacked
    from meshgrad import FinalizeConfig, ParallelDims, ParamSpec, RouterSpec
    from meshgrad.params import Role

    sz = view.sizes
    dims = ParallelDims(pp=sz["pp"], dp=sz["dp"], cp=sz["cp"], tp=sz["tp"], gtp=sz["gtp"], ep=sz["ep"], etp=1, egtp=sz["egtp"])
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[scen.dtype]
    params, grads = [], {}
    for c in range(scen.num_chunks):
        for p in scen.params:
            key = (c, p.name)
            values = [d.grads[key] for d in inputs]
            if all(x is None for x in values):
                continue
            n = next(x for x in values if x is not None).shape
            params.append(ParamSpec(name=p.name, chunk=c, shape=n, dtype=scen.dtype, expert=p.expert, role=Role(p.role),
                                    **{k: getattr(p, k) for k in FLAGS}))
            grads[key] = np.stack([np.zeros(n, np.float32) if x is None else x for x in values]).astype(dtype)
    routers, rstate = [], {}
    for c in range(scen.num_chunks):
        for r in scen.routers:
            routers.append(RouterSpec(name=r.name, chunk=c, num_experts=r.num_experts, training=r.training,
                                      has_expert_bias=r.has_expert_bias, frozen_expert_bias=r.frozen_expert_bias,
                                      has_qb_beta=r.has_qb_beta, has_aux_loss_tracker=r.has_aux_loss_tracker))
            rstate[(c, r.name)] = {f: np.stack([getattr(d.routers[(c, r.name)], f) for d in inputs]) for f in ROUTER_FIELDS}
    tokens = None if inputs[0].num_tokens is None else np.asarray([d.num_tokens for d in inputs], np.int32)
    config = FinalizeConfig.from_mapping({k: (tuple(v) if isinstance(v, list) else v) for k, v in scen.config.items()})
    out, _ = finalize_stacked(grads, rstate, tokens, params=params, routers=routers, config=config, dims=dims,
                              devices=jax.devices("cpu")[: dims.world_size], force_all_reduce=force)
    return {k: np.asarray(jnp.asarray(v).astype(jnp.float32)) for k, v in out.items()}


