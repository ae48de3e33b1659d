"""``python -m bench.full_graph``: a whole training step captured in one CUDA graph with
``torch_impl.finalize_model_grads`` inside, as Megatron's ``FullCudaGraphWrapper``
(``--cuda-graph-impl full_iteration``) captures ``forward_backward_func`` and the
``finalize_model_grads_func`` it calls; its replays compared with eager steps.

A world of one rank (NCCL on CUDA). The model is a small MLP in megatron-core's real
``DistributedDataParallel`` (``bench.ddp.MiniDDP`` without megatron-core, said so in the
output) with per-token loss: one step = ``zero_grad_buffer()``, forward on a static input,
``loss.backward()``, ``torch_impl.finalize_model_grads(model, num_tokens=n)`` with ``n`` a
device tensor. The step is warmed up eagerly on a side stream, captured, and replayed on
new inputs and token counts written in place (docs/cuda_graphs.md, "The rule"); after each
replay every gradient is compared with an eager step of a twin model on the same input.
Replay and eager step are timed, interleaved.

``--device cpu`` (no GPU): the capture cannot be made; the same step runs with the
capture path taken (``torch.cuda.is_current_stream_capturing`` patched True) against eager
steps -- a smoke test of this script (``bash bench/gpu.sh --cpu-smoke``).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

HIDDEN, BATCH, TRIALS = 256, 64, 3


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
        return MiniDDP(module, None, device=device, lazy=False), "bench.ddp.MiniDDP (no megatron-core)"
    if device == "cpu":
        torch.cuda.current_device = lambda: "cpu"  # the DDP's buffers on the CPU
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, calculate_per_token_loss=True)
    return DistributedDataParallel(config, DistributedDataParallelConfig(), module), "megatron-core DDP"


def _step(model: Any, x: torch.Tensor, tokens: torch.Tensor) -> Callable[[], None]:
    import torch_impl

    def step() -> None:
        model.zero_grad_buffer()
        model(x).float().pow(2).sum().backward()
        torch_impl.finalize_model_grads([model], num_tokens=tokens)

    return step


def _grads(model: Any) -> list[torch.Tensor]:
    return [p.main_grad.detach().clone() for p in model.parameters()]


def run(device: str, rounds: int) -> dict[str, Any]:
    store = os.path.join(tempfile.mkdtemp(prefix="meshgrad-graph-"), "store")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{store}", rank=0, world_size=1)
    model, kind = _model(device)
    twin, _ = _model(device)  # the same seed: the same parameters
    x, tokens = torch.zeros(BATCH, HIDDEN, device=device), torch.tensor(1, device=device)
    x_eager, tokens_eager = torch.zeros_like(x), torch.zeros_like(tokens)
    step, eager = _step(model, x, tokens), _step(twin, x_eager, tokens_eager)
    out: dict[str, Any] = {"device": device, "ddp": kind}
    gen = torch.Generator().manual_seed(0)
    if device == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # warm-up: plans, binds, runs the first-call checks
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
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
    worst = 0.0
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
    out["max_rel_diff_replay_vs_eager"] = worst
    out["values_ok"] = worst <= 1e-6
    if device == "cuda":
        from bench.timing import interleaved

        timed = interleaved({"eager step": eager, "graph replay": replay}, rounds=rounds, batch=10,
                            sync=torch.cuda.synchronize)
        out["time"] = timed
        out["speedup"] = timed["eager step"]["median"] / timed["graph replay"]["median"]
    dist.destroy_process_group()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    result = run(args.device, args.rounds)
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print("whole step replay == eager:", "OK" if result["values_ok"] else "MISMATCH")
    return 0 if result["values_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
