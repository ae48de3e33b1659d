"""Compare per-rank outputs of a backend with the reference, with dtype-fitting tolerances."""

from __future__ import annotations

import dataclasses

import numpy as np

from parity_tests.results import ScenarioResult
from parity_tests.scenarios import RankData, RouterState, Scenario

ROUTER_FIELDS = tuple(f.name for f in dataclasses.fields(RouterState) if f.name != "aux_loss_resets")


def tolerance(scenario: Scenario) -> tuple[float, float]:
    """(rtol, atol) for a scenario: zero in exact and wide mode, dtype-scaled in random mode."""
    if scenario.mode in ("exact", "wide"):
        return 0.0, 0.0
    n = scenario.world_size
    if scenario.dtype == "float32":
        return 1e-6 * n, 1e-6 * n
    return 2.0**-7 * n, 2.0**-7 * n  # bf16 / fp16: a few roundings per value


@dataclasses.dataclass
class Comparison:
    """Result of comparing one backend's outputs with the reference's."""

    max_abs_diff: float
    failures: list[str]

    @property
    def ok(self) -> bool:
        return not self.failures


def _close(a: np.ndarray, b: np.ndarray, rtol: float, atol: float) -> tuple[bool, float]:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return False, float("inf")
    if a.size == 0:
        return True, 0.0
    same_nan = np.isnan(a) == np.isnan(b)
    # Equal values (infinities included) and NaN where both hold NaN differ by 0.
    equal = (a == b) | (np.isnan(a) & np.isnan(b))
    with np.errstate(invalid="ignore"):
        diff = np.where(equal, 0.0, np.abs(a - b))
    diff = np.nan_to_num(diff, nan=np.inf)
    ok = bool(same_nan.all()) and bool((equal | (diff <= atol + rtol * np.abs(np.where(equal, 0.0, b)))).all())
    return ok, float(diff.max())


def compare_ranks(
    scenario: Scenario, got: list[RankData], want: list[RankData], routers: bool = True
) -> Comparison:
    """Compare every gradient (and router buffer) of every rank.

    Args:
      scenario: the scenario (for tolerances).
      got: a backend's per-rank outputs.
      want: the reference's per-rank outputs.
      routers: also compare router state.

    Returns:
      A Comparison with the max abs difference and a line per mismatch.
    """
    rtol, atol = tolerance(scenario)
    failures: list[str] = []
    worst = 0.0
    if len(got) != len(want):
        return Comparison(float("inf"), [f"{len(got)} ranks returned, {len(want)} expected"])
    for rank, (g, w) in enumerate(zip(got, want)):
        if set(g.grads) != set(w.grads):
            failures.append(f"rank {rank}: gradient keys differ: {sorted(set(g.grads) ^ set(w.grads))}")
            continue
        for key, wv in w.grads.items():
            gv = g.grads[key]
            if (gv is None) != (wv is None):
                failures.append(f"rank {rank} {key}: None mismatch (got {gv is None}, want {wv is None})")
                continue
            if wv is None:
                continue
            ok, diff = _close(gv, wv, rtol, atol)
            worst = max(worst, diff)
            if not ok:
                failures.append(f"rank {rank} grad {key}: max |diff| {diff:.3g}")
        if not routers:
            continue
        for key, ws in w.routers.items():
            gs = g.routers.get(key)
            if gs is None:
                failures.append(f"rank {rank} router {key}: missing")
                continue
            for field in ROUTER_FIELDS:
                # Router state is float32 whatever the gradient dtype; the qb_beta EMA is
                # not exact in binary even on integer data.
                exact = scenario.mode == "exact" and field != "qb_beta"
                r_tol = 0.0 if exact else 1e-6 * scenario.world_size
                ok, diff = _close(getattr(gs, field), getattr(ws, field), r_tol, r_tol)
                worst = max(worst, diff)
                if not ok:
                    failures.append(f"rank {rank} router {key}.{field}: max |diff| {diff:.3g}")
            if gs.aux_loss_resets != ws.aux_loss_resets:
                failures.append(
                    f"rank {rank} router {key}: aux-loss resets {gs.aux_loss_resets} != {ws.aux_loss_resets}"
                )
    return Comparison(worst, failures)


def _entry_diff(scenario: Scenario, got: RankData, want: RankData, kind: str, key) -> tuple[bool, float]:
    """Difference of one gradient or one router's state on one rank."""
    rtol, atol = tolerance(scenario)
    if kind == "grad":
        g, w = got.grads.get(key), want.grads.get(key)
        if g is None or w is None:
            return (g is None) == (w is None), 0.0 if (g is None) == (w is None) else float("inf")
        return _close(g, w, rtol, atol)
    gs, ws = got.routers.get(key), want.routers.get(key)
    if gs is None or ws is None:
        return False, float("inf")
    ok, worst = gs.aux_loss_resets == ws.aux_loss_resets, 0.0
    for field in ROUTER_FIELDS:
        exact = scenario.mode == "exact" and field != "qb_beta"
        r_tol = 0.0 if exact else 1e-6 * scenario.world_size
        f_ok, diff = _close(getattr(gs, field), getattr(ws, field), r_tol, r_tol)
        ok, worst = ok and f_ok, max(worst, diff)
    return ok, worst


def diff_by_step(
    scenario: Scenario, got: list[RankData], want: list[RankData], touched: dict[str, set]
) -> dict[str, tuple[bool, float]]:
    """Per step (docs/semantics.md): (within tolerance, max abs diff) over the values that
    step touched.

    Args:
      scenario: the scenario.
      got: a backend's per-rank outputs.
      want: the reference's per-rank outputs.
      touched: the reference's step -> {(rank, kind, key)}.

    Returns:
      step name -> (ok, max abs diff), for the steps that touched anything.
    """
    out: dict[str, tuple[bool, float]] = {}
    for step, entries in touched.items():
        if not entries:
            continue
        ok, worst = True, 0.0
        for rank, kind, key in entries:
            e_ok, diff = _entry_diff(scenario, got[rank], want[rank], kind, key)
            ok, worst = ok and e_ok, max(worst, diff)
        out[step] = (ok, worst)
    return out


def check_against_reference(scenario: Scenario, result: ScenarioResult, backend: str) -> None:
    """Raise AssertionError unless ``result`` matches the numpy reference.

    A scenario the reference rejects must be rejected by the backend too.

    Args:
      scenario: the scenario.
      result: the backend's outcome.
      backend: its name, for messages.
    """
    from parity_tests.reference import reference_finalize
    from parity_tests.scenarios import make_rank_inputs

    inputs = [make_rank_inputs(scenario, rank) for rank in range(scenario.world_size)]
    try:
        want = reference_finalize(scenario, inputs)
    except Exception as exc:  # the reference rejects the scenario: the backend must too
        if result.error is None:
            raise AssertionError(f"reference raised {exc!r}; {backend} returned outputs") from exc
        return
    if result.error is not None:
        raise AssertionError(f"{backend} raised: {result.error}")
    comparison = compare_ranks(scenario, result.outputs, want.outputs)
    if not comparison.ok:
        raise AssertionError("\n".join(comparison.failures[:20]))
