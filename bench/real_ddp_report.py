"""The real-DDP rows (:mod:`bench.real_ddp`) as printed and judged: one line per setting
with each candidate's time, the paired ratios and the value check, the CPU line and parts
under it (:func:`format_real_ddp`), and the goals (:func:`real_ddp_goals`)."""

from __future__ import annotations

from typing import Any

from bench.goals import goal
from bench.real_ddp import GOALS, NAMES, PART_NAMES, PROFILED, RATIO_COLUMNS


def name_of(result: dict[str, Any]) -> str:
    """The rows' name: ``real-ddp-<layers>L-h<hidden>-dp<world>``."""
    return f"real-ddp-{result['layers']}L-h{result['hidden']}-dp{result['world']}"


def _width(name: str) -> int:
    """The width of a candidate's column."""
    return max(18, len(name) + 5)


def format_real_ddp(result: dict[str, Any]) -> str:
    """One row per mode: ms per call of each twin and the floor, the paired ratios
    (:data:`bench.real_ddp.PAIRS`), the value check."""
    if "error" in result:
        return f"real-DDP benchmark world failed: {result['error']}"
    names = result.get("names", NAMES)
    ratios = [(key, short) for key, short in RATIO_COLUMNS if key in next(iter(result["modes"].values()), {})]
    lines = [f"{name_of(result)}  (megatron-core DDP, {result['parameters']} params per rank, per-token loss; "
             "ratios: median of same-round ratios, mean of the ranks)",
             f"  {'mode':<21}" + "".join(f"{n + ' ms':>{_width(n)}}" for n in names)
             + "".join(f"{short:>{len(short) + 2}}" for _, short in ratios) + "  gradients ours vs mcore"]
    for mode, row in result["modes"].items():
        t, v = row["seconds per call"], row["values"]
        same = "bit-identical" if v["identical"] else "DIFFER"
        lines.append(
            f"  {mode:<21}" + "".join(f"{1e3 * t[n]:>{_width(n)}.4f}" for n in names)
            + "".join(f"{row[key]:>{len(short) + 2}.3f}" for key, short in ratios)
            + f"  {same} (max abs diff {v['max_abs_diff']:g}, "
            + f"{v['steps compared']} steps, max |grad| {v['grad_abs_max']:.3g})"
        )
        busy = row["cpu seconds per call"]
        lines.append(f"  {'':<21}" + "".join(f"{1e3 * busy[n]:>{_width(n)}.4f}" for n in names)
                     + "  <- CPU ms of the calling thread (mean of the ranks)")
        lines += format_parts(row.get("cpu parts per call"), row.get("python functions per call"),
                              row.get("torch operations per call"))
    return "\n".join(lines)


def format_parts(parts: dict[str, dict[str, float]] | None, functions: dict[str, list[int]] | None = None,
                 operations: dict[str, list[str]] | None = None) -> list[str]:
    """The ``--parts`` lines of one setting: per part, the CPU us per call of each profiled
    candidate, then the Python functions one steady call enters and the torch operations
    one runs (nothing without a profile)."""
    if not parts:
        return []
    lines = [f"  {'':<21}CPU us per call, part by part (mean of the ranks):"
             + "".join(f"{c:>{_width(c)}}" for c in PROFILED)]
    for part in PART_NAMES:
        lines.append(f"  {'':<23}{part:<30}" + "".join(f"{1e6 * parts[c][part]:>{_width(c)}.1f}" for c in PROFILED))
    if functions:
        lines.append(f"  {'':<23}{'Python functions (distinct/calls)':<30}"
                     + "".join(f"{'%d / %d' % tuple(functions[c]):>{_width(c)}}" for c in PROFILED))
    if operations:
        lines.append(f"  {'':<23}{'torch operations':<30}"
                     + "".join(f"{len(operations[c]):>{_width(c)}}" for c in PROFILED))
    return lines


def real_ddp_goals(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The goals of the real-DDP rows, each with its floor where one exists."""
    if "error" in result:
        return []
    name, out = name_of(result), []
    for mode, row in result["modes"].items():
        floored = "torch_impl / floor" in row
        if floored:
            out.append(goal(f"{name} {mode}: torch_impl finalize / floor <= {GOALS['floor']:g}",
                            row["torch_impl / floor"], GOALS["floor"], floor=1.0))
        out.append(goal(f"{name} {mode}: torch_impl / megatron-core <= {GOALS['megatron-core']:g}",
                        row["torch_impl / megatron-core"], GOALS["megatron-core"],
                        floor=1.0 / row["megatron-core / floor"] if floored else None))
        out.append(goal(f"{name} {mode}: gradients, max abs diff torch_impl vs megatron-core == 0",
                        row["values"]["max_abs_diff by candidate"]["torch_impl"], 0))
    return out


__all__ = ["format_parts", "format_real_ddp", "name_of", "real_ddp_goals"]
