"""Run parity scenarios through jax_impl in this process, on fake CPU devices.

Per scenario: ParamSpecs / RouterSpecs from the layout, every rank's inputs from
``make_rank_inputs`` stacked along a leading world dimension, one ``jax_impl.finalize``
call (stacked mode: compiled once per distinct program, then run again to time the run alone).
"""

from __future__ import annotations

from jax_impl.mesh import ensure_host_devices

#: Fake CPU devices this process needs (the largest parity world).
HOST_DEVICES = 8
ensure_host_devices(HOST_DEVICES)

import time  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_impl.finalize import finalize  # noqa: E402
from meshgrad import FinalizeConfig, ResetTemporaries, plan_finalize  # noqa: E402
from parity_tests.results import ScenarioResult  # noqa: E402
from parity_tests.specs import scenario_dims, scenario_specs  # noqa: E402
from parity_tests.scenarios import Key, RankData, RouterState, Scenario, make_rank_inputs  # noqa: E402

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_ROUTER_FIELDS = ("local_tokens_per_expert", "expert_bias", "qb_beta", "qb_beta_accum", "qb_beta_count")


def stack_inputs(
    scenario: Scenario, inputs: list[RankData]
) -> tuple[dict[Key, np.ndarray], dict[Key, dict[str, np.ndarray]], np.ndarray | None]:
    """Per-rank inputs stacked along a leading world dim (gradients in the scenario dtype)."""
    dtype = _DTYPES[scenario.dtype]
    grads = {
        key: np.stack([r.grads[key] for r in inputs]).astype(dtype)
        for key, value in inputs[0].grads.items()
        if value is not None
    }
    routers = {
        key: {f: np.stack([getattr(r.routers[key], f) for r in inputs]) for f in _ROUTER_FIELDS}
        for key in inputs[0].routers
    }
    tokens = None
    if inputs[0].num_tokens is not None:
        tokens = np.asarray([r.num_tokens for r in inputs], dtype=np.int32)
    return grads, routers, tokens


def _outputs(
    inputs: list[RankData], grads: dict, routers: dict, aux_reset: set[Key]
) -> list[RankData]:
    grads = {k: np.asarray(v.astype(jnp.float32)) for k, v in grads.items()}
    routers = {k: {f: np.asarray(v) for f, v in s.items()} for k, s in routers.items()}
    out = []
    for rank, data in enumerate(inputs):
        out.append(
            RankData(
                grads={k: (None if v is None else grads[k][rank]) for k, v in data.grads.items()},
                routers={
                    k: RouterState(
                        **{f: routers[k][f][rank] for f in _ROUTER_FIELDS}, aux_loss_resets=int(k in aux_reset)
                    )
                    for k in data.routers
                },
                num_tokens=data.num_tokens,
            )
        )
    return out


def run_scenario(scenario: Scenario) -> ScenarioResult:
    """One scenario: compile (or reuse) and run; errors are returned, not raised."""
    try:
        dims = scenario_dims(scenario)
        params, routers = scenario_specs(scenario)
        config = FinalizeConfig.from_mapping(scenario.config)
        devices = jax.devices("cpu")
        if len(devices) < dims.world_size:
            raise RuntimeError(f"{dims.world_size} CPU devices needed, {len(devices)} available")
        devices = devices[: dims.world_size]
        plan = plan_finalize(params, config, dims, routers, force_all_reduce=scenario.force_all_reduce)
        aux_reset = {k for a in plan.actions if isinstance(a, ResetTemporaries) for k in a.reset_aux_loss}
        inputs = [make_rank_inputs(scenario, rank) for rank in range(dims.world_size)]
        grads, rstate, tokens = stack_inputs(scenario, inputs)
        kwargs = dict(plan=plan, dims=dims, devices=devices, stacked=True)
        start = time.perf_counter()
        jax.block_until_ready(finalize(grads, rstate, tokens, **kwargs))
        first = time.perf_counter() - start
        start = time.perf_counter()
        out = jax.block_until_ready(finalize(grads, rstate, tokens, **kwargs))
        seconds = time.perf_counter() - start
        return ScenarioResult(
            outputs=_outputs(inputs, out[0], out[1], aux_reset),
            seconds=seconds,
            compile_seconds=max(first - seconds, 0.0),
        )
    except Exception as exc:  # recorded per scenario
        text = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
        return ScenarioResult(outputs=None, error=text)


def run_jax(scenarios: list[Scenario]) -> dict[str, ScenarioResult]:
    """Run each scenario through jax_impl.

    Args:
      scenarios: the scenarios (world sizes up to ``HOST_DEVICES``).

    Returns:
      scenario name -> ScenarioResult (outputs per rank, or the error text).
    """
    return {s.name: run_scenario(s) for s in scenarios}
