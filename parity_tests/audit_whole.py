"""The whole-load replay of one step: every rank's sampled values in memory at once, the
reference run over all parameters of a dtype in one call.

This is the replay as first written, kept as the plain statement of what a replay
computes: :mod:`parity_tests.audit_stream` gives the same rows in bounded memory, and the
tests compare the two. ``replay(directory, stream=False)`` uses it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from parity_tests.audit_compare import (
    EPS, Row, compare_routers, compare_tokens, compare_values, step_report, tolerance,
)
from parity_tests.audit_files import RankFile
from parity_tests.audit_sampled import run_jax, sampled_reference, shard_fn
from parity_tests.audit_view import View, build_view, check_positions, global_params, router_layouts, router_state
from parity_tests.scenarios import Key, RankData, Scenario


def replay_step(files: list[RankFile], use_jax: bool = False) -> dict[str, Any]:
    """Replay one step: expected values from the reference (and jax), compared.

    Returns:
      A JSON-able dict: step, layout, rows and the verdict.
    """
    meta0 = files[0].meta
    step = meta0["step"]
    view = build_view(files)
    world = len(files)
    force = bool(meta0["force_all_reduce"])
    vparams, per_rank = global_params(files)
    check_positions(files, per_rank)
    routers = router_layouts(files)
    num_chunks = max(f.meta["num_chunks"] for f in files)
    scatter = bool(view.config.get("use_distributed_optimizer")) and not force
    ddp_scatter = scatter and any(any(f.meta["ddp_chunks"]) for f in files)
    rows: dict[tuple[str, int, str], Row] = {}
    dtypes = sorted({p.dtype for p in vparams.values()}) or ["float32"]
    sz = view.sizes
    for k, dtype in enumerate(dtypes):
        chosen = [p for p in vparams.values() if p.dtype == dtype]
        ref_dtype = dtype if dtype in ("float32", "bfloat16", "float16") else "float32"
        scen = Scenario(
            f"audit-step{step}-{dtype}", pp=sz["pp"], dp=sz["dp"], cp=sz["cp"], tp=sz["tp"], gtp=sz["gtp"],
            ep=sz["ep"], etp=1, egtp=sz["egtp"], num_chunks=num_chunks, params=tuple(p.layout for p in chosen),
            routers=tuple(routers.values()) if k == 0 else (), config=dict(view.config), dtype=ref_dtype, mode="random",
        )
        inputs, absolute, recorded = _inputs(files, view, scen, per_rank, num_chunks)
        shard = shard_fn(files, view, per_rank, scen) if scatter else None
        outputs, touched = sampled_reference(scen, inputs, force, shard or (lambda *a: None))
        bounds, _ = sampled_reference(scen, absolute, force, shard or (lambda *a: None))
        jax_out = run_jax(scen, inputs, view, force) if use_jax and not scatter else None
        eps = EPS.get(dtype, 2.0**-23)
        for v in range(world):
            r = view.actual[v]
            f = files[r]
            for i, p in enumerate(f.meta["params"]):
                vname = per_rank[r][i]
                if vparams[vname].dtype != dtype:
                    continue
                key = (p["chunk"], vname)
                row = rows.setdefault(("param", p["chunk"], vname), Row("param", p["chunk"], " | ".join(sorted(vparams[vname].labels))))
                for sname, keys in touched.items():
                    if any(t[1] == "grad" and t[2] == key for t in keys) and sname not in row.steps:
                        row.steps.append(sname)
                want = outputs[v].grads[key]
                if want is None or not p["has_grad"]:
                    continue
                if ddp_scatter and f.meta["ddp_chunks"][p["chunk"]]:
                    row.status = "unverified" if row.status == "ok" else row.status
                    row.detail = row.detail or "Megatron DDP reduce-scatter: its shard layout is not recorded"
                    continue
                got = recorded[v][key]
                row.ranks += 1
                if not p["has_grad_after"]:
                    row.worse(math.inf, True, f"rank {r}: the gradient is gone after finalize")
                    continue
                tol, nonfinite = tolerance(eps, world, bounds[v].grads[key])
                diff, bad = compare_values(got, want, tol)
                detail = ""
                if bad is not None:
                    pos = int(f.arrays["positions"][sum(q["samples"] for q in f.meta["params"][:i]) + bad])
                    detail = (f"rank {r}, flat index {pos}: recorded {float(got[bad])!r}, expected {float(want[bad])!r} "
                              f"(before: {float(inputs[v].grads[key][bad])!r})")
                row.worse(diff, bad is not None, detail)
                if nonfinite:
                    where = [view.actual[u] for u in range(world)
                             if inputs[u].grads.get(key) is not None and not np.isfinite(inputs[u].grads[key]).all()]
                    odd = int(np.flatnonzero(~np.isfinite(np.asarray(bounds[v].grads[key], np.float64)))[0])
                    pos = int(f.arrays["positions"][sum(q["samples"] for q in f.meta["params"][:i]) + odd])
                    row.nonfinite(f"the recorded before values hold NaN/inf (rank{'s' if len(where) != 1 else ''} "
                                  f"{where if len(where) != 1 else where[0]}): rank {r}, flat index {pos} expects "
                                  f"{float(want[odd])!r}; such a step cannot be verified (compared exactly)")
                if jax_out is not None and key in jax_out:
                    jd, jbad = compare_values(got, jax_out[key][v], tol)
                    row.jax_max_abs_diff = max(row.jax_max_abs_diff or 0.0, jd)
                    row.jax_status = "MISMATCH" if (jbad is not None or row.jax_status == "MISMATCH") else "ok"
        if k == 0:
            compare_routers(files, view, routers, inputs, outputs, rows)
    rows[("num_tokens", 0, "num_tokens")] = compare_tokens(files, view)
    experts = any(p.layout.expert for p in vparams.values()) or bool(routers)
    return step_report(meta0, step, world, view, list(rows.values()), experts=experts, force=force,
                       jax=bool(use_jax and not scatter))


def _inputs(files: list[RankFile], view: View, scen: Scenario, per_rank: list[dict[int, str]], num_chunks: int
            ) -> tuple[list[RankData], list[RankData], list[dict[Key, np.ndarray]]]:
    """(inputs, |inputs|, recorded outputs) per reference rank for one scenario."""
    keys = [(c, p.name) for c in range(num_chunks) for p in scen.params]
    names = {p.name for p in scen.params}
    inputs, absolute, recorded = [], [], []
    for v in range(len(files)):
        f = files[view.actual[v]]
        grads: dict[Key, np.ndarray | None] = {k: None for k in keys}
        after: dict[Key, np.ndarray] = {}
        for i, p in enumerate(f.meta["params"]):
            vname = per_rank[f.rank][i]
            if vname not in names:
                continue
            key = (p["chunk"], vname)
            if p["has_grad"]:
                grads[key] = _param_values(f, i, "before").astype(np.float32)
            after[key] = _param_values(f, i, "after")
        routers = {}
        index = {(r["chunk"], r["name"]): i for i, r in enumerate(f.meta["routers"])}
        for layout in scen.routers:
            for c in range(num_chunks):
                i = index.get((c, layout.name))
                routers[(c, layout.name)] = router_state(f if i is not None else None, i, layout, "before")
        before = f.meta["num_tokens"]["before"]
        tokens = None if before is None else int(before)
        inputs.append(RankData(grads, routers, tokens))
        absolute.append(RankData({k: None if g is None else np.abs(g) for k, g in grads.items()},
                                 {k: dataclasses.replace(s) for k, s in routers.items()}, tokens))
        recorded.append(after)
    return inputs, absolute, recorded


def _param_values(f: RankFile, i: int, when: str) -> np.ndarray:
    """Parameter ``i``'s sampled values (``when``: "before" or "after"), float64."""
    p = f.meta["params"][i]
    start = sum(q["samples"] for q in f.meta["params"][:i])
    return np.asarray(f.arrays[f"grad_{when}"][start:start + p["samples"]], dtype=np.float64)

