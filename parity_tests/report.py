"""The parity report: every scenario through torch_impl, jax_impl and the numpy reference.

Used by ``python -m parity_tests``; returns data so tests and tools can reuse it. The
steps are those of docs/semantics.md, in execution order.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from parity_tests.compare import compare_ranks, diff_by_step
from parity_tests.reference import reference_finalize
from parity_tests.results import ScenarioResult
from parity_tests.scenarios import Scenario, by_world_size, make_rank_inputs

STEPS = (
    "dp_sync", "cond_embedder", "router", "non_tp", "gtp", "word_embedding",
    "pos_embedding", "expert_bias", "qb_beta", "reset", "token_scale",
)


@dataclasses.dataclass
class ScenarioReport:
    """Parity of one scenario on every backend that ran."""

    scenario: Scenario
    steps: dict[str, dict[str, tuple[bool, float]]]  # backend -> step -> (ok, max diff)
    failures: dict[str, list[str]]  # backend -> mismatch lines or the error
    results: dict[str, ScenarioResult]

    @property
    def ok(self) -> bool:
        return not any(self.failures.values())


class Progress:
    """Progress of a parity run on a stream.

    On a terminal: a tqdm bar redrawn in place. Elsewhere (a CI log, a pipe, a file): a
    plain line at every tenth of the work and at every torch world, so the log stays
    readable. ``stream=None`` writes nothing.

    Args:
      total: units of work (scenario x backend runs).
      stream: where to write, or None.
    """

    def __init__(self, total: int, stream: TextIO | None) -> None:
        self.total, self.done, self.stream = max(total, 1), 0, stream
        self.start = time.perf_counter()
        self._every = max(1, -(-self.total // 10))
        self._bar: Any = None
        self._logged = 0
        if stream is not None and _is_terminal(stream):
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, file=stream, unit="run", dynamic_ncols=True, leave=False)

    def advance(self, n: int, label: str) -> None:
        """Record ``n`` finished runs; ``label`` says what finished."""
        self.done += n
        if self.stream is None:
            return
        if self._bar is not None:
            self._bar.set_description_str(label[:40], refresh=False)
            self._bar.update(n)
            return
        if label.startswith("torch") or self.done // self._every > self._logged // self._every or self.done >= self.total:
            elapsed = time.perf_counter() - self.start
            self.stream.write(f"parity: {self.done}/{self.total} runs done, {elapsed:.1f}s: {label}\n")
            self.stream.flush()
            self._logged = self.done

    def close(self) -> None:
        """Remove the bar (a terminal) or write the closing line (a log)."""
        if self._bar is not None:
            self._bar.close()
        elif self.stream is not None and self._logged < self.done:
            elapsed = time.perf_counter() - self.start
            self.stream.write(f"parity: {self.done}/{self.total} runs done, {elapsed:.1f}s\n")
            self.stream.flush()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def run_backends(
    scenarios: Sequence[Scenario], backends: Sequence[str], progress: Progress
) -> dict[str, dict[str, ScenarioResult]]:
    """Run the scenarios on each backend: one jax process, one gloo world per world size."""
    out: dict[str, dict[str, ScenarioResult]] = {}
    if "jax" in backends:
        from parity_tests.jax_world import run_jax

        out["jax"] = {}
        for scenario in scenarios:
            out["jax"].update(run_jax([scenario]))
            progress.advance(1, f"jax {scenario.name}")
    if "torch" in backends:
        from parity_tests.torch_world import run_torch_world

        out["torch"] = {}
        for world_size, group in sorted(by_world_size(tuple(scenarios)).items()):
            out["torch"].update(run_torch_world(group, world_size))
            progress.advance(len(group), f"torch world of {world_size}")
    return out


def build_report(
    scenarios: Sequence[Scenario],
    backends: Sequence[str] = ("torch", "jax"),
    stream: TextIO | None = sys.stderr,
) -> list[ScenarioReport]:
    """Run everything and compare each backend with the reference, step by step."""
    progress = Progress(len(scenarios) * len(backends), stream)
    results = run_backends(scenarios, backends, progress)
    progress.close()
    reports = []
    for scenario in scenarios:
        inputs = [make_rank_inputs(scenario, r) for r in range(scenario.world_size)]
        ref = reference_finalize(scenario, inputs)
        steps: dict[str, dict[str, tuple[bool, float]]] = {}
        failures: dict[str, list[str]] = {}
        per_backend: dict[str, ScenarioResult] = {}
        for backend in backends:
            result = results[backend].get(scenario.name) or ScenarioResult(None, "not run")
            per_backend[backend] = result
            if result.outputs is None:
                failures[backend] = [f"error: {result.error}"]
                steps[backend] = {}
                continue
            failures[backend] = compare_ranks(scenario, result.outputs, ref.outputs).failures
            steps[backend] = diff_by_step(scenario, result.outputs, ref.outputs, ref.touched)
        reports.append(ScenarioReport(scenario, steps, failures, per_backend))
    return reports


def _fmt(cell: tuple[bool, float] | None) -> str:
    if cell is None:
        return "-"
    ok, diff = cell
    return f"{diff:.2g}" + ("" if ok else " FAIL")


def format_table(reports: Sequence[ScenarioReport], backends: Sequence[str]) -> str:
    """Step x scenario table of max abs differences against the reference."""
    name_w = max([len(r.scenario.name) for r in reports] + [8])
    timing = "jax" in backends
    header = (
        f"{'scenario':<{name_w}}  {'step':<15}" + "".join(f"{b + ' Δ':>12}" for b in backends) + "  verdict"
        + ("  jax compile / run" if timing else "")
    )
    lines = [header, "-" * len(header)]
    for rep in reports:
        steps = [s for s in STEPS if any(s in rep.steps.get(b, {}) for b in backends)]
        for i, step in enumerate(steps or ["(none)"]):
            cells = [_fmt(rep.steps.get(b, {}).get(step)) for b in backends]
            ok = all(rep.steps.get(b, {}).get(step, (True, 0))[0] for b in backends)
            line = (
                f"{rep.scenario.name:<{name_w}}  {step:<15}" + "".join(f"{c:>12}" for c in cells)
                + ("  ok     " if ok and rep.ok else "  FAIL   ")
            )
            jax_result = rep.results.get("jax")
            if timing and i == 0 and jax_result is not None and jax_result.outputs is not None:
                line += f"  {(jax_result.compile_seconds or 0.0) * 1e3:7.0f}ms / {jax_result.seconds * 1e3:.2f}ms"
            lines.append(line.rstrip())
        for backend, lines_ in rep.failures.items():
            for failure in lines_[:3]:
                lines.append(f"    {backend}: {failure}")
    return "\n".join(lines)


def format_summary(reports: Sequence[ScenarioReport], backends: Sequence[str]) -> str:
    """Per step: scenarios covered, worst difference per backend, verdict; jax timings."""
    lines = [f"{'step':<15}{'scenarios':>10}" + "".join(f"{b + ' max Δ':>14}" for b in backends) + "  verdict"]
    for step in STEPS:
        covered = [r for r in reports if any(step in r.steps.get(b, {}) for b in backends)]
        if not covered:
            continue
        worst = {b: max((r.steps.get(b, {}).get(step, (True, 0.0))[1] for r in covered), default=0.0) for b in backends}
        ok = all(r.steps.get(b, {}).get(step, (True, 0))[0] for r in covered for b in backends)
        lines.append(
            f"{step:<15}{len(covered):>10}" + "".join(f"{worst[b]:>14.2g}" for b in backends) + ("  ok" if ok else "  FAIL")
        )
    if "jax" in backends:
        compile_s = [r.results["jax"].compile_seconds or 0.0 for r in reports if "jax" in r.results]
        run_s = [r.results["jax"].seconds for r in reports if "jax" in r.results]
        if compile_s:
            lines.append(
                f"jax: compile {sum(compile_s):.1f}s total (max {max(compile_s):.2f}s), "
                f"run {sum(run_s) * 1e3:.1f}ms total (max {max(run_s) * 1e3:.2f}ms) over {len(compile_s)} scenarios"
            )
    return "\n".join(lines)


def verdict(reports: Sequence[ScenarioReport]) -> str:
    failed = [r.scenario.name for r in reports if not r.ok]
    if not failed:
        return f"PARITY: all {len(reports)} scenarios match the reference on every backend"
    return f"NO PARITY: {len(failed)} of {len(reports)} scenarios differ: {', '.join(failed[:5])}" + (
        " ..." if len(failed) > 5 else ""
    )


def to_json(reports: Sequence[ScenarioReport]) -> str:
    rows = []
    for rep in reports:
        rows.append(
            {
                "scenario": rep.scenario.name,
                "world_size": rep.scenario.world_size,
                "ok": rep.ok,
                "steps": {b: {s: {"ok": ok, "max_abs_diff": d} for s, (ok, d) in st.items()} for b, st in rep.steps.items()},
                "failures": rep.failures,
                "seconds": {b: r.seconds for b, r in rep.results.items()},
                "jax_compile_seconds": rep.results["jax"].compile_seconds if "jax" in rep.results else None,
            }
        )
    return json.dumps(rows, indent=1, default=float)


def select(
    scenarios: Sequence[Scenario], mesh: Callable[[Scenario], bool] | None, pattern: str | None
) -> list[Scenario]:
    out = [s for s in scenarios if (mesh is None or mesh(s)) and (pattern is None or pattern in s.name)]
    return out


# --------------------------------------------------------------------------- html

#: Cell colours: exact (0), well within tolerance, near it, beyond it, not touched.
HTML_COLOURS = {"exact": "#1a7f37", "small": "#8fd19e", "near": "#f2cc60", "fail": "#d1242f", "none": "#eeeeee"}


def cell_class(cell: tuple[bool, float] | None, atol: float) -> str:
    """Colour class of one step x scenario cell from its difference and tolerance.

    Args:
      cell: (within tolerance, max abs difference), or None when the step touched nothing.
      atol: the absolute tolerance of that step in that scenario (:func:`step_tolerance`).

    Returns:
      "none" (not touched), "exact" (difference 0), "small" (at most 1% of the
      tolerance), "near" (within tolerance) or "fail".
    """
    if cell is None:
        return "none"
    ok, diff = cell
    if not ok:
        return "fail"
    if diff == 0.0:
        return "exact"
    return "small" if atol > 0 and diff <= 0.01 * atol else "near"


#: Steps whose values are router buffers (float32 whatever the gradient dtype).
ROUTER_STEPS = ("expert_bias", "qb_beta", "reset")


def step_tolerance(scenario: Scenario, step: str) -> float:
    """The absolute tolerance a step's values are held to in ``scenario``.

    Gradients: :func:`parity_tests.compare.tolerance`. Router buffers: 1e-6 x world size
    (the quantile-balancing EMA is not exact in binary even on integer data).
    """
    from parity_tests.compare import tolerance

    if step in ROUTER_STEPS:
        return 1e-6 * scenario.world_size
    return tolerance(scenario)[1]


def _worst(classes: Sequence[str]) -> str:
    order = ("none", "exact", "small", "near", "fail")
    return max(classes, key=order.index)


def format_html(reports: Sequence[ScenarioReport], backends: Sequence[str]) -> str:
    """A self-contained HTML page: the scenario x step grid coloured by difference / tolerance.

    Each cell shows every backend's max abs difference from the numpy reference for that
    step; its colour is the worse backend's class (:func:`cell_class`). The page also
    holds the verdict, the colour key and each failing scenario's first mismatches.

    Args:
      reports: from :func:`build_report`.
      backends: the backends that ran, in column order.

    Returns:
      The HTML text (no external resources).
    """
    from html import escape

    steps = [s for s in STEPS if any(s in r.steps.get(b, {}) for r in reports for b in backends)]
    style = "".join(f".{k}{{background:{v}}}" for k, v in HTML_COLOURS.items())
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8"><title>meshgrad parity report</title>',
        "<style>body{font-family:sans-serif;font-size:13px}table{border-collapse:collapse}"
        "td,th{border:1px solid #999;padding:2px 6px;text-align:right;white-space:nowrap}"
        "th.name,td.name{text-align:left}.exact{color:#fff}.fail{color:#fff}" + style + "</style></head><body>",
        "<h1>meshgrad parity report</h1>",
        f'<p id="verdict">{escape(verdict(reports))}</p>',
        "<p>Each cell: the largest absolute difference from the numpy reference over every value "
        "that step touched, on every rank, per backend (" + escape(" / ".join(backends)) + "). "
        "Tolerance (hover a cell): gradients 0 in exact and wide scenarios, else float32 1e-6 x "
        "world size and bf16 / fp16 2^-7 x world size; router buffers 1e-6 x world size. Steps are described in docs/semantics.md.</p>",
        '<table class="key"><tr>'
        + "".join(
            f'<td class="{k}">{escape(t)}</td>'
            for k, t in (
                ("exact", "0 (bit-identical)"),
                ("small", "<= 1% of tolerance"),
                ("near", "within tolerance"),
                ("fail", "beyond tolerance or error"),
                ("none", "step touched nothing"),
            )
        )
        + "</tr></table><br>",
        '<table id="grid"><tr><th class="name">scenario</th><th>world</th>'
        + "".join(f"<th>{escape(s)}</th>" for s in steps)
        + "<th>verdict</th></tr>",
    ]
    for rep in reports:
        cells = []
        for step in steps:
            atol = step_tolerance(rep.scenario, step)
            per = [rep.steps.get(b, {}).get(step) for b in backends]
            klass = _worst([cell_class(c, atol) for c in per])
            text = " / ".join(_fmt(c) for c in per) if klass != "none" else "-"
            title = f"{rep.scenario.name} {step}: tolerance {atol:g}"
            cells.append(f'<td class="{klass}" title="{escape(title)}">{escape(text)}</td>')
        status = '<td class="exact">ok</td>' if rep.ok else '<td class="fail">FAIL</td>'
        out.append(
            f'<tr><td class="name">{escape(rep.scenario.name)}</td>'
            f"<td>{rep.scenario.world_size}</td>" + "".join(cells) + status + "</tr>"
        )
    out.append("</table>")
    failed = [r for r in reports if not r.ok]
    if failed:
        out.append("<h2>Failures</h2><ul>")
        for rep in failed:
            lines = [f"{b}: {line}" for b, ls in rep.failures.items() for line in ls[:3]]
            out.append(f"<li>{escape(rep.scenario.name)}<pre>{escape(chr(10).join(lines))}</pre></li>")
        out.append("</ul>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"
