"""The parity report: every scenario through torch_impl, jax_impl and the numpy reference.

Used by ``python -m parity_tests``; returns data so tests and tools can reuse it.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import TextIO

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
    """A one-line progress bar on a stream (a no-op when disabled)."""

    def __init__(self, total: int, stream: TextIO | None, width: int = 30) -> None:
        self.total, self.done, self.stream, self.width = max(total, 1), 0, stream, width
        self.start = time.perf_counter()

    def advance(self, n: int, label: str) -> None:
        self.done += n
        if self.stream is None:
            return
        filled = int(self.width * self.done / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.perf_counter() - self.start
        self.stream.write(f"\r[{bar}] {self.done}/{self.total} {elapsed:6.1f}s {label[:40]:<40}")
        self.stream.flush()

    def close(self) -> None:
        if self.stream is not None:
            self.stream.write("\n")
            self.stream.flush()


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
