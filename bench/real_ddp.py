"""``python -m bench.real_ddp``: finalize time with megatron-core's REAL
``DistributedDataParallel`` chunks, megatron-core's finalize against torch_impl's and
against the floor, in a gloo world (real collectives, one process per rank). Also run by
``python -m bench`` (``--no-real-ddp`` skips it).

The other benchmark rows use ``bench.ddp.MiniDDP``, a stand-in with Megatron DDP's
finalize-facing surface (see bench/README.md for which rows and why). This script measures
what the real DDP runs: an MLP of ``--layers`` x ``--hidden`` in megatron-core's DDP on every
rank of a gloo world with Megatron's ``parallel_state`` (dp = world), per-token loss,
in four settings: ``overlap_grad_reduce`` off and on, the distributed optimizer (the DDP
reduce-scatters), and bfloat16 parameters with ``grad_reduce_in_fp32``. Five twin DDPs per
setting (same seed):

* ``megatron-core``: ``megatron.core.distributed.finalize_model_grads([ddp], num_tokens=n)``;
* ``torch_impl``: ``torch_impl.finalize_model_grads([ddp], num_tokens=n)`` (planning once,
  then its cached plan around the DDP's own sync);
* ``torch_impl no round``: the same with ``consistency_check = "off"`` in the model's config
  (no status round: the one small collective a call adds before data moves; shown, no goal);
* ``floor``: what any finalize must do here, and nothing else: the DDP's
  ``finish_grad_sync()``, the all-reduce of the token count over the DDP's own group
  (dp x cp, as megatron-core's finalize: the group without cp is another process group of
  the same ranks, and switching to it costs gloo time no finalize needs to spend) and the
  DDP's ``scale_gradients(1 / n)``;
* ``megatron-core again``: a second twin finalized by megatron-core, the control (shown, no
  goal): its ratio to ``megatron-core`` is how far two identical finalizes read apart in
  the same run, the spread of the measurement itself on this machine.

Asked for by ``--candidates`` only: ``torch_impl unchecked``, torch_impl's finalize with
its steady check skipped once it has said yes (:class:`bench.unchecked.Unchecked`; the
status round, sync and scale as in ``torch_impl``): ``torch_impl`` over it is what the
check costs a step. Not a safe finalize; its gradients are compared all the same. And
``floor, count first``: the floor with the token count's all-reduce moved before the DDP's
sync, where the contract puts torch_impl's status round (which carries the count here):
over ``floor``, it is what that order alone costs calls made back to back, with no forward
or backward between them (no overlap, distributed optimizer, bf16); ``torch_impl`` over it
is torch_impl's price with the order taken out.

With ``overlap_grad_reduce`` each call first runs ``zero_grad_buffer()``, forward and
backward (the DDP's hooks start the reduction during backward), for all alike.
Without it the calls repeat on the reduced buffers. The token count changes on every call,
as in training (:func:`step_counts`): each candidate's calls take this rank's counts in
turn, whose global sums (``world / 2``, then ``2 * world``) scale the summed values by 2,
then by 1/2, so that they keep their magnitude exactly.
Times are interleaved rounds (``bench.timing.interleaved``), the slowest rank's median per
call; each ratio is the median over rounds of the two candidates' times in the same round
(:data:`PAIRS`), averaged over the ranks: on two cores shared by four ranks the machine's
speed drifts between rounds, and a ratio of two medians carries that drift. Under each
row, the CPU time the calling thread spent in one finalize (``time.thread_time``; waiting
in a collective costs none), the mean over calls and ranks: with four ranks on two cores,
one rank's CPU before a collective keeps the others waiting.

With ``--parts`` the two finalizes' calls are also counted part by part while timed
(:func:`cpu_parts`, :mod:`bench.cpu_parts`): the calling thread's CPU per call in
torch_impl's replay lookup and status round, the DDP's own sync and scale, megatron-core's
token broadcast and all-reduce, and the rest; then the Python functions one more steady call
of each enters (:func:`~bench.cpu_parts.functions_entered`: this rank's, exact) and the torch
operations one more runs (:func:`~bench.cpu_parts.operations_run`).

Values, not timing: before and after the timed calls, the megatron-core and torch_impl twins
(and ``torch_impl unchecked``, the floor and ``floor, count first`` when timed) each run one
step on the same per-rank input (zero, forward, backward, finalize); their gradient buffers
must be bit-identical to megatron-core's (``max_abs_diff``, the largest of them, 0; each
twin's in ``max_abs_diff by candidate``: torch_impl's is the goal's) and not zero.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

from bench.cpu_parts import CpuParts, functions_entered, operations_run

NAMES = ("megatron-core", "torch_impl", "torch_impl no round", "floor", "megatron-core again")
#: Candidates timed only when asked for (``--candidates``), in this order after NAMES.
OPT_IN = ("torch_impl unchecked", "floor, count first")
#: Each setting: the DDP config's fields set, and whether the model is in bfloat16.
MODES: dict[str, dict[str, bool]] = {
    "no overlap": {},
    "overlap_grad_reduce": {"overlap_grad_reduce": True},
    "distributed optimizer": {"use_distributed_optimizer": True},
    "bf16, fp32 reduce": {"grad_reduce_in_fp32": True, "bf16": True},
}
#: The ratios reported, each the median over rounds of the two candidates' times in the
#: same round (``bench.timing.paired_ratio``: a slow phase of the machine cancels out),
#: averaged over the ranks.
PAIRS = (("torch_impl", "megatron-core"), ("torch_impl", "floor"), ("megatron-core", "floor"),
         ("torch_impl no round", "megatron-core"), ("megatron-core again", "megatron-core"),
         ("torch_impl", "torch_impl unchecked"), ("floor, count first", "floor"),
         ("torch_impl", "floor, count first"))
#: The ratio columns printed, with their headers.
RATIO_COLUMNS = (("torch_impl / megatron-core", "ours/mcore"), ("torch_impl / floor", "ours/floor"),
                 ("megatron-core / floor", "mcore/floor"), ("torch_impl no round / megatron-core", "no round/mcore"),
                 ("megatron-core again / megatron-core", "mcore A/A"),
                 ("torch_impl / torch_impl unchecked", "ours/unchecked"),
                 ("floor, count first / floor", "first/floor"), ("torch_impl / floor, count first", "ours/first"))
#: torch_impl / floor and torch_impl / megatron-core: the full contract (status round on)
#: at megatron-core's speed.
GOALS = {"floor": 1.2, "megatron-core": 1.05}


#: The candidates ``--parts`` profiles, and the parts timed in their calls (the calling
#: thread's CPU, outermost part only: :class:`bench.cpu_parts.CpuParts`), in print order.
PROFILED = ("megatron-core", "torch_impl")
PART_NAMES = ("steady check (replay lookup)", "status round", "DDP finish_grad_sync", "broadcast",
              "all_reduce", "DDP scale_gradients", "rest", "call")


def cpu_parts(ddp_class: Any) -> CpuParts:
    """The parts ``--parts`` times: torch_impl's replay lookup of a steady call and its status
    round (the agree stage), the DDP's own sync and scale (both candidates call them), and the
    token count's collectives megatron-core makes itself (``torch.distributed``'s; the
    DDP's own collectives are inside its sync)."""
    import torch.distributed as dist

    from torch_impl.call import pipeline

    return CpuParts([
        ("steady check (replay lookup)", pipeline, "replayed"), ("status round", pipeline, "agree_call"),
        ("DDP finish_grad_sync", ddp_class, "finish_grad_sync"), ("DDP scale_gradients", ddp_class, "scale_gradients"),
        ("broadcast", dist, "broadcast"), ("all_reduce", dist, "all_reduce"),
    ])


