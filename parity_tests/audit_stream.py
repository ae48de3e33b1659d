"""The streamed replay of one step: block by block of parameters, in bounded memory.

Gives the rows of :func:`parity_tests.audit_whole.replay_step` (the same verdicts,
differences and details) while holding only one block's values of every rank at a time
(:mod:`parity_tests.audit_blocks`): per block, the reference runs on the block's groups,
the recorded values are compared with its outputs on all ranks at once (numpy, no loop
per rank and parameter), and only comparisons that change a row's verdict (a value
outside the tolerance, a gradient gone, an unverified DDP shard, NaN or inf) are
replayed one by one, in the order of the whole-load replay.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import numpy as np

from parity_tests.audit_blocks import BlockValues, Group, StepTables, group_key, plan_blocks, read_block, shard_bounds
from parity_tests.audit_compare import (
    EPS, Row, compare_matrix, compare_routers, compare_tokens, compare_values, step_report, tolerance,
)
from parity_tests.audit_files import read_rank_file
from parity_tests.audit_index import RankIndex
from parity_tests.audit_sampled import run_jax, sampled_reference
from parity_tests.audit_view import View, build_view, check_positions, global_params, router_layouts, router_state
from parity_tests.audit_whole import replay_step as replay_whole_step
from parity_tests.scenarios import RankData, RouterLayout, Scenario

#: Values (over all ranks) per block: about 100 MB of arrays at a time at most.
BLOCK_VALUES = 1 << 21
_UNVERIFIED = "Megatron DDP reduce-scatter: its shard layout is not recorded"


@dataclasses.dataclass
class _Step:
    """What every block of one step needs.

    Args:
      records, view, tables: the step's records by rank, global view and tables.
      tokens: ``num_tokens`` before, per reference rank.
      force, scatter, ddp_scatter: ``force_all_reduce``; a distributed optimizer's
        reduce-scatter applies; and some chunks are Megatron DDP ones under it.
      use_jax: the JAX oracle runs too.
    """

    records: list[RankIndex]
    view: View
    tables: StepTables
    tokens: list[int | None]
    force: bool
    scatter: bool
    ddp_scatter: bool
    use_jax: bool


def replay_step(records: list[RankIndex], use_jax: bool = False, budget: int = BLOCK_VALUES) -> dict[str, Any]:
    """Replay one step, a block of parameters at a time.

    Args:
      records: the step's records by rank (:func:`parity_tests.audit_index.scan`).
      use_jax: also run the JAX oracle (then one block per dtype, no groups).
      budget: values per block over all ranks (0: one block per dtype).

    Returns:
      The whole-load replay's JSON-able dict: step, layout, rows and the verdict.
    """
    meta0 = records[0].meta
    view = build_view(records)
    force = bool(meta0["force_all_reduce"])
    vparams, per_rank = global_params(records)
    check_positions(records, per_rank)
    routers = router_layouts(records)
    num_chunks = max(f.meta["num_chunks"] for f in records)
    tables = StepTables(records, view, vparams, per_rank, num_chunks)
    if not tables.streamable:  # one parameter twice in a chunk, or of different sample counts
        cache: dict[Any, Any] = {}
        return replay_whole_step([read_rank_file(os.path.dirname(f.path), f.path, int(meta0["step"]), f.rank, cache)
                                  for f in records], use_jax)
    scatter = bool(view.config.get("use_distributed_optimizer")) and not force
    tokens = [None if records[view.actual[v]].meta["num_tokens"]["before"] is None
              else int(records[view.actual[v]].meta["num_tokens"]["before"]) for v in range(len(records))]
    st = _Step(records, view, tables, tokens, force, scatter, scatter and any(any(f.meta["ddp_chunks"]) for f in records),
               use_jax and not scatter)
    rows: dict[tuple[str, int, str], Row] = {}
    dtypes = sorted({p.dtype for p in vparams.values()}) or ["float32"]
    for k, dtype in enumerate(dtypes):
        _add_rows(st, per_rank, dtype, rows)
        every = _scenario(st, f"audit-step{meta0['step']}-{dtype}", dtype, [p.layout for p in vparams.values() if p.dtype == dtype])
        shards = shard_bounds(tables, dtype, every) if scatter else None
        for groups in plan_blocks(tables, dtype, 0 if st.use_jax else budget, merge=not st.use_jax):
            _replay_block(st, dtype, groups, shards, rows)
        if k == 0 and routers:
            _replay_routers(st, routers, rows)
    rows[("num_tokens", 0, "num_tokens")] = compare_tokens(records, view)
    experts = any(p.layout.expert for p in vparams.values()) or bool(routers)
    return step_report(meta0, meta0["step"], len(records), view, list(rows.values()), experts=experts, force=force,
                       jax=bool(use_jax and not scatter))


def _scenario(st: _Step, name: str, dtype: str, params: list[Any], routers: tuple[RouterLayout, ...] = ()) -> Scenario:
    """A reference scenario of the step's mesh and config."""
    sz = st.view.sizes
    return Scenario(name, pp=sz["pp"], dp=sz["dp"], cp=sz["cp"], tp=sz["tp"], gtp=sz["gtp"], ep=sz["ep"], etp=1,
                    egtp=sz["egtp"], num_chunks=st.tables.num_chunks, params=tuple(params), routers=routers,
                    config=dict(st.view.config), dtype=dtype if dtype in ("float32", "bfloat16", "float16") else "float32",
                    mode="random")


