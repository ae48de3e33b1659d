"""finalize_model_grads and the seed helpers in a world of one rank (no process group):
local math, DDP delegation, plan caching and validation before mutation."""

from __future__ import annotations

import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from meshgrad import FinalizeConfig  # noqa: E402
from parity_tests.scenarios import ParamLayout, RouterLayout, Scenario, make_rank_inputs  # noqa: E402
from parity_tests.torch_world import build_model, load_inputs, read_outputs  # noqa: E402
from torch_impl import (  # noqa: E402
    _allreduce_conditional_embedding_grads,
    _allreduce_layernorm_grads,
    _allreduce_non_tensor_model_parallel_grads,
    _allreduce_replicated_grads_over_gtp_remat_group,
    _allreduce_router_grads,
    _allreduce_word_embedding_grads,
    _update_router_expert_bias,
    _update_router_qb_beta,
    finalize_model_grads,
    reset_model_temporary_tensors,
)
from torch_impl.finalize import ModelState  # noqa: E402

PARAMS = (
    ParamLayout("embedding.word_embeddings.weight", (3, 2), role="word_embedding"),
    ParamLayout("layer.norm.weight", (2,), sequence_parallel=True),
    ParamLayout("layer.linear.weight", (2, 2)),
    ParamLayout("layer.experts.weight", (2,), expert=True),
    ParamLayout("layer.frozen.weight", (2,), requires_grad=False),
)
ROUTERS = (
    RouterLayout("layer.router", 4, has_qb_beta=True),
    RouterLayout("layer.router_eval", 4, training=False, has_qb_beta=True),
    RouterLayout("layer.router_frozen", 3, frozen_expert_bias=True),
)


def _setup(config: dict | None = None, dtype: str = "float32", grad_attr: str = "main_grad", **kw):
    scenario = Scenario("local", params=PARAMS, routers=ROUTERS, config=config or {}, dtype=dtype, grad_attr=grad_attr, **kw)
    model = build_model(scenario, 0, FinalizeConfig.from_mapping(scenario.config))
    data = make_rank_inputs(scenario, 0)
    load_inputs(model, scenario, data)
    return scenario, model, data


def _snapshot(model, scenario, data):
    return read_outputs(model, scenario, data)


def _same(a, b) -> bool:
    grads = all(
        (x is None and b.grads[k] is None) or np.array_equal(x, b.grads[k]) for k, x in a.grads.items()
    )
    routers = all(
        all(np.array_equal(getattr(s, f), getattr(b.routers[k], f)) for f in ("expert_bias", "qb_beta", "qb_beta_accum", "local_tokens_per_expert"))
        and s.aux_loss_resets == b.routers[k].aux_loss_resets
        for k, s in a.routers.items()
    )
    return grads and routers


def test_default_config_world_of_one_only_resets_qb_accumulators():
    scenario, model, data = _setup()
    before = _snapshot(model, scenario, data)
    finalize_model_grads(model)
    after = _snapshot(model, scenario, data)
    for key, state in before.routers.items():
        if key[1] != "layer.router_frozen":  # the routers with qb state: accumulators zeroed
            state.qb_beta_accum = np.zeros_like(state.qb_beta_accum)
    assert _same(before, after)
    assert not after.routers[(0, "layer.router")].qb_beta_count.any()


@pytest.mark.parametrize(
    "dtype,grad_attr,n",
    [
        ("float32", "main_grad", torch.tensor(4, dtype=torch.int64)),
        ("bfloat16", "grad", torch.tensor(4, dtype=torch.int64)),
        ("float32", "main_grad", torch.tensor([4], dtype=torch.int32)),  # one element, 1-d
    ],
)
def test_num_tokens_scales_every_grad_exactly(dtype, grad_attr, n):
    scenario, model, data = _setup({"calculate_per_token_loss": True}, dtype=dtype, grad_attr=grad_attr)
    finalize_model_grads(model, num_tokens=n)
    out = _snapshot(model, scenario, data)
    assert int(n) == 4  # the caller's tensor is not mutated
    for key, g in data.grads.items():
        if g is None:
            assert out.grads[key] is None
        else:
            np.testing.assert_array_equal(out.grads[key], g / 4)


