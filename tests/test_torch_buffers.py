"""Zero-copy coalescing: meshgrad's flat gradient buffers (torch_impl.buffers).

Local tests (world of one) check the buffers themselves: layout, views, the accumulate
hook, zeroing, detaching. One gloo world of 4 ranks then runs finalize_model_grads on
models whose gradients live in meshgrad's buffers and on the same models with
user-owned gradients, and checks every value against the numpy reference and the copied
bytes: zero with meshgrad's buffers, exactly the coalesced bytes without.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from meshgrad import FinalizeConfig, Reduction  # noqa: E402
from parity_tests.compare import compare_ranks  # noqa: E402
from parity_tests.reference import reference_finalize  # noqa: E402
from parity_tests.scenarios import RankData, Scenario, gpt_params, make_rank_inputs  # noqa: E402
from parity_tests.torch_world import build_model, collection, load_inputs, read_outputs  # noqa: E402
from parity_tests.world_cases import case_values, run_cases  # noqa: E402
from torch_impl import finalize_model_grads  # noqa: E402
from torch_impl.buffers import attach_grad_buffers  # noqa: E402
from torch_impl.finalize import ModelState, execution_stats  # noqa: E402

WORLD = 4
_GROUPS: dict[Any, Any] = {}


# =========================================================================== local


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.ones(3))
        self.norm.sequence_parallel = True
        self.lin = nn.Linear(3, 2)
        self.frozen = nn.Parameter(torch.ones(2), requires_grad=False)
        self.config = FinalizeConfig(calculate_per_token_loss=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x * self.norm).sum()


def test_main_grad_views_live_in_one_buffer_in_layout_order():
    model = [Tiny()]
    bufs = attach_grad_buffers(model)
    (flat,) = bufs.buffers
    assert flat.numel() == 3 + 6 + 2 and flat.dtype == torch.float32
    offsets = [p.main_grad.storage_offset() for p in (model[0].norm, model[0].lin.weight, model[0].lin.bias)]
    assert offsets == [0, 3, 9]
    assert all(p.main_grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for p in (model[0].norm, model[0].lin.weight))
    assert not hasattr(model[0].frozen, "main_grad")


def test_accumulate_hook_sums_backwards_into_main_grad_and_frees_grad():
    torch.manual_seed(0)
    model = [Tiny()]
    ref = Tiny()
    ref.load_state_dict(model[0].state_dict())
    bufs = attach_grad_buffers(model)
    x1, x2 = torch.randn(4, 3), torch.randn(4, 3)
    model[0](x1).backward()
    model[0](x2).backward()
    ref(x1).backward()
    ref(x2).backward()
    for name, p in model[0].named_parameters():
        if p.requires_grad:
            assert p.grad is None
            torch.testing.assert_close(p.main_grad, dict(ref.named_parameters())[name].grad)
    bufs.zero_()
    assert all(float(b.abs().sum()) == 0 for b in bufs.buffers)


def test_grad_attr_mode_accumulates_in_place_and_zero_restores_views():
    torch.manual_seed(1)
    model = [Tiny()]
    bufs = attach_grad_buffers(model, attr="grad")
    views = {k: v for k, v in bufs.views.items()}
    model[0](torch.randn(2, 3)).backward()
    for key, view in views.items():
        param = model[0].get_parameter(key[1])
        assert param.grad is view
    first = bufs.buffers[0].clone()
    assert float(first.abs().sum()) > 0
    model[0].zero_grad(set_to_none=True)  # drops the views
    bufs.zero_()
    assert all(model[0].get_parameter(k[1]).grad is v for k, v in views.items())
    with pytest.raises(ValueError, match="attr must be"):
        attach_grad_buffers([Tiny()], attr="weight")


def test_existing_gradients_are_copied_in_and_detach_removes_views():
    model = [Tiny()]
    model[0].lin.weight.main_grad = torch.full((2, 3), 7.0)
    bufs = attach_grad_buffers(model)
    assert torch.equal(model[0].lin.weight.main_grad, torch.full((2, 3), 7.0))
    assert model[0].lin.weight.main_grad.untyped_storage().data_ptr() == bufs.buffers[0].untyped_storage().data_ptr()
    bufs.detach()
    assert not hasattr(model[0].lin.weight, "main_grad") and not bufs.hooks


def test_grad_reduce_in_fp32_buffers_are_float32_main_grads():
    model = [Tiny().to(torch.bfloat16)]
    model[0].config = FinalizeConfig(grad_reduce_in_fp32=True)
    bufs = attach_grad_buffers(model)
    assert [b.dtype for b in bufs.buffers] == [torch.float32]
    assert model[0].lin.weight.main_grad.dtype == torch.float32
    other = [Tiny().to(torch.bfloat16)]
    other[0].config = FinalizeConfig(grad_reduce_in_fp32=True)
    with pytest.raises(ValueError, match="attr='main_grad'"):
        attach_grad_buffers(other, attr="grad")


def test_ddp_wrapped_chunks_are_rejected():
    class DDP(nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

        def finish_grad_sync(self):
            pass

    with pytest.raises(TypeError, match="owns its gradient buffers"):
        attach_grad_buffers([DDP(Tiny())])


def test_world_of_one_token_scaling_copies_nothing_and_scales_exactly():
    model = [Tiny()]
    attach_grad_buffers(model)
    values = {}
    for i, (name, p) in enumerate(model[0].named_parameters()):
        if p.requires_grad:
            p.main_grad.copy_(torch.arange(p.numel(), dtype=torch.float32).view(p.shape) + i)
            values[name] = p.main_grad.clone()
    finalize_model_grads(model, num_tokens=torch.tensor(4))
    stats = execution_stats(model)
    assert stats.bytes_copied == 0 and stats.calls == 1
    for name, value in values.items():
        assert torch.equal(model[0].get_parameter(name).main_grad, value / 4)


def test_own_views_are_watched_by_identity_and_a_replaced_one_is_seen():
    """meshgrad's own buffer views are watched by identity only (their storage and shape
    are meshgrad's); a parameter given another gradient tensor is still seen: the step
    re-binds and scales the new tensor."""
    model = [Tiny()]
    attach_grad_buffers(model)
    norm, weight = model[0].norm, model[0].lin.weight
    norm.main_grad.fill_(4.0)
    weight.main_grad.fill_(8.0)
    finalize_model_grads(model, num_tokens=torch.tensor(2))
    ((_, _, watch, _),) = ModelState.of(model).found.values()
    assert watch.grads.tensors == [] and len(watch.grads.params) == 4  # all own views
    assert torch.equal(norm.main_grad, torch.full((3,), 2.0)) and execution_stats(model).bytes_copied == 0
    replacement = torch.full((3,), 6.0)
    norm.main_grad = replacement
    finalize_model_grads(model, num_tokens=torch.tensor(2))
    assert norm.main_grad is replacement and torch.equal(replacement, torch.full((3,), 3.0))
    assert torch.equal(weight.main_grad, torch.full((2, 3), 2.0))
    ((_, _, watch, _),) = ModelState.of(model).found.values()
    assert watch.grads.tensors == [replacement]  # not an own view: watched in full
    assert execution_stats(model).programs_bound == 2  # re-bound to the new tensor


@pytest.mark.parametrize("keep", [True, False], ids=["kept buffer", "buffer per call"])
@pytest.mark.parametrize("kind", ["contiguous", "mixed dtypes", "strided"])
def test_staging_copies_in_and_back_exactly(kind, keep):
    """The staging copies of a reduction of separate tensors lay the tensors out in
    order (cast to the buffer's dtype) and write the buffer back exactly, whichever copy
    path the tensors take."""
    from torch_impl.run.staging import _Staging

    tensors = [torch.arange(6.0).view(2, 3) + 1, torch.arange(4.0) * -1.5, torch.full((1,), 7.25)]
    if kind == "mixed dtypes":
        tensors[1] = tensors[1].to(torch.bfloat16)
    if kind == "strided":
        tensors[0] = (torch.arange(6.0).view(3, 2) + 1).t()
    sizes = [t.numel() for t in tensors]
    stage = _Staging(tensors, sizes, torch.float32, keep=keep)
    for step in range(2):
        staged = stage.copy_in()
        buffer = staged[0]
        assert torch.equal(buffer, torch.cat([t.float().reshape(-1) for t in tensors]))
        buffer.copy_(torch.arange(buffer.numel(), dtype=torch.float32) * (step + 2))
        stage.copy_out(staged)
        for tensor, part in zip(tensors, torch.split(buffer, sizes)):
            assert torch.equal(tensor, part.view(tensor.shape).to(tensor.dtype)), (kind, step)
        assert (stage.copy_in()[0] is buffer) == keep


# =========================================================================== gloo world

CFG = dict(sequence_parallel=True, qk_layernorm=True, calculate_per_token_loss=True)
DP_TP = Scenario("buf-dp2tp2", dp=2, tp=2, params=gpt_params(), config=CFG, num_tokens="random")
PP_TP = Scenario(
    "buf-pp2tp2",
    pp=2,
    tp=2,
    num_chunks=2,
    params=gpt_params(),
    config=dict(sequence_parallel=True, qk_layernorm=True, has_cond_embedder=True, flextron=True),
)
AVG = Scenario("buf-dp2tp2-avg", dp=2, tp=2, params=gpt_params(), config=dict(sequence_parallel=True, average_in_collective=True))
DISTOPT = Scenario("buf-dp4-distopt", dp=4, params=gpt_params(), config=dict(use_distributed_optimizer=True))
SCENARIOS = {s.name: s for s in (DP_TP, PP_TP, AVG, DISTOPT)}


def _copy_in(model: list[Any], data: RankData) -> None:
    """Write one rank's inputs into the existing gradient tensors (meshgrad's views)."""
    for (chunk, name), values in data.grads.items():
        if values is not None:
            param = model[chunk].get_parameter(name)
            param.main_grad.copy_(torch.from_numpy(np.array(values, dtype=np.float32)))


def _tokens(data: RankData) -> Any:
    return None if data.num_tokens is None else torch.tensor(data.num_tokens)


def _coalesced_bytes(model: list[Any]) -> int:
    """What the copy path must copy: the gradients of every reduction of separate
    tensors in and out (a single contiguous gradient is reduced in place)."""
    (bound,) = ModelState.of(model).plans.values()
    sizes = {p.key: p.numel * 4 for p in bound.plan.params}
    return sum(
        2 * sum(sizes[k] for k in a.keys)
        for a in bound.plan.actions
        if isinstance(a, Reduction) and len(a.keys) > 1
    )


def _run(scenario: Scenario, rank: int, buffers: bool) -> tuple[list[RankData], dict[str, int]]:
    config = types.SimpleNamespace(**scenario.config)
    model = build_model(scenario, rank, config)
    pgc = collection(scenario, _GROUPS)
    data = make_rank_inputs(scenario, rank)
    if buffers:
        attach_grad_buffers(model, pgc)
    outputs = []
    for _ in range(2):  # the second call reuses the plan and its bound program
        if buffers:
            _copy_in(model, data)
        else:
            load_inputs(model, scenario, data)  # fresh user-owned tensors each step
        finalize_model_grads(model, num_tokens=_tokens(data), pg_collection=pgc)
        outputs.append(read_outputs(model, scenario, data))
    stats = execution_stats(model)
    info = dict(
        bytes=stats.bytes_copied,
        calls=stats.calls,
        plans=stats.plans_built,
        programs=stats.programs_bound,
        coalesced=_coalesced_bytes(model),
    )
    return outputs, info


def case_buffers(rank: int, world: int) -> dict[str, Any]:
    return {name: _run(s, rank, True) for name, s in SCENARIOS.items()}


def case_user_owned(rank: int, world: int) -> dict[str, Any]:
    return {name: _run(s, rank, False) for name, s in SCENARIOS.items()}


def case_mixed_dtypes(rank: int, world: int) -> dict[str, Any]:
    """tp=4: float32 and bfloat16 sequence-parallel grads fused into one collective run
    in float32 (Megatron's flatten promotes), counted by wrapping dist.all_reduce."""
    import torch.distributed as dist

    chunk = nn.Module()
    chunk.config = FinalizeConfig(sequence_parallel=True)
    chunk.ln32 = nn.Parameter(torch.zeros(2))
    chunk.ln16 = nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    for p in (chunk.ln32, chunk.ln16):
        p.sequence_parallel = True
    # bf16 has 8 significant bits: 256 + 1 + 1 + 1 summed in bf16 stays 256; in fp32 it is 259.
    value = 256.0 if rank == 0 else 1.0
    chunk.ln32.main_grad = torch.full((2,), value)
    chunk.ln16.main_grad = torch.full((2,), value, dtype=torch.bfloat16)
    tp = dist.new_group(list(range(world)))
    groups = types.SimpleNamespace(tp=tp, pp=None, embd=None, pos_embd=None, dp_cp=None)
    calls = []
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.dtype)
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        finalize_model_grads([chunk], pg_collection=groups)
    finally:
        dist.all_reduce = original
    return dict(
        calls=[str(d) for d in calls],
        ln32=chunk.ln32.main_grad.tolist(),
        ln16=chunk.ln16.main_grad.float().tolist(),
        dtype=str(chunk.ln16.main_grad.dtype),
    )


