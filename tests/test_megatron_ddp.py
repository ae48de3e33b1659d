"""megatron-core's REAL ``DistributedDataParallel`` with torch_impl's finalize against
megatron-core's own finalize, on twin models, bit for bit, over several steps.

One spawned gloo world of 4 ranks (Megatron's ``parallel_state`` with dp=4) runs every
case; megatron-core's device lookups point at the CPU
(:func:`parity_tests.megatron_state.megatron_on_cpu`). Each case builds one model twice
(same seed), wraps each twin in megatron-core's ``DistributedDataParallel`` with the same
``DistributedDataParallelConfig``, and trains both for a few steps (zero the grad buffer,
forward, backward, finalize, SGD on ``main_grad``): one twin's finalize is
``megatron.core.distributed.finalize_model_grads``, the other's
``torch_impl.finalize_model_grads``. Losses, gradient buffers and parameters must be
bit-identical at every step; where megatron-core's DDP raises (``check_for_nan_in_grad``
on a NaN gradient) ours raises ``NonFiniteGradError`` naming the parameter, before any
collective and with the gradient buffer unchanged (it reads the DDP's buffers first: with
NaN on one rank only, megatron-core's own check raises there while its peers enter the
collective, which this test cannot run for megatron-core; ours raises on every rank). The DDP's buckets, ``overlap_grad_reduce``
(its reduction starts in backward hooks), the distributed optimizer's reduce-scatter,
``grad_reduce_in_fp32`` with bf16 parameters, ``average_in_collective`` and per-token
scaling (``scale_gradients``) are all megatron-core's own.

Besides the twin comparison, the first step's synced gradient of every all-reduce case
is checked against an independent reference: the float64 mean over ranks of each rank's
local gradient, computed with plain autograd on an unwrapped copy.

gloo has no ``ReduceOp.AVG`` (NCCL has): for ``average_in_collective`` this test process
wraps ``torch.distributed.all_reduce`` / ``reduce_scatter_tensor`` so that AVG is SUM then a
division (both twins go through it alike). Skipped without megatron-core.
"""

from __future__ import annotations

import copy
import re
import time
import warnings
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from parity_tests.megatron_state import import_megatron_core  # noqa: E402
from parity_tests.world_cases import case_values, run_cases  # noqa: E402

WORLD = 4
STEPS = 4  # from the third, finalize's steady check is answered by its probes
LR = 0.125

#: name -> (DistributedDataParallelConfig fields, options)
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "allreduce": (dict(), {}),
    "allreduce-buckets": (dict(bucket_size=64), {}),
    "overlap": (dict(overlap_grad_reduce=True, bucket_size=64), {}),
    "distopt": (dict(use_distributed_optimizer=True), {}),
    "distopt-overlap": (dict(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=64), {}),
    "bf16-fp32-reduce": (dict(grad_reduce_in_fp32=True), dict(dtype="bfloat16")),
    "bf16-fp32-reduce-distopt-overlap": (
        dict(grad_reduce_in_fp32=True, use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=64),
        dict(dtype="bfloat16"),
    ),
    "average-in-collective": (dict(average_in_collective=True), {}),
    "average-in-collective-distopt": (dict(average_in_collective=True, use_distributed_optimizer=True), {}),
    "per-token-loss": (dict(), dict(per_token=True)),
    "per-token-loss-overlap-distopt": (
        dict(overlap_grad_reduce=True, use_distributed_optimizer=True, bucket_size=64), dict(per_token=True)
    ),
    "check-nan": (dict(check_for_nan_in_grad=True), {}),
    "check-nan-hit": (dict(check_for_nan_in_grad=True), dict(nan_at_step=1)),
    "check-nan-one-rank": (dict(check_for_nan_in_grad=True), dict(nan_at_step=1, nan_rank=1, ours_only=True)),
}
#: Cases run with torch_impl's finalize alone (megatron-core's twin would wait for the
#: process-group timeout there).
OURS_ONLY = [n for n, (_, o) in CASES.items() if o.get("ours_only")]

# =========================================================================== worker side


def _avg_on_gloo() -> None:
    """gloo lacks ReduceOp.AVG: emulate it as SUM then a division, for both twins."""
    import torch.distributed as dist

    def wrap(fn: Any, out_index: int) -> Any:
        def call(*args: Any, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False, **kw: Any) -> Any:
            if op != dist.ReduceOp.AVG:
                return fn(*args, op=op, group=group, async_op=async_op, **kw)
            work = fn(*args, op=dist.ReduceOp.SUM, group=group, async_op=False, **kw)
            args[out_index].div_(dist.get_world_size(group))
            return _Done() if async_op else work

        return call

    dist.all_reduce = wrap(dist.all_reduce, 0)
    dist.reduce_scatter_tensor = wrap(dist.reduce_scatter_tensor, 0)


