"""``python -m bench``: meshgrad against megatron-core, side by side, in one run.

1. Fake process-group backend (``torch.testing._internal.distributed.fake_pg``): local
   overhead per call of each step and of the whole finalize, collectives launched and
   gradient bytes copied per finalize call, on GPT-like layouts (TP=8, PP=2, DP=2, tied
   embeddings; ``--moe`` adds routers with expert bias and experts).
   The drop-in non-TP step is also timed against its floor (the staging copies in and
   out with ``torch._foreach_copy_`` + one collective, in the same run).
2. MoE scale rows (``bench.scale``): layers x experts up to 64 x 128 (16,705 parameters),
   Megatron-DDP and plain chunks, first call and steady-state step, all rows in one run.
3. A gloo world of 4 processes: end-to-end finalize time against the floor (the same
   collectives on pre-flattened buffers).
4. megatron-core's real ``DistributedDataParallel`` in a gloo world of 4 (``bench.real_ddp``):
   megatron-core's finalize, torch_impl's (with and without its status round), the floor and
   megatron-core's again (the control) on twin DDPs, in four settings, and the two
   finalizes' gradients compared bit for bit.
5. A model under torch's ``fully_shard`` (FSDP2) in a gloo world of 2 (``bench.fsdp2``):
   torch_impl's finalize against the floor (the count's all-reduce and the scale of each
   local shard), steady and after each training step, gradients compared bit for bit;
   measured, no goal.

Prints a table and writes JSON (``--json PATH``, default ``bench/results/latest.json``).
A benchmark, never a timed test: it reports what it measures and checks the goals.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from typing import Any

from bench.goals import format_goals, goal, markdown_goals
from bench.models import Layout

FAKE_LAYOUTS = {
    "gpt-24L-h1024": Layout("gpt-24L-h1024", 24, 1024, tp=8, pp=2, dp=2),
    "gpt-24L-h1024-pp1": Layout("gpt-24L-h1024-pp1", 24, 1024, tp=8, pp=1, dp=2),
    "gpt-48L-h4096": Layout("gpt-48L-h4096", 48, 4096, tp=8, pp=2, dp=2),
}
GLOO_LAYOUTS = {
    "gloo-24L-h256-tp2dp2": Layout("gloo-24L-h256-tp2dp2", 24, 256, tp=2, pp=1, dp=2, vocab=8192),
    "gloo-24L-h256-tp2pp2": Layout("gloo-24L-h256-tp2pp2", 24, 256, tp=2, pp=2, dp=1, vocab=8192),
}
GOALS = {"non_tp": 0.1, "finalize": 0.15, "gloo": 1.2, "drop_in_floor": 1.5}
#: Stretch goals: the own-buffer non-TP step where it was before the per-step checks (a
#: moonshot), and the drop-in non-TP step against meshgrad's own staging (a stricter floor
#: than the copy floor: the checks' cost alone).
STRETCH = {"non_tp": 0.05, "drop_in_staging": 1.5}


def environment() -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        from importlib.metadata import version

        env["megatron_core"] = version("megatron-core")
    except Exception:
        env["megatron_core"] = None
    return env


def _ms(t: dict[str, float] | None) -> str:
    return "-" if not t else f"{1e3 * t['median']:.4f}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


MODELS = ("megatron", "meshgrad drop-in", "meshgrad buffers")


def format_fake(result: dict[str, Any]) -> str:
    lay = result["layout"]
    lines = [
        f"{lay['name']}  (TP{lay['tp']} PP{lay['pp']} DP{lay['dp']}{' MoE' if lay['moe_experts'] else ''}, "
        f"rank 0 = stage 0: {result['params']} params, {result['non_tp_tensors']} non-TP grads, "
        f"{result['grad_bytes'] / 2**20:.0f} MiB of grads, device {result['device']})",
        f"  {'step':<18}" + "".join(f"{m:>18}" for m in MODELS) + f"{'buffers/mcore':>15}{'drop-in/mcore':>15}",
    ]
    t = result["time"]
    from bench.fake import STEPS

    for step in STEPS:
        if not any(step in t.get(m, {}) for m in MODELS):
            continue
        cells = "".join(f"{_ms(t.get(m, {}).get(step)):>18}" for m in MODELS)
        r = result.get("ratios", {})
        lines.append(f"  {step + ' ms':<18}{cells}{_ratio(r.get(f'{step} (buffers)')):>15}{_ratio(r.get(f'{step} (drop-in)')):>15}")
    floor = t.get("floor", {}).get("non_tp")
    if floor:
        lines.append(
            f"  {'non_tp floor ms':<18}{_ms(floor):>18}   (staging copies in + out, one collective: "
            f"drop-in / floor {_ratio(result['ratios'].get('non_tp drop-in / floor'))})"
        )
    staging = t.get("staging floor", {}).get("non_tp")
    if staging:
        lines.append(
            f"  {'staging floor ms':<18}{_ms(staging):>18}   (meshgrad's own staging copies, one collective, no check: "
            f"drop-in / it {_ratio(result['ratios'].get('non_tp drop-in / staging floor'))})"
        )
    lines.append(f"  {'collectives/call':<18}" + "".join(f"{result['collectives'].get(m, '-'):>18}" for m in MODELS))
    lines.append(
        f"  {'bytes copied/call':<18}" + "".join(f"{int(result['bytes_copied'].get(m, 0)):>18}" if m in result['bytes_copied'] else f"{'-':>18}" for m in MODELS)
    )
    return "\n".join(lines)


def format_gloo(result: dict[str, Any]) -> str:
    lay = result["layout"]
    t = result["time"]
    head = f"{lay['name']}  (TP{lay['tp']} PP{lay['pp']} DP{lay['dp']}, {result['grad_bytes'] / 2**20:.0f} MiB of grads per rank)"
    cells = [f"floor {1e3 * t['floor']['median']:.3f} ms"]
    for name in ("meshgrad buffers", "meshgrad drop-in", "megatron"):
        if name in t:
            cells.append(f"{name} {1e3 * t[name]['median']:.3f} ms ({result['vs_floor'][name]:.3f}x)")
    return head + "\n  " + "   ".join(cells)


def goals(fake: list[dict[str, Any]], gloo: list[dict[str, Any]], scale: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every goal of one run, each with its floor where one exists (see :func:`bench.goals.split_goals`)."""
    out = []
    for r in fake:
        name = r["layout"]["name"]
        ratios = r.get("ratios", {})
        for step in ("non_tp", "finalize"):
            out.append(goal(f"{name}: {step} meshgrad/megatron <= {GOALS[step]:g}", ratios.get(f"{step} (buffers)"),
                            GOALS[step]))
        out.append(goal(f"{name}: non_tp meshgrad/megatron <= {STRETCH['non_tp']:g}", ratios.get("non_tp (buffers)"),
                        STRETCH["non_tp"], stretch=True))
        out.append(goal(f"{name}: bytes copied with meshgrad buffers == 0", r["bytes_copied"].get("meshgrad buffers"), 0))
        floor_ms = _ms(r["time"].get("floor", {}).get("non_tp"))
        out.append(goal(f"{name}: drop-in non_tp / copy floor ({floor_ms} ms) <= {GOALS['drop_in_floor']:g}",
                        ratios.get("non_tp drop-in / floor"), GOALS["drop_in_floor"], floor=1.0))
        if "non_tp drop-in / staging floor" in ratios:  # the checks' own cost: the same copies in both
            staging_ms = _ms(r["time"]["staging floor"]["non_tp"])
            out.append(goal(f"{name}: drop-in non_tp / meshgrad's staging floor ({staging_ms} ms) <= "
                            f"{STRETCH['drop_in_staging']:g}", ratios["non_tp drop-in / staging floor"],
                            STRETCH["drop_in_staging"], floor=1.0, stretch=True))
    for r in gloo:
        name = r["layout"]["name"]
        out.append(goal(f"{name}: finalize / floor <= {GOALS['gloo']:g}", r["vs_floor"].get("meshgrad buffers"),
                        GOALS["gloo"], floor=1.0))
        out.append(goal(f"{name}: bytes copied with meshgrad buffers == 0", r["meshgrad_buffers_bytes_copied"], 0))
    if scale:
        from bench.scale import scale_goals

        out.extend(scale_goals(scale))
    return out


