"""No state leaks between calls or models: three model lists finalized in one process
over separate groups, step after step, give what fresh calls and the reference give.

One gloo world of 4 ranks holds, on every rank, three long-lived model lists:

* A: dp 2 x tp 2 with experts and routers, groups from one torch DeviceMesh (dp, tp);
* B: pp 2 x tp 2 with two virtual chunks, groups from another DeviceMesh (pp, tp);
* C: two independent dp-2 replicas (ranks {0, 1} and {2, 3}: disjoint groups, a model
  over part of the world), groups from a ProcessGroupCollection.

For 6 steps (order of the models alternating), each model gets that step's inputs, with
num_tokens on odd steps, and a parameter of A frozen on steps 3-4 (a new plan, then the
cached one again), and is finalized; a fresh model built for the same inputs is finalized
once. Long-lived and fresh results must be bit-identical, and equal to the numpy
reference.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from parity_tests.compare import compare_ranks  # noqa: E402
from parity_tests.reference import reference_finalize  # noqa: E402
from parity_tests.scenarios import ParamLayout, Scenario, gpt_params, make_rank_inputs, moe_routers  # noqa: E402
from parity_tests.torch_world import build_model, load_inputs, read_outputs, scenario_config  # noqa: E402
from parity_tests.world_cases import run_cases  # noqa: E402
from test_reliability_inputs import LINEAR, snapshot  # noqa: E402

WORLD = 4
STEPS = 6
A = Scenario(
    "conc-A-dp2tp2", dp=2, tp=2, ep=2, etp=1,
    params=gpt_params(experts=True),
    routers=moe_routers(qb=True),
    config=dict(
        sequence_parallel=True, qk_layernorm=True, calculate_per_token_loss=True,
        moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.25,
        moe_router_load_balancing_type="quantile_balancing",
    ),
)
B = Scenario(
    "conc-B-pp2tp2", pp=2, tp=2, num_chunks=2,
    params=gpt_params(),
    config=dict(has_cond_embedder=True, flextron=True, sequence_parallel=True, calculate_per_token_loss=True,
                position_embedding_stages=(0, 1)),
)
C = Scenario(
    "conc-C-dp2-replicas", dp=2,
    params=gpt_params(),
    config=dict(average_in_collective=True, use_distributed_optimizer=True),
)
MODELS = {"A": A, "B": B, "C": C}


def scenario_at(name: str, step: int) -> Scenario:
    """The inputs of ``name`` at ``step``: a new seed, num_tokens on odd steps (A, B), and
    A's linear weight frozen on steps 3 and 4."""
    base = MODELS[name]
    params = base.params
    if name == "A" and step in (3, 4):
        params = tuple(dataclasses.replace(p, requires_grad=False) if p.name == LINEAR else p for p in params)
    tokens = "random" if name != "C" and step % 2 else None
    return dataclasses.replace(base, params=params, seed=step, num_tokens=tokens)


def local_rank(name: str, rank: int) -> int:
    return rank % 2 if name == "C" else rank


def _finalize(model: list[Any], scenario: Scenario, data: Any, groups: Any) -> None:
    from torch_impl import finalize_model_grads

    tokens = None if data.num_tokens is None else torch.tensor(data.num_tokens)
    finalize_model_grads(model, num_tokens=tokens, pg_collection=groups)


def case_many_steps_many_models(rank: int, world: int) -> list[tuple[str, int, bool, Any]]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    groups = {
        "A": init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")),
        "B": init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp")),
    }
    replicas = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    groups["C"] = types.SimpleNamespace(
        tp=None, pp=None, embd=None, pos_embd=None, dp_cp=replicas[rank // 2], expt_dp=None, tp_dp_cp=replicas[rank // 2]
    )
    live = {}
    for name, scenario in MODELS.items():
        live[name] = build_model(scenario, local_rank(name, rank), scenario_config(scenario, False))
    out = []
    for step in range(STEPS):
        names = list(MODELS) if step % 2 == 0 else list(reversed(MODELS))
        for name in names:
            scenario = scenario_at(name, step)
            r = local_rank(name, rank)
            data = make_rank_inputs(scenario, r)
            model = live[name]
            for chunk in model:
                for layout in scenario.params:
                    chunk.get_parameter(layout.name).requires_grad_(layout.requires_grad)
            load_inputs(model, scenario, data)
            _finalize(model, scenario, data, groups[name])
            got = read_outputs(model, scenario, data)
            fresh = build_model(scenario, r, scenario_config(scenario, False))
            load_inputs(fresh, scenario, data)
            _finalize(fresh, scenario, data, groups[name])
            same = all(
                snapshot_grad(model, key) == snapshot_grad(fresh, key)
                for key, value in data.grads.items()
                if value is not None
            ) and {k: v for k, v in snapshot(model).items() if k[0] != "grad"} == {
                k: v for k, v in snapshot(fresh).items() if k[0] != "grad"
            }
            out.append((name, step, same, got))
    return out


def snapshot_grad(model: list[Any], key: tuple[int, str]) -> Any:
    return snapshot([model[key[0]]])[("grad", 0, key[1])]


CASES = ["case_many_steps_many_models"]


def test_repeated_calls_on_several_models_equal_fresh_calls_and_the_reference(reliability):
    got = run_cases(__name__, CASES, WORLD, timeout=240)["case_many_steps_many_models"]
    problems = [f"rank {r}: {s}: {v}" for r, (s, v) in enumerate(got) if s != "ok"]
    assert not problems, "\n".join(problems)
    per_rank = [v for _, v in got]
    checked = 0
    for index, (name, step, _, _) in enumerate(per_rank[0]):
        scenario = scenario_at(name, step)
        ranks = scenario.world_size
        inputs = [make_rank_inputs(scenario, r) for r in range(ranks)]
        want = reference_finalize(scenario, inputs).outputs
        for rank in range(WORLD):
            got_name, got_step, same, outputs = per_rank[rank][index]
            assert (got_name, got_step) == (name, step)
            assert same, f"rank {rank}: model {name} step {step}: long-lived result differs from a fresh call"
            mine = want[local_rank(name, rank)]
            # A parameter frozen this step keeps an older gradient in the long-lived model.
            for key, value in inputs[local_rank(name, rank)].grads.items():
                if value is None:
                    outputs.grads[key] = mine.grads[key]
            result = compare_ranks(scenario, [outputs], [mine])
            assert result.ok, (name, step, rank, result.failures[:5])
            checked += 1
    assert checked == WORLD * STEPS * len(MODELS)
    reliability(
        "concurrency",
        f"3 models (2 DeviceMeshes, 1 disjoint collection) x {STEPS} steps, interleaved [4 ranks]",
        "every call equals a fresh call bit for bit and the reference; no state leaks",
    )