def _add_rows(st: _Step, per_rank: list[dict[int, str]], dtype: str, rows: dict[Any, Row]) -> None:
    """The dtype's parameter rows, in the whole-load replay's order (reference ranks, then
    the rank's parameters; a rank whose parameter list was seen adds none)."""
    seen: set[int] = set()
    vparams = st.tables.vparams
    for v in range(len(st.records)):
        f = st.records[st.view.actual[v]]
        if id(f.meta["params"]) in seen:
            continue
        seen.add(id(f.meta["params"]))
        for i, p in enumerate(f.meta["params"]):
            vname = per_rank[f.rank][i]
            if vparams[vname].dtype == dtype and ("param", p["chunk"], vname) not in rows:
                rows[("param", p["chunk"], vname)] = Row("param", p["chunk"], " | ".join(sorted(vparams[vname].labels)))


def _replay_block(st: _Step, dtype: str, groups: list[Group], shards: Any, rows: dict[Any, Row]) -> None:
    """Read one block, run the reference (values and |values|) on it, compare, into ``rows``."""
    values = read_block(st.tables, groups, shards)
    world = len(st.records)
    scen = _scenario(st, f"audit-block-{dtype}", dtype, [g.layout for g in groups])
    slots = [(g, c) for g in range(len(groups)) for c in range(st.tables.num_chunks)]
    grads: list[dict[Any, np.ndarray | None]] = [{group_key(groups, s): None for s in slots} for _ in range(world)]
    for s, ranks in values.ranks.items():
        for w, v in enumerate(ranks):
            grads[v][group_key(groups, s)] = values.before[s][w]
    inputs = [RankData(g, {}, st.tokens[v]) for v, g in enumerate(grads)]
    owned = {(int(v), group_key(groups, s)): o[w] for s, o in values.owned.items() if o is not None
             for w, v in enumerate(values.ranks[s])}
    shard = (lambda rank, key, expert: owned.get((rank, key)))
    outputs, touched = sampled_reference(scen, inputs, st.force, shard)
    absolute = [RankData({k: None if g is None else np.abs(g) for k, g in d.items()}, {}, d_tokens)
                for d, d_tokens in zip(grads, st.tokens)]
    bounds, _ = sampled_reference(scen, absolute, st.force, shard)
    del absolute
    jax_out = run_jax(scen, inputs, st.view, st.force) if st.use_jax else None
    hit = {name: {t[2] for t in keys if t[1] == "grad"} for name, keys in touched.items()}
    for s in slots:
        key = group_key(groups, s)
        steps = [name for name, keys in hit.items() if key in keys]
        for m in groups[s[0]].members:
            row = rows.get(("param", s[1], st.tables.names[m]))
            if row is not None and not row.steps:
                row.steps.extend(steps)
    for s in values.ranks:
        _compare_slot(st, dtype, groups, s, values, inputs, outputs, bounds, jax_out, rows)


