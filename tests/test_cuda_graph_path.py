"""CUDA-graph readiness of ``torch_impl.finalize_model_grads``, on CPU: the call that would
run under a capture (Megatron's ``FullCudaGraphWrapper`` captures ``forward_backward_func``
and with it ``config.finalize_model_grads_func``) makes no host read and launches the
collectives of an eager call.

"Under capture" is made with the public torch functions only: in the test process
``torch.cuda.is_current_stream_capturing`` returns True (and ``torch.cuda.is_available`` and
``torch.cuda.is_initialized``, which guard it). One gloo world of 4 ranks runs every case;
per case and rank, on fresh inputs each time: call 1 eager (plans and runs the first-call
checks), call 2 eager (the steady state, what a replay must repeat), call 3 "captured",
and call 4 "captured" with no ``torch.distributed`` function wrapped (so the bound
collectives call their process groups directly, as they do in training). Recorded during
calls 2 to 4:

* host reads of a tensor: ``aten._local_scalar_dense`` / ``is_nonzero`` / ``equal`` (what
  ``.item()``, ``bool(tensor)``, ``int()`` / ``float()`` and ``torch.equal`` dispatch to)
  counted with a ``TorchDispatchMode``, and ``Tensor.tolist`` / ``.cpu`` / ``.numpy`` /
  ``.item`` counted with wrapped methods (on CPU every tensor is on the gradients' device);
* every ``torch.distributed`` collective called, in calls 2 and 3: name, op, dtype, element
  count, group ranks.

Checked: calls 3 and 4 make no host read; its collectives equal call 2's, one for one (with
``check_for_nan_in_grad`` on, call 2 also runs the NaN check's host read and status round,
which capture skips: then call 3's collectives equal call 2's on gradient data); and the
gradients, router buffers and ``num_tokens`` after calls 3 and 4 equal those after call 2,
bit for bit (integer-valued data), and the numpy reference's.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

from parity_tests.scenarios import Scenario, gpt_params, moe_routers  # noqa: E402
from parity_tests.world_cases import case_values, run_cases  # noqa: E402

WORLD = 4
SCENARIOS = {
    "pp2tp2-seqpar-tied": Scenario("pp2tp2", pp=2, tp=2, params=gpt_params(),
                                   config=dict(sequence_parallel=True, qk_layernorm=True)),
    "dp2tp2-moe-bias-distopt-tokens": Scenario(
        "dp2tp2-moe", dp=2, tp=2, ep=2, etp=1, params=gpt_params(experts=True), routers=moe_routers(),
        config=dict(moe_router_enable_expert_bias=True, sequence_parallel=True, use_distributed_optimizer=True,
                    calculate_per_token_loss=True),
        num_tokens="random"),
    "dp4-nan-check": Scenario("dp4", dp=4, params=gpt_params(), config=dict(check_for_nan_in_grad=True)),
    "dp2pp2-bf16-fp32-reduce": Scenario("dp2pp2-bf16", dp=2, pp=2, params=gpt_params(), dtype="bfloat16",
                                        config=dict(grad_reduce_in_fp32=True)),
}
COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single", "all_gather_into_tensor",
               "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier",
               "all_to_all_single", "reduce", "send", "recv", "isend", "irecv", "batch_isend_irecv")
HOST_READ_OPS = ("_local_scalar_dense", "is_nonzero", "equal")
HOST_READ_METHODS = ("tolist", "cpu", "numpy", "item")

# =========================================================================== worker side


class _Recorder:
    """Counts host reads and records collectives while active."""

    def __init__(self, record_collectives: bool = True) -> None:
        self.reads: list[str] = []
        self.collectives: list[tuple[Any, ...]] = []
        # Off: torch.distributed's functions stay torch's own, so the bound collectives call
        # their process groups directly (torch_impl.run.collectives.bind_all_reduce).
        self.record_collectives = record_collectives

    def __enter__(self) -> "_Recorder":
        import torch
        import torch.distributed as dist
        from torch.utils._python_dispatch import TorchDispatchMode

        recorder = self

        class Reads(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                if func.__name__.split(".")[0] in HOST_READ_OPS:
                    recorder.reads.append(func.__name__)
                return func(*args, **(kwargs or {}))

        self._saved: list[tuple[Any, str, Any]] = []
        for name in HOST_READ_METHODS:
            self._patch(torch.Tensor, name, self._read_method(name))
        for name in COLLECTIVES if self.record_collectives else ():
            if hasattr(dist, name):
                self._patch(dist, name, self._collective(name))
        self._mode = Reads()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)

    def _patch(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        original = getattr(owner, name)
        self._saved.append((owner, name, original))
        setattr(owner, name, make(original))

    def _read_method(self, name: str) -> Callable[[Any], Any]:
        def make(original: Any) -> Any:
            def read(tensor: Any, *args: Any, **kwargs: Any) -> Any:
                self.reads.append(f"Tensor.{name}")
                return original(tensor, *args, **kwargs)

            return read

        return make

    def _collective(self, name: str) -> Callable[[Any], Any]:
        def make(original: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                import torch
                import torch.distributed as dist

                tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
                group = kwargs.get("group")
                ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else "world"
                op = str(kwargs.get("op", args[1] if name == "all_reduce" and len(args) > 1 else ""))
                shape = (str(tensor.dtype), tensor.numel()) if tensor is not None else ("object", 0)
                self.collectives.append((name, op, *shape, ranks))
                return original(*args, **kwargs)

            return call

        return make


class _Capturing:
    """``torch.cuda.is_current_stream_capturing()`` (and ``is_available()``,
    ``is_initialized()``: a capture runs in an initialized context) True while active."""

    _NAMES = ("is_available", "is_initialized", "is_current_stream_capturing")

    def __enter__(self) -> None:
        import torch

        self._saved = tuple(getattr(torch.cuda, name) for name in self._NAMES)
        for name in self._NAMES:
            setattr(torch.cuda, name, lambda: True)

    def __exit__(self, *exc: Any) -> None:
        import torch

        for name, saved in zip(self._NAMES, self._saved):
            setattr(torch.cuda, name, saved)


def _run(scenario: Scenario, rank: int, cache: dict[Any, Any]) -> dict[str, Any]:
    import torch

    import torch_impl
    from parity_tests.scenarios import make_rank_inputs
    from parity_tests.torch_world import build_model, device_mesh, load_inputs, read_outputs, scenario_config

    config = scenario_config(scenario, finalize_config=False)
    model = build_model(scenario, rank, config)
    mesh = device_mesh(scenario, cache)
    data = make_rank_inputs(scenario, rank)
    out: dict[str, Any] = {"inputs": data}

    def call(capture: bool | None, record_collectives: bool = True) -> tuple[Any, ...]:
        """Load fresh inputs, finalize (recorded unless ``capture`` is None), read the outputs."""
        load_inputs(model, scenario, data)
        n = None if data.num_tokens is None else torch.tensor(int(data.num_tokens))
        with _Recorder(record_collectives) as rec:
            with _Capturing() if capture else contextlib.nullcontext():
                torch_impl.finalize_model_grads(model, num_tokens=n, pg_collection=mesh)
        state = (read_outputs(model, scenario, data), None if n is None else int(n))
        return state, list(rec.reads), list(rec.collectives)

    call(None)  # 1: eager, first call (plans, first-call checks)
    for name, capture, record in (("eager", False, True), ("captured", True, True), ("captured direct", True, False)):
        state, reads, collectives = call(capture, record)
        out[name] = {"state": state, "reads": reads, "collectives": collectives}
    return out


def graph_world(rank: int, world: int) -> dict[str, Any]:
    cache: dict[Any, Any] = {}
    return {name: _run(scenario, rank, cache) for name, scenario in SCENARIOS.items()}


# =========================================================================== tests (parent)

_WORLD: dict[str, Any] = {}


def _results() -> list[dict[str, Any]]:
    if "v" not in _WORLD:
        _WORLD["v"] = case_values(run_cases(__name__, ["graph_world"], WORLD, timeout=300), "graph_world")
    return _WORLD["v"]


def _data_collectives(calls: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Collectives on floating-point data (gradients, router buffers, token scale)."""
    return [c for c in calls if c[2].startswith("torch.float") or c[2] == "torch.bfloat16"]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_captured_call_makes_no_host_read(name: str) -> None:
    for rank, result in enumerate(_results()):
        for call in ("captured", "captured direct"):
            assert result[name][call]["reads"] == [], f"rank {rank}, {call}: {result[name][call]['reads'][:10]}"


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_captured_call_launches_the_eager_collectives(name: str) -> None:
    for rank, result in enumerate(_results()):
        eager, captured = result[name]["eager"]["collectives"], result[name]["captured"]["collectives"]
        assert _data_collectives(captured), f"rank {rank}: no collective recorded"
        if SCENARIOS[name].cfg("check_for_nan_in_grad"):
            assert result[name]["eager"]["reads"], "the eager NaN check reads the host (capture must skip it)"
            assert _data_collectives(captured) == _data_collectives(eager), f"rank {rank}"
        else:
            assert captured == eager, f"rank {rank}:\neager    {eager}\ncaptured {captured}"


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_captured_call_gives_the_eager_numbers(name: str) -> None:
    """After calls 3 and 4 every gradient, router buffer and num_tokens equals call 2's, bit
    for bit, and the numpy reference's."""
    from parity_tests.compare import compare_ranks
    from parity_tests.reference import reference_finalize

    scenario = SCENARIOS[name]
    results = _results()
    for rank, result in enumerate(results):
        eager, n_eager = result[name]["eager"]["state"]
        for call in ("captured", "captured direct"):  # collectives through torch.distributed / on the groups
            captured, n_captured = result[name][call]["state"]
            assert n_eager == n_captured
            same = compare_ranks(dataclasses.replace(scenario, mode="exact"), [captured], [eager])
            assert not same.failures and same.max_abs_diff == 0.0, f"rank {rank}, {call}: {same.failures[:5]}"
    want = reference_finalize(scenario, [r[name]["inputs"] for r in results]).outputs
    got = compare_ranks(scenario, [r[name]["captured"]["state"][0] for r in results], want)
    assert not got.failures, got.failures[:5]
