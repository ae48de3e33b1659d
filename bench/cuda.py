"""``python -m bench.cuda``: the GPU half of the benchmark (run by ``bench/gpu.sh``).

* ``--backend nccl``: a world of one rank on one GPU (NCCL): whole-finalize local
  overhead per call with ``num_tokens``, meshgrad (own buffers, drop-in) against
  megatron-core; then the whole meshgrad finalize captured in one CUDA graph and replayed
  (no host sync inside: num_tokens stays on the device), checked by value, timed
  against eager; megatron-core's finalize is tried under capture too (0.16's
  ``if num_tokens > 0`` needs the host; 0.19 clamps the count on the device and captures).
  On CUDA, also one steady call of each row under torch's sync debug mode: its host syncs.
* ``--backend fake``: the multi-rank layout (TP=8, PP=2, DP=2) on torch's fake backend
  with gradients on the device: the same capture / replay / value check, with meshgrad's
  pre-scale, in-place reductions (no-ops under fake) and the token scale in the graph.

``--device cpu --backend gloo`` (or ``fake``) runs every non-graph part on the CPU: a
smoke test of this script without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
import traceback
import types
from typing import Any

import torch
import torch.distributed as dist

from bench.models import Layout, build_chunk
from bench.timing import interleaved

WORLD1 = Layout("gpt-24L-h1024-world1", 24, 1024, tp=1, pp=1, dp=1)
FAKE = Layout("gpt-24L-h1024", 24, 1024, tp=8, pp=2, dp=2)


def _fill(model_buffers: list[torch.Tensor], seed: int = 0) -> list[torch.Tensor]:
    """Integer-valued gradients (exact under scaling by a power of two), kept as copies;
    drawn on the buffers' device (a host draw of billions of values takes minutes)."""
    out = []
    for i, b in enumerate(model_buffers):
        gen = torch.Generator(device=b.device).manual_seed(seed * 1000 + i)
        b.copy_(torch.randint(-8, 9, b.shape, generator=gen, device=b.device, dtype=b.dtype))
        out.append(b.detach().clone())
    return out


def init_world_of_one(backend: str, device: str) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device).index or 0)  # "cuda" alone names no index
    store = os.path.join(tempfile.mkdtemp(prefix="meshgrad-bench-"), "store")
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)


def _capture(fn: Any, device: str) -> Any:
    """``fn`` warmed up on a side stream, then captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def eager_check(fn: Any, buffers: list[torch.Tensor], tokens: torch.Tensor, device: str) -> bool:
    """One eager finalize on fresh integer values with 8 tokens: every gradient / 8."""
    before = _fill(buffers, seed=99)
    tokens.fill_(8)
    fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return all(bool(torch.equal(b, v / 8)) for b, v in zip(buffers, before))


def graph_check(
    fn: Any, buffers: list[torch.Tensor], tokens: torch.Tensor, expected_scale: float, device: str, rounds: int
) -> dict[str, Any]:
    """Capture ``fn`` (a whole finalize reading ``tokens``), replay it on fresh values and
    check every gradient (``expected_scale`` = the factor with tokens = 4); time replay
    against eager."""
    out: dict[str, Any] = {}
    if not device.startswith("cuda"):
        return {"skipped": "no CUDA device"}
    try:
        graph = _capture(fn, device)
    except Exception as err:  # reported, not raised
        return {"captured": False, "error": f"{type(err).__name__}: {err}"[:400]}
    out["captured"] = True
    ok = True
    for trial in range(3):
        before = _fill(buffers, seed=trial + 1)
        tokens.fill_(4 * 2**trial)  # powers of two: the scaled values are exact
        graph.replay()
        torch.cuda.synchronize()
        factor = expected_scale / 2**trial
        for b, v in zip(buffers, before):
            ok = ok and bool(torch.equal(b, v * factor))
    out["values_ok"] = ok
    timed = interleaved(
        {"eager": fn, "graph replay": graph.replay}, rounds=rounds, batch=20, sync=torch.cuda.synchronize
    )
    out["time"] = timed
    out["speedup"] = timed["eager"]["median"] / timed["graph replay"]["median"]
    return out


def host_syncs(fn: Any) -> dict[str, Any]:
    """One call of ``fn`` under torch's sync debug mode: the host syncs torch sees it make
    (a ``.item()``, a copy to the host, ...), counted and the first few named."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message).splitlines()[0][:160] for w in caught if "called a synchronizing" in str(w.message)]
    return {"count": len(syncs), "first": syncs[:3]}