def test_zero_num_tokens_scales_by_one():
    scenario, model, data = _setup({"calculate_per_token_loss": True})
    finalize_model_grads(model, num_tokens=torch.tensor(0))
    out = _snapshot(model, scenario, data)
    for key, g in data.grads.items():
        if g is not None:
            np.testing.assert_array_equal(out.grads[key], g)


def test_router_updates_and_reset_world_of_one():
    config = dict(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.25,
                  moe_router_load_balancing_type="quantile_balancing", moe_router_quantile_balancing_ema=0.5)
    scenario, model, data = _setup(config)
    finalize_model_grads(model)
    out = _snapshot(model, scenario, data)
    key = (0, "layer.router")
    before, after = data.routers[key], out.routers[key]
    tokens = before.local_tokens_per_expert
    want_bias = before.expert_bias + 0.25 * np.sign(tokens.mean() - tokens)
    np.testing.assert_array_equal(after.expert_bias, want_bias.astype(np.float32))
    local = before.qb_beta_accum / max(float(before.qb_beta_count), 1.0)
    new = 0.5 * before.qb_beta + 0.5 * local
    np.testing.assert_allclose(after.qb_beta, new - new.mean(), rtol=0, atol=1e-6)
    # Reset: token counts and qb accumulators zeroed everywhere (eval routers too).
    for k in out.routers:
        assert not out.routers[k].local_tokens_per_expert.any()
    assert not out.routers[(0, "layer.router_eval")].qb_beta_accum.any()
    # Eval and frozen routers keep their bias; eval keeps its qb_beta.
    for k in ((0, "layer.router_eval"), (0, "layer.router_frozen")):
        np.testing.assert_array_equal(out.routers[k].expert_bias, data.routers[k].expert_bias)
    np.testing.assert_array_equal(out.routers[(0, "layer.router_eval")].qb_beta, data.routers[(0, "layer.router_eval")].qb_beta)
    assert all(s.aux_loss_resets == 0 for s in out.routers.values())


def test_global_aux_loss_tracker_reset_counts():
    scenario, model, data = _setup({"moe_router_load_balancing_type": "global_aux_loss"})
    finalize_model_grads(model)
    finalize_model_grads(model)
    out = _snapshot(model, scenario, data)
    assert {k: s.aux_loss_resets for k, s in out.routers.items()} == {k: 2 for k in out.routers}


class DDP(nn.Module):
    """A Megatron-DDP-like wrapper that records its calls."""

    def __init__(self, module: nn.Module, with_kwarg: bool = True, with_scale: bool = True) -> None:
        super().__init__()
        self.module = module
        self.calls: list = []
        if with_kwarg:
            self.finish_grad_sync = lambda force_all_reduce=False: self.calls.append(("finish", force_all_reduce))
        else:
            self.finish_grad_sync = lambda: self.calls.append(("finish",))
        if with_scale:
            self.scale_gradients = lambda scale: self.calls.append(("scale", scale.dtype, float(scale)))


def test_ddp_chunks_delegate_dp_sync_and_scaling():
    scenario, model, data = _setup({"calculate_per_token_loss": True})
    inner = model[0]
    inner.config = types.SimpleNamespace(calculate_per_token_loss=True)
    ddp = DDP(inner)
    finalize_model_grads([ddp], num_tokens=torch.tensor(8), force_all_reduce=True)
    assert ddp.calls == [("finish", True), ("scale", torch.float32, 0.125)]
    out = _snapshot([ddp], scenario, data)
    for key, g in data.grads.items():  # DDP scales its own buffers: nothing scaled here
        assert (g is None and out.grads[key] is None) or np.array_equal(out.grads[key], g)
    old = DDP(inner, with_kwarg=False)
    finalize_model_grads([old])
    assert old.calls == [("finish",)]


def test_ddp_without_scale_gradients_raises_before_anything():
    scenario, model, data = _setup({"calculate_per_token_loss": True})
    ddp = DDP(model[0], with_scale=False)
    before = _snapshot([ddp], scenario, data)
    with pytest.raises(TypeError, match="scale_gradients"):
        finalize_model_grads([ddp], num_tokens=torch.tensor(8))
    assert ddp.calls == []
    assert _same(before, _snapshot([ddp], scenario, data))


