"""The benchmark's goals: one constructor, each goal next to its floor where one exists.

A goal whose floor alone (the copies or collectives any implementation needs) already
misses its limit is no goal: it is printed apart, measured, never judged.
"""

from __future__ import annotations

from typing import Any


def goal(text: str, value: Any, limit: float, floor: float | None = None) -> dict[str, Any]:
    """One goal: ``value <= limit``; ``floor`` is what the same measure gives for the floor
    alone (the copies or collectives any implementation needs), None when there is none."""
    return dict(goal=text, value=value, limit=limit, floor=floor, ok=None if value is None else value <= limit)


def split_goals(all_goals: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(goals, floor-bound): a goal whose floor alone already misses its limit is no goal
    (nothing could meet it); it is reported apart, measured next to its floor, never judged."""
    bound = [g for g in all_goals if g.get("floor") is not None and g["floor"] > g["limit"]]
    return [g for g in all_goals if g not in bound], bound


def _value(x: Any) -> str:
    return "-" if x is None else (f"{x:.4f}" if isinstance(x, float) else str(x))


def format_goals(all_goals: list[dict[str, Any]]) -> str:
    """The goals, each ``[met]`` / ``[MISSED]`` / ``[n/a]`` with its measured value and floor,
    then the measures whose floor misses the limit (no verdict)."""
    kept, bound = split_goals(all_goals)
    lines = ["== goals (each next to its floor where one exists) =="]
    for g in kept:
        verdict = "n/a" if g["ok"] is None else ("met" if g["ok"] else "MISSED")
        floor = "" if g.get("floor") is None else f"; floor {_value(g['floor'])}"
        lines.append(f"  [{verdict:>6}] {g['goal']}  (measured {_value(g['value'])}{floor})")
    if bound:
        lines.append("== not goals: the floor alone misses the limit (measured, not judged) ==")
        for g in bound:
            lines.append(f"  [ floor] {g['goal']}  (measured {_value(g['value'])}; floor {_value(g['floor'])})")
    return "\n".join(lines)


def markdown_goals(all_goals: list[dict[str, Any]], env: dict[str, Any]) -> str:
    """The same list as a markdown table (docs/performance.md), with the machine it ran on."""
    kept, bound = split_goals(all_goals)
    lines = [
        f"Measured by `{' '.join(['.venv/bin/python -m bench', *env.get('argv', [])])}` on {env.get('cpus')} CPU cores "
        f"({env.get('machine')}, Python {env.get('python')}, torch {env.get('torch')}, megatron-core "
        f"{env.get('megatron_core')}):",
        "",
        "| goal | measured | floor | verdict |",
        "|---|---|---|---|",
    ]
    for g in kept:
        verdict = "n/a" if g["ok"] is None else ("met" if g["ok"] else "**missed**")
        lines.append(f"| {g['goal']} | {_value(g['value'])} | {_value(g.get('floor'))} | {verdict} |")
    for g in bound:
        lines.append(f"| {g['goal']} | {_value(g['value'])} | {_value(g['floor'])} | no goal: its floor misses it |")
    return "\n".join(lines) + "\n"