def run_world_of_one(
    device: str,
    backend: str,
    rounds: int,
    with_megatron: bool = True,
    layout: Layout = WORLD1,
    save: Any = None,
) -> dict[str, Any]:
    import torch_impl
    from bench.counting import megatron_finalize_module
    from bench.ddp import MiniDDP
    from bench.fake import buffers_to
    from torch_impl.buffers import attach_grad_buffers
    from torch_impl.finalize import execution_stats

    init_world_of_one(backend, device)
    one = dist.new_group([0])
    mpgc = types.SimpleNamespace(tp=one, pp=one, embd=None, pos_embd=None, dp_cp=one)
    pgc = types.SimpleNamespace(tp=one, pp=one, embd=None, pos_embd=None, dp_cp=one, expt_dp=None, tp_dp_cp=one)
    sync = torch.cuda.synchronize if device.startswith("cuda") else None

    def chunk() -> Any:
        c = build_chunk(layout, 0)
        buffers_to(c, device)
        return c

    own = [chunk()]
    bufs = attach_grad_buffers(own, pgc, device=device)
    _fill(list(bufs.buffers))
    dropin = [MiniDDP(chunk(), None, device=device, lazy=False)]
    tokens = torch.tensor(4, device=device)
    cands = {
        "meshgrad buffers": lambda: torch_impl.finalize_model_grads(own, num_tokens=tokens, pg_collection=pgc),
        "meshgrad drop-in": lambda: torch_impl.finalize_model_grads(dropin, num_tokens=tokens, pg_collection=pgc),
    }
    fmg = megatron_finalize_module() if with_megatron else None
    mc: list[Any] = []
    if fmg is not None:
        mc = [MiniDDP(chunk(), one, device=device, lazy=False)]
        cands["megatron"] = lambda: fmg.finalize_model_grads(mc, tokens.clone(), mpgc)
    floor_tokens = tokens.clone()

    def floor() -> None:  # what any finalize must do here: the count's all-reduce and the scale
        floor_tokens.copy_(tokens)
        dist.all_reduce(floor_tokens, group=one)
        torch._foreach_mul_(list(bufs.buffers), 1.0 / floor_tokens)

    cands["floor"] = floor
    cands.update(status_round_rows(device))
    result: dict[str, Any] = {"layout": dataclasses.asdict(layout), "backend": backend, "device": device}
    result["time"] = interleaved(cands, rounds=rounds, batch=20, sync=sync)
    t = {name: row["median"] for name, row in result["time"].items()}
    result["ratios"] = {
        "meshgrad buffers / floor": t["meshgrad buffers"] / t["floor"],
        "status round / tiny all-reduce": t["status round"] / t["tiny all-reduce"],
        "status round / meshgrad buffers finalize": t["status round"] / t["meshgrad buffers"],
        **({"meshgrad buffers / megatron": t["meshgrad buffers"] / t["megatron"]} if "megatron" in t else {}),
    }
    result["bytes_copied_meshgrad_buffers"] = execution_stats(own).bytes_copied
    if device.startswith("cuda"):  # a steady call of each (all ran above): torch's view of its host syncs
        result["host syncs per call"] = {name: host_syncs(fn) for name, fn in cands.items()}
    result["eager values_ok"] = eager_check(cands["meshgrad buffers"], list(bufs.buffers), tokens, device)
    tokens.fill_(4)
    # Capture: meshgrad's whole finalize, tokens on the device.
    result["graph meshgrad buffers"] = graph_check(cands["meshgrad buffers"], list(bufs.buffers), tokens, 0.25, device, rounds)
    if save is not None:  # before trying megatron under capture (a failed capture may poison the context)
        save(result)
    if fmg is not None:
        result["graph megatron"] = graph_check(
            cands["megatron"], [b for b, _ in mc[0].grad_buffers], tokens, 0.25, device, rounds
        )
    return result