def test_plan_is_cached_and_replanned_when_grads_change():
    scenario, model, data = _setup({"calculate_per_token_loss": True})
    finalize_model_grads(model, num_tokens=torch.tensor(1))
    finalize_model_grads(model, num_tokens=torch.tensor(1))
    state = ModelState.of(model)
    assert len(state.plans) == 1
    param = model[0].get_parameter("layer.norm.weight")
    param.requires_grad_(False)
    value = param.main_grad.clone()
    finalize_model_grads(model, num_tokens=torch.tensor(2))
    assert len(state.plans) == 2
    assert torch.equal(param.main_grad, value)  # frozen now: not scaled


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda m: finalize_model_grads(m[0].weight), TypeError, "list of nn.Module"),
        (lambda m: finalize_model_grads([m[0], 3]), TypeError, r"model\[1\]"),
        (lambda m: finalize_model_grads(m, num_tokens=torch.tensor(2.0 + 1j)), TypeError, "integer or floating"),
        (lambda m: finalize_model_grads(m, num_tokens=4), TypeError, "one-element tensor"),
        (lambda m: finalize_model_grads(m, pg_collection=types.SimpleNamespace(tp=None, pp=None, embd=None, dp_cp=None)), ValueError, "'pos_embd'.*rank 0|rank 0.*'pos_embd'"),
    ],
)
def test_validation_errors_leave_grads_untouched(call, error, match):
    scenario, model, data = _setup({"calculate_per_token_loss": True})
    model[0].weight = nn.Parameter(torch.zeros(1))
    before = _snapshot(model, scenario, data)
    with pytest.raises(error, match=match):
        call(model)
    assert _same(before, _snapshot(model, scenario, data))


def test_missing_config_is_a_type_error():
    with pytest.raises(TypeError, match="config"):
        finalize_model_grads([nn.Linear(2, 2)])


def test_nan_check_raises_before_mutation():
    scenario, model, data = _setup({"check_for_nan_in_grad": True, "calculate_per_token_loss": True})
    model[0].get_parameter("layer.linear.weight").main_grad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="layer.linear.weight"):
        finalize_model_grads(model, num_tokens=torch.tensor(2))
    assert model[0].get_parameter("layer.norm.weight").main_grad.tolist() == data.grads[(0, "layer.norm.weight")].tolist()


def test_helpers_world_of_one():
    config = dict(sequence_parallel=True, has_cond_embedder=True, flextron=True, moe_router_enable_expert_bias=True,
                  moe_router_bias_update_rate=1.0, moe_router_load_balancing_type="quantile_balancing")
    scenario, model, data = _setup(config, num_chunks=2)
    cfg = model[0].config
    before = _snapshot(model, scenario, data)
    for helper in (_allreduce_non_tensor_model_parallel_grads, _allreduce_layernorm_grads,
                   _allreduce_conditional_embedding_grads, _allreduce_word_embedding_grads):
        helper(model, cfg)
    _allreduce_router_grads(model, cfg)
    _allreduce_replicated_grads_over_gtp_remat_group(model, None, None)
    assert _same(before, _snapshot(model, scenario, data))  # all size-1 groups: no-ops
    _update_router_expert_bias(model, cfg)
    _update_router_qb_beta(model, cfg)
    out = _snapshot(model, scenario, data)
    key = (1, "layer.router")
    tokens = data.routers[key].local_tokens_per_expert
    np.testing.assert_array_equal(out.routers[key].expert_bias, data.routers[key].expert_bias + np.sign(tokens.mean() - tokens))
    assert out.routers[key].local_tokens_per_expert.tolist() == tokens.tolist()  # not reset yet
    reset_model_temporary_tensors(cfg, model)
    out = _snapshot(model, scenario, data)
    assert not any(s.local_tokens_per_expert.any() for s in out.routers.values())
    assert not any(s.qb_beta_accum.any() for k, s in out.routers.items() if k[1] != "layer.router_frozen")


def test_megatron_transformer_config_is_accepted():
    core = pytest.importorskip("megatron.core.transformer.transformer_config")
    config = core.TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, calculate_per_token_loss=True)
    scenario, model, data = _setup()
    model[0].config = config
    finalize_model_grads(model, num_tokens=torch.tensor(2))
    out = _snapshot(model, scenario, data)
    key = (0, "layer.linear.weight")
    np.testing.assert_array_equal(out.grads[key], data.grads[key] / 2)


