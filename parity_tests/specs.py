"""A parity scenario in meshgrad's terms: its ParallelDims and ParamSpecs / RouterSpecs.

Shared by the backends' worlds and the tests (the numpy reference does not use it: it
must not depend on meshgrad).
"""

from __future__ import annotations

from meshgrad import ParallelDims, ParamSpec, RouterSpec
from parity_tests.scenarios import Scenario


def scenario_dims(scenario: Scenario) -> ParallelDims:
    """The scenario's mesh sizes, dense and expert view."""
    return ParallelDims(
        pp=scenario.pp, dp=scenario.dp, cp=scenario.cp, tp=scenario.tp, gtp=scenario.gtp,
        ep=scenario.ep, etp=scenario.expert_tp, egtp=scenario.egtp,
    )


def scenario_specs(scenario: Scenario) -> tuple[list[ParamSpec], list[RouterSpec]]:
    """Every chunk holds every layout param / router; has_grad = requires_grad."""
    params = [
        ParamSpec(
            name=p.name, chunk=c, shape=p.shape, dtype=scenario.dtype, expert=p.expert,
            sequence_parallel=p.sequence_parallel,
            average_gradients_across_tp_domain=p.average_gradients_across_tp_domain,
            pipeline_parallel=p.pipeline_parallel, flextron_router_pp_sync=p.flextron_router_pp_sync,
            is_gtp_weight_remat=p.is_gtp_weight_remat, has_grad=p.requires_grad, role=p.role,
        )
        for c in range(scenario.num_chunks)
        for p in scenario.params
    ]
    routers = [
        RouterSpec(
            name=r.name, chunk=c, num_experts=r.num_experts, training=r.training,
            has_expert_bias=r.has_expert_bias, frozen_expert_bias=r.frozen_expert_bias,
            has_qb_beta=r.has_qb_beta, qb_accum_present=True, has_aux_loss_tracker=r.has_aux_loss_tracker,
        )
        for c in range(scenario.num_chunks)
        for r in scenario.routers
    ]
    return params, routers
