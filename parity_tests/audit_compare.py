"""Comparing recorded values with expected ones: a row of the report per compared
quantity, the per-element tolerance, the router buffers and ``num_tokens``.

The tolerance of an element is ``eps(dtype) * (W + 2) * B``, B from a second reference run
on absolute values (the bound on the magnitudes a rounding error scales with); where B is
not finite the comparison is exact and the row cannot pass (``NONFINITE``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from parity_tests.audit_files import ROUTER_FIELDS, RankFile
from parity_tests.audit_view import View
from parity_tests.scenarios import RankData, RouterLayout

#: Unit roundoff-like spacing per gradient dtype (float64 is compared at the reference's float32).
EPS = {"float32": 2.0**-23, "float64": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10}


@dataclasses.dataclass
class Row:
    """One compared quantity of one step."""

    kind: str  # "param" | "router" | "num_tokens"
    chunk: int
    name: str
    ranks: int = 0
    max_abs_diff: float = 0.0
    status: str = "ok"  # "ok" | "MISMATCH" | "unverified"
    detail: str = ""
    steps: list[str] = dataclasses.field(default_factory=list)  # the steps touching it
    jax_max_abs_diff: float | None = None
    jax_status: str | None = None

    def worse(self, diff: float, bad: bool, detail: str) -> None:
        """Account one comparison: its difference, and the first failing one's detail."""
        self.max_abs_diff = max(self.max_abs_diff, diff)
        if bad and self.status != "MISMATCH":
            self.status, self.detail = "MISMATCH", detail

    def nonfinite(self, detail: str) -> None:
        """The recorded "before" values hold NaN or inf: the expected values there are
        not finite, no tolerance applies (compared exactly), and the row cannot pass."""
        if self.status != NONFINITE:
            self.status, self.detail = NONFINITE, detail


#: The verdict of a row whose recorded "before" values hold NaN or inf (not a pass).
NONFINITE = "NONFINITE"
#: Verdicts that fail a step.
FAILING = ("MISMATCH", NONFINITE)


def tolerance(eps: float, world: int, bound: np.ndarray) -> tuple[np.ndarray, bool]:
    """(per-element tolerance, whether any bound is NaN or inf); where the bound is not
    finite the tolerance is 0 (an exact comparison: ``inf > nan`` is false, so a NaN
    tolerance would pass anything)."""
    tol = eps * (world + 2) * np.abs(np.asarray(bound, np.float64)) + 1e-30
    finite = np.isfinite(tol)
    if finite.all():
        return tol, False
    return np.where(finite, tol, 0.0), True


def compare_values(got: np.ndarray, want: np.ndarray, tol: np.ndarray) -> tuple[float, int | None]:
    """(max abs difference, first index outside the tolerance or None); NaN == NaN."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    with np.errstate(invalid="ignore"):
        d = np.where(same, 0.0, np.abs(got - want))
    d = np.nan_to_num(d, nan=np.inf)
    bad = np.flatnonzero(d > tol)
    return (float(d.max()) if d.size else 0.0), (int(bad[0]) if bad.size else None)


def compare_matrix(got: np.ndarray, want: np.ndarray, bound: np.ndarray, eps: float, world: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`tolerance` and :func:`compare_values` on whole arrays at once (a row per rank).

    Args:
      got, want, bound: recorded, expected and |x| bound values, one shape.
      eps, world: the tolerance's ``eps(dtype)`` and world size.

    Returns:
      (absolute differences, NaN as inf; outside the tolerance; bound not finite), elementwise.
    """
    tol = eps * (world + 2) * np.abs(np.asarray(bound, np.float64)) + 1e-30
    nonfinite = ~np.isfinite(tol)
    if nonfinite.any():
        tol = np.where(nonfinite, 0.0, tol)
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    with np.errstate(invalid="ignore"):
        d = np.where(same, 0.0, np.abs(got - want))
    d = np.nan_to_num(d, nan=np.inf)
    return d, d > tol, nonfinite


