"""Property-based tests (hypothesis): random valid configurations agree across
torch_impl, jax_impl and the numpy reference and keep finalization's invariants; random
invalid inputs raise the documented errors.

A valid example is a :class:`parity_tests.scenarios.Scenario` drawn at random: a mesh of
at most 8 ranks (pp, dp, cp, gtp, tp; ep, etp, egtp for experts), config flags, a layout
(a random subset of the GPT-like parameters, routers or none), dtype, gradient attribute,
exact or random data, num_tokens and seed. Invariants checked on every backend's outputs:

* agreement with the reference (``parity_tests.compare``, dtype tolerances);
* replicated gradients are identical across their group: dense ones across dp_cp, expert
  ones across expt_dp (no reduce-scatter), tp-reduced ones across tp;
* sums are preserved: over all ranks, sum(out) = factor x sum(in) for unflagged dense and
  expert parameters (factor from the DP / GTP ops; exact data, no num_tokens);
* per-token scaling is exactly ``to_dtype(out_without * float32(1 / max(n, 1)))``;
* NaN / Inf with ``check_for_nan_in_grad`` off propagate as in the reference; with it on,
  every backend raises (torch: NonFiniteGradError on every rank; jax: ValueError;
  reference: RuntimeError).

jax and the reference run inside ``@given``; the torch examples are drawn in-process by
hypothesis too and then run batched, one gloo world per world size.

Budget: ``MESHGRAD_PROPERTY_EXAMPLES`` examples per property (default 30). Examples are
derandomized (the same every run) unless ``MESHGRAD_PROPERTY_SEED`` is set. A longer run:
``MESHGRAD_PROPERTY_EXAMPLES=300 MESHGRAD_PROPERTY_SEED=7 python -m pytest tests/test_properties.py``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from meshgrad import FinalizeConfig, Group, ParallelDims, ResetTemporaries, plan_finalize  # noqa: E402
from parity_tests.compare import compare_ranks  # noqa: E402
from parity_tests.specs import scenario_dims, scenario_specs  # noqa: E402
from parity_tests.reference import reference_finalize  # noqa: E402
from parity_tests.scenarios import RankData, Scenario, gpt_params, make_rank_inputs, moe_routers, to_dtype  # noqa: E402

EXAMPLES = int(os.environ.get("MESHGRAD_PROPERTY_EXAMPLES", "30"))
SEED = os.environ.get("MESHGRAD_PROPERTY_SEED")
PLAIN_DENSE = ("decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.0.mlp.linear_fc1.weight")
PLAIN_EXPERT = ("decoder.layers.0.mlp.experts.linear_fc1.weight",)
BOOL_FLAGS = (
    "sequence_parallel", "qk_layernorm", "has_cond_embedder", "flextron", "calculate_per_token_loss",
    "average_in_collective", "use_distributed_optimizer", "grad_reduce_in_fp32", "moe_router_enable_expert_bias",
)


def budget(n: int = EXAMPLES) -> Callable[[Any], Any]:
    """hypothesis settings for one property: ``n`` examples, no deadline (jax compiles),
    derandomized unless MESHGRAD_PROPERTY_SEED is set."""
    chosen = settings(
        max_examples=n, deadline=None, database=None, derandomize=SEED is None,
        suppress_health_check=list(HealthCheck),
    )
    if SEED is None:
        return chosen
    return lambda f: hypothesis.seed(int(SEED))(chosen(f))


# =========================================================================== strategies


#: Dense meshes (pp, dp, cp, gtp, tp) of at most 8 ranks, larger worlds first (cp, gtp <= 2).
DENSE_SHAPES = sorted(
    (
        (pp, dp, cp, gtp, tp)
        for pp in (1, 2, 4, 8) for dp in (1, 2, 4, 8) for cp in (1, 2) for gtp in (1, 2) for tp in (1, 2, 4, 8)
        if pp * dp * cp * gtp * tp <= 8
    ),
    key=lambda s: (-s[0] * s[1] * s[2] * s[3] * s[4], s),
)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def scenarios(draw: Any, max_exponent: int = 3) -> Scenario:
    """A random valid scenario of at most 2**max_exponent ranks."""
    shapes = [s for s in DENSE_SHAPES if s[0] * s[1] * s[2] * s[3] * s[4] <= 2**max_exponent]
    sizes = dict(zip(("pp", "dp", "cp", "gtp", "tp"), draw(st.sampled_from(shapes))))
    inner = sizes["dp"] * sizes["cp"] * sizes["gtp"] * sizes["tp"]
    experts = draw(st.booleans())
    ep, etp, egtp = 1, None, 1
    if experts:
        egtp = draw(st.sampled_from(sorted({1, sizes["gtp"]})))
        etp = draw(st.sampled_from(_divisors(inner // egtp)))
        ep = draw(st.sampled_from(_divisors(inner // (egtp * etp))))
    remat = (sizes["gtp"] > 1 or egtp > 1) and draw(st.booleans())
    full = gpt_params(
        position_embedding=draw(st.booleans()),
        frozen_embedding=draw(st.booleans()),
        experts=experts,
        gtp_remat=remat,
    )
    keep = draw(st.lists(st.booleans(), min_size=len(full), max_size=len(full)))
    params = tuple(p for p, k in zip(full, keep) if k) or full[:1]
    routers = draw(st.sampled_from([(), moe_routers(), moe_routers(qb=True)]))
    config: dict[str, Any] = {name: True for name in BOOL_FLAGS if draw(st.booleans())}
    config["share_embeddings_and_output_weights"] = draw(st.booleans())
    config["moe_router_load_balancing_type"] = draw(
        st.sampled_from(["aux_loss", "global_aux_loss", "quantile_balancing", "none"])
    )
    config["moe_router_bias_update_rate"] = draw(st.sampled_from([0.25, 1e-3]))
    config["moe_router_quantile_balancing_ema"] = draw(st.sampled_from([0.0, 0.5, 0.9]))
    if draw(st.booleans()):
        config["mtp_num_layers"] = 1
    pp = sizes["pp"]
    for name in ("embedding_stages", "position_embedding_stages"):
        if pp > 1 and draw(st.booleans()):
            config[name] = tuple(sorted(draw(st.sets(st.integers(0, pp - 1), min_size=1))))
    return Scenario(
        "prop",
        **sizes,
        ep=ep,
        etp=etp,
        egtp=egtp,
        num_chunks=draw(st.sampled_from([1, 2])),
        params=params,
        routers=routers,
        config=config,
        dtype=draw(st.sampled_from(["float32", "bfloat16"])),
        grad_attr=draw(st.sampled_from(["main_grad", "grad"])),
        mode=draw(st.sampled_from(["exact", "random"])),
        num_tokens=draw(st.sampled_from([None, "random", "zero"])),
        seed=draw(st.integers(0, 10**6)),
        force_all_reduce=draw(st.booleans()),
    )


@dataclasses.dataclass(frozen=True)
class Example:
    """A scenario, optionally with one gradient entry replaced by NaN / Inf on one rank."""

    scenario: Scenario
    poison: tuple[int, tuple[int, str], int, float] | None = None  # (rank, key, flat index, value)

    @property
    def checked(self) -> bool:
        return bool(self.scenario.cfg("check_for_nan_in_grad", False))

    def inputs(self) -> list[RankData]:
        data = [make_rank_inputs(self.scenario, r) for r in range(self.scenario.world_size)]
        if self.poison is not None:
            rank, key, index, value = self.poison
            grad = np.array(data[rank].grads[key], dtype=np.float32)
            grad.reshape(-1)[index] = value
            data[rank].grads[key] = grad
        return data


@st.composite
def poisoned(draw: Any) -> Example:
    """A valid scenario with NaN / Inf in one gradient element of one rank, and
    check_for_nan_in_grad on or off."""
    scenario = draw(scenarios())
    check = draw(st.booleans())
    scenario = dataclasses.replace(scenario, config={**scenario.config, "check_for_nan_in_grad": check})
    data = make_rank_inputs(scenario, 0)
    keys = sorted(k for k, v in data.grads.items() if v is not None and np.size(v))
    if not keys:
        return Example(scenario)
    rank = draw(st.integers(0, scenario.world_size - 1))
    key = draw(st.sampled_from(keys))
    index = draw(st.integers(0, int(np.size(data.grads[key])) - 1))
    value = draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    return Example(scenario, (rank, key, index, value))


def draw_examples(strategy: Any, n: int) -> list[Any]:
    """``n`` examples of ``strategy``, drawn by hypothesis in this process."""
    out: list[Any] = []

    @budget(n)
    @given(strategy)
    def collect(value: Any) -> None:
        out.append(value)

    collect()
    return out


# =========================================================================== backends and invariants


def _jax_side() -> tuple[Any, Any, Any, Any]:
    """(jax, finalize_stacked, stack_inputs, outputs), imported at their first use: the
    torch property's ranks import this module (its examples are pickled) and need no jax,
    which costs each of them 0.6 s of CPU."""
    import jax
    from jax_impl.finalize import finalize_stacked
    from parity_tests.jax_world import _outputs, stack_inputs

    return jax, finalize_stacked, stack_inputs, _outputs


def run_jax(scenario: Scenario, inputs: list[RankData]) -> list[RankData]:
    """jax_impl on stacked inputs (raises what finalize_stacked raises)."""
    jax, finalize_stacked, stack_inputs, outputs = _jax_side()
    dims = scenario_dims(scenario)
    params, routers = scenario_specs(scenario)
    config = FinalizeConfig.from_mapping(dict(scenario.config))
    plan = plan_finalize(params, config, dims, routers)
    aux = {k for a in plan.actions if isinstance(a, ResetTemporaries) for k in a.reset_aux_loss}
    grads, rstate, tokens = stack_inputs(scenario, inputs)
    out = finalize_stacked(
        grads, rstate, tokens, params=params, routers=routers, config=config, dims=dims,
        devices=jax.devices("cpu")[: dims.world_size], force_all_reduce=scenario.force_all_reduce,
    )
    return outputs(inputs, out[0], out[1], aux)


def without_tokens(inputs: Sequence[RankData]) -> list[RankData]:
    return [dataclasses.replace(d, num_tokens=None) for d in inputs]


def _same(a: Any, b: Any) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and np.array_equal(a, b, equal_nan=True))


def invariant_failures(scenario: Scenario, inputs: Sequence[RankData], outputs: Sequence[RankData]) -> list[str]:
    """Replication across groups and preserved sums (see the module docstring)."""
    cfg = scenario.config
    dims = scenario_dims(scenario)
    layout = {p.name: p for p in scenario.params}
    scatter = bool(cfg.get("use_distributed_optimizer")) and not scenario.force_all_reduce
    failures: list[str] = []
    for rank, out in enumerate(outputs):
        for key, grad in out.grads.items():
            if grad is None:
                continue
            p = layout[key[1]]
            groups = [] if scatter else [Group.EDP if p.expert else Group.DP_CP]
            tp_reduced = p.average_gradients_across_tp_domain or (cfg.get("sequence_parallel") and p.sequence_parallel) or (
                cfg.get("qk_layernorm") and ("q_layernorm" in p.name or "k_layernorm" in p.name)
            )
            if tp_reduced and dims.tp > 1:
                groups.append(Group.TP)
            for group in groups:
                for peer in dims.group_ranks(group, rank):
                    if not _same(grad, outputs[peer].grads[key]):
                        failures.append(f"{key} differs between ranks {rank} and {peer} of their {group} group")
    if scenario.mode != "exact" or scatter or inputs[0].num_tokens is not None:
        return failures
    per_token = bool(cfg.get("calculate_per_token_loss"))
    dense = (dims.dp * dims.cp if per_token else 1) * (dims.gtp if per_token and dims.gtp > 1 else 1)
    expert = (dims.edp if per_token else dims.edp / (dims.dp * dims.cp)) * (dims.egtp if per_token else 1)
    for name, factor in [(n, dense) for n in PLAIN_DENSE] + [(n, expert) for n in PLAIN_EXPERT]:
        if name not in layout or not layout[name].requires_grad:
            continue
        for chunk in range(scenario.num_chunks):
            key = (chunk, name)
            total_in = sum(np.sum(d.grads[key], dtype=np.float64) for d in inputs)
            total_out = sum(np.sum(d.grads[key], dtype=np.float64) for d in outputs)
            if total_out != factor * total_in:
                failures.append(f"{key}: sum over ranks {total_out} != {factor} x {total_in}")
    return failures


def token_scale_failures(
    scenario: Scenario, inputs: Sequence[RankData], with_tokens: Sequence[RankData], without: Sequence[RankData]
) -> list[str]:
    """Every gradient with num_tokens == to_dtype(without * float32(1 / max(n, 1)))."""
    dims = scenario_dims(scenario)
    group = Group.DP_CP_GTP if dims.gtp > 1 else Group.DP_CP
    failures = []
    for rank in range(dims.world_size):
        n = sum(int(inputs[dims.group_ranks(Group.PP, m)[-1]].num_tokens) for m in dims.group_ranks(group, rank))
        scale = np.float32(1) / np.float32(max(n, 1))
        for key, got in with_tokens[rank].grads.items():
            if got is None:
                continue
            want = to_dtype(np.asarray(without[rank].grads[key], np.float32) * scale, scenario.dtype)
            if not np.array_equal(got, want, equal_nan=True):
                failures.append(f"rank {rank} {key}: not exactly x 1/max({n}, 1)")
    return failures


def check_backend(name: str, example: Example, got: list[RankData], without: list[RankData] | None) -> None:
    scenario, inputs = example.scenario, example.inputs()
    want = reference_finalize(scenario, inputs).outputs
    result = compare_ranks(scenario, got, want)
    assert result.ok, (name, scenario, result.failures[:5])
    if example.poison is not None:
        return
    problems = invariant_failures(scenario, inputs, got)
    if inputs[0].num_tokens is not None:
        assert without is not None
        problems += token_scale_failures(scenario, inputs, got, without)
    assert not problems, (name, scenario, problems[:5])


# =========================================================================== jax + reference (in-process)


@budget()
@given(scenarios())
def jax_agrees_with_reference_and_keeps_invariants(scenario):
    example = Example(scenario)
    inputs = example.inputs()
    got = run_jax(scenario, inputs)
    without = run_jax(scenario, without_tokens(inputs)) if inputs[0].num_tokens is not None else None
    check_backend("jax", example, got, without)
    if without is not None:  # the reference obeys the same scaling law
        ref = reference_finalize(scenario, inputs).outputs
        assert not token_scale_failures(scenario, inputs, ref, reference_finalize(scenario, without_tokens(inputs)).outputs)


def test_jax_agrees_with_reference_and_keeps_invariants(reliability):
    pytest.importorskip("jax")
    start = time.monotonic()
    jax_agrees_with_reference_and_keeps_invariants()
    reliability("property", f"{EXAMPLES} random valid configs: jax vs reference ({time.monotonic() - start:.0f} s)",
                "agree; replication, sums, exact 1/max(n,1) scaling hold")


@budget(max(EXAMPLES // 2, 5))
@given(poisoned())
def jax_nan_propagates_like_the_reference_or_is_reported(example):
    inputs = example.inputs()
    if example.checked and example.poison is not None:
        with pytest.raises(RuntimeError, match=f"rank {example.poison[0]}: NaN or Inf in grad"):
            reference_finalize(example.scenario, inputs)
        with pytest.raises(ValueError, match=f"rank {example.poison[0]}: NaN or Inf in the gradient of '{example.poison[1][1]}'"):
            run_jax(example.scenario, inputs)
        return
    check_backend("jax", example, run_jax(example.scenario, inputs), None)


def test_jax_nan_propagates_like_the_reference_or_is_reported(reliability):
    pytest.importorskip("jax")
    jax_nan_propagates_like_the_reference_or_is_reported()
    reliability("property", f"{max(EXAMPLES // 2, 5)} random NaN / Inf injections: jax vs reference",
                "check off: propagate exactly as the reference; on: ValueError naming rank and parameter")


# =========================================================================== torch (batched worlds)


def _torch_examples(rank: int, world: int, examples: list[Example], sink: Any) -> None:
    from parity_tests.torch_world import build_model, collection, device_mesh, load_inputs, read_outputs, scenario_config
    from torch_impl import finalize_model_grads

    cache: dict[Any, Any] = {}
    for index, example in enumerate(examples):
        scenario = example.scenario
        try:
            use_mesh = index % 2 == 0
            config = scenario_config(scenario, finalize_config=not use_mesh and index % 4 == 3)
            groups = device_mesh(scenario, cache) if use_mesh else collection(scenario, cache)
            model = build_model(scenario, rank, config, wrap=index % 3 == 1)
            data = example.inputs()[rank]
            load_inputs(model, scenario, data)
            tokens = None if data.num_tokens is None else torch.tensor(data.num_tokens, dtype=torch.int64)
            finalize_model_grads(model, num_tokens=tokens, pg_collection=groups, force_all_reduce=scenario.force_all_reduce)
            sink.put(index, ("ok", read_outputs(model, scenario, data)))
        except Exception as err:  # recorded per example
            sink.put(index, ("error", f"{type(err).__name__}: {err}"))


def run_torch(examples: list[Example]) -> tuple[list[Any], float]:
    """Per example, per rank: ("ok", RankData) or ("error", text); one world per size."""
    from parity_tests.process_world import spawn_world

    results: list[Any] = [None] * len(examples)
    start = time.monotonic()
    sizes = sorted({e.scenario.world_size for e in examples})
    for size in sizes:
        chosen = [i for i, e in enumerate(examples) if e.scenario.world_size == size]
        outcome = spawn_world(_torch_examples, size, [examples[i] for i in chosen], timeout=300)
        assert not outcome.timed_out and not any(outcome.fatal), outcome.fatal
        for local, index in enumerate(chosen):
            results[index] = [outcome.results[r].get(local, ("missing", "")) for r in range(size)]
    return results, time.monotonic() - start


@pytest.fixture(scope="module")
def torch_examples() -> list[Example]:
    valid = [Example(s) for s in draw_examples(scenarios(), EXAMPLES)]
    nan = draw_examples(poisoned(), max(EXAMPLES // 3, 4))
    examples: list[Example] = []
    for example in valid:
        examples.append(example)
        if example.scenario.num_tokens is not None:  # its twin without num_tokens
            examples.append(dataclasses.replace(example, scenario=dataclasses.replace(example.scenario, num_tokens=None)))
    return examples + nan


def test_torch_agrees_with_reference_and_keeps_invariants(torch_examples, reliability):
    results, seconds = run_torch(torch_examples)
    runs = nans = 0
    for index, example in enumerate(torch_examples):
        per_rank = results[index]
        if example.checked and example.poison is not None:
            bad = example.poison[0]
            for rank, (status, value) in enumerate(per_rank):
                assert status == "error" and value.startswith("NonFiniteGradError: "), (rank, value)
                if rank == bad:
                    assert f"rank {rank}: NaN or Inf in the gradient of {example.poison[1][1]!r}" in value, value
                else:
                    assert f"rank {rank}: rank {bad} has NaN or Inf" in value, value
            nans += 1
            continue
        errors = [f"rank {r}: {v}" for r, (s, v) in enumerate(per_rank) if s != "ok"]
        assert not errors, (example.scenario, errors[:3])
        got = [v for _, v in per_rank]
        without = None
        if example.scenario.num_tokens is not None and example.poison is None:
            twin = index + 1
            assert torch_examples[twin].scenario.num_tokens is None
            without = [v for _, v in results[twin]]
        check_backend("torch", example, got, without)
        runs += 1
        nans += example.poison is not None
    assert runs >= EXAMPLES
    reliability(
        "property",
        f"{len(torch_examples)} random examples through torch (worlds of "
        f"{sorted({e.scenario.world_size for e in torch_examples})} ranks, {seconds:.0f} s)",
        f"agree with the reference; invariants hold; {nans} NaN / Inf examples propagate or raise everywhere",
    )


# =========================================================================== invalid inputs


@budget()
@given(
    st.fixed_dictionaries(
        {a: st.integers(-1, 5) for a in ("pp", "dp", "cp", "tp", "gtp", "ep", "egtp")},
        optional={"etp": st.integers(-1, 5), "edp": st.integers(-1, 5)},
    )
)
def invalid_parallel_dims_raise_value_error(sizes):
    valid = all(v >= 1 for v in sizes.values())
    if valid:
        inner = sizes["dp"] * sizes["cp"] * sizes["gtp"] * sizes["tp"]
        expert = sizes["ep"] * sizes.get("etp", sizes["tp"]) * sizes["egtp"]
        valid = inner % expert == 0 and sizes.get("edp", inner // expert) * expert == inner
    if valid:
        dims = ParallelDims(**sizes)
        assert dims.edp * dims.ep * dims.etp * dims.egtp == dims.dp * dims.cp * dims.gtp * dims.tp
    else:
        with pytest.raises(ValueError, match="ParallelDims"):
            ParallelDims(**sizes)


_FIELDS = {f.name: f for f in dataclasses.fields(FinalizeConfig)}
_BAD_VALUES = st.one_of(
    st.sampled_from(["yes", "", "aux-loss", "every", None, 1.5, -2, float("nan"), (0.5,), [1], object()]),
    st.integers(-5, 5),
)


@budget()
@given(st.sampled_from(sorted(_FIELDS)), _BAD_VALUES)
def invalid_config_values_raise_type_or_value_error_naming_the_field(name, value):
    try:
        config = FinalizeConfig(**{name: value})
    except (TypeError, ValueError) as err:
        assert f"FinalizeConfig.{name}" in str(err), str(err)
        return
    # Accepted: then it is a value of the field's documented kind.
    stored = getattr(config, name)
    kind = _FIELDS[name].type
    if kind == "bool":
        assert isinstance(stored, bool)
    elif name == "mtp_num_layers":
        assert stored is None or (isinstance(stored, int) and stored >= 0)
    elif name.endswith("_stages"):
        assert stored is None or all(isinstance(s, int) and s >= 0 for s in stored)
    elif name in ("moe_router_bias_update_rate", "moe_router_quantile_balancing_ema"):
        assert isinstance(stored, (int, float)) and np.isfinite(stored)
    else:
        assert isinstance(stored, str)


_SMALL = Scenario("invalid-jax", dp=2, tp=2, params=gpt_params(), config=dict(sequence_parallel=True))


@budget()
@given(
    st.sampled_from(["leading", "trailing", "int_dtype", "missing", "extra", "float_tokens", "nan_checked"]),
    st.integers(0, 3),
)
def invalid_jax_inputs_raise_documented_errors(kind, rank):
    jax, finalize_stacked, stack_inputs, _ = _jax_side()
    scenario = _SMALL
    if kind == "nan_checked":
        scenario = dataclasses.replace(_SMALL, config={**_SMALL.config, "check_for_nan_in_grad": True})
    dims = scenario_dims(scenario)
    params, routers = scenario_specs(scenario)
    config = FinalizeConfig.from_mapping(dict(scenario.config))
    inputs = [make_rank_inputs(scenario, r) for r in range(4)]
    grads, rstate, tokens = stack_inputs(scenario, inputs)
    key = sorted(grads)[rank % len(grads)]
    errors = {"leading": ValueError, "trailing": ValueError, "int_dtype": TypeError, "missing": KeyError,
              "extra": ValueError, "float_tokens": TypeError, "nan_checked": ValueError}
    if kind == "leading":
        grads[key] = grads[key][:3]
    elif kind == "trailing":
        grads[key] = grads[key].reshape(4, -1)[:, :1] if grads[key][0].size > 1 else grads[key][..., None]
    elif kind == "int_dtype":
        grads[key] = np.asarray(grads[key]).astype(np.int32)
    elif kind == "missing":
        del grads[key]
    elif kind == "extra":
        grads[(5, "not.a.param")] = np.zeros((4, 2), np.float32)
    elif kind == "float_tokens":
        tokens = np.ones(4, np.float32)
    else:
        grads[key] = np.array(grads[key])
        grads[key][rank].reshape(-1)[0] = np.nan
    with pytest.raises(errors[kind]) as info:
        finalize_stacked(grads, rstate, tokens, params=params, routers=routers, config=config, dims=dims,
                         devices=jax.devices("cpu")[:4])
    if kind == "nan_checked":
        assert str(info.value).startswith(f"rank {rank}: NaN or Inf in the gradient of {key[1]!r}")
    elif kind in ("int_dtype", "missing"):
        assert key[1] in str(info.value)


_LOCAL = Scenario("invalid-torch", params=gpt_params(experts=True), routers=moe_routers(),
                  config=dict(calculate_per_token_loss=True, moe_router_enable_expert_bias=True))


@budget()
@given(
    st.sampled_from(["num_tokens_dtype", "num_tokens_shape", "num_tokens_meta", "grad_shape", "grad_dtype"]),
    st.sampled_from([torch.float16, torch.float32, torch.float64, torch.bool, torch.complex64]),
    st.integers(2, 5),
    st.integers(0, 100),
)
def invalid_torch_inputs_raise_before_touching_anything(kind, dtype, length, pick):
    from parity_tests.torch_world import build_model, load_inputs
    from test_reliability_inputs import attempt
    from torch_impl import finalize_model_grads

    model = build_model(_LOCAL, 0, FinalizeConfig.from_mapping(_LOCAL.config))
    load_inputs(model, _LOCAL, make_rank_inputs(_LOCAL, 0))
    names = [p.name for p in _LOCAL.params if p.requires_grad]
    name = names[pick % len(names)]
    tokens: Any = torch.tensor(4)
    if kind == "num_tokens_dtype":
        # Integer and floating counts are valid (as in Megatron); bool and complex are not.
        bad = dtype in (torch.bool, torch.complex64)
        tokens = torch.ones((), dtype=dtype if bad else torch.bool)
        error, text = TypeError, "num_tokens must be an integer or floating tensor"
    elif kind == "num_tokens_shape":
        tokens, error, text = torch.ones(length, dtype=torch.int64), TypeError, "num_tokens must be a one-element"
    elif kind == "num_tokens_meta":
        tokens, error, text = torch.tensor(4, device="meta"), ValueError, "meta device"
    elif kind == "grad_shape":
        p = model[0].get_parameter(name)
        p.main_grad = torch.zeros(p.numel() + length - 1)
        error, text = ValueError, f"{name!r} (chunk 0) has shape"
    else:
        p = model[0].get_parameter(name)
        if dtype.is_floating_point:
            p.main_grad = torch.zeros(p.shape, dtype=torch.int32)
        else:
            p.main_grad = torch.zeros(p.shape, dtype=dtype)
        error, text = TypeError, repr(name)
    kind_name, message, untouched, _ = attempt(model, lambda m: finalize_model_grads(m, num_tokens=tokens))
    assert kind_name == error.__name__ and text in message and message.startswith("rank 0: "), (kind_name, message)
    assert untouched


def test_random_invalid_inputs_raise_documented_errors(reliability):
    pytest.importorskip("jax")
    invalid_parallel_dims_raise_value_error()
    invalid_config_values_raise_type_or_value_error_naming_the_field()
    invalid_jax_inputs_raise_documented_errors()
    invalid_torch_inputs_raise_before_touching_anything()
    reliability("property", f"{EXAMPLES} x 4 random invalid inputs (dims, config, jax arrays, torch tensors)",
                "each raises its documented error (ValueError / TypeError / KeyError); torch changes nothing")