def step_counts(rank: int, world: int) -> tuple[int, ...]:
    """This rank's token counts, taken in turn by each candidate's calls: the global count
    changes on every call, as in training -- ``world / 2`` (ranks below ``world / 2`` pass 1,
    the others 0), then ``2 * world`` --, and its two scales of the summed values (2, then
    1/2) cancel exactly. An odd world passes 1 on every call (a constant count)."""
    if world % 2:
        return (1,)
    return (1 if rank < world // 2 else 0, 2)


def megatron_missing() -> str | None:
    """Why the real-DDP rows cannot run here (megatron-core not importable), or None."""
    import importlib.util

    try:
        found = importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else "megatron-core is not installed (pip install megatron-core)"


def _grads(ddp: Any) -> Any:
    import torch

    return torch.cat([p.main_grad.detach().reshape(-1).float() for p in ddp.parameters()])


def world_main(rank: int, world: int, payload: dict[str, Any], sink: Any) -> None:
    """One rank (``parity_tests.process_world.spawn_world`` target)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import torch_impl
    from bench.timing import interleaved, paired_ratio
    from bench.unchecked import Unchecked
    from parity_tests.megatron_state import megatron_on_cpu

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # megatron-core's device lookups (its DDP buffers) on the CPU; its TorchFunctionMode
        # (tensors asked for on "cuda") is left at once: nothing here needs it, and a Python
        # mode around every torch call would add to the very overhead measured
        megatron_on_cpu().__exit__(None, None, None)
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads as megatron_finalize
        from megatron.core.transformer.transformer_config import TransformerConfig

        ps.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    # the group the DDP syncs over and megatron-core's finalize reduces the count on
    dp_cp_group = ps.get_data_parallel_group(with_context_parallel=True)
    hidden = payload["hidden"]
    names = tuple(payload.get("names", NAMES))

    def build(mode: dict[str, bool], round_off: bool) -> Any:
        torch.manual_seed(0)
        dtype = torch.bfloat16 if mode.get("bf16") else torch.float32
        layers = [nn.Linear(hidden, hidden, dtype=dtype) for _ in range(payload["layers"])]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, calculate_per_token_loss=True,
                                    bf16=bool(mode.get("bf16")), params_dtype=dtype)
            if round_off:
                cfg.consistency_check = "off"  # read by torch_impl from the model's config
            fields = {k: v for k, v in mode.items() if k != "bf16"}
            ddp_cfg = DistributedDataParallelConfig(bucket_size=1 << 18, **fields)
            return DistributedDataParallel(cfg, ddp_cfg, nn.Sequential(*layers))

    def floor(count_first: bool) -> Callable[..., None]:
        """The floor's finalize: the DDP's sync and the count's all-reduce (in that order, or
        the count first), then the DDP's scale."""

        def finalize(model: list[Any], num_tokens: Any) -> None:
            (ddp,) = model
            if count_first:
                dist.all_reduce(num_tokens, group=dp_cp_group)
            ddp.finish_grad_sync()
            if not count_first:
                dist.all_reduce(num_tokens, group=dp_cp_group)
            ddp.scale_gradients(1.0 / num_tokens)

        return finalize

    unchecked = Unchecked()  # installed for the whole world, reset per setting
    finals: dict[str, Callable[..., None]] = {
        "megatron-core": megatron_finalize, "torch_impl": torch_impl.finalize_model_grads,
        "torch_impl no round": torch_impl.finalize_model_grads, "floor": floor(count_first=False),
        "megatron-core again": megatron_finalize, "torch_impl unchecked": unchecked.finalize,
        "floor, count first": floor(count_first=True),
    }
    # each against megatron-core: the floors too, which do its arithmetic in their own order
    compared = [n for n in ("torch_impl", "torch_impl unchecked", "floor", "floor, count first") if n in names]
    x32 = torch.randn(4, hidden, generator=torch.Generator().manual_seed(rank))
    token_counts = [torch.tensor(c) for c in step_counts(rank, world)]  # each call's, in turn
    out: dict[str, Any] = {}
    with unchecked.installed() if "torch_impl unchecked" in names else contextlib.nullcontext():
        for key in payload.get("modes", MODES):
            mode = MODES[key]
            overlap = bool(mode.get("overlap_grad_reduce"))
            x = x32.to(torch.bfloat16) if mode.get("bf16") else x32
            models = {name: build(mode, name == "torch_impl no round") for name in names}
            unchecked.reset()

            def backward(name: str) -> None:
                models[name].zero_grad_buffer()
                models[name](x).sum().backward()

            def check() -> tuple[list[float], float]:
                """One step of the twins compared on the same input: (each compared twin's
                largest abs difference from megatron-core's gradients, the smallest max abs
                gradient)."""
                grads = {}
                for name in ("megatron-core", *compared):
                    backward(name)
                    finals[name]([models[name]], num_tokens=torch.tensor(x.shape[0]))
                    grads[name] = _grads(models[name])
                return ([float((grads["megatron-core"] - grads[n]).abs().max()) for n in compared],
                        min(float(grads[n].abs().max()) for n in compared))

            checks = [check()]
            for name in names if not overlap else ():  # gradients in the buffers (overlap: each call's own)
                backward(name)

            cpu = {n: [0.0, 0] for n in names}  # this thread's CPU seconds in the finalize calls, and their count

            def ready(name: str, turn: int) -> Any:
                """Make ``name``'s next call ready; its token count (this rank's ``turn``-th)."""
                if overlap:  # each call needs a started reduction: backward's hooks start it
                    backward(name)
                return token_counts[turn % len(token_counts)].clone()

            def call(name: str, final: Callable[..., None]) -> Callable[[], None]:
                spent, turn = cpu[name], [0]

                def run() -> None:
                    tokens = ready(name, turn[0])
                    turn[0] += 1
                    start = time.thread_time()
                    final([models[name]], num_tokens=tokens)
                    spent[0] += time.thread_time() - start
                    spent[1] += 1

                return run

            profile = cpu_parts(DistributedDataParallel) if payload.get("parts") else None
            timed_finals = dict(finals)
            if profile is not None:  # the two finalizes' calls counted part by part while timed
                timed_finals.update({n: profile.counted(n, finals[n]) for n in PROFILED})
            with profile.installed() if profile is not None else contextlib.nullcontext():
                timed = interleaved({n: call(n, timed_finals[n]) for n in names}, rounds=payload["rounds"],
                                    batch=payload["batch"])

            def entered(name: str) -> list[int]:  # the Python functions a steady call enters
                counts: list[int] = []
                for turn in range(2):  # the first call after the parts' wrappers left is not steady
                    tokens = ready(name, turn)  # another count than the last, as timed
                    counts = list(functions_entered(lambda: finals[name]([models[name]], num_tokens=tokens)))
                return counts

            functions = {n: entered(n) for n in PROFILED} if profile is not None else None

            def operations(name: str) -> list[str]:  # the torch operations one more steady call runs
                tokens = ready(name, 0)  # another count than entered()'s last
                return operations_run(lambda: finals[name]([models[name]], num_tokens=tokens))

            ops = {n: operations(n) for n in PROFILED} if profile is not None else None
            busy = torch.tensor([cpu[n][0] / cpu[n][1] for n in names], dtype=torch.float64)
            dist.all_reduce(busy)
            busy /= world
            checks.append(check())
            medians = torch.tensor([timed[n]["median"] for n in names], dtype=torch.float64)
            dist.all_reduce(medians, op=dist.ReduceOp.MAX)
            paired = [(a, b) for a, b in PAIRS if a in names and b in names]
            pairs = torch.tensor([paired_ratio(timed[a], timed[b]) for a, b in paired], dtype=torch.float64)
            dist.all_reduce(pairs)  # the ranks' mean (every call syncs them: their ratios differ by noise)
            pairs /= world
            # each twin's largest difference over both steps, then of any rank
            worst = torch.tensor([max(c[0][i] for c in checks) for i in range(len(compared))], dtype=torch.float64)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            smallest = torch.tensor([min(c[1] for c in checks)], dtype=torch.float64)
            dist.all_reduce(smallest, op=dist.ReduceOp.MIN)  # the smallest gradient of any rank
            largest = float(worst.max())
            seconds = {n: float(m) for n, m in zip(names, medians)}
            parts = profile.ranks_mean(PROFILED, PART_NAMES) if profile is not None else None
            out[key] = {
                **({"cpu parts per call": parts, "python functions per call": functions,
                    "torch operations per call": ops} if parts is not None else {}),
                "seconds per call": seconds,
                "cpu seconds per call": {n: float(b) for n, b in zip(names, busy)},
                **{f"{a} / {b}": float(r) for (a, b), r in zip(paired, pairs)},
                **({"torch_impl unchecked: calls without the check": [unchecked.skipped, unchecked.calls]}
                   if "torch_impl unchecked" in names else {}),
                "values": {"steps compared": len(checks), "max_abs_diff": largest,
                           "identical": largest == 0.0, "grad_abs_max": float(smallest[0]),
                           "max_abs_diff by candidate": {n: float(d) for n, d in zip(compared, worst)}},
            }
    ps.destroy_model_parallel()
    if rank == 0:
        params = payload["layers"] * (hidden**2 + hidden)
        sink.put("result", {"world": world, "layers": payload["layers"], "hidden": hidden, "parameters": params,
                            "names": list(names),
                            "modes": out})