def status_round_rows(device: str) -> dict[str, Any]:
    """Two rows that price the status round on this backend: the round itself as a call
    runs it (its vector to the device, one SUM all-reduce over the world, one read back:
    the step's one host sync), and the bare latency of a tiny all-reduce of the same
    vector followed by a synchronize."""
    from torch_impl.run import status

    route = status.world_route()
    vector = torch.zeros(status.STATUS_SIZE, dtype=torch.int64, device=route[0][2])

    def tiny() -> None:
        dist.all_reduce(vector)
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def round_() -> None:
        status.reduce_status(status.status_vector(), route, 0, "bench")

    return {"status round": round_, "tiny all-reduce": tiny}


def run_fake(device: str, rounds: int, layout: Layout = FAKE) -> dict[str, Any]:
    """The multi-rank layout under the fake backend, gradients on ``device``."""
    import torch_impl
    from bench.fake import buffers_to, fake_groups, init_fake
    from torch_impl.buffers import attach_grad_buffers

    if dist.is_initialized():
        dist.destroy_process_group()
    init_fake(layout.world)
    pgc = fake_groups(layout)
    own = [build_chunk(layout, 0)]
    buffers_to(own[0], device)
    bufs = attach_grad_buffers(own, pgc, device=device)
    _fill(list(bufs.buffers))
    tokens = torch.tensor(4, device=device)
    fn = lambda: torch_impl.finalize_model_grads(own, num_tokens=tokens, pg_collection=pgc)  # noqa: E731
    sync = torch.cuda.synchronize if device.startswith("cuda") else None
    result: dict[str, Any] = {"layout": dataclasses.asdict(layout), "backend": "fake", "device": device}
    result["time"] = interleaved({"meshgrad buffers": fn}, rounds=rounds, batch=20, sync=sync)
    result["eager values_ok"] = eager_check(fn, list(bufs.buffers), tokens, device)
    tokens.fill_(4)
    # Under fake, collectives do nothing: the global token count is this rank's 4, and
    # the reductions leave values alone, so each gradient is divided by 4.
    result["graph meshgrad buffers"] = graph_check(fn, list(bufs.buffers), tokens, 0.25, device, rounds)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cuda", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backend", choices=("nccl", "gloo", "fake"), default="nccl")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-megatron", action="store_true")
    parser.add_argument("--layers", type=int, help="override the layout's layer count (CPU smoke: small)")
    parser.add_argument("--hidden", type=int, help="override the layout's hidden size")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench.cuda: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    rounds = 5 if args.quick else 15
    started = time.time()
    base = FAKE if args.backend == "fake" else WORLD1
    layout = dataclasses.replace(
        base, layers=args.layers or base.layers, hidden=args.hidden or base.hidden, vocab=base.vocab if args.hidden is None else 4096
    )

    def save(result: dict[str, Any]) -> None:
        result["seconds"] = time.time() - started
        result["torch"] = torch.__version__
        result["cuda_device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2, default=str)

    try:
        if args.backend == "fake":
            result = run_fake(args.device, rounds, layout)
        else:
            result = run_world_of_one(
                args.device, args.backend, rounds, with_megatron=not args.no_megatron, layout=layout, save=save
            )
    except Exception:
        traceback.print_exc()
        return 1
    save(result)
    print(json.dumps(result, indent=2, default=str))
    graph = result.get("graph meshgrad buffers", {})
    if not result.get("eager values_ok"):
        print("bench.cuda: meshgrad's eager finalize gave wrong values", file=sys.stderr)
        return 1
    if graph.get("captured") is False or graph.get("values_ok") is False:
        print("bench.cuda: meshgrad's finalize did not capture / replay correctly", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