def _compare_slot(st: _Step, dtype: str, groups: list[Group], s: tuple[int, int], values: BlockValues,
                  inputs: list[RankData], outputs: list[RankData], bounds: list[RankData],
                  jax_out: dict[Any, np.ndarray] | None, rows: dict[Any, Row]) -> None:
    """One (group, chunk): every rank's recorded values against the reference's, per member."""
    key = group_key(groups, s)
    ranks = values.ranks[s]
    world = len(st.records)
    got = values.after[s]
    want = np.stack([outputs[v].grads[key] for v in ranks])
    bound = np.stack([bounds[v].grads[key] for v in ranks])
    d, bad, nonfinite = compare_matrix(got, want, bound, EPS.get(dtype, 2.0**-23), world)
    recs = [st.records[st.view.actual[v]] for v in ranks]
    unverified = np.array([st.ddp_scatter and bool(f.meta["ddp_chunks"][s[1]]) for f in recs], dtype=bool)
    group = groups[s[0]]
    for j, m in enumerate(group.members):
        row = rows[("param", s[1], st.tables.names[m])]
        lo, hi = group.offsets[j], group.offsets[j] + int(st.tables.samples[m])
        params = values.params[s][:, j]
        gone = ~st.tables.has_after[m * st.tables.num_chunks + s[1], ranks] & ~unverified
        compared = ~unverified & ~gone
        row.ranks += int((~unverified).sum())
        seg_d = d[:, lo:hi]
        diffs = seg_d.max(axis=1) if hi > lo else np.zeros(len(ranks))
        if compared.any():
            row.max_abs_diff = max(row.max_abs_diff, float(diffs[compared].max()))
        seg_bad = bad[:, lo:hi].any(axis=1) & compared
        seg_nonfinite = nonfinite[:, lo:hi].any(axis=1) & compared
        for w in np.flatnonzero(unverified | gone | seg_bad | seg_nonfinite):
            f, i = recs[w], int(params[w])
            if unverified[w]:
                row.status = "unverified" if row.status == "ok" else row.status
                row.detail = row.detail or _UNVERIFIED
                continue
            if gone[w]:
                row.worse(math.inf, True, f"rank {f.rank}: the gradient is gone after finalize")
                continue
            start = int(st.tables.table(f).start[i])
            detail = ""
            if seg_bad[w]:
                b = int(np.argmax(bad[w, lo:hi]))
                detail = (f"rank {f.rank}, flat index {int(f.arrays['positions'][start + b])}: recorded "
                          f"{float(got[w, lo + b])!r}, expected {float(want[w, lo + b])!r} "
                          f"(before: {float(values.before[s][w, lo + b])!r})")
            row.worse(float(diffs[w]), bool(seg_bad[w]), detail)
            if seg_nonfinite[w]:
                where = [st.view.actual[int(u)] for u, x in zip(ranks, values.before[s][:, lo:hi])
                         if not np.isfinite(x).all()]
                odd = int(np.flatnonzero(~np.isfinite(np.asarray(bound[w, lo:hi], np.float64)))[0])
                row.nonfinite(f"the recorded before values hold NaN/inf (rank{'s' if len(where) != 1 else ''} "
                              f"{where if len(where) != 1 else where[0]}): rank {f.rank}, flat index "
                              f"{int(f.arrays['positions'][start + odd])} expects {float(want[w, lo + odd])!r}; "
                              "such a step cannot be verified (compared exactly)")
        if jax_out is not None and key in jax_out:
            for w in np.flatnonzero(compared):
                tol, _ = tolerance(EPS.get(dtype, 2.0**-23), world, bound[w, lo:hi])
                jd, jbad = compare_values(got[w, lo:hi], jax_out[key][ranks[w]][lo:hi], tol)
                row.jax_max_abs_diff = max(row.jax_max_abs_diff or 0.0, jd)
                row.jax_status = "MISMATCH" if (jbad is not None or row.jax_status == "MISMATCH") else "ok"


def _replay_routers(st: _Step, routers: dict[str, RouterLayout], rows: dict[Any, Row]) -> None:
    """The routers' buffers: the reference on the routers alone, compared (their rows follow
    the first dtype's parameters, as in the whole-load replay)."""
    c = st.tables.num_chunks
    inputs = []
    for v in range(len(st.records)):
        f = st.records[st.view.actual[v]]
        index = {(r["chunk"], r["name"]): i for i, r in enumerate(f.meta["routers"])}
        state = {}
        for layout in routers.values():
            for chunk in range(c):
                i = index.get((chunk, layout.name))
                state[(chunk, layout.name)] = router_state(f if i is not None else None, i, layout, "before")
        inputs.append(RankData({}, state, st.tokens[v]))
    first = sorted({p.dtype for p in st.tables.vparams.values()}) or ["float32"]
    scen = _scenario(st, "audit-routers", first[0], [], tuple(routers.values()))
    outputs, _ = sampled_reference(scen, inputs, st.force, lambda *a: None)
    compare_routers(st.records, st.view, routers, inputs, outputs, rows)
