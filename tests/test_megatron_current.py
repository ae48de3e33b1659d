"""Current Megatron-Core behaviour that torch_impl matches, in one gloo world of 4 ranks.

The world is tp=2 x dp=2 (tp fastest). Chunks are Megatron-DDP-shaped (``finish_grad_sync``
and ``scale_gradients`` as Megatron's DDP), configs are namespaces with Megatron's field
names, and ``ProcessGroupCollection`` below has the two properties of Megatron-Core's
current class that matter here: it is a dataclass of that name, and a field never set
reads as None through ``__getattr__`` (so ``hasattr`` is always true). The megatron-core
0.19.2 oracle (tests/test_megatron019_oracle.py) checks the same against Megatron itself;
these cases run without it. Every value is compared exactly (integer-valued data).
"""

from __future__ import annotations

import dataclasses
import sys
import types
import warnings
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_reliability_inputs import kind_of  # noqa: E402
from parity_tests.world_cases import case_values, local_cases, run_cases  # noqa: E402

WORLD = 4
FIELDS = ("tp", "pp", "embd", "pos_embd", "dp_cp", "dp_cp_gtp_remat", "tp_dp_cp", "expt_dp", "gtp_remat",
          "expt_gtp_remat")


@dataclasses.dataclass(init=False)
class ProcessGroupCollection:
    """Megatron-shaped collection: fields set after construction, unset ones read None."""

    tp: Any = dataclasses.field(init=False)
    pp: Any = dataclasses.field(init=False)
    embd: Any = dataclasses.field(init=False)
    pos_embd: Any = dataclasses.field(init=False)
    dp_cp: Any = dataclasses.field(init=False)
    dp_cp_gtp_remat: Any = dataclasses.field(init=False)
    tp_dp_cp: Any = dataclasses.field(init=False)
    expt_dp: Any = dataclasses.field(init=False)
    gtp_remat: Any = dataclasses.field(init=False)
    expt_gtp_remat: Any = dataclasses.field(init=False)

    def __init__(self, **kwargs: Any) -> None:
        for key, value in kwargs.items():
            setattr(self, key, value)

    def __getattr__(self, name: str) -> Any:
        if name in FIELDS:
            return None
        raise AttributeError(name)


# --------------------------------------------------------------------------- worker side


def _groups() -> dict[str, Any]:
    """tp {0,1},{2,3}; dp {0,2},{1,3}; the world for tp_dp_cp; pp and embd singletons."""
    import torch.distributed as dist

    rank = dist.get_rank()
    mine: dict[str, Any] = {}
    for name, rows in (("tp", [[0, 1], [2, 3]]), ("dp_cp", [[0, 2], [1, 3]]), ("one", [[0], [1], [2], [3]])):
        for row in rows:
            pg = dist.new_group(row)
            if rank in row:
                mine[name] = pg
    mine["world"] = dist.group.WORLD
    return mine


class _Router(torch.nn.Module):
    def __init__(self, experts: int, rank: int) -> None:
        super().__init__()
        self.register_buffer("expert_bias", torch.zeros(experts))
        self.register_buffer("local_tokens_per_expert", torch.arange(experts, dtype=torch.float32) * (rank + 1))
        self.register_buffer("qb_beta", torch.arange(experts, dtype=torch.float32))
        self.register_buffer("qb_beta_accum", torch.arange(1, experts + 1, dtype=torch.float32) * 2.0 * (rank + 1))
        self.register_buffer("qb_beta_count", torch.tensor(2.0))
        self.resets = 0

    def reset_global_aux_loss_tracker(self) -> None:
        self.resets += 1


class _Net(torch.nn.Module):
    share_embeddings_and_output_weights = False

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.dense = torch.nn.Parameter(torch.zeros(2, 3))
        self.norm = torch.nn.Parameter(torch.zeros(3))
        self.norm.sequence_parallel = True
        self.replicated = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
        self.router = _Router(4, rank)
        base = float(rank + 1)
        for i, p in enumerate((self.dense, self.norm, self.replicated)):
            p.main_grad = torch.full_like(p, base * (i + 1))


class _DDP(torch.nn.Module):
    """Megatron-DDP-shaped chunk: its own (here: no-op) grad sync and scale_gradients."""

    def __init__(self, module: torch.nn.Module, config: Any, log: list[str]) -> None:
        super().__init__()
        self.module, self.config, self.log = module, config, log
        self.ddp_config = types.SimpleNamespace(use_megatron_fsdp=False)

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        self.log.append("finish_grad_sync")

    def scale_gradients(self, scaling: Any) -> None:
        for p in self.module.parameters():
            p.main_grad *= scaling