def test_cached_state_survives_deepcopy_and_pickle():
    import copy
    import pickle

    scenario, model, data = _setup({"calculate_per_token_loss": True})
    finalize_model_grads(model, num_tokens=torch.tensor(1))
    clone = copy.deepcopy(model)
    assert ModelState.of(clone).plans == {}
    assert pickle.loads(pickle.dumps(ModelState.of(model))).plans == {}
    load_inputs(clone, scenario, data)  # deepcopy does not carry main_grad
    finalize_model_grads(clone, num_tokens=torch.tensor(2))
    key = (0, "layer.linear.weight")
    np.testing.assert_array_equal(read_outputs(clone, scenario, data).grads[key], data.grads[key] / 2)


def test_megatron_process_group_collection_fields():
    pgc_module = pytest.importorskip("megatron.core.process_groups_config")
    scenario, model, data = _setup()
    from torch_impl.run.errors import MegatronAssertionError

    before = _snapshot(model, scenario, data)
    # tp None without parallel_state: Megatron-Core fails (None.size()); so does meshgrad,
    # before anything changes, with an error that is an AssertionError too.
    none_tp = pgc_module.ProcessGroupCollection(tp=None, pp=None, embd=None, pos_embd=None, dp_cp=None, expt_dp=None)
    with pytest.raises(MegatronAssertionError, match="pg_collection.tp is None"):
        finalize_model_grads(model, pg_collection=none_tp)
    # A field the collection lacks (0.16.1's class has no __getattr__): Megatron asserts hasattr.
    partial = pgc_module.ProcessGroupCollection(tp=None, pp=None, embd=None, dp_cp=None, expt_dp=None)
    with pytest.raises(AssertionError, match="no attribute pos_embd"):
        finalize_model_grads(model, pg_collection=partial)
    assert _same(before, _snapshot(model, scenario, data))


def test_mixed_ddp_and_plain_chunks_plan_dp_sync_for_plain_only():
    from meshgrad import Group, GroupSizes, Step
    from torch_impl.call.plan import build_plan
    from torch_impl.sources.discover import discover

    scenario, model, data = _setup(num_chunks=2)
    cfg = FinalizeConfig()
    found = discover(model, cfg)
    sizes = GroupSizes(sizes={Group.DP_CP: 2, Group.EDP: 2}, embd_stages=(0,), pos_embd_stages=(0,))
    ddp = DDP(model[0])
    bound = build_plan(found, cfg, sizes, (ddp, None), force_all_reduce=False)
    dp = bound.plan.for_step(Step.DP_SYNC)
    assert dp and all(k[0] == 1 for a in dp for k in a.keys)
    assert {a.group for a in dp} == {Group.DP_CP, Group.EDP}
    assert bound.ddp == (ddp,) and all(k[0] == 1 for k in bound.plain_scale_keys)


class _GradModeProbe(nn.Module):
    """A DDP-like chunk whose ``finish_grad_sync`` records the grad mode it runs under and,
    when told to, fails (as a failed collective would)."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(2, 2)
        self.config = FinalizeConfig()
        self.modes: list[bool] = []
        self.fail = False

    def finish_grad_sync(self) -> None:
        self.modes.append(torch.is_grad_enabled())
        if self.fail:
            raise RuntimeError("simulated: connection closed by peer")


@pytest.mark.parametrize("grad_on", [True, False], ids=["grad on", "under no_grad"])
def test_the_run_stage_runs_without_grad_and_restores_the_mode(grad_on: bool) -> None:
    """The run stage switches grad mode off and back as ``torch.no_grad()`` would, on a
    steady step, and when it raises; a caller already under ``no_grad`` stays there."""
    chunk = _GradModeProbe()
    with torch.set_grad_enabled(grad_on):
        for _ in range(3):  # planning, then steady steps
            finalize_model_grads([chunk])
            assert torch.is_grad_enabled() is grad_on
        chunk.fail = True
        with pytest.raises(Exception, match="connection closed"):
            finalize_model_grads([chunk])
        assert torch.is_grad_enabled() is grad_on
    assert chunk.modes == [False] * 4