class _Done:
    """A finished async handle."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _module(dtype: str) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))
    return module.to(getattr(torch, dtype))


def _batch(step: int, rank: int, dtype: str) -> Any:
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 8, generator=g).to(getattr(torch, dtype))


def _config(per_token: bool) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, calculate_per_token_loss=per_token)


def _reference_grads(module: Any, x: Any) -> list[np.ndarray]:
    """The float64 mean over ranks of each rank's local gradient (plain autograd)."""
    import torch
    import torch.distributed as dist

    local = copy.deepcopy(module).to(torch.float64)
    local(x.to(torch.float64)).pow(2).mean().backward()
    out = []
    for p in local.parameters():
        every = [torch.zeros_like(p.grad) for _ in range(dist.get_world_size())]
        dist.all_gather(every, p.grad.contiguous())
        out.append((sum(every) / len(every)).numpy())
    return out


def _train(impl: str, ddp_fields: dict[str, Any], options: dict[str, Any], rank: int) -> dict[str, Any]:
    """Train one twin; ``impl`` is "megatron" or "ours". Returns per-step losses, grads,
    params (float64 numpy), or the error raised."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads as megatron_finalize

    import torch_impl

    dtype = options.get("dtype", "float32")
    per_token = options.get("per_token", False)
    finalize = megatron_finalize if impl == "megatron" else torch_impl.finalize_model_grads
    cfg = _config(per_token)
    module = _module(dtype)
    reference = _reference_grads(module, _batch(0, rank, dtype)) if impl == "ours" else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(**ddp_fields), module)
    steps: list[dict[str, Any]] = []
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        x = _batch(step, rank, dtype)
        if options.get("nan_at_step") == step and options.get("nan_rank", rank) == rank:
            x[0, 0] = float("nan")
        out = ddp(x).float().pow(2)
        loss = out.sum() if per_token else out.mean()
        if options.get("ours_only") and step == options.get("nan_at_step", STEPS) + 1:
            reference = _reference_grads(ddp.module, x)  # the first step after the failed one
        loss.backward()
        before = [b.grad_data.clone() for b in ddp.buffers]
        start = time.perf_counter()
        try:
            tokens = torch.tensor(out.numel() * (rank + 1)) if per_token else None
            finalize([ddp], num_tokens=tokens)
        except Exception as err:  # compared between the twins
            seconds = time.perf_counter() - start
            cause = err.__cause__ if err.__cause__ is not None else err
            unchanged = all(bool(((a == b.grad_data) | (a.isnan() & b.grad_data.isnan())).all())
                            for a, b in zip(before, ddp.buffers))
            steps.append({"error": (isinstance(err, RuntimeError), type(cause).__name__, str(cause)[:300]),
                          "unchanged": unchanged, "seconds": seconds})
            if options.get("ours_only"):
                continue  # the next step must work
            return {"steps": steps, "reference": reference}
        grads = [p.main_grad.detach().to(torch.float64).numpy().copy() for p in ddp.parameters()]
        with torch.no_grad():
            for p in ddp.parameters():
                p.add_(p.main_grad.to(p.dtype), alpha=-LR)
        params = [p.detach().to(torch.float64).numpy().copy() for p in ddp.parameters()]
        steps.append({"loss": float(loss.detach()), "grads": grads, "params": params})
    return {"steps": steps, "reference": reference}


def ddp_world(rank: int, world: int) -> dict[str, Any]:
    """Every case on this rank, both twins."""
    from megatron.core import parallel_state as ps

    from parity_tests.megatron_state import megatron_on_cpu

    megatron_on_cpu()
    _avg_on_gloo()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ps.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    try:
        return {
            name: {side: _train(side, fields, options, rank)
                   for side in (("ours",) if options.get("ours_only") else ("megatron", "ours"))}
            for name, (fields, options) in CASES.items()
        }
    finally:
        ps.destroy_model_parallel()


# =========================================================================== tests (parent)

_WORLD: dict[str, Any] = {}


def _results() -> list[dict[str, Any]]:
    if "values" not in _WORLD:
        _WORLD["values"] = case_values(run_cases(__name__, ["ddp_world"], WORLD, timeout=400, prepare=import_megatron_core), "ddp_world")
    return _WORLD["values"]


@pytest.mark.parametrize("name", [n for n in CASES if n not in OURS_ONLY])
def test_real_ddp_twins_bit_identical(name: str) -> None:
    """megatron-core's finalize and torch_impl's on twin real-DDP models: the same losses,
    gradients and parameters, bit for bit, at every step; where megatron-core's DDP raises,
    ours raises NonFiniteGradError before anything changed."""
    problems = []
    for rank, result in enumerate(_results()):
        meg, ours = result[name]["megatron"]["steps"], result[name]["ours"]["steps"]
        assert len(meg) == len(ours), f"rank {rank}: megatron ran {len(meg)} steps, ours {len(ours)}"
        for step, (m, o) in enumerate(zip(meg, ours)):
            if "error" in m or "error" in o:
                if "error" not in m or "error" not in o or o["error"][1] != "NonFiniteGradError" or not o["unchanged"]:
                    problems.append(f"rank {rank} step {step}: megatron {m.get('error')} ours {o.get('error')}")
                continue
            if m["loss"] != o["loss"]:
                problems.append(f"rank {rank} step {step}: loss megatron {m['loss']!r} ours {o['loss']!r}")
            for what in ("grads", "params"):
                for i, (a, b) in enumerate(zip(m[what], o[what])):
                    if not np.array_equal(a, b):
                        problems.append(f"rank {rank} step {step}: {what}[{i}] differ (max {np.abs(a - b).max()})")
    assert not problems, "\n".join(problems[:20])


def test_real_ddp_cases_are_not_vacuous() -> None:
    """The NaN case raises (megatron-core's own check) and the others train: parameters move
    and losses change between steps."""
    for rank, result in enumerate(_results()):
        for name in CASES:
            if name in OURS_ONLY:
                continue
            steps = result[name]["megatron"]["steps"]
            if name == "check-nan-hit":
                assert "error" in steps[-1] and len(steps) == 2, f"rank {rank}: {steps[-1]}"
                continue
            assert len(steps) == STEPS and all("loss" in s for s in steps), f"{name} rank {rank}: {steps[-1]}"
            assert steps[0]["loss"] != steps[-1]["loss"], f"{name} rank {rank}: loss did not change"


def test_nan_in_one_ranks_ddp_buffer_raises_on_every_rank_before_the_ddp_syncs() -> None:
    """NaN on rank 1 only with the DDP's check_for_nan_in_grad: every rank raises
    NonFiniteGradError promptly (well within the 300 s group timeout), rank 1 naming the
    parameter; no rank's gradient buffer changed; the next step trains and gives the mean
    of the local gradients on every rank."""
    results = _results()
    for rank, result in enumerate(results):
        steps = result["check-nan-one-rank"]["ours"]["steps"]
        assert len(steps) == STEPS and "loss" in steps[0] and "loss" in steps[2], f"rank {rank}: {steps}"
        is_runtime, kind, text = steps[1]["error"]
        assert kind == "NonFiniteGradError" and steps[1]["unchanged"], f"rank {rank}: {steps[1]}"
        assert steps[1]["seconds"] < 30, f"rank {rank} waited {steps[1]['seconds']:.1f} s"
        # NaN in the input reaches every gradient: all six parameters are counted.
        named = re.search(r"gradient of '\d\.(weight|bias)' and 5 more in the gradient buffer", text)
        assert named if rank == 1 else ("rank 1 has NaN or Inf" in text), f"rank {rank}: {text}"
        reference = result["check-nan-one-rank"]["ours"]["reference"]
        for i, (got, want) in enumerate(zip(steps[2]["grads"], reference)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * max(1e-3, float(np.abs(want).max())),
                                       err_msg=f"rank {rank} param {i}")
            np.testing.assert_array_equal(got, results[0]["check-nan-one-rank"]["ours"]["steps"][2]["grads"][i])


@pytest.mark.parametrize("name", [n for n, (f, o) in CASES.items() if not f.get("use_distributed_optimizer")
                                  and not o.get("per_token") and "nan_at_step" not in o])
def test_real_ddp_first_step_matches_reference(name: str) -> None:
    """After torch_impl's finalize the real DDP's all-reduced gradient is the mean over ranks
    of the local gradients (float64 reference; bf16 parameters within bf16 rounding), and is
    the same on every rank."""
    fields, options = CASES[name]
    tol = 0.02 if options.get("dtype") == "bfloat16" else 1e-5
    results = _results()
    for rank, result in enumerate(results):
        ours = result[name]["ours"]
        for i, (got, want) in enumerate(zip(ours["steps"][0]["grads"], ours["reference"])):
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1e-3, float(np.abs(want).max())),
                                       err_msg=f"{name} rank {rank} param {i}")
            np.testing.assert_array_equal(got, results[0][name]["ours"]["steps"][0]["grads"][i])
