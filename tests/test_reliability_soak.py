"""Soak (opt-in: ``MESHGRAD_SOAK=1``; ``MESHGRAD_SOAK_STEPS``, default 300): one
long-lived model in a gloo world of 4 ranks (dp 2 x tp 2, experts and routers) runs
hundreds of random steps; between steps every rank makes the same random changes --
parameters frozen / unfrozen, flags (``sequence_parallel``,
``average_gradients_across_tp_domain``) set or cleared, parameters added, config values
(per-token loss, average in collective, expert bias) flipped, new gradient tensors,
num_tokens present or not -- and every step is checked against a fresh model finalized
with the same inputs (bit for bit) and against the numpy reference.

    MESHGRAD_SOAK=1 .venv/bin/python -m pytest -q tests/test_reliability_soak.py
"""

from __future__ import annotations

import dataclasses
import os
import random
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from parity_tests.compare import compare_ranks  # noqa: E402
from parity_tests.reference import reference_finalize  # noqa: E402
from parity_tests.scenarios import ParamLayout, Scenario, gpt_params, make_rank_inputs, moe_routers  # noqa: E402
from parity_tests.torch_world import build_model, load_inputs, read_outputs, run_cases, scenario_config  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("MESHGRAD_SOAK") != "1", reason="opt-in soak: MESHGRAD_SOAK=1")

WORLD = 4
STEPS = int(os.environ.get("MESHGRAD_SOAK_STEPS", "300"))
BASE = Scenario(
    "soak-dp2tp2", dp=2, tp=2, ep=2, etp=1,
    params=gpt_params(experts=True),
    routers=moe_routers(),
    config=dict(sequence_parallel=True, moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.25),
)
FLAGS = ("sequence_parallel", "average_gradients_across_tp_domain")
TOGGLES = ("calculate_per_token_loss", "average_in_collective", "moe_router_enable_expert_bias")


def scenario_at(step: int) -> Scenario:
    """Step ``step``'s scenario: random (but the same on every rank) changes of BASE."""
    rng = random.Random(step)
    params = list(BASE.params)
    for _ in range(step // 50 + 1):  # the model grows now and then
        if rng.random() < 0.3:
            params.append(ParamLayout(f"decoder.extra{len(params)}.weight", (3,)))
    for i, p in enumerate(params):
        if p.role != "none" or p.expert:
            continue
        changes: dict[str, Any] = {}
        if rng.random() < 0.15:
            changes["requires_grad"] = not p.requires_grad
        if rng.random() < 0.15:
            flag = rng.choice(FLAGS)
            changes[flag] = not getattr(p, flag)
            other = FLAGS[1 - FLAGS.index(flag)]
            changes[other] = False  # one flag at a time, as Megatron sets them
        params[i] = dataclasses.replace(p, **changes)
    config = dict(BASE.config)
    for name in TOGGLES:
        if rng.random() < 0.2:
            config[name] = not config.get(name, False)
    tokens = rng.choice([None, "random"])
    return dataclasses.replace(BASE, params=tuple(params), config=config, seed=step, num_tokens=tokens)


def _apply(model: list[Any], scenario: Scenario, config: Any) -> None:
    """Make the long-lived model look like ``scenario``: parameters, flags, config."""
    chunk = model[0]
    for layout in scenario.params:
        owner, _, leaf = layout.name.rpartition(".")
        try:
            p = chunk.get_parameter(layout.name)
        except AttributeError:
            parent = chunk
            for part in owner.split("."):
                if part not in parent._modules:
                    parent.add_module(part, nn.Module())
                parent = parent._modules[part]
            p = nn.Parameter(torch.zeros(layout.shape))
            parent.register_parameter(leaf, p)
        p.requires_grad_(layout.requires_grad)
        for flag in FLAGS:
            if getattr(layout, flag):
                setattr(p, flag, True)
            elif flag in vars(p):
                delattr(p, flag)
    for name in TOGGLES:
        setattr(config, name, bool(scenario.config.get(name, False)))


def _grad_bytes(model: list[Any], key: tuple[int, str]) -> bytes:
    p = model[key[0]].get_parameter(key[1])
    return p.main_grad.detach().contiguous().view(torch.uint8).numpy().tobytes()


def case_soak(rank: int, world: int) -> dict[str, Any]:
    from test_reliability_inputs import snapshot, timed_collection

    from torch_impl import finalize_model_grads

    groups = timed_collection(BASE, timeout=30.0)
    config = scenario_config(BASE, False)
    live = build_model(BASE, rank, config)
    failures: list[str] = []
    checked = 0
    for step in range(STEPS):
        scenario = scenario_at(step)
        _apply(live, scenario, config)
        data = make_rank_inputs(scenario, rank)
        load_inputs(live, scenario, data)
        tokens = None if data.num_tokens is None else torch.tensor(data.num_tokens)
        try:
            finalize_model_grads(live, num_tokens=tokens, pg_collection=groups)
        except Exception as err:  # recorded; the step's comparison is skipped
            failures.append(f"step {step}: live call raised {type(err).__name__}: {err}")
            continue
        fresh = build_model(scenario, rank, scenario_config(scenario, False))
        load_inputs(fresh, scenario, data)
        tokens = None if data.num_tokens is None else torch.tensor(data.num_tokens)  # reduced in place
        finalize_model_grads(fresh, num_tokens=tokens, pg_collection=groups)
        keys = [k for k, v in data.grads.items() if v is not None]
        buffers = [{k: v for k, v in snapshot(m).items() if k[0] == "buffer"} for m in (live, fresh)]
        differing = [k for k in keys if _grad_bytes(live, k) != _grad_bytes(fresh, k)]
        differing += [k for k in buffers[1] if buffers[0].get(k) != buffers[1][k]]
        if differing:
            failures.append(f"step {step}: long-lived result differs from a fresh call in {differing[:3]}")
        inputs = [make_rank_inputs(scenario, r) for r in range(WORLD)]
        want = reference_finalize(scenario, inputs).outputs[rank]
        got = read_outputs(live, scenario, data)
        for key, value in data.grads.items():
            if value is None:
                got.grads[key] = want.grads[key]
        result = compare_ranks(scenario, [got], [want])
        if not result.ok:
            failures.append(f"step {step}: differs from the reference: {result.failures[:2]}")
        checked += 1
    return {"checked": checked, "failures": failures[:20]}


CASES = ["case_soak"]


def test_soak_random_steps_match_fresh_calls_and_the_reference(reliability):
    got = run_cases(__name__, CASES, WORLD, timeout=60 + 3 * STEPS)["case_soak"]
    problems = [f"rank {r}: {s}: {v}" for r, (s, v) in enumerate(got) if s != "ok"]
    assert not problems, "\n".join(problems)
    for rank, (_, value) in enumerate(got):
        assert not value["failures"], (rank, value["failures"])
        assert value["checked"] == STEPS, (rank, value)
    reliability("soak", f"{STEPS} random steps changing model, flags, config, gradients, num_tokens [4 ranks]",
                "every step equals a fresh call bit for bit and the reference")
