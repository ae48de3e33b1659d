"""``python -m bench.cold_calls``: the non-TP step called once after its caches were
evicted, as a training loop calls it, next to the same call warm (fake backend, one
process as rank 0).

The bench's interleaved rounds (:func:`bench.timing.interleaved`) time 20 calls a batch:
all but the first find the caches as the call before left them. Training calls finalize
once after backward, whose work has replaced what the processor's caches held. Here each
round, for each candidate in turn (rotating), writes a buffer larger than a core's
private caches (``--flush-mb``; the shared last-level cache keeps what it keeps), times
one call (cold), then one more (warm). Ratios are the median over rounds of meshgrad's
time / megatron-core's in the same round, cold against cold and warm against warm.

Candidates, per layout (``bench.run.FAKE_LAYOUTS``): megatron-core's
``_allreduce_non_tensor_model_parallel_grads`` on a :class:`bench.ddp.MiniDDP` chunk,
meshgrad's on its own buffers (``attach_grad_buffers``) and meshgrad's drop-in on a
MiniDDP chunk. Values: every model's non-TP gradients get the same integer values before
the timed calls and must hold them after (the fake backend's collectives move nothing:
a difference is a staging that lost or moved a value).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from bench import fake
from bench.counting import megatron_finalize_module
from bench.ddp import MiniDDP
from bench.models import Layout, non_tp_params
from bench.run import FAKE_LAYOUTS
from bench.timing import paired_ratio, rotated


def _models(lay: Layout) -> tuple[dict[str, Callable[[], object]], dict[str, list[torch.Tensor]]]:
    """(name -> one non-TP step, name -> its non-TP gradients) of each candidate,
    megatron-core's first (the ratios' denominator)."""
    import torch_impl
    from torch_impl.buffers import attach_grad_buffers

    fake.init_fake(lay.world)
    groups = fake.fake_groups(lay)

    fmg = megatron_finalize_module()
    mcore, dropin = ([MiniDDP(fake.first_stage_chunk(lay, "cpu"), groups.dp_cp, device="cpu")] for _ in range(2))
    own = [fake.first_stage_chunk(lay, "cpu")]
    attach_grad_buffers(own, groups, lazy=True, device="cpu")
    config = own[0].config
    steps: dict[str, Callable[[], object]] = {
        "megatron-core": lambda: fmg._allreduce_non_tensor_model_parallel_grads(mcore, config, groups.tp),
        "meshgrad buffers": lambda: torch_impl._allreduce_non_tensor_model_parallel_grads(own, config, groups.tp),
        "meshgrad drop-in": lambda: torch_impl._allreduce_non_tensor_model_parallel_grads(dropin, config, groups.tp),
    }
    roots = {"megatron-core": mcore[0].module, "meshgrad buffers": own[0], "meshgrad drop-in": dropin[0].module}
    return steps, {name: [p.main_grad for p in non_tp_params(root)] for name, root in roots.items()}


def measure(lay: Layout, *, rounds: int, flush_mb: int) -> dict[str, Any]:
    """Cold and warm seconds per call of each candidate, one sample per round.

    Returns:
      {"layout", "non_tp_grads", "cold" / "warm": name -> samples, "ratios":
      "<name> / megatron-core, cold|warm" -> median paired ratio}.

    Raises:
      RuntimeError: a model's non-TP gradients did not keep their values.
    """
    steps, grads = _models(lay)
    values = [torch.randint(-8, 8, g.shape, generator=torch.Generator().manual_seed(i)).to(g.dtype)
              for i, g in enumerate(grads["megatron-core"])]
    for tensors in grads.values():
        torch._foreach_copy_(tensors, values)
    for step in steps.values():  # the first call plans; the next ones take the steady path
        for _ in range(3):
            step()
    flush = torch.zeros(flush_mb << 20, dtype=torch.uint8)
    samples: dict[str, dict[str, list[float]]] = {"cold": {n: [] for n in steps}, "warm": {n: [] for n in steps}}
    names = list(steps)
    enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(rounds):
            for name in rotated(names, r):
                for kind in ("cold", "warm"):
                    if kind == "cold":
                        flush.add_(1)
                    start = time.perf_counter()
                    steps[name]()
                    samples[kind][name].append(time.perf_counter() - start)
    finally:
        if enabled:
            gc.enable()
    lost = [name for name, tensors in grads.items() if not all(map(torch.equal, tensors, values))]
    if lost:
        raise RuntimeError(f"{lay.name}: non-TP gradients changed in {lost}")
    ratios = {
        f"{name} / megatron-core, {kind}": paired_ratio({"samples": samples[kind][name]},
                                                        {"samples": samples[kind]["megatron-core"]})
        for kind in ("cold", "warm") for name in names[1:]
    }
    return {"layout": lay.name, "non_tp_grads": len(values), "cold": samples["cold"], "warm": samples["warm"],
            "ratios": ratios}


def report(result: dict[str, Any]) -> str:
    """Median us per call, cold and warm, and the paired ratios to megatron-core's."""
    lines = [f"{result['layout']}: non-TP step, {result['non_tp_grads']} non-TP grads "
             "(median us per call; ratio: median of same-round ratios to megatron-core's)",
             f"  {'':18s} {'cold us':>9s} {'warm us':>9s} {'cold/mcore':>11s} {'warm/mcore':>11s}"]
    for name in result["cold"]:
        cold, warm = (statistics.median(result[k][name]) * 1e6 for k in ("cold", "warm"))
        ratio = [result["ratios"].get(f"{name} / megatron-core, {k}") for k in ("cold", "warm")]
        cells = " ".join(f"{r:11.3f}" if r is not None else f"{'-':>11s}" for r in ratio)
        lines.append(f"  {name:18s} {cold:9.1f} {warm:9.1f} {cells}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cold_calls", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", default=["gpt-24L-h1024", "gpt-24L-h1024-pp1"],
                        choices=sorted(FAKE_LAYOUTS))
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--flush-mb", type=int, default=8, help="bytes written before each cold call (MiB)")
    args = parser.parse_args(argv)
    if megatron_finalize_module() is None:
        print("cold calls skipped: megatron-core is not installed (its step is the ratios' denominator)")
        return 0
    for name in args.layouts:
        print(report(measure(FAKE_LAYOUTS[name], rounds=args.rounds, flush_mb=args.flush_mb)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