def compare_routers(files: list[RankFile], view: View, layouts: dict[Any, RouterLayout],
                    inputs: list[RankData], outputs: list[RankData], rows: dict[Any, Row]) -> None:
    """Every recorded router buffer after finalize against the reference's, into ``rows``.

    Args:
      files: the step's files by rank; view: its global view; layouts: unused (the
        outputs hold every router); inputs, outputs: the reference's, by reference rank.
      rows: the report's rows, extended in place.
    """
    eps = 2.0**-23 * (len(files) + 2)
    for v in range(len(files)):
        f = files[view.actual[v]]
        for i, r in enumerate(f.meta["routers"]):
            key = (r["chunk"], r["name"])
            if key not in outputs[v].routers:
                continue
            want_state = outputs[v].routers[key]
            before_state = inputs[v].routers[key]
            for fld in ROUTER_FIELDS:
                name = f"router{i}.{fld}.after"
                if name not in f.arrays:
                    continue
                row = rows.setdefault(("router", r["chunk"], f"{r['name']}.{fld}"), Row("router", r["chunk"], f"{r['name']}.{fld}"))
                row.ranks += 1
                got = np.asarray(f.arrays[name], np.float64)
                want = np.asarray(getattr(want_state, fld), np.float64)
                scale = 1.0 + np.max(np.abs(np.concatenate([np.ravel(want), np.ravel(getattr(before_state, fld))])))
                if got.shape != want.shape:
                    row.worse(math.inf, True, f"rank {f.rank}: shape {got.shape}, expected {want.shape}")
                    continue
                finite = bool(np.isfinite(scale))
                diff, bad = compare_values(got.ravel(), want.ravel(), np.full(want.size, eps * scale if finite else 0.0))
                detail = "" if bad is None else (
                    f"rank {f.rank}, element {bad}: recorded {float(got.ravel()[bad])!r}, expected {float(want.ravel()[bad])!r}")
                row.worse(diff, bad is not None, detail)
                if not finite:
                    row.nonfinite(f"rank {f.rank}: the recorded router values hold NaN/inf; such a step cannot be verified")


def compare_tokens(files: list[RankFile], view: View) -> Row:
    """num_tokens after: the global count (broadcast from the last stage, summed over
    dp_cp, in place as Megatron does) or unchanged."""
    row = Row("num_tokens", 0, "num_tokens")
    mesh = view.mesh
    given = [f.meta["num_tokens"]["before"] is not None for f in files]
    if not any(given):
        row.detail = "not given"
        return row
    if not all(given):
        row.worse(math.inf, True, f"num_tokens given on some ranks only: missing on {[i for i, g in enumerate(given) if not g]}")
        return row
    value = {v: files[view.actual[v]].meta["num_tokens"]["before"] for v in range(mesh.world)}
    last = {}
    for group in mesh.groups(("pp",), "dense"):
        src = max(group, key=lambda x: mesh.coords(x, "dense")["pp"])
        for x in group:
            last[x] = value[src]
    axes = ("dp", "cp", "gtp") if mesh.gtp > 1 else ("dp", "cp")
    modes = set()
    for group in mesh.groups(axes, "dense"):
        total = sum(last[x] for x in group)
        for x in group:
            f = files[view.actual[x]]
            got = f.meta["num_tokens"]["after"]
            row.ranks += 1
            if got == total:
                modes.add("global count")
            elif got == value[x]:
                modes.add("unchanged")
            else:
                row.worse(abs(got - total), True, f"rank {f.rank}: num_tokens after {got}, expected {total} (or unchanged {value[x]})")
    if row.status == "ok":
        row.detail = "after: " + " / ".join(sorted(modes))
    return row


def step_report(meta0: dict[str, Any], step: int, world: int, view: View, rows: list[Row], *,
                experts: bool, force: bool, jax: bool) -> dict[str, Any]:
    """One audited step's report: its layout and config, every row, and whether all passed.

    Args:
      meta0: rank 0's metadata of the step.
      step: the step's number.
      world: the number of ranks recorded.
      view: the step's view of the mesh.
      rows: the compared rows.
      experts: the step has expert parameters or routers.
      force: ``force_all_reduce`` was set.
      jax: the step was also replayed in JAX.
    """
    ok = all(r.status not in FAILING for r in rows) and all(r.jax_status != "MISMATCH" for r in rows)
    return {
        "step": step,
        "world_size": world,
        "finalize": meta0["finalize"],
        "layout": view.sizes,
        "has_experts": experts,
        "rank_map": view.virtual,
        "config": view.config,
        "force_all_reduce": force,
        "jax": jax,
        "rows": [dataclasses.asdict(r) for r in rows],
        "ok": ok,
    }