def _real_ddp(args: argparse.Namespace, quick: bool) -> dict[str, Any]:
    """The real-DDP rows (``bench.real_ddp``), printed; ``{"skipped": reason}`` when they cannot run."""
    from bench.real_ddp import megatron_missing, run_real_ddp
    from bench.real_ddp_report import format_real_ddp, real_ddp_goals

    print("\n== megatron-core's real DDP, gloo world of 4: finalize per call (median of rounds, slowest rank) ==",
          flush=True)
    reason = "--no-megatron" if args.no_megatron else megatron_missing()
    if reason:
        print(f"  skipped: {reason}", flush=True)
        return {"skipped": reason}
    layers, hidden = (int(v) for v in (args.real_ddp_size or ("4x256" if quick else "8x256")).split("x"))
    result = run_real_ddp(layers=layers, hidden=hidden, rounds=args.rounds or (25 if quick else 31),
                          batch=4 if quick else 8)
    result["goals"] = real_ddp_goals(result)
    print(format_real_ddp(result), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, the 24-layer layouts only")
    parser.add_argument("--json", metavar="PATH", help="write results here (default bench/results/latest.json)")
    parser.add_argument("--layouts", nargs="*", choices=sorted(FAKE_LAYOUTS), help="fake-backend layouts to run")
    parser.add_argument("--moe", action="store_true", help="add MoE routers (expert bias) and experts to every layout")
    parser.add_argument("--no-fake", action="store_true", help="skip the fake-backend side by side")
    parser.add_argument("--no-gloo", action="store_true", help="skip the gloo world of 4")
    parser.add_argument("--no-jax", action="store_true", help="skip the JAX rows (bench.jax_rows)")
    parser.add_argument("--no-real-ddp", action="store_true", help="skip the real megatron-core DDP rows (bench.real_ddp)")
    parser.add_argument("--no-fsdp2", action="store_true", help="skip the FSDP2 row (bench.fsdp2)")
    parser.add_argument("--real-ddp-size", metavar="LxH", help="real-DDP MLP: layers x hidden (default 8x256, --quick 4x256)")
    parser.add_argument("--no-scale", action="store_true", help="skip the MoE scale rows")
    parser.add_argument("--no-at-scale", action="store_true",
                        help="skip the cost-model calibration and planning-scale rows (bench.at_scale)")
    parser.add_argument(
        "--scale-rows", nargs="+", metavar="LxE", help="MoE scale rows to run (default 8x8 32x8 32x64 64x128)"
    )
    parser.add_argument("--no-megatron", action="store_true", help="meshgrad only (megatron-core not needed)")
    parser.add_argument("--device", default="cpu", help="device of the fake-backend gradients (cpu, cuda)")
    parser.add_argument("--rounds", type=int, help="timed rounds per candidate")
    parser.add_argument("--markdown", metavar="PATH", help="also write the goals as a markdown table here")
    args = parser.parse_args(argv)

    quick = args.quick
    rounds = args.rounds or (5 if quick else 15)
    names = args.layouts or (["gpt-24L-h1024", "gpt-24L-h1024-pp1"] if quick else list(FAKE_LAYOUTS))
    started = time.time()
    shown = list(sys.argv[1:] if argv is None else argv)
    for option in ("--json", "--markdown"):  # where it wrote, not what it measured
        while option in shown:
            at = shown.index(option)
            del shown[at:at + 2]
    env = {**environment(), "argv": shown}
    report: dict[str, Any] = {"env": env, "args": vars(args), "fake": [], "scale": None, "gloo": [], "real_ddp": None}
    if not args.no_fake:
        from bench.fake import measure_layout

        print("== fake backend: local overhead per call (median ms of interleaved rounds) ==", flush=True)
        for name in names:
            lay = FAKE_LAYOUTS[name]
            if args.moe:
                lay = dataclasses.replace(lay, name=lay.name + "-moe", moe_experts=8)
            batch = 5 if lay.hidden >= 4096 else 20
            result = measure_layout(lay, rounds=rounds, batch=batch, device=args.device, with_megatron=not args.no_megatron)
            report["fake"].append(result)
            print(format_fake(result), flush=True)
    if not args.no_scale:
        from bench.scale import ROWS, format_scale, measure_scale, parse_rows

        rows = parse_rows(args.scale_rows) if args.scale_rows else list(ROWS)
        print(
            "\n== MoE scale: first call and steady-state step (fake backend, TP8 DP2 PP1, median ms of "
            "interleaved rounds, every row in one run) ==",
            flush=True,
        )
        report["scale"] = measure_scale(
            rows,
            rounds=args.rounds or (7 if quick else 15),
            target_s=0.005 if quick else 0.01,
            repeats=3,  # the median of three first calls: one outlier (a collection, page faults) does not move it
            with_megatron=not args.no_megatron,
        )
        print(format_scale(report["scale"]), flush=True)
    if not args.no_gloo:
        from bench.gloo import run_gloo

        print("\n== gloo world of 4: end-to-end finalize per call (median of rounds, slowest rank; "
              "x the floor: median of same-round ratios) ==", flush=True)
        for name in ["gloo-24L-h256-tp2dp2"] if quick else list(GLOO_LAYOUTS):
            lay = GLOO_LAYOUTS[name]
            result = run_gloo(lay, rounds=5 if quick else 9, batch=3, megatron=not args.no_megatron)
            report["gloo"].append(result)
            print(format_gloo(result), flush=True)
    if not args.no_real_ddp:
        report["real_ddp"] = _real_ddp(args, quick)
    if not args.no_fsdp2:
        from bench.fsdp2 import format_fsdp2, run_fsdp2

        print("\n== torch's FSDP2, gloo world of 2: finalize against the floor, steady and after each training step ==", flush=True)
        report["fsdp2"] = run_fsdp2(rounds=args.rounds or (11 if quick else 21))
        print(format_fsdp2(report["fsdp2"]), flush=True)
    if not args.no_at_scale:
        from bench.at_scale import format_rows as format_at_scale, run as run_at_scale

        print("\n== at scale: cost model vs gloo worlds of 2-8 (median us, slowest rank), planning 70B at 1k-16k ranks ==",
              flush=True)
        report["at_scale"] = run_at_scale(quick)
        print(format_at_scale(report["at_scale"]), flush=True)
    if not args.no_jax:
        from bench.jax_rows import format_rows, run_subprocess

        print("\n== JAX: jax_impl.finalize vs a hand-written psum tree map (8 fake CPU devices) ==", flush=True)
        report["jax"] = run_subprocess(quick)
        print(format_rows(report["jax"]["rows"]), flush=True)
    report["goals"] = goals(report["fake"], report["gloo"], report["scale"])
    report["goals"] += (report["real_ddp"] or {}).get("goals", [])
    report["goals"] += report.get("jax", {}).get("goals", [])
    if report.get("at_scale"):
        from bench.at_scale import at_scale_goals

        report["goals"] += at_scale_goals(report["at_scale"])
    report["seconds"] = time.time() - started
    print("\n" + format_goals(report["goals"]))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown_goals(report["goals"], report["env"]))
    path = args.json or os.path.join(os.path.dirname(__file__), "results", "latest.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2, default=str)
    print(f"\nJSON: {path}  ({report['seconds']:.0f} s)")
    fsdp2 = report.get("fsdp2", {})
    failed = "error" in (report["real_ddp"] or {}) or "error" in fsdp2 or fsdp2.get("identical") is False
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