def _per_call_staging(run: Any) -> Any:
    """``run()`` with every staging buffer made per call (none kept between calls, as
    for a model's large gradients), restored afterwards."""
    import torch_impl.run.execute as execute

    saved = execute.PERSISTENT_STAGING_BYTES
    execute.PERSISTENT_STAGING_BYTES = 0
    try:
        return run()
    finally:
        execute.PERSISTENT_STAGING_BYTES = saved


def case_user_owned_per_call_staging(rank: int, world: int) -> dict[str, Any]:
    return _per_call_staging(lambda: case_user_owned(rank, world))


def case_mixed_dtypes_per_call_staging(rank: int, world: int) -> dict[str, Any]:
    return _per_call_staging(lambda: case_mixed_dtypes(rank, world))


@pytest.fixture(scope="module")
def world() -> dict[str, list[tuple[str, Any]]]:
    return run_cases(
        __name__,
        ["case_buffers", "case_user_owned", "case_mixed_dtypes", "case_user_owned_per_call_staging",
         "case_mixed_dtypes_per_call_staging"],
        WORLD,
        timeout=300,
    )


@pytest.mark.parametrize("case", ["case_mixed_dtypes", "case_mixed_dtypes_per_call_staging"])
def test_mixed_dtype_non_tp_grads_share_one_float32_collective(world, case):
    want16 = float(torch.tensor(259.0).to(torch.bfloat16))
    for out in _ok(world, case):
        assert out["calls"] == ["torch.float32"]
        assert out["ln32"] == [259.0, 259.0]
        assert out["ln16"] == [want16, want16] and out["dtype"] == "torch.bfloat16"


