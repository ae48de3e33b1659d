"""Megatron's own training schedule with ``torch_impl.finalize_model_grads`` as its
``config.finalize_model_grads_func``: a tiny megatron-core ``GPTModel`` in megatron-core's
``DistributedDataParallel``, trained with ``get_forward_backward_func()`` over TP x PP x DP
on CPU gloo, against the same run with megatron-core's own finalize. With pp > 1
``get_forward_backward_func()`` returns the 1F1B pipelined schedule
(``forward_backward_pipelining_without_interleaving``), with pp = 1
``forward_backward_no_pipelining``; each row names the schedule that ran.

For each layout the script trains the model twice from the same seed -- once with
``megatron.core.distributed.finalize_model_grads``, once with
``torch_impl.finalize_model_grads`` -- and compares, at every step and on every rank, the
losses (last pipeline stage) and every parameter bit for bit. The attention has q / k
layernorms (``qk_layernorm``: their gradients are summed over tp by the finalize; the
local spec's torch LayerNorm refuses sequence parallelism), the word embedding is
tied across the first and last stages (its gradients summed over the embedding group;
with pp = 1 one tensor serves both),
and the loss is per token (``calculate_per_token_loss``: the schedule hands the global
token count to the finalize). It prints one row per (layout, step) and ends with
``VERDICT: OK`` (exit 0) or ``VERDICT: MISMATCH`` (exit 1)::

    python examples/megatron_schedule.py                     # tp2-pp2-dp1, tp1-pp2-dp2, tp2-pp1-dp2: 4 ranks
    python examples/megatron_schedule.py --layout 2x2x2      # tp2-pp2-dp2, 8 ranks
    python examples/megatron_schedule.py --steps 5 --dump DIR  # DIR/rank<r>.pt: losses, params

Needs megatron-core (no CUDA, no TransformerEngine: the local layer spec). megatron-core is
not changed; its device lookups are pointed at the CPU in these processes
(``parity_tests.megatron_state.megatron_on_cpu``: ``torch.cuda.current_device`` returns
"cpu", tensors asked for on "cuda" are made on the CPU, the CUDA RNG tracker's fork is a
no-op -- the model has no dropout).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VOCAB, SEQ, MICRO_BATCH, MICRO_BATCHES, LR = 64, 8, 2, 2, 0.25


def _config(tp: int, pp: int) -> Any:
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=4, use_cpu_initialization=True,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
        qk_layernorm=True, hidden_dropout=0.0, attention_dropout=0.0, calculate_per_token_loss=True,
    )


def _batches(step: int, dp_rank: int) -> Any:
    """The micro-batches of one step on one data-parallel rank (the same on its tp / pp peers)."""
    import torch

    g = torch.Generator().manual_seed(100 * step + dp_rank)
    for _ in range(MICRO_BATCHES):
        yield torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g)


def _forward_step(data: Any, model: Any) -> tuple[Any, Any]:
    import torch

    tokens = next(data)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
    mask = (labels % 5 != 0).float()  # some tokens do not count: the per-token divisor is real

    def loss_func(output: Any) -> tuple[Any, Any, dict[str, Any]]:
        total = (output.float() * mask).sum()
        count = mask.sum().to(torch.int)
        return total, count, {"lm loss": torch.stack([total.detach(), count.float()])}

    return model(inputs, positions, None, labels=labels), loss_func


def train(tp: int, pp: int, finalize: Any, steps: int) -> dict[str, Any]:
    """One training run of this rank: per step the loss (last stage; None elsewhere) and
    every parameter after the SGD update."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    torch.manual_seed(1234 + ps.get_pipeline_model_parallel_rank() * 10 + ps.get_tensor_model_parallel_rank())
    config = _config(tp, pp)
    model = GPTModel(config, get_gpt_layer_local_spec(qk_layernorm=True), vocab_size=VOCAB,
                     max_sequence_length=SEQ, share_embeddings_and_output_weights=True,
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    config.finalize_model_grads_func = finalize
    forward_backward = get_forward_backward_func()
    out: dict[str, Any] = {"schedule": forward_backward.__name__, "losses": [], "params": []}
    for step in range(steps):
        ddp.zero_grad_buffer()
        reported = forward_backward(
            forward_step_func=_forward_step, data_iterator=_batches(step, ps.get_data_parallel_rank()),
            model=[ddp], num_microbatches=MICRO_BATCHES, seq_length=SEQ, micro_batch_size=MICRO_BATCH,
        )
        with torch.no_grad():
            for p in ddp.parameters():
                p.sub_(LR * p.main_grad)
        loss = None
        if reported:  # last stage: sum of token losses / tokens over this rank's micro-batches
            total = torch.stack([r["lm loss"] for r in reported]).sum(0)
            loss = float(total[0] / total[1])
        out["losses"].append(loss)
        out["params"].append({n: p.detach().clone() for n, p in ddp.named_parameters()})
    return out


def _differences(a: dict[str, Any], b: dict[str, Any], step: int) -> list[str]:
    import torch

    diffs = [] if a["losses"][step] == b["losses"][step] else [f"loss {a['losses'][step]} vs {b['losses'][step]}"]
    for name, x in a["params"][step].items():
        if not torch.equal(x, b["params"][step][name]):
            diffs.append(f"{name} (max {float((x - b['params'][step][name]).abs().max()):.3g})")
    return diffs


def run_rank(rank: int, world: int, store: str, layouts: list[tuple[int, int, int]], steps: int,
             dump: str | None) -> None:
    """One rank: every layout, both finalize functions; rank 0 prints the rows."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    warnings.simplefilter("ignore")
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads as megatron_finalize

    import torch_impl
    from parity_tests.megatron_state import megatron_on_cpu

    megatron_on_cpu()
    results: dict[str, Any] = {}
    bad = 0
    for tp, pp, dp in layouts:
        name = f"tp{tp}-pp{pp}-dp{dp}"
        ps.initialize_model_parallel(tp, pp, create_gloo_process_groups=False)
        ref = train(tp, pp, megatron_finalize, steps)
        ours = train(tp, pp, torch_impl.finalize_model_grads, steps)
        ps.destroy_model_parallel()
        results[name] = {"megatron": ref, "torch_impl": ours}
        if rank == 0:
            print(f"{name}: megatron-core's {ours['schedule']}", flush=True)
        for step in range(steps):
            diffs = _differences(ref, ours, step)
            rows: list[Any] = [None] * world
            dist.all_gather_object(rows, (ref["losses"][step], ours["losses"][step], diffs))
            bad += sum(bool(r[2]) for r in rows)
            if rank == 0:
                loss = next(r for r in rows[::-1] if r[0] is not None)  # a last-stage rank's loss
                state = "identical" if not any(r[2] for r in rows) else "; ".join(
                    f"rank {i}: {', '.join(r[2][:3])}" for i, r in enumerate(rows) if r[2])
                print(f"{name} step {step}: loss megatron {loss[0]:.6f} torch_impl {loss[1]:.6f} | params {state}",
                      flush=True)
    if dump:
        torch.save(results, os.path.join(dump, f"rank{rank}.pt"))
    if rank == 0:
        print("VERDICT: OK (losses and parameters bit-identical)" if not bad else "VERDICT: MISMATCH", flush=True)
    dist.destroy_process_group()
    if bad:
        raise SystemExit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", action="append", help="TPxPPxDP (repeatable; default 2x2x1, 1x2x2, 2x1x2)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--dump", help="folder for rank<r>.pt (losses and parameters of both runs)")
    args = parser.parse_args(argv)
    layouts = [tuple(int(v) for v in text.split("x")) for text in (args.layout or ["2x2x1", "1x2x2", "2x1x2"])]
    worlds = {tp * pp * dp for tp, pp, dp in layouts}
    if len(worlds) != 1:
        parser.error(f"all layouts must use the same number of ranks, got {sorted(worlds)}")
    world = worlds.pop()
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=run_rank, args=(r, world, os.path.join(tmp, "store"), layouts, args.steps,
                                                    args.dump)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
    return 0 if all(p.exitcode == 0 for p in procs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
