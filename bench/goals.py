"""The benchmark's goals: one constructor, each goal next to its floor where one exists.

A goal whose floor alone (the copies or collectives any implementation needs) already
misses its limit is no goal: it is printed apart, measured, never judged. A stretch goal
(a moonshot, or a limit against a stricter floor than the goal's own) is judged and
printed apart from the goals, so that a miss there reads as what it is.
"""

from __future__ import annotations

from typing import Any

#: A list of :func:`goal` dicts.
Goals = list[dict[str, Any]]


def goal(text: str, value: Any, limit: float, floor: float | None = None, stretch: bool = False) -> dict[str, Any]:
    """One goal: ``value <= limit``; ``floor`` is what the same measure gives for the floor
    alone (the copies or collectives any implementation needs), None when there is none;
    ``stretch``: a goal beyond the benchmark's own (judged, printed apart)."""
    return dict(goal=text, value=value, limit=limit, floor=floor, ok=None if value is None else value <= limit,
                stretch=stretch)


def split_goals(all_goals: Goals) -> tuple[Goals, Goals, Goals]:
    """(goals, floor-bound, stretch goals): a goal whose floor alone already misses its
    limit is no goal (nothing could meet it); it is reported apart, measured next to its
    floor, never judged. A stretch goal is judged, and reported apart from the goals."""
    bound = [g for g in all_goals if g.get("floor") is not None and g["floor"] > g["limit"]]
    stretch = [g for g in all_goals if g.get("stretch") and g not in bound]
    return [g for g in all_goals if g not in bound and g not in stretch], bound, stretch


def _verdict(g: dict[str, Any]) -> str:
    """``met``, ``MISSED``, or ``n/a`` where nothing was measured."""
    return "n/a" if g["ok"] is None else ("met" if g["ok"] else "MISSED")


def _value(x: Any) -> str:
    return "-" if x is None else (f"{x:.4f}" if isinstance(x, float) else str(x))


def _judged(g: dict[str, Any]) -> str:
    """One goal's line: its verdict, text, measured value and floor."""
    floor = "" if g.get("floor") is None else f"; floor {_value(g['floor'])}"
    return f"  [{_verdict(g):>6}] {g['goal']}  (measured {_value(g['value'])}{floor})"


def format_goals(all_goals: Goals) -> str:
    """The goals, each ``[met]`` / ``[MISSED]`` / ``[n/a]`` with its measured value and floor,
    then the stretch goals the same way, then the measures whose floor misses the limit
    (no verdict)."""
    kept, bound, stretch = split_goals(all_goals)
    lines = ["== goals (each next to its floor where one exists) ==", *map(_judged, kept)]
    if stretch:
        lines += ["== stretch goals (beyond the goals above: judged apart) ==", *map(_judged, stretch)]
    if bound:
        lines.append("== not goals: the floor alone misses the limit (measured, not judged) ==")
        for g in bound:
            lines.append(f"  [ floor] {g['goal']}  (measured {_value(g['value'])}; floor {_value(g['floor'])})")
    return "\n".join(lines)


def markdown_goals(all_goals: Goals, env: dict[str, Any]) -> str:
    """The same list as a markdown table (docs/performance.md), with the machine it ran on
    (a stretch goal's verdict says so)."""
    kept, bound, stretch = split_goals(all_goals)
    lines = [
        f"Measured by `{' '.join(['.venv/bin/python -m bench', *env.get('argv', [])])}` on {env.get('cpus')} CPU cores "
        f"({env.get('machine')}, Python {env.get('python')}, torch {env.get('torch')}, megatron-core "
        f"{env.get('megatron_core')}):",
        "",
        "| goal | measured | floor | verdict |",
        "|---|---|---|---|",
    ]
    for g in kept + stretch:
        verdict = "**missed**" if _verdict(g) == "MISSED" else _verdict(g)
        verdict = f"stretch: {verdict}" if g.get("stretch") else verdict
        lines.append(f"| {g['goal']} | {_value(g['value'])} | {_value(g.get('floor'))} | {verdict} |")
    for g in bound:
        lines.append(f"| {g['goal']} | {_value(g['value'])} | {_value(g['floor'])} | no goal: its floor misses it |")
    return "\n".join(lines) + "\n"
