"""Each seed helper of torch_impl.finalize in a gloo world of 4 ranks, checked by value.

One world runs every ``case_*`` function below on every rank (spawning is the slow
part); the tests then compare each rank's outputs with values computed here from the
same per-rank inputs. Data are small integers, so every check is bit-exact (qb_beta
excepted: its EMA is not exact in binary).
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from meshgrad import FinalizeConfig  # noqa: E402
from parity_tests.specs import scenario_dims  # noqa: E402
from parity_tests.scenarios import (  # noqa: E402
    POS_EMB,
    WORD_EMB,
    ParamLayout,
    RankData,
    Scenario,
    gpt_params,
    make_rank_inputs,
    moe_routers,
)
from parity_tests.torch_world import build_model, collection, load_inputs, read_outputs  # noqa: E402
from parity_tests.world_cases import case_values, local_cases, run_cases  # noqa: E402
from test_reliability_inputs import ddp_buffer_layout  # noqa: E402

WORLD = 4
_GROUPS: dict[Any, Any] = {}  # per worker process: groups per mesh (tests only)

ALL_ON = dict(sequence_parallel=True, qk_layernorm=True, has_cond_embedder=True, flextron=True)
PP_TP = Scenario("pp2tp2", pp=2, tp=2, num_chunks=2, params=gpt_params(), config=ALL_ON)
POS_ALL = Scenario("pos-all", pp=2, tp=2, num_chunks=2, params=gpt_params(), config=dict(position_embedding_stages=(0, 1)))
POS_FROZEN = Scenario(
    "pos-frozen",
    pp=2,
    tp=2,
    params=tuple(p if p.name != POS_EMB else ParamLayout(POS_EMB, (4, 4), role="position_embedding", requires_grad=False) for p in gpt_params()),
    config=dict(position_embedding_stages=(0, 1)),
)
ROUTER_CFG = dict(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.25,
                  moe_router_load_balancing_type="quantile_balancing", moe_router_quantile_balancing_ema=0.5)
DP_TP = Scenario("dp2tp2", dp=2, tp=2, params=gpt_params(experts=True), routers=moe_routers(qb=True), config=ROUTER_CFG)
GTP = Scenario("gtp2tp2", gtp=2, tp=2, ep=2, etp=1, egtp=2, params=gpt_params(experts=True, gtp_remat=True))
DDP_MESH = Scenario("pp2dp2", pp=2, dp=2, params=gpt_params(), config=dict(calculate_per_token_loss=True), num_tokens="random")


def _prepare(scenario: Scenario, rank: int) -> tuple[list[Any], Any, RankData]:
    config = types.SimpleNamespace(**scenario.config)
    model = build_model(scenario, rank, config)
    data = make_rank_inputs(scenario, rank)
    load_inputs(model, scenario, data)
    return model, collection(scenario, _GROUPS), data


def _inputs(scenario: Scenario) -> list[RankData]:
    return [make_rank_inputs(scenario, r) for r in range(scenario.world_size)]


def _coords(scenario: Scenario, rank: int) -> dict[str, int]:
    return {str(k): v for k, v in scenario_dims(scenario).coords(rank).items()}


def _peers(scenario: Scenario, rank: int, axes: tuple[str, ...]) -> list[int]:
    return scenario_dims(scenario).axis_ranks(rank, axes)


# =========================================================================== cases (run on every rank)


def case_non_tp(rank: int, world: int) -> RankData:
    from torch_impl import _allreduce_non_tensor_model_parallel_grads

    model, pgc, data = _prepare(PP_TP, rank)
    _allreduce_non_tensor_model_parallel_grads(model, model[0].config, pgc.tp)
    return read_outputs(model, PP_TP, data)


def case_cond_embedder(rank: int, world: int) -> RankData:
    from torch_impl import _allreduce_conditional_embedding_grads

    model, pgc, data = _prepare(PP_TP, rank)
    _allreduce_conditional_embedding_grads(model, model[0].config, pgc.pp)
    return read_outputs(model, PP_TP, data)


def case_router(rank: int, world: int) -> RankData:
    from torch_impl import _allreduce_router_grads

    model, pgc, data = _prepare(PP_TP, rank)
    _allreduce_router_grads(model, model[0].config, pp_group=pgc.pp)
    return read_outputs(model, PP_TP, data)


def case_word_embedding(rank: int, world: int) -> RankData:
    from torch_impl import _allreduce_word_embedding_grads

    model, pgc, data = _prepare(PP_TP, rank)
    _allreduce_word_embedding_grads(model, model[0].config, pgc.embd, pgc.pp)
    return read_outputs(model, PP_TP, data)


def case_word_embedding_untied(rank: int, world: int) -> RankData:
    from torch_impl import _allreduce_word_embedding_grads

    model, pgc, data = _prepare(PP_TP, rank)
    for chunk in model:
        chunk.share_embeddings_and_output_weights = False
    _allreduce_word_embedding_grads(model, model[0].config, pgc.embd, pgc.pp)
    return read_outputs(model, PP_TP, data)


def case_position_embedding(rank: int, world: int) -> RankData:
    from torch_impl import _allreduce_position_embedding_grads

    model, pgc, data = _prepare(POS_ALL, rank)
    _allreduce_position_embedding_grads(model, model[0].config, pgc.pos_embd, pgc.pp)
    return read_outputs(model, POS_ALL, data)


def case_position_embedding_frozen(rank: int, world: int) -> list[tuple[str, bool]]:
    from torch_impl import _allreduce_position_embedding_grads, finalize_model_grads

    model, pgc, data = _prepare(POS_FROZEN, rank)
    before = read_outputs(model, POS_FROZEN, data)
    out = []
    for call in (
        lambda: _allreduce_position_embedding_grads(model, model[0].config, pgc.pos_embd, pgc.pp),
        lambda: finalize_model_grads(model, pg_collection=pgc),
    ):
        try:
            call()
            out.append(("no error", False))
        except ValueError as err:
            out.append((str(err), _same_grads(before, read_outputs(model, POS_FROZEN, data))))
    return out


def case_custom_embedding_getter(rank: int, world: int) -> RankData:
    from torch_impl import _allreduce_embedding_grad

    model, pgc, data = _prepare(PP_TP, rank)
    _allreduce_embedding_grad(
        model, pgc.embd, pgc.pp, lambda m: m.get_parameter("decoder.final_layernorm.weight"), config=model[0].config
    )
    return read_outputs(model, PP_TP, data)


def case_expert_bias(rank: int, world: int) -> RankData:
    from torch_impl import _update_router_expert_bias

    model, pgc, data = _prepare(DP_TP, rank)
    _update_router_expert_bias(model, model[0].config, pgc.tp_dp_cp)
    return read_outputs(model, DP_TP, data)


def case_qb_beta(rank: int, world: int) -> RankData:
    from torch_impl import _update_router_qb_beta

    model, pgc, data = _prepare(DP_TP, rank)
    _update_router_qb_beta(model, model[0].config, pgc.dp_cp)
    return read_outputs(model, DP_TP, data)


def case_gtp_avg(rank: int, world: int) -> RankData:
    from torch_impl import _allreduce_replicated_grads_over_gtp_remat_group

    model, pgc, data = _prepare(GTP, rank)
    _allreduce_replicated_grads_over_gtp_remat_group(model, pgc.gtp_remat, pgc.expt_gtp_remat)
    return read_outputs(model, GTP, data)


def case_gtp_sum(rank: int, world: int) -> RankData:
    from torch_impl import _allreduce_replicated_grads_over_gtp_remat_group

    model, pgc, data = _prepare(GTP, rank)
    _allreduce_replicated_grads_over_gtp_remat_group(model, pgc.gtp_remat, pgc.expt_gtp_remat, calculate_per_token_loss=True)
    return read_outputs(model, GTP, data)


def case_none_group_errors(rank: int, world: int) -> tuple[list[str], bool]:
    from torch_impl import (
        _allreduce_conditional_embedding_grads,
        _allreduce_non_tensor_model_parallel_grads,
        _allreduce_word_embedding_grads,
        _update_router_expert_bias,
    )

    model, pgc, data = _prepare(PP_TP, rank)
    before = read_outputs(model, PP_TP, data)
    cfg = model[0].config
    errors = []
    for call in (
        lambda: _allreduce_non_tensor_model_parallel_grads(model, cfg),
        lambda: _allreduce_conditional_embedding_grads(model, cfg),
        lambda: _allreduce_word_embedding_grads(model, cfg, None, pgc.pp),
        lambda: _update_router_expert_bias(model, FinalizeConfig(moe_router_enable_expert_bias=True)),
    ):
        try:
            call()
            errors.append("no error")
        except ValueError as err:
            errors.append(str(err))
    return errors, _same_grads(before, read_outputs(model, PP_TP, data))


class _DDP(torch.nn.Module):
    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module
        self.calls: list[Any] = []

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        self.calls.append(("finish", force_all_reduce))

    def scale_gradients(self, scale: torch.Tensor) -> None:
        self.calls.append(("scale", str(scale.dtype), float(scale)))


def case_ddp_num_tokens(rank: int, world: int) -> list[Any]:
    from torch_impl import finalize_model_grads

    model, pgc, data = _prepare(DDP_MESH, rank)
    ddp = [_DDP(chunk) for chunk in model]
    finalize_model_grads(ddp, num_tokens=torch.tensor(data.num_tokens), pg_collection=pgc, force_all_reduce=True)
    return ddp[0].calls


def case_dtensor(rank: int, world: int) -> dict[str, Any]:
    """A sequence-parallel DTensor gradient sharded over tp: whole (unsharded) reduction
    versus Megatron-FSDP local-shard reduction, and the DTensor helpers."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from torch_impl import _allreduce_non_tensor_model_parallel_grads, _reshard_if_dtensor, _unshard_if_dtensor

    mesh = _GROUPS.setdefault("dtensor-mesh", init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp")))
    tp_mesh = mesh["tp"]
    out: dict[str, Any] = {}
    for fsdp in (False, True):
        layer = torch.nn.Linear(1, 4, bias=False)
        layer.weight.sequence_parallel = True
        layer.config = FinalizeConfig(sequence_parallel=True, use_megatron_fsdp=fsdp)
        local = torch.full((2, 1), float(rank + 1)) * torch.tensor([[1.0], [10.0]])
        layer.weight.main_grad = distribute_tensor(torch.zeros(4, 1), tp_mesh, [Shard(0)])
        layer.weight.main_grad.to_local().copy_(local)
        layer.weight.main_grad.tag = "kept"
        _allreduce_non_tensor_model_parallel_grads([layer], layer.config, tp_mesh.get_group())
        out[f"fsdp={fsdp}"] = layer.weight.main_grad.to_local().flatten().tolist()
    whole = _unshard_if_dtensor(layer.weight.main_grad)
    again = _reshard_if_dtensor(whole * 2, layer.weight.main_grad)
    out["whole"] = whole.flatten().tolist()
    out["reshard"] = (again.to_local().flatten().tolist(), getattr(again, "tag", None), tuple(again.placements) == (Shard(0),))
    return out


FLAT = Scenario(
    "flat",
    tp=2,
    dp=2,
    params=(
        ParamLayout("norm1.weight", (3,), sequence_parallel=True),
        ParamLayout("norm2.weight", (2, 2), sequence_parallel=True),
    ),
    config=dict(sequence_parallel=True),
)


def case_flat_buffer(rank: int, world: int) -> tuple[RankData, list[bool]]:
    """Gradients that are back-to-back views of one buffer are reduced in place."""
    import torch.distributed as dist

    from torch_impl import _allreduce_non_tensor_model_parallel_grads

    model, pgc, data = _prepare(FLAT, rank)
    buffer = torch.cat([model[0].get_parameter(p.name).main_grad.reshape(-1) for p in FLAT.params])
    offset = 0
    for p in FLAT.params:
        param = model[0].get_parameter(p.name)
        param.main_grad = buffer[offset : offset + param.numel()].view(param.shape)
        offset += param.numel()
    seen: list[bool] = []
    original = dist.all_reduce

    def spy(tensor, *args, **kwargs):
        seen.append(tensor.data_ptr() == buffer.data_ptr() and tensor.numel() == buffer.numel())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = spy
    try:
        _allreduce_non_tensor_model_parallel_grads(model, model[0].config, pgc.tp)
    finally:
        dist.all_reduce = original
    return read_outputs(model, FLAT, data), seen


def case_helper_mismatch(rank: int, world: int) -> tuple[str, bool]:
    """Rank 1 alone flags one more parameter sequence_parallel: its tp group would launch
    different collectives. Called on its own, the helper compares the ranks first."""
    from torch_impl import _allreduce_non_tensor_model_parallel_grads

    model, pgc, data = _prepare(PP_TP, rank)
    before = read_outputs(model, PP_TP, data)
    if rank == 1:
        param = next(p for _, p in model[0].named_parameters() if not getattr(p, "sequence_parallel", False))
        param.sequence_parallel = True
    try:
        _allreduce_non_tensor_model_parallel_grads(model, model[0].config, pgc.tp)
        outcome = "no error"
    except Exception as err:  # noqa: BLE001 - the test compares the type and text
        outcome = f"{type(err).__name__}: {err}"
    return outcome, _same_grads(before, read_outputs(model, PP_TP, data))


def _same_grads(a: RankData, b: RankData) -> bool:
    return all(
        (x is None and b.grads[k] is None) or (x is not None and np.array_equal(x, b.grads[k])) for k, x in a.grads.items()
    )


def _layers(count: int) -> tuple[ParamLayout, ...]:
    """``count`` decoder layers (a sequence-parallel layernorm, q / k layernorms, a TP
    weight, a TP-averaged weight each) and a final layernorm."""
    params = []
    for i in range(count):
        layer = f"decoder.layers.{i}"
        params += [
            ParamLayout(f"{layer}.input_layernorm.weight", (H_LAYERS,), sequence_parallel=True),
            ParamLayout(f"{layer}.self_attention.q_layernorm.weight", (2,)),
            ParamLayout(f"{layer}.self_attention.k_layernorm.weight", (2,)),
            ParamLayout(f"{layer}.self_attention.linear_qkv.weight", (3, H_LAYERS)),
            ParamLayout(f"{layer}.mlp.tp_avg.weight", (3,), average_gradients_across_tp_domain=True),
        ]
    return tuple(params) + (ParamLayout("decoder.final_layernorm.weight", (H_LAYERS,), sequence_parallel=True),)


H_LAYERS = 5
DDP_LAYERS = Scenario("ddp-layers", tp=4, params=_layers(6), config=dict(sequence_parallel=True, qk_layernorm=True))


#: The layernorm whose ``main_grad`` is given another storage after the second call.
SWAPPED = "decoder.layers.2.input_layernorm.weight"


def case_ddp_buffer_layers(rank: int, world: int) -> tuple[RankData, list[bool], bool, RankData, list[float]]:
    """A Megatron DDP's layout: every ``main_grad`` a view of one buffer, parameters in
    reverse order. The non-TP gradients are staged by strided runs (one per position in
    the layer); called twice (the second call takes the kept staging), then once more
    after one layernorm's ``main_grad.data`` moved to a new storage (the runs are views of
    the old one: the step must rebind, reduce the new storage and leave the old alone)."""
    from torch_impl import _allreduce_non_tensor_model_parallel_grads
    from torch_impl.run import strided_runs

    model, pgc, data = _prepare(DDP_LAYERS, rank)
    ddp_buffer_layout(model)
    params = [p for p in model[0].parameters() if p.requires_grad][::-1]
    # The TP weights between the staged gradients in the buffer (``params`` order).
    between = [not (getattr(p, "sequence_parallel", False) or "layernorm" in n or "tp_avg" in n)
               for n, p in model[0].named_parameters() if p.requires_grad][::-1]
    others = torch.cat([p.main_grad.reshape(-1) for p, tp in zip(params, between) if tp]).clone()
    built: list[bool] = []
    build = strided_runs.RunCopies.build

    def spy(*args: Any) -> Any:
        runs = build(*args)
        built.append(runs is not None)
        return runs

    strided_runs.RunCopies.build = spy
    try:
        for _ in range(2):
            _allreduce_non_tensor_model_parallel_grads(model, model[0].config, pgc.tp)
    finally:
        strided_runs.RunCopies.build = build
    untouched = torch.equal(torch.cat([p.main_grad.reshape(-1) for p, tp in zip(params, between) if tp]), others)
    after_two = read_outputs(model, DDP_LAYERS, data)
    swapped = model[0].get_parameter(SWAPPED)
    old = swapped.main_grad.view(-1)  # the old storage, still the DDP buffer's
    swapped.main_grad.data = swapped.main_grad.detach().clone()
    _allreduce_non_tensor_model_parallel_grads(model, model[0].config, pgc.tp)
    return after_two, built, untouched, read_outputs(model, DDP_LAYERS, data), old.tolist()


CASES = local_cases(globals())


# =========================================================================== tests (parent)


@pytest.fixture(scope="module")
def world() -> dict[str, list[tuple[str, Any]]]:
    return run_cases(__name__, CASES, WORLD, timeout=300)


_ok = case_values


def _check(scenario: Scenario, got: list[RankData], expected: dict[tuple[int, Any], np.ndarray]) -> None:
    """Every gradient equals ``expected[(rank, key)]`` when given, else its input."""
    inputs = _inputs(scenario)
    for rank, out in enumerate(got):
        for key, value in out.grads.items():
            want = expected.get((rank, key), inputs[rank].grads[key])
            if want is None:
                assert value is None, (rank, key)
            else:
                np.testing.assert_array_equal(value, want, err_msg=f"rank {rank} {key}")


def test_non_tensor_parallel_grads(world):
    inputs = _inputs(PP_TP)
    expected = {}
    for rank in range(WORLD):
        peers = _peers(PP_TP, rank, ("tp",))
        for key in inputs[rank].grads:
            name = key[1]
            if inputs[rank].grads[key] is None:
                continue
            total = sum(inputs[p].grads[key] for p in peers)
            if "tp_avg" in name:
                expected[(rank, key)] = total / len(peers)
            elif "layernorm" in name:  # sequence_parallel (input/final) and q/k layernorms
                expected[(rank, key)] = total
    _check(PP_TP, _ok(world, "case_non_tp"), expected)


def test_ddp_buffer_layers_staged_by_strided_runs(world):
    """Gradients of a Megatron DDP's buffer, six layers: the layernorms are summed and the
    TP-averaged weights averaged over TP, twice (the second call on the first's result),
    by the strided runs (both reductions use them), and the TP weights between them in the
    buffer keep their values."""
    inputs = _inputs(DDP_LAYERS)
    expected = {}
    for rank in range(WORLD):
        peers = _peers(DDP_LAYERS, rank, ("tp",))
        for key, value in inputs[rank].grads.items():
            total = sum(inputs[p].grads[key] for p in peers)
            if "tp_avg" in key[1]:
                expected[(rank, key)] = total / len(peers)  # the mean of equal means
            elif "layernorm" in key[1]:
                expected[(rank, key)] = total * len(peers)
    got = _ok(world, "case_ddp_buffer_layers")
    _check(DDP_LAYERS, [out for out, *_ in got], expected)
    for rank, (_, built, untouched, _, _) in enumerate(got):
        assert built == [True, True] and untouched, (rank, built, untouched)
    # A third call after one main_grad's storage moved: every layernorm summed once more,
    # the moved one in its new storage, its old place in the buffer as the second call left it.
    third = {k: v * len(_peers(DDP_LAYERS, k[0], ("tp",))) if "layernorm" in k[1][1] else v
             for k, v in expected.items()}
    _check(DDP_LAYERS, [out for *_, out, _ in got], third)
    for rank, (*_, old) in enumerate(got):
        np.testing.assert_array_equal(old, expected[(rank, (0, SWAPPED))], err_msg=f"rank {rank}")


@pytest.mark.parametrize("case,param", [("case_cond_embedder", "cond_embedder.timestep.weight"), ("case_router", "flextron_router.weight")])
def test_pipeline_replicated_grads(world, case, param):
    inputs = _inputs(PP_TP)
    expected = {}
    for rank in range(WORLD):
        peers = _peers(PP_TP, rank, ("pp",))
        total = sum(inputs[p].grads[(c, param)] for p in peers for c in range(PP_TP.num_chunks))
        for c in range(PP_TP.num_chunks):
            expected[(rank, (c, param))] = total
    _check(PP_TP, _ok(world, case), expected)


def _embedding_expected(scenario: Scenario, param: str, stages: tuple[int, ...]) -> dict:
    """Stage s uses chunk 0 on the first stage, the last chunk on the last (no MTP)."""
    inputs = _inputs(scenario)
    last = scenario.num_chunks - 1
    expected = {}
    for rank in range(WORLD):
        stage = _coords(scenario, rank)["pp"]
        if stage not in stages:
            continue
        peers = [p for p in _peers(scenario, rank, ("pp",)) if _coords(scenario, p)["pp"] in stages]
        chunk_of = lambda r: 0 if _coords(scenario, r)["pp"] == 0 else last  # noqa: E731
        expected[(rank, (chunk_of(rank), param))] = sum(inputs[p].grads[(chunk_of(p), param)] for p in peers)
    return expected


def test_word_embedding_grads(world):
    _check(PP_TP, _ok(world, "case_word_embedding"), _embedding_expected(PP_TP, WORD_EMB, (0, 1)))


def test_word_embedding_untied_is_noop(world):
    _check(PP_TP, _ok(world, "case_word_embedding_untied"), {})


def test_position_embedding_grads(world):
    _check(POS_ALL, _ok(world, "case_position_embedding"), _embedding_expected(POS_ALL, POS_EMB, (0, 1)))


def test_position_embedding_without_grad_raises_before_mutation(world):
    for rank, results in enumerate(_ok(world, "case_position_embedding_frozen")):
        for message, untouched in results:
            assert f"rank {rank}" in message and POS_EMB in message, message
            assert untouched


def test_custom_embedding_getter(world):
    name = "decoder.final_layernorm.weight"
    _check(PP_TP, _ok(world, "case_custom_embedding_getter"), _embedding_expected(PP_TP, name, (0, 1)))


def test_expert_bias_one_sum_over_tp_dp_cp(world):
    inputs = _inputs(DP_TP)
    got = _ok(world, "case_expert_bias")
    for rank in range(WORLD):
        for layout in DP_TP.routers:
            key = (0, layout.name)
            before = inputs[rank].routers[key]
            bias = got[rank].routers[key].expert_bias
            if not layout.training or layout.frozen_expert_bias:
                np.testing.assert_array_equal(bias, before.expert_bias)
                continue
            tokens = sum(inputs[p].routers[key].local_tokens_per_expert for p in range(WORLD))
            want = (before.expert_bias + 0.25 * np.sign(tokens.mean() - tokens)).astype(np.float32)
            np.testing.assert_array_equal(bias, want)
    _check(DP_TP, got, {})


def test_qb_beta_mean_over_dp_cp(world):
    inputs = _inputs(DP_TP)
    got = _ok(world, "case_qb_beta")
    for rank in range(WORLD):
        peers = _peers(DP_TP, rank, ("dp", "cp"))
        for layout in DP_TP.routers:
            key = (0, layout.name)
            before = inputs[rank].routers[key]
            if not layout.training:
                np.testing.assert_array_equal(got[rank].routers[key].qb_beta, before.qb_beta)
                continue
            local = [inputs[p].routers[key].qb_beta_accum / max(float(inputs[p].routers[key].qb_beta_count), 1.0) for p in peers]
            new = 0.5 * before.qb_beta + 0.5 * np.mean(local, axis=0)
            np.testing.assert_allclose(got[rank].routers[key].qb_beta, new - new.mean(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("case,op", [("case_gtp_avg", "avg"), ("case_gtp_sum", "sum")])
def test_gtp_remat_replicated_grads(world, case, op):
    inputs = _inputs(GTP)
    expected = {}
    for rank in range(WORLD):
        for layout in GTP.params:
            key = (0, layout.name)
            if layout.is_gtp_weight_remat or not layout.requires_grad:
                continue
            peers = _peers(GTP, rank, ("egtp",) if layout.expert else ("gtp",))
            total = sum(inputs[p].grads[key] for p in peers)
            expected[(rank, key)] = total / len(peers) if op == "avg" else total
    _check(GTP, _ok(world, case), expected)


def test_helpers_need_explicit_groups_in_a_multi_rank_world(world):
    for rank, (errors, untouched) in enumerate(_ok(world, "case_none_group_errors")):
        assert untouched
        # As Megatron: tp, pp and tp_dp_cp would be looked up in parallel_state (an error
        # without it); a None embedding group is parallel_state's or none: nothing to do.
        assert errors[2] == "no error"
        for message, group in zip(errors[:2] + errors[3:], ("'tp'", "'pp'", "'tp_dp_cp'")):
            assert f"rank {rank}" in message and group in message and "None" in message, message


def test_a_helper_alone_compares_the_ranks_of_its_group(world):
    # tp group {0, 1} differs: ConsistencyError on both, nothing changed; {2, 3} agree.
    for rank, (outcome, untouched) in enumerate(_ok(world, "case_helper_mismatch")):
        if rank in (0, 1):
            assert outcome.startswith("ConsistencyError") and "'tp'" in outcome and untouched, outcome
        else:
            assert outcome == "no error", outcome


def test_ddp_chunks_get_finish_and_global_token_scale(world):
    # The last stage holds 4 tokens per DP rank (the first stage's 7 is overwritten by the
    # broadcast): global count 8, scale 1/8 on every rank.
    for calls in _ok(world, "case_ddp_num_tokens"):
        assert calls == [("finish", True), ("scale", "torch.float32", 0.125)]


def test_dtensor_gradients(world):
    for rank, out in enumerate(_ok(world, "case_dtensor")):
        tp = rank % 2
        shards = {t: [float(t + 1 + 2 * (rank // 2)), 10.0 * (t + 1 + 2 * (rank // 2))] for t in (0, 1)}
        # Whole tensor reduced over tp (both peers hold the same whole): twice this shard.
        assert out["fsdp=False"] == [2 * v for v in shards[tp]]
        # Megatron-FSDP: the local shards themselves are summed over tp.
        assert out["fsdp=True"] == [a + b for a, b in zip(shards[0], shards[1])]
        whole = [a + b for a, b in zip(shards[0], shards[1])]
        assert out["whole"] == whole + whole
        values, tag, placements = out["reshard"]
        assert values == [2 * v for v in whole] and tag == "kept" and placements


def test_flat_buffer_is_reduced_in_place(world):
    inputs = _inputs(FLAT)
    expected = {}
    for rank in range(WORLD):
        for key in inputs[rank].grads:
            expected[(rank, key)] = sum(inputs[p].grads[key] for p in _peers(FLAT, rank, ("tp",)))
    got = _ok(world, "case_flat_buffer")
    _check(FLAT, [g for g, _ in got], expected)
    assert all(seen == [True] for _, seen in got)
