"""The hand-rolled capture of one training step (``python -m bench.full_graph --impl hand``,
and the fallback of Megatron's wrapper path without megatron-core): one step
(``zero_grad_buffer()``, forward on a static input, backward, torch_impl's finalize with
``num_tokens`` a device tensor) of an MLP in megatron-core's DDP (``bench.ddp.MiniDDP``
without it), built, warmed up and captured with ``torch.cuda.graph`` on one side stream
(:func:`capture_stream`), replayed on new inputs written in place and compared with a
twin's eager steps; timed on CUDA. On a CPU the capture path is taken with the capture
flag stood in (nothing is captured), and so is the current stream that megatron-core
0.19's DDP asks CUDA for in each gradient sync.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

HIDDEN, BATCH, TRIALS = 256, 64, 3
TOLERANCE = 1e-6  # max abs diff / max abs value, graph against eager


def _into_main_grad(param: torch.Tensor) -> None:
    param.main_grad.add_(param.grad)
    param.grad = None


class CpuStream:
    """A CUDA stream stood in on a CPU (here and in :mod:`bench.full_graph`'s simulated
    graphs): megatron-core's wrapper makes streams wait for each other, and its 0.19 DDP
    makes the current stream wait for the events its own CUDA graph replays leave on
    parameters (none here). There is nothing to wait for."""

    def wait_stream(self, other: Any) -> None:
        """Nothing to wait for on a CPU."""

    def wait_event(self, event: Any) -> None:
        """Nothing to wait for on a CPU."""


def capture_stream(device: str) -> Any:
    """The stream the models are built and every step runs on: the one the capture uses.

    A DDP keeps each parameter's AccumulateGrad node for its hooks, and autograd remembers
    the stream a node was made on. Unless torch can override that stale stream under capture
    (``torch.autograd.graph.set_override_stale_capture_stream``, pytorch#180090; torch 2.11
    lacks it), a backward captured on another stream joins the stream the DDP was built on,
    and the capture fails (``cudaErrorStreamCaptureImplicit``), whatever the finalize. So the
    models are built on the capture stream: megatron-core's shared one when it has one
    (0.19; 0.16's wrapper makes its own inside), else a new stream for the hand-rolled
    capture. None on a CPU.
    """
    if device != "cuda":
        return None
    try:
        from megatron.core.full_cuda_graph import get_shared_capture_stream
    except ImportError:
        return torch.cuda.Stream()
    return get_shared_capture_stream()


def _model(device: str) -> tuple[Any, str]:
    """A per-token-loss MLP in megatron-core's real DDP, or MiniDDP without megatron-core."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN)).to(device)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
            from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError:
        from bench.ddp import MiniDDP

        module.config = type("Config", (), {"calculate_per_token_loss": True})()
        module.ddp_config = type("DDPConfig", (), {"use_distributed_optimizer": False})()
        ddp = MiniDDP(module, None, device=device, lazy=False)
        for p in module.parameters():  # backward accumulates into main_grad, as Megatron's DDP does
            p.register_post_accumulate_grad_hook(_into_main_grad)
        return ddp, "bench.ddp.MiniDDP (no megatron-core)"
    if device == "cpu":
        torch.cuda.current_device = lambda: "cpu"  # the DDP's buffers on the CPU
        if not torch.cuda.is_available():  # megatron-core 0.19 asks for the stream its sync runs on
            torch.cuda.current_stream = lambda device=None: CpuStream()
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, calculate_per_token_loss=True)
    return DistributedDataParallel(config, DistributedDataParallelConfig(), module), "megatron-core DDP"


def _step(model: Any, x: torch.Tensor, tokens: torch.Tensor) -> Callable[[], None]:
    import torch_impl
    from bench.ddp import MiniDDP

    forward = model.module if isinstance(model, MiniDDP) else model  # MiniDDP has no forward of its own

    def step() -> None:
        model.zero_grad_buffer()
        forward(x).float().pow(2).sum().backward()
        torch_impl.finalize_model_grads([model], num_tokens=tokens)

    return step


def _grads(model: Any) -> list[torch.Tensor]:
    return [p.main_grad.detach().clone() for p in model.parameters()]


def run_hand_rolled(device: str, rounds: int) -> dict[str, Any]:
    """The hand-rolled capture of one step (the fallback without megatron-core)."""
    store = os.path.join(tempfile.mkdtemp(prefix="meshgrad-graph-"), "store")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{store}", rank=0, world_size=1)
    stream = capture_stream(device)
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        out = _hand_rolled(device, rounds, stream)
    dist.destroy_process_group()
    return out


def _hand_rolled(device: str, rounds: int, stream: Any) -> dict[str, Any]:
    """Build, warm up, capture (on ``stream``, the current one on CUDA), replay and compare."""
    model, kind = _model(device)
    twin, _ = _model(device)  # the same seed: the same parameters
    x, tokens = torch.zeros(BATCH, HIDDEN, device=device), torch.tensor(1, device=device)
    x_eager, tokens_eager = torch.zeros_like(x), torch.zeros_like(tokens)
    step, eager = _step(model, x, tokens), _step(twin, x_eager, tokens_eager)
    out: dict[str, Any] = {"impl": "hand-rolled torch.cuda.graph", "device": device, "ddp": kind}
    gen = torch.Generator().manual_seed(0)
    if device == "cuda":
        for _ in range(3):  # warm-up on the capture stream: plans, binds, runs the first-call checks
            step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            step()
        replay: Callable[[], None] = graph.replay
        out["captured"] = True
    else:
        step()  # eager first call
        saved = torch.cuda.is_available, torch.cuda.is_current_stream_capturing

        def replay() -> None:
            torch.cuda.is_available = torch.cuda.is_current_stream_capturing = lambda: True
            try:
                step()
            finally:
                torch.cuda.is_available, torch.cuda.is_current_stream_capturing = saved

        out["captured"] = "simulated (no CUDA device: capture path taken, nothing captured)"
    worst, largest = 0.0, 0.0
    for trial in range(TRIALS):
        data, n = torch.randn(BATCH, HIDDEN, generator=gen), 100 + 17 * trial
        x.copy_(data)
        tokens.fill_(n)  # in place: the captured step reads this memory
        x_eager.copy_(data)
        tokens_eager.fill_(n)
        replay()
        eager()
        for a, b in zip(_grads(model), _grads(twin)):
            worst = max(worst, float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)))
            largest = max(largest, float(b.abs().max()))
    out["max_rel_diff_replay_vs_eager"] = worst
    out["grad_abs_max"] = largest  # not zero: the comparison is not vacuous
    out["values_ok"] = worst <= TOLERANCE
    if device == "cuda":
        from bench.timing import interleaved

        timed = interleaved({"eager step": eager, "graph replay": replay}, rounds=rounds, batch=10,
                            sync=torch.cuda.synchronize)
        out["time"] = timed
        out["speedup"] = timed["eager step"]["median"] / timed["graph replay"]["median"]
    return out
