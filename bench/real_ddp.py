"""``python -m bench.real_ddp``: finalize time with megatron-core's REAL
``DistributedDataParallel`` chunks, megatron-core's finalize against torch_impl's, in a
gloo world (real collectives, one process per rank).

The other benchmark rows use ``bench.ddp.MiniDDP``, a stand-in with Megatron DDP's
finalize-facing surface: their chunks hold parameters on the meta device in fake-backend
worlds of up to 64 ranks in one process, where megatron-core's DDP cannot be built (it
needs ``parallel_state`` or a full ``ProcessGroupCollection`` of real groups and a
``TransformerConfig``). This script measures what the real DDP can run: an MLP of
``--layers`` x ``--hidden`` in megatron-core's DDP on every rank of a gloo world with
Megatron's ``parallel_state`` (dp = world), per-token loss, ``overlap_grad_reduce`` off
and on. Each call is ``finalize_model_grads([ddp], num_tokens=n)``: the DDP's own bucket
sync and ``scale_gradients``, plus what the finalize adds around them (megatron-core:
its helper calls; torch_impl: planning once, then its cached plan). Times are interleaved
rounds (``bench.timing.interleaved``), the slowest rank's median per call; the ratio
torch_impl / megatron-core is printed, no goal.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from typing import Any


def world_main(rank: int, world: int, payload: dict[str, Any], sink: Any) -> None:
    """One rank (``parity_tests.torch_world.spawn_world`` target)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import torch_impl
    from bench.timing import interleaved

    torch.cuda.current_device = lambda: "cpu"  # megatron-core's DDP buffers on the CPU
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads as megatron_finalize
        from megatron.core.transformer.transformer_config import TransformerConfig

        ps.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    out: dict[str, Any] = {}
    for overlap in (False, True):
        models = {}
        for name in ("megatron-core", "torch_impl"):
            torch.manual_seed(0)
            layers = [nn.Linear(payload["hidden"], payload["hidden"]) for _ in range(payload["layers"])]
            ddp_cfg = DistributedDataParallelConfig(overlap_grad_reduce=overlap, bucket_size=1 << 18)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, calculate_per_token_loss=True)
                models[name] = DistributedDataParallel(cfg, ddp_cfg, nn.Sequential(*layers))
        x = torch.randn(4, payload["hidden"])
        tokens = torch.tensor(4 * world)
        for ddp in models.values():  # gradients in the buffers; with overlap, the reduction started
            ddp.zero_grad_buffer()
            ddp(x).sum().backward()
        finals = {"megatron-core": megatron_finalize, "torch_impl": torch_impl.finalize_model_grads}

        def call(name: str) -> Any:
            def run() -> None:
                ddp = models[name]
                if overlap:  # each call needs a started reduction: backward's hooks start it
                    ddp.zero_grad_buffer()
                    ddp(x).sum().backward()
                finals[name]([ddp], num_tokens=tokens.clone())

            return run

        timed = interleaved({n: call(n) for n in finals}, rounds=payload["rounds"], batch=payload["batch"])
        medians = torch.tensor([timed[n]["median"] for n in finals], dtype=torch.float64)
        dist.all_reduce(medians, op=dist.ReduceOp.MAX)
        key = "overlap_grad_reduce" if overlap else "no overlap"
        out[key] = {n: float(m) for n, m in zip(finals, medians)}
        out[key]["torch_impl / megatron-core"] = float(medians[1] / medians[0])
    ps.destroy_model_parallel()
    if rank == 0:
        params = payload["layers"] * (payload["hidden"] ** 2 + payload["hidden"])
        sink.put("result", {"world": world, "parameters": params, "seconds per call": out})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    from parity_tests.torch_world import spawn_world

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    payload = dict(layers=args.layers, hidden=args.hidden, rounds=args.rounds, batch=args.batch)
    outcome = spawn_world(world_main, args.world, payload, timeout=600)
    fatal = next((f for f in outcome.fatal if f), None)
    if fatal or "result" not in outcome.results[0]:
        print(f"real-DDP benchmark world failed: {'timed out' if outcome.timed_out else fatal}")
        return 1
    text = json.dumps(outcome.results[0]["result"], indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