_ok = case_values


def _reference(scenario: Scenario) -> list[RankData]:
    return reference_finalize(scenario, [make_rank_inputs(scenario, r) for r in range(scenario.world_size)]).outputs


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_buffers_match_the_reference_with_zero_bytes_copied(world, name):
    ranks = [r[name] for r in _ok(world, "case_buffers")]
    scenario = SCENARIOS[name]
    want = _reference(scenario)
    for call in range(2):
        cmp = compare_ranks(scenario, [outputs[call] for outputs, _ in ranks], want, routers=False)
        assert cmp.ok, cmp.failures
    for rank, (_, info) in enumerate(ranks):
        assert info["calls"] == 2 and info["plans"] == 1 and info["programs"] == 1, (rank, info)
        if scenario is not DISTOPT:
            assert info["bytes"] == 0, (rank, info)


def test_distributed_optimizer_with_buffers_copies_only_the_shard(world):
    ranks = [r[DISTOPT.name] for r in _ok(world, "case_buffers")]
    for rank, (_, info) in enumerate(ranks):
        # The reduce-scatter writes this rank's shard back (and pads the buffer when the
        # group size does not divide it): less than the copy path's in-and-out.
        assert 0 < info["bytes"] < 2 * info["coalesced"], (rank, info)


@pytest.mark.parametrize("case", ["case_user_owned", "case_user_owned_per_call_staging"])
@pytest.mark.parametrize("name", [n for n in SCENARIOS if n != DISTOPT.name])
def test_user_owned_grads_match_and_count_the_copied_bytes(world, name, case):
    ranks = [r[name] for r in _ok(world, case)]
    scenario = SCENARIOS[name]
    want = _reference(scenario)
    for call in range(2):
        cmp = compare_ranks(scenario, [outputs[call] for outputs, _ in ranks], want, routers=False)
        assert cmp.ok, cmp.failures
    for rank, (_, info) in enumerate(ranks):
        # New gradient tensors each step: the plan is kept, the program re-bound.
        assert info["plans"] == 1 and info["programs"] == 2, (rank, info)
        assert info["bytes"] == 2 * info["coalesced"] > 0, (rank, info)


@pytest.mark.parametrize("case", ["case_user_owned", "case_user_owned_per_call_staging"])
def test_user_owned_grads_with_the_distributed_optimizer_match(world, case):
    """The reduce-scatter through a staging buffer (kept, or made per call) leaves what the
    reference says in each rank's shard."""
    ranks = [r[DISTOPT.name] for r in _ok(world, case)]
    want = _reference(DISTOPT)
    for call in range(2):
        cmp = compare_ranks(DISTOPT, [outputs[call] for outputs, _ in ranks], want, routers=False)
        assert cmp.ok, cmp.failures
    for rank, (_, info) in enumerate(ranks):
        assert 0 < info["bytes"] and info["programs"] == 2, (rank, info)