def _config(**fields: Any) -> Any:
    base = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=1, sequence_parallel=True,
                calculate_per_token_loss=True, moe_router_load_balancing_type="aux_loss",
                moe_router_enable_expert_bias=False, moe_router_bias_update_rate=0.25)
    return types.SimpleNamespace(**{**base, **fields})


def _model(rank: int, **fields: Any) -> tuple[list[Any], list[str]]:
    log: list[str] = []
    return [_DDP(_Net(rank), _config(**fields), log)], log


def _state(model: list[Any]) -> dict[str, np.ndarray]:
    net = model[0].module
    out = {n: p.main_grad.float().numpy().copy() for n, p in net.named_parameters()}
    out.update({f"router.{n}": b.float().numpy().copy() for n, b in net.router.named_buffers()})
    return out


def _error(call: Any) -> tuple[str, bool, str]:
    try:
        call()
    except Exception as err:  # the type name, whether it is an AssertionError, the text
        return kind_of(err), isinstance(err, AssertionError), str(err)
    return "no error", False, ""


def case_unset_tp_dp_cp(rank: int, world: int) -> Any:
    import torch_impl

    g = _groups()
    pgc = ProcessGroupCollection(tp=g["tp"], pp=g["one"], embd=None, pos_embd=None, dp_cp=g["dp_cp"])
    model, _ = _model(rank, moe_router_enable_expert_bias=True)
    before = _state(model)
    err = _error(lambda: torch_impl.finalize_model_grads(model, pg_collection=pgc))
    return err, all(np.array_equal(before[k], v) for k, v in _state(model).items())


def case_unset_dp_cp_reduces_num_tokens_over_world(rank: int, world: int) -> Any:
    import torch_impl

    g = _groups()
    pgc = ProcessGroupCollection(tp=g["tp"], pp=g["one"], embd=None, pos_embd=None)
    model, _ = _model(rank)
    n = torch.tensor([rank + 1], dtype=torch.int32)
    torch_impl.finalize_model_grads(model, num_tokens=n, pg_collection=pgc)
    return n.tolist(), n.dtype == torch.int32, _state(model)


def case_num_tokens_dtypes(rank: int, world: int) -> Any:
    import torch_impl

    g = _groups()
    pgc = ProcessGroupCollection(tp=g["tp"], pp=g["one"], embd=None, pos_embd=None, dp_cp=g["dp_cp"])
    out = {}
    for dtype, value in ((torch.int8, 100), (torch.int64, 3), (torch.float32, 2.5), (torch.float64, 3.0)):
        model, _ = _model(rank)
        n = torch.tensor(value, dtype=dtype)
        torch_impl.finalize_model_grads(model, num_tokens=n, pg_collection=pgc)
        out[str(dtype)] = (n.item(), _state(model)["dense"])
    return out


def case_load_balancing_list(rank: int, world: int) -> Any:
    import torch_impl

    g = _groups()
    pgc = ProcessGroupCollection(tp=g["tp"], pp=g["one"], embd=None, pos_embd=None, dp_cp=g["dp_cp"])
    out = {}
    for lbt in (["quantile_balancing"], ["aux_loss", "global_aux_loss"], "quantile_balancing"):
        model, _ = _model(rank, moe_router_load_balancing_type=lbt)
        torch_impl.finalize_model_grads(model, pg_collection=pgc)
        out[str(lbt)] = (_state(model)["router.qb_beta"], model[0].module.router.resets)
    return out


def case_helpers_called_alone(rank: int, world: int) -> Any:
    import torch_impl

    g = _groups()
    model, _ = _model(rank, moe_router_load_balancing_type="aux_loss")
    config = model[0].config
    # qb_beta: the balancing type is not checked, and a None group is the world.
    torch_impl._update_router_qb_beta(model, config, dp_cp_group=None)
    qb = _state(model)["router.qb_beta"]
    # Router grads: config.flextron is not checked (pp group given as the extension).
    model, _ = _model(rank, flextron=False)
    net = model[0].module
    net.dense.flextron_router_pp_sync = True
    torch_impl._allreduce_router_grads(model, model[0].config, pp_group=g["tp"])
    router = _state(model)["dense"]
    # Without parallel_state, a None group Megatron would look up is an error (AssertionError).
    model, _ = _model(rank)
    err = _error(lambda: torch_impl._allreduce_router_grads(model, model[0].config))
    return qb, router, err