def run_real_ddp(*, world: int = 4, layers: int = 8, hidden: int = 256, rounds: int = 7, batch: int = 10,
                 timeout: float = 600.0, names: tuple[str, ...] = NAMES,
                 modes: tuple[str, ...] = tuple(MODES), parts: bool = False) -> dict[str, Any]:
    """Run the benchmark world; its result, or ``{"error": ...}`` when the world failed.

    Args:
      names: the candidates timed (megatron-core and torch_impl always: the value check
        compares them).
      modes: the settings run (keys of :data:`MODES`).
      parts: also count the CPU of the two finalizes' calls part by part (:func:`cpu_parts`).
    """
    from parity_tests.megatron_state import import_megatron_core
    from parity_tests.process_world import spawn_world

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    names = tuple(n for n in (*NAMES, *OPT_IN) if n in {*names, "megatron-core", "torch_impl"})
    payload = dict(layers=layers, hidden=hidden, rounds=rounds, batch=batch, names=names, modes=modes, parts=parts)
    outcome = spawn_world(world_main, world, payload, timeout=timeout, prepare=import_megatron_core)
    if any(outcome.fatal) or "result" not in outcome.results[0]:
        return {"error": outcome.why()}
    return outcome.results[0]["result"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--candidates", nargs="+", choices=[*NAMES, *OPT_IN], default=list(NAMES),
                        help="the finalizes timed (megatron-core and torch_impl always; "
                             "torch_impl unchecked and floor, count first only when named)")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES), help="the settings run")
    parser.add_argument("--parts", action="store_true",
                        help="also print where each finalize's CPU goes, part by part (timed with the parts wrapped)")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    missing = megatron_missing()
    if missing:
        print(f"real-DDP rows skipped: {missing}")
        return 0
    from bench.goals import format_goals
    from bench.real_ddp_report import format_real_ddp, real_ddp_goals

    result = run_real_ddp(world=args.world, layers=args.layers, hidden=args.hidden, rounds=args.rounds,
                          batch=args.batch, names=tuple(args.candidates), modes=tuple(args.modes), parts=args.parts)
    result["goals"] = real_ddp_goals(result)
    print(format_real_ddp(result))
    if result["goals"]:
        print("\n" + format_goals(result["goals"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 1 if "error" in result else 0


if __name__ == "__main__":
    raise SystemExit(main())
