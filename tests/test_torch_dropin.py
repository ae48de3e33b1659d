"""torch_impl as a drop-in replacement for ``megatron.core.distributed.finalize_model_grads``.

* The public functions have Megatron's names and parameter lists (the seed API page).
* No library module imports megatron; with ``pg_collection=None`` megatron is looked up in
  ``sys.modules`` only.
* In one gloo world of 4 ranks, every kind of group source -- a ProcessGroupCollection-like
  object, a mapping, a DeviceMesh, MeshGroups, TorchGroups and (when megatron-core is
  installed) Megatron's own ProcessGroupCollection and ``pg_collection=None`` with an
  initialized ``parallel_state`` -- gives the same, reference-exact numbers; wrapped chunks
  (``.module`` chains, config and ddp_config at different depths) read their Megatron
  config fields; bad sources raise clear errors (never AssertionError) and change nothing.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import types
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch_impl  # noqa: E402
from parity_tests.scenarios import RankData, Scenario, gpt_params, make_rank_inputs, moe_routers  # noqa: E402
from test_reliability_inputs import kind_of  # noqa: E402
from parity_tests.torch_world import build_model, collection, load_inputs, read_outputs  # noqa: E402
from parity_tests.megatron_state import preload_megatron_core  # noqa: E402
from parity_tests.world_cases import local_cases, run_cases  # noqa: E402

#: Parameter names, in order, of every function of the seed API page (megatron-core).
SEED_SIGNATURES = {
    "_get_main_grad_attr": ["param"],
    "_unshard_if_dtensor": ["tensor"],
    "_reshard_if_dtensor": ["tensor_to_shard", "reference_tensor"],
    "_allreduce_conditional_embedding_grads": ["model", "config", "pp_group"],
    "_get_shared_word_embedding_weight": ["model_module", "config"],
    "_get_position_embedding_weight": ["model_module"],
    "_allreduce_word_embedding_grads": ["model", "config", "embd_group", "pp_group"],
    "_allreduce_embedding_grad": ["model", "embd_group", "pp_group", "weight_getter", "skip_if_none", "config"],
    "_allreduce_position_embedding_grads": ["model", "config", "pos_emb_group", "pp_group"],
    "_allreduce_router_grads": ["model", "config"],
    "reset_model_temporary_tensors": ["config", "model"],
    "_update_router_expert_bias": ["model", "config", "tp_dp_cp_group"],
    "_update_router_qb_beta": ["model", "config", "dp_cp_group"],
    "_allreduce_non_tensor_model_parallel_grads": ["model", "config", "tp_group"],
    "_allreduce_layernorm_grads": ["model", "config", "tp_group"],
    "_allreduce_replicated_grads_over_gtp_remat_group": [
        "model", "gtp_remat_group", "egtp_remat_group", "calculate_per_token_loss"],
    "finalize_model_grads": ["model", "num_tokens", "pg_collection", "force_all_reduce"],
}


def _positional(fn: Any) -> list[str]:
    return [
        p.name
        for p in inspect.signature(fn).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]


@pytest.mark.parametrize("name", sorted(SEED_SIGNATURES))
def test_seed_signatures(name: str) -> None:
    # Our positional parameters start with the seed's (extensions are keyword-only or
    # trailing and optional).
    assert _positional(getattr(torch_impl, name))[: len(SEED_SIGNATURES[name])] == SEED_SIGNATURES[name]


def test_signatures_accept_megatron_calls() -> None:
    """Every function megatron-core has is in torch_impl, and each call shape megatron-core
    accepts (its positional parameters) binds to ours."""
    pytest.importorskip("megatron.core")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.distributed  # noqa: F401
    theirs = sys.modules["megatron.core.distributed.finalize_model_grads"]
    names = [n for n in SEED_SIGNATURES if hasattr(theirs, n)]
    assert {"finalize_model_grads", "_allreduce_word_embedding_grads", "reset_model_temporary_tensors"} <= set(names)
    for name in names:
        params = list(inspect.signature(getattr(theirs, name)).parameters)
        inspect.signature(getattr(torch_impl, name)).bind(*params)  # raises if it does not fit


def test_no_megatron_import_in_library_code() -> None:
    code = (
        "import sys, torch, torch.nn as nn\n"
        "import meshgrad, torch_impl, torch_impl.finalize, torch_impl.run.groups, torch_impl.sources.discover\n"
        "from meshgrad import FinalizeConfig\n"
        "m = nn.Linear(2, 2); m.config = FinalizeConfig()\n"
        "torch_impl.finalize_model_grads([m])\n"
        "torch_impl._allreduce_word_embedding_grads([m], m.config)\n"
        "assert not [k for k in sys.modules if k.startswith('megatron')], 'megatron imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_world_of_one_without_groups() -> None:
    model = build_model(SCENARIO_1, 0, types.SimpleNamespace(**SCENARIO_1.config))
    data = make_rank_inputs(SCENARIO_1, 0)
    load_inputs(model, SCENARIO_1, data)
    torch_impl.finalize_model_grads(model, num_tokens=torch.tensor(4))
    out = read_outputs(model, SCENARIO_1, data)
    for key, g in data.grads.items():
        assert (g is None and out.grads[key] is None) or np.array_equal(out.grads[key], g / 4)


@pytest.mark.parametrize("bad", [42, "groups", object()])
def test_unknown_group_source_is_a_type_error(bad: Any) -> None:
    model = build_model(SCENARIO_1, 0, types.SimpleNamespace(**SCENARIO_1.config))
    with pytest.raises(TypeError, match="pg_collection must be"):
        torch_impl.finalize_model_grads(model, pg_collection=bad)


SCENARIO_1 = Scenario("one", params=gpt_params(), config=dict(calculate_per_token_loss=True), num_tokens="random")


# =========================================================================== gloo world of 4

WORLD = 4
DROPIN = Scenario(
    "dropin",
    pp=2,
    tp=2,
    num_chunks=2,
    params=gpt_params(experts=True),
    routers=tuple(r for r in moe_routers() if r.num_experts == 4),
    config=dict(sequence_parallel=True, qk_layernorm=True, has_cond_embedder=True, moe_router_enable_expert_bias=True,
                moe_router_bias_update_rate=0.25, calculate_per_token_loss=True),
    num_tokens="random",
)
#: DP-sync options from a DDP config on the outermost wrapper (dp2: the sync really runs).
DDP_OPTIONS = Scenario(
    "ddp-options",
    dp=2,
    tp=2,
    num_chunks=2,
    params=gpt_params(experts=True),
    config=dict(sequence_parallel=True, use_distributed_optimizer=True, grad_reduce_in_fp32=True),
    dtype="bfloat16",
    mode="wide",
    seed=3,
)
_CACHE: dict[Any, Any] = {}


def _megatron_config(scenario: Scenario, ddp_in_config: bool = True) -> Any:
    """A TransformerConfig-like namespace (Megatron field names)."""
    fields = {k: v for k, v in scenario.config.items()
              if ddp_in_config or k not in ("use_distributed_optimizer", "grad_reduce_in_fp32", "average_in_collective")}
    return types.SimpleNamespace(**fields, tensor_model_parallel_size=scenario.tp,
                                 pipeline_model_parallel_size=scenario.pp, expert_model_parallel_size=scenario.ep,
                                 expert_tensor_parallel_size=scenario.expert_tp)


def _run(scenario: Scenario, rank: int, source: Any, model: list[Any] | None = None) -> RankData:
    data = make_rank_inputs(scenario, rank)
    if model is None:
        model = build_model(scenario, rank, _megatron_config(scenario))
    load_inputs([_inner(c) for c in model], scenario, data)
    n = None if data.num_tokens is None else torch.tensor(data.num_tokens)
    torch_impl.finalize_model_grads(model, num_tokens=n, pg_collection=source)
    return read_outputs([_inner(c) for c in model], scenario, data)


def _inner(chunk: Any) -> Any:
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _mesh(scenario: Scenario) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    key = ("mesh", scenario.pp, scenario.dp, scenario.tp)
    if key not in _CACHE:
        _CACHE[key] = init_device_mesh("cpu", key[1:], mesh_dim_names=("pp", "dp", "tp"))
    return _CACHE[key]


def _error(call: Any) -> tuple[str, str]:
    try:
        call()
    except Exception as err:
        return kind_of(err), str(err)
    return "no error", ""


def case_sources(rank: int, world: int) -> dict[str, Any]:
    """The same finalize through every kind of group source."""
    from meshgrad import Group
    from torch_impl import TorchGroups, mesh_groups

    out: dict[str, Any] = {}
    pgc = collection(DROPIN, _CACHE)
    out["namespace"] = _run(DROPIN, rank, pgc)
    out["mapping"] = _run(DROPIN, rank, {Group(k): v for k, v in vars(pgc).items()})
    out["mapping-str"] = _run(DROPIN, rank, dict(vars(pgc)))
    out["mesh"] = _run(DROPIN, rank, _mesh(DROPIN))
    out["meshgroups"] = _run(DROPIN, rank, mesh_groups(_mesh(DROPIN)))
    out["mesh-again"], out["mesh-again-groups"] = _counting_new_groups(lambda: _run(DROPIN, rank, _mesh(DROPIN)))
    out["torchgroups"] = _run(DROPIN, rank, TorchGroups.from_collection(pgc))
    # No groups and no parallel_state in a world of 4: a clear error, nothing changed.
    model = build_model(DROPIN, rank, _megatron_config(DROPIN))
    data = make_rank_inputs(DROPIN, rank)
    load_inputs(model, DROPIN, data)
    out["none-error"] = _error(lambda: torch_impl.finalize_model_grads(model))
    out["none-untouched"] = read_outputs(model, DROPIN, data)
    out["helper-none-error"] = _error(lambda: torch_impl._allreduce_non_tensor_model_parallel_grads(model, model[0].config))
    out["megatron"] = _megatron_sources(rank)
    return out


def _counting_new_groups(call: Any) -> tuple[Any, int]:
    """``call()``'s result and how many process groups it created."""
    import torch.distributed as dist

    made: list[int] = []
    new_group = dist.new_group

    def counting(*args: Any, **kwargs: Any) -> Any:
        made.append(1)
        return new_group(*args, **kwargs)

    dist.new_group = counting
    try:
        return call(), len(made)
    finally:
        dist.new_group = new_group