def case_gtp_fence(rank: int, world: int) -> Any:
    import torch_impl

    g = _groups()
    pgc = ProcessGroupCollection(tp=g["one"], pp=g["one"], embd=None, pos_embd=None, dp_cp=g["dp_cp"],
                                 gtp_remat=g["tp"], dp_cp_gtp_remat=g["world"])
    module = types.ModuleType("megatron.core.tensor_parallel.gtp_api")
    out = {}
    for name, kwargs in (("megatron", {}), ("user", {"gtp_fence": None})):
        model, log = _model(rank, gtp_weight_remat_size=2, tensor_model_parallel_size=1)
        module.wait_for_gtp_grad_reduction_on_current_stream = lambda log=log: log.append("megatron fence")
        if name == "user":
            kwargs = {"gtp_fence": lambda log=log: log.append("user fence")}
        sys.modules[module.__name__] = module
        try:
            torch_impl.finalize_model_grads(model, num_tokens=torch.tensor(1), pg_collection=pgc, **kwargs)
        finally:
            del sys.modules[module.__name__]
        out[name] = (list(log), _state(model))
    return out


def case_groups_are_the_truth(rank: int, world: int) -> Any:
    import torch_impl

    g = _groups()
    # The config says tp=4 but the collection's tp group has 2 ranks: Megatron runs with
    # the groups; meshgrad warns once, or raises with strict_groups.
    pgc = ProcessGroupCollection(tp=g["tp"], pp=g["one"], embd=None, pos_embd=None, dp_cp=g["dp_cp"])
    model, _ = _model(rank, tensor_model_parallel_size=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch_impl.finalize_model_grads(model, pg_collection=pgc)
    messages = [str(w.message) for w in caught if "tp" in str(w.message)]
    strict, _ = _model(rank, tensor_model_parallel_size=4, strict_groups=True)
    err = _error(lambda: torch_impl.finalize_model_grads(strict, pg_collection=pgc))
    return messages, _state(model)["norm"], err


def case_gtp_coalesces_over_dtypes(rank: int, world: int) -> Any:
    import torch.distributed as dist

    import torch_impl

    g = _groups()
    model, _ = _model(rank)
    calls: list[str] = []
    original = dist.all_reduce

    def counting(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(str(tensor.dtype))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        torch_impl._allreduce_replicated_grads_over_gtp_remat_group(model, g["tp"], None, calculate_per_token_loss=True)
    finally:
        dist.all_reduce = original
    return calls, _state(model)


def case_helper_bad_model_on_one_rank(rank: int, world: int) -> Any:
    import time

    import torch_impl

    g = _groups()
    model, _ = _model(rank)
    before = _state(model)
    call = (p for p in model) if rank == 1 else model  # rank 1 passes a generator
    start = time.perf_counter()
    err = _error(lambda: torch_impl._allreduce_non_tensor_model_parallel_grads(call, model[0].config, g["tp"]))
    return err, time.perf_counter() - start, all(np.array_equal(before[k], v) for k, v in _state(model).items())


CASES = sorted(local_cases(globals()))  # alphabetical, the order these worlds always ran in


# --------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def world() -> dict[str, Any]:
    return run_cases(__name__, CASES, WORLD, timeout=240)


def _grads(rank: int) -> dict[str, np.ndarray]:
    base = float(rank + 1)
    return {"dense": np.full((2, 3), base), "norm": np.full(3, 2 * base), "replicated": np.full(2, 3 * base)}


TP_PEER = {0: 1, 1: 0, 2: 3, 3: 2}
EXPERTS = np.arange(1, 5, dtype=np.float32)
DP_PEER = {0: 2, 2: 0, 1: 3, 3: 1}


def test_unset_tp_dp_cp_with_expert_bias_raises_like_megatron(world: dict[str, Any]) -> None:
    for rank, ((kind, is_assertion, message), untouched) in enumerate(case_values(world, "case_unset_tp_dp_cp")):
        assert kind == "MegatronAssertionError" and is_assertion and isinstance(kind, str)
        assert f"rank {rank}" in message and "tp_dp_cp" in message and "not set" in message
        assert untouched


def test_unset_dp_cp_reduces_num_tokens_over_the_world(world: dict[str, Any]) -> None:
    for rank, (count, kept_dtype, state) in enumerate(
        case_values(world, "case_unset_dp_cp_reduces_num_tokens_over_world")
    ):
        assert count == [10] and kept_dtype  # 1 + 2 + 3 + 4, left in the caller's tensor
        scale = np.float32(1) / np.float32(10)
        assert np.array_equal(state["dense"], (_grads(rank)["dense"].astype(np.float32) * scale))
        norm = (_grads(rank)["norm"] + _grads(TP_PEER[rank])["norm"]).astype(np.float32) * scale
        assert np.array_equal(state["norm"], norm)


def test_num_tokens_integer_and_floating_reduced_without_overflow(world: dict[str, Any]) -> None:
    for rank, out in enumerate(case_values(world, "case_num_tokens_dtypes")):
        dense = _grads(rank)["dense"].astype(np.float32)
        count, grads = out["torch.int8"]
        assert count == 200 - 256  # the int8 tensor wraps; the scale does not
        assert np.array_equal(grads, dense * (np.float32(1) / np.float32(200)))
        count, grads = out["torch.int64"]
        assert count == 6 and np.array_equal(grads, dense * (np.float32(1) / np.float32(6)))
        count, grads = out["torch.float32"]
        assert count == 5.0 and np.array_equal(grads, dense * (np.float32(1) / np.float32(5)))
        count, grads = out["torch.float64"]
        # Megatron's float64 factor multiplies float32 gradients (a 0-d factor: in float32).
        assert count == 6.0 and np.array_equal(grads, dense * np.float32(1.0 / 6.0))


def test_load_balancing_type_list(world: dict[str, Any]) -> None:
    for rank, out in enumerate(case_values(world, "case_load_balancing_list")):
        qb, resets = out["['quantile_balancing']"]
        assert np.array_equal(qb, np.arange(4, dtype=np.float32)) and resets == 0  # a list never runs qb
        qb, resets = out["['aux_loss', 'global_aux_loss']"]
        assert np.array_equal(qb, np.arange(4, dtype=np.float32)) and resets == 1
        qb, resets = out["quantile_balancing"]
        # accum / count, AVG over dp; ema 0.0 (Megatron's default) keeps only the new mean.
        new = EXPERTS * np.float32((rank + 1 + DP_PEER[rank] + 1) / 2)
        assert np.array_equal(qb, new - new.mean()) and resets == 0


def test_helpers_called_alone_behave_like_megatrons(world: dict[str, Any]) -> None:
    for rank, (qb, router, err) in enumerate(case_values(world, "case_helpers_called_alone")):
        new = EXPERTS * np.float32(sum(r + 1 for r in range(WORLD)) / WORLD)  # AVG over the world
        assert np.array_equal(qb, new - new.mean())
        assert np.array_equal(router, _grads(rank)["dense"] + _grads(TP_PEER[rank])["dense"])
        kind, is_assertion, message = err
        assert kind == "MegatronAssertionError" and is_assertion and "parallel_state" in message


def test_gtp_fence_runs_before_the_dp_sync(world: dict[str, Any]) -> None:
    for rank, out in enumerate(case_values(world, "case_gtp_fence")):
        for name in ("megatron", "user"):
            log, state = out[name]
            assert log == [f"{name} fence", "finish_grad_sync"], log
            # GTP over tp pairs (SUM: per-token loss), then 1 / (4 ranks x 1 token).
            want = (_grads(rank)["dense"] + _grads(TP_PEER[rank])["dense"]) * np.float32(0.25)
            assert np.array_equal(state["dense"], want)


def test_groups_are_the_truth_with_a_warning_and_strict_mode(world: dict[str, Any]) -> None:
    for rank, (messages, norm, err) in enumerate(case_values(world, "case_groups_are_the_truth")):
        assert len(messages) == 1 and "tensor_model_parallel_size = 4" in messages[0] and "strict_groups" in messages[0]
        assert np.array_equal(norm, _grads(rank)["norm"] + _grads(TP_PEER[rank])["norm"])
        kind, is_assertion, message = err
        assert kind == "ValueError" and f"rank {rank}" in message and "'tp'" in message


def test_gtp_step_is_one_collective_over_the_promoted_dtype(world: dict[str, Any]) -> None:
    for rank, (calls, state) in enumerate(case_values(world, "case_gtp_coalesces_over_dtypes")):
        assert calls == ["torch.float32"]  # fp32 and bf16 grads in one float32 collective
        for name in ("dense", "norm", "replicated"):
            assert np.array_equal(state[name], _grads(rank)[name] + _grads(TP_PEER[rank])[name])


def test_helper_error_on_one_rank_reaches_its_group(world: dict[str, Any]) -> None:
    for rank, ((kind, _, message), seconds, untouched) in enumerate(
        case_values(world, "case_helper_bad_model_on_one_rank")
    ):
        if rank == 1:
            assert kind == "TypeError" and "rank 1" in message
        elif rank == 0:  # rank 1's tp peer: raises at once, naming rank 1
            assert kind == "ConsistencyError" and "rank 1" in message and seconds < 30, (kind, message)
        else:  # the other tp group runs normally
            assert kind == "no error"
        assert untouched or rank > 1
