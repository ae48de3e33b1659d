"""``python -m meshgrad``: size a run before the machines exist (the core and numpy only).

* ``explain``: what finalize launches on each rank class of a layout -- each collective in
  launch order, its group (size, axes), dtype and bytes, totals per axes, Megatron-Core's
  launches beside -- and, with ``--cost``, the predicted time of each (docs/explain.md).
* ``at-scale``: the predicted table of docs/performance.md "At scale".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any

from meshgrad.at_scale import format_table, predict_table
from meshgrad.config import FinalizeConfig
from meshgrad.cost import H100_NVLINK, NCCL_LAUNCH_S, NDR_INFINIBAND, CostModel, finalize_cost
from meshgrad.errors import FinalizeInputError
from meshgrad.explain import Explanation, Layout, explain, model_stages
from meshgrad.presets import PRESETS, ModelPreset

_OVERRIDES = ("layers", "hidden", "ffn", "heads", "kv_heads", "vocab", "experts", "max_positions")


def _layout_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("layout")
    for name in ("pp", "dp", "cp", "tp", "ep", "gtp", "vpp"):
        group.add_argument(f"--{name}", type=int, default=1, metavar="N", help=f"{name} size (default 1)")
    group.add_argument("--etp", type=int, metavar="N", help="expert tensor-parallel size (default: tp)")
    group.add_argument("--world", type=int, metavar="N", help="total ranks: dp = world / (pp x cp x gtp x tp)")


def _cost_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cost model (docs/performance.md#at-scale)")
    group.add_argument("--nvlink-gbs", type=float, default=H100_NVLINK.beta_bytes_s / 1e9, help="intra-node GB/s")
    group.add_argument("--nvlink-us", type=float, default=H100_NVLINK.alpha_s * 1e6, help="intra-node us per step")
    group.add_argument("--ib-gbs", type=float, default=NDR_INFINIBAND.beta_bytes_s / 1e9, help="inter-node GB/s per GPU")
    group.add_argument("--ib-us", type=float, default=NDR_INFINIBAND.alpha_s * 1e6, help="inter-node us per ring step")
    group.add_argument("--ib-tree-us", type=float, default=NDR_INFINIBAND.tree_alpha * 1e6, help="inter-node us per tree level")
    group.add_argument("--launch-us", type=float, default=NCCL_LAUNCH_S * 1e6, help="fixed us per collective")
    group.add_argument("--gpus-per-node", type=int, default=8)
    group.add_argument("--algorithm", choices=("auto", "ring", "tree"), default="auto", help="all-reduce algorithm")


def cost_model(args: argparse.Namespace) -> CostModel:
    """The cost model of the command line's overrides."""
    intra = dataclasses.replace(H100_NVLINK, beta_bytes_s=args.nvlink_gbs * 1e9, alpha_s=args.nvlink_us * 1e-6)
    inter = dataclasses.replace(NDR_INFINIBAND, beta_bytes_s=args.ib_gbs * 1e9, alpha_s=args.ib_us * 1e-6,
                                alpha_tree_s=args.ib_tree_us * 1e-6)
    return CostModel(intra, inter, args.launch_us * 1e-6, args.gpus_per_node, args.algorithm)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m meshgrad", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("explain", help="the collectives of each rank class of a layout")
    model = ex.add_argument_group("model")
    which = model.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", choices=sorted(PRESETS), help="a size preset")
    which.add_argument("--params-json", metavar="PATH", help="a JSON list of parameters (docs/explain.md), '-' = stdin")
    for name in _OVERRIDES:
        model.add_argument(f"--{name.replace('_', '-')}", type=int, metavar="N", help=f"override the preset's {name}")
    model.add_argument("--grad-dtype", choices=("float32", "bfloat16", "float16"), help="gradient dtype (preset: float32)")
    _layout_args(ex)
    flags = ex.add_argument_group("config")
    flags.add_argument("--distributed-optimizer", action="store_true", help="DP sync is a reduce-scatter")
    flags.add_argument("--per-token-loss", action="store_true", help="calculate_per_token_loss (num_tokens given)")
    flags.add_argument("--sp", "--sequence-parallel", dest="sp", action="store_true", help="sequence parallelism")
    flags.add_argument("--overlap", action="store_true", help="overlap_grad_reduce: Megatron's DDP runs the DP sync")
    flags.add_argument("--bucket-size", type=int, metavar="N",
                       help="Megatron DDP's bucket_size in elements (default: max(40M, 1M x dp) with --overlap)")
    flags.add_argument("--grad-reduce-in-fp32", action="store_true")
    flags.add_argument("--average-in-collective", action="store_true")
    flags.add_argument("--no-expert-bias", action="store_true", help="drop the preset's router expert bias")
    flags.add_argument("--untied", action="store_true", help="a JSON model's embeddings are not tied")
    out = ex.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print JSON (classes, collectives, bytes, costs)")
    out.add_argument("--cost", action="store_true", help="add the predicted time of each collective")
    out.add_argument("--rank", type=int, metavar="R", help="also list what global rank R launches, with group members")
    _cost_args(ex)
    scale = sub.add_parser("at-scale", help="the predicted table at 1k, 4k and 16k GPUs")
    scale.add_argument("--overlap", action="store_true", help="overlap_grad_reduce (DP sync during backward)")
    scale.add_argument("--json", action="store_true")
    _cost_args(scale)
    return parser