def _megatron_sources(rank: int) -> Any:
    """Megatron's own ProcessGroupCollection, and pg_collection=None with parallel_state."""
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core import parallel_state as ps
            from megatron.core.process_groups_config import ProcessGroupCollection
            from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError:
        return "megatron-core not installed"
    ps.initialize_model_parallel(tensor_model_parallel_size=DROPIN.tp, pipeline_model_parallel_size=DROPIN.pp,
                                 expert_tensor_parallel_size=DROPIN.expert_tp, create_gloo_process_groups=False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2)
        for name, value in _megatron_config(DROPIN).__dict__.items():
            setattr(config, name, value)
        out = {}
        model = build_model(DROPIN, rank, config)
        out["pgc"] = _run(DROPIN, rank, ProcessGroupCollection.use_mpu_process_groups(), model)
        model = build_model(DROPIN, rank, config)
        out["none"] = _run(DROPIN, rank, None, model)
        from torch_impl import execution_stats

        built = execution_stats(model).plans_built  # one TorchGroups per parallel_state: the plan is reused
        _run(DROPIN, rank, None, model)  # the same call again
        out["stable"] = built >= 1 and execution_stats(model).plans_built == built
        return out
    finally:
        ps.destroy_model_parallel()


def case_wrapped(rank: int, world: int) -> dict[str, Any]:
    """Megatron-style wrapping: DDP-like(Float16Module-like(model)); config on the model,
    ddp_config on the outermost wrapper; DP options come from the ddp_config."""
    from torch import nn

    class Wrapper(nn.Module):
        def __init__(self, module: nn.Module, **attrs: Any) -> None:
            super().__init__()
            self.module = module
            for k, v in attrs.items():
                setattr(self, k, v)

    ddp_config = types.SimpleNamespace(use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                                       average_in_collective=False, use_megatron_fsdp=False, check_for_nan_in_grad=True)
    pgc = collection(DDP_OPTIONS, _CACHE)
    inner = build_model(DDP_OPTIONS, rank, _megatron_config(DDP_OPTIONS, ddp_in_config=False))
    wrapped = [Wrapper(Wrapper(c), ddp_config=ddp_config) for c in inner]
    seen: list[str] = []
    import torch.distributed as dist

    original = dist.all_reduce, getattr(dist, "reduce_scatter_single", None), dist.reduce_scatter_tensor

    def spy(name: str, fn: Any) -> Any:
        def call(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            seen.append(f"{name}:{tensor.dtype}")
            return fn(tensor, *args, **kwargs)
        return call

    dist.all_reduce = spy("all_reduce", original[0])
    if original[1] is not None:
        dist.reduce_scatter_single = spy("reduce_scatter", original[1])
    dist.reduce_scatter_tensor = spy("reduce_scatter", original[2])
    try:
        got = _run(DDP_OPTIONS, rank, pgc, wrapped)
    finally:
        dist.all_reduce = original[0]
        if original[1] is not None:
            dist.reduce_scatter_single = original[1]
        dist.reduce_scatter_tensor = original[2]
    return {"wrapped": got, "collectives": seen}


CASES = local_cases(globals())


@pytest.fixture(scope="module")
def world() -> dict[str, list[Any]]:
    got = run_cases(__name__, CASES, WORLD, timeout=300, prepare=preload_megatron_core)
    out = {}
    for name, per_rank in got.items():
        problems = [f"rank {r}: {s}: {v}" for r, (s, v) in enumerate(per_rank) if s != "ok"]
        assert not problems, "\n".join(problems)
        out[name] = [v for _, v in per_rank]
    return out


def _reference(scenario: Scenario) -> list[RankData]:
    from parity_tests import reference

    return reference.reference_finalize(scenario, [make_rank_inputs(scenario, r) for r in range(scenario.world_size)]).outputs


def _assert_equal(got: list[RankData], want: list[RankData], routers: bool = True) -> None:
    for rank, (g, w) in enumerate(zip(got, want)):
        for key, value in w.grads.items():
            assert (value is None) == (g.grads[key] is None), (rank, key)
            if value is not None:
                np.testing.assert_array_equal(g.grads[key], value, err_msg=f"rank {rank} {key}")
        if routers:
            for key, state in w.routers.items():
                np.testing.assert_array_equal(g.routers[key].expert_bias, state.expert_bias, err_msg=f"rank {rank} {key}")
                np.testing.assert_array_equal(g.routers[key].local_tokens_per_expert, state.local_tokens_per_expert)


@pytest.mark.parametrize("source", ["namespace", "mapping", "mapping-str", "mesh", "meshgroups", "torchgroups", "mesh-again"])
def test_every_group_source_gives_the_reference_numbers(world, source: str) -> None:
    _assert_equal([r[source] for r in world["case_sources"]], _reference(DROPIN))


def test_models_given_one_mesh_share_its_process_groups(world) -> None:
    """A new model over a DeviceMesh an earlier model used creates no process group (the
    mesh's groups are kept once per live mesh, not per model) and gets the same numbers."""
    assert [r["mesh-again-groups"] for r in world["case_sources"]] == [0] * WORLD


def test_megatron_collection_and_parallel_state(world) -> None:
    per_rank = [r["megatron"] for r in world["case_sources"]]
    if isinstance(per_rank[0], str):
        pytest.skip(per_rank[0])
    want = _reference(DROPIN)
    _assert_equal([r["pgc"] for r in per_rank], want)
    _assert_equal([r["none"] for r in per_rank], want)
    assert all(r["stable"] for r in per_rank)  # one TorchGroups per parallel_state: the plan is reused


def test_no_groups_in_a_multi_rank_world_is_a_clear_error(world) -> None:
    inputs = [make_rank_inputs(DROPIN, r) for r in range(WORLD)]
    for rank, out in enumerate(world["case_sources"]):
        kind, message = out["none-error"]
        assert kind == "MegatronAssertionError" and f"rank {rank}" in message and "parallel_state" in message, message
        _assert_equal([out["none-untouched"]], [inputs[rank]])
        kind, message = out["helper-none-error"]
        assert kind == "MegatronAssertionError" and "'tp'" in message, message


def test_wrapped_chunks_read_config_and_ddp_config(world) -> None:
    per_rank = world["case_wrapped"]
    _assert_equal([r["wrapped"] for r in per_rank], _reference(DDP_OPTIONS), routers=False)
    for r in per_rank:
        # use_distributed_optimizer and grad_reduce_in_fp32 came from the outer ddp_config.
        dp = [c for c in r["collectives"] if c.startswith("reduce_scatter")]
        assert dp and all(c.endswith("float32") for c in dp), r["collectives"]


def test_mtp_chunk_rule_applies_to_the_word_embedding_only() -> None:
    """As megatron-core: a middle stage reduces its position embedding from chunk 0 even
    with MTP layers, its word embedding from the last chunk (tests/test_megatron_oracle.py
    checks the same against megatron-core itself)."""
    from meshgrad import FinalizeConfig, Group, GroupSizes, ParamSpec, Role, Step, plan_finalize

    specs = [ParamSpec(name, chunk=c, shape=(2,), role=role)
             for c in (0, 1)
             for name, role in (("word.weight", Role.WORD_EMBEDDING), ("pos.weight", Role.POSITION_EMBEDDING))]
    sizes = GroupSizes(sizes={Group.PP: 3}, embd_stages=(0, 1, 2), pos_embd_stages=(0, 1, 2))
    plan = plan_finalize(specs, FinalizeConfig(mtp_num_layers=1), sizes, dp_sync=False)
    word, pos = plan.for_step(Step.WORD_EMBEDDING)[0], plan.for_step(Step.POS_EMBEDDING)[0]
    assert word.keys_by_stage == ((0, "word.weight"), (1, "word.weight"), (1, "word.weight"))
    assert pos.keys_by_stage == ((0, "pos.weight"), (0, "pos.weight"), (1, "pos.weight"))