def _layout(args: argparse.Namespace) -> Layout:
    dp = args.dp
    if args.world is not None:
        inner = args.pp * args.cp * args.gtp * args.tp
        if args.world % inner:
            raise FinalizeInputError(f"--world {args.world} is not a multiple of pp x cp x gtp x tp = {inner}")
        dp = args.world // inner
    return Layout(pp=args.pp, dp=dp, cp=args.cp, tp=args.tp, ep=args.ep, etp=args.etp, gtp=args.gtp, vpp=args.vpp)


def _model(args: argparse.Namespace) -> tuple[Any, str, bool, bool, bool]:
    """(model, name, tied, qk_layernorm, expert bias)."""
    if args.params_json:
        text = sys.stdin.read() if args.params_json == "-" else open(args.params_json, encoding="utf-8").read()
        return text, args.params_json, not args.untied, False, False
    m: ModelPreset = PRESETS[args.model]
    changes = {k: getattr(args, k) for k in _OVERRIDES if getattr(args, k) is not None}
    if args.grad_dtype:
        changes["grad_dtype"] = args.grad_dtype
    if args.no_expert_bias:
        changes["expert_bias"] = False
    m = dataclasses.replace(m, **changes)
    return m, m.name, m.tied, m.qk_layernorm, m.expert_bias and bool(m.experts)


def run_explain(args: argparse.Namespace) -> Explanation:
    """The explanation of the parsed ``explain`` arguments."""
    layout = _layout(args)
    model, name, tied, qk, bias = _model(args)
    config = FinalizeConfig(
        sequence_parallel=args.sp, qk_layernorm=qk, calculate_per_token_loss=args.per_token_loss,
        average_in_collective=args.average_in_collective, use_distributed_optimizer=args.distributed_optimizer,
        grad_reduce_in_fp32=args.grad_reduce_in_fp32, share_embeddings_and_output_weights=tied,
        moe_router_enable_expert_bias=bias,
    )
    return explain(model_stages(model, layout), layout, config, model=name, overlap=args.overlap,
                   bucket_size=args.bucket_size)


def _explain_main(args: argparse.Namespace) -> int:
    explained = run_explain(args)
    costs = finalize_cost(explained, cost_model(args)) if args.cost or args.json else []
    if args.json:
        data = explained.to_json()
        for entry, c in zip(data["classes"], costs):
            entry["predicted_seconds"] = {"meshgrad": c.seconds, "status": c.status_seconds, "megatron": c.megatron_seconds,
                                          "per_collective": [t for _, t in c.per_launch]}
        if args.rank is not None:
            data["rank"] = {"rank": args.rank, "launches": [
                {"step": l.step, "kind": l.kind, "group": l.group, "members": list(m), "dtype": l.dtype, "numel": l.numel}
                for l, m in explained.rank_launches(args.rank)]}
        print(json.dumps(data, indent=1))
        return 0
    print(explained.text(), end="")
    for c in costs:
        print(f"predicted, {c.name}: meshgrad {1e3 * c.seconds:.3f} ms (status round {1e6 * c.status_seconds:.1f} us, "
              f"{100 * c.status_share:.2f} %), Megatron-Core {1e3 * c.megatron_seconds:.3f} ms")
    if args.rank is not None:
        print(f"\nrank {args.rank} ({explained.class_of(args.rank).name}):")
        for item, members in explained.rank_launches(args.rank):
            shown = list(members) if len(members) <= 16 else f"{len(members)} ranks {list(members[:4])}..."
            print(f"  {item.step:<22} {item.kind:<14} {item.group:<16} {item.dtype:<9} {item.numel:>14,}  {shown}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "explain":
            return _explain_main(args)
        rows = predict_table(cost_model(args), overlap=args.overlap)
        print(json.dumps(rows, indent=1) if args.json else format_table(rows))
        return 0
    except (FinalizeInputError, ValueError, TypeError) as err:
        print(f"python -m meshgrad {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
