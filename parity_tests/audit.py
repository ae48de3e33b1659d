"""``python -m parity_tests audit DIR``: replay recorded finalize steps against the reference.

Every rank of an audited run wrote, per step, one ``.npz`` file (``torch_impl.audit``):
the gradient values at sampled flat positions before and after finalize, router buffers
and ``num_tokens``; and once per plan a ``plan.*.npz`` file its step files refer to: its
groups, config, parameters and the sampled positions. This module loads all ranks' files,
rebuilds the global view (a mesh whose ranks are the recorded ones, in the reference's
order), runs the independent numpy reference (:mod:`parity_tests.reference`) on the
sampled "before" values and compares its outputs with the recorded "after" values, per
step and parameter; ``--jax`` also runs the JAX oracle on the same inputs.

The reference works elementwise, so sampled elements are enough, with two additions made
here: the reduce-scatter layout of a distributed optimizer (meshgrad's documented layout,
applied to the sampled positions from each gradient's full size and order), and the
tolerance, per element, from a second reference run on absolute values (the bound on the
magnitudes a rounding error scales with).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from parity_tests import reference as ref
from parity_tests.scenarios import Key, ParamLayout, RankData, RouterLayout, RouterState, Scenario, to_dtype

FORMAT_VERSION = 2
ROUTER_FIELDS = ("local_tokens_per_expert", "expert_bias", "qb_beta", "qb_beta_accum", "qb_beta_count")
FLAGS = ("sequence_parallel", "average_gradients_across_tp_domain", "pipeline_parallel",
         "flextron_router_pp_sync", "is_gtp_weight_remat")
_FILE = re.compile(r"^step(\d+)\.rank(\d+)\.npz$")
#: Unit roundoff-like spacing per gradient dtype (float64 is compared at the reference's float32).
_EPS = {"float32": 2.0**-23, "float64": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10}
#: Group name -> (axes, view) of the reference mesh it must equal.
_GROUP_AXES = {
    "tp": (("tp",), "dense"),
    "pp": (("pp",), "dense"),
    "dp_cp": (("dp", "cp"), "dense"),
    "expt_dp": (("edp",), "expert"),
    "tp_dp_cp": (("dp", "cp", "tp"), "dense"),
    "gtp_remat": (("gtp",), "dense"),
    "expt_gtp_remat": (("egtp",), "expert"),
    "dp_cp_gtp_remat": (("dp", "cp", "gtp"), "dense"),
}


class AuditError(ValueError):
    """The recorded files cannot be replayed (missing ranks, mixed steps, bad layout)."""


# =========================================================================== loading


@dataclasses.dataclass
class RankFile:
    """One rank's record of one step."""

    path: str
    meta: dict[str, Any]
    arrays: dict[str, np.ndarray]

    @property
    def rank(self) -> int:
        return int(self.meta["rank"])


def _read_npz(path: str) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


def _json(array: np.ndarray) -> Any:
    return json.loads(array.tobytes().decode())


def _read_plan(directory: str, rank: int, plan: str, cache: dict[tuple[int, str], tuple[dict[str, Any], np.ndarray]]
               ) -> tuple[dict[str, Any], np.ndarray]:
    """(static facts, sampled positions) of one rank's plan file."""
    key = (rank, plan)
    if key not in cache:
        path = os.path.join(directory, f"plan.rank{rank:05d}.{plan}.npz")
        if not os.path.isfile(path):
            raise AuditError(f"{path}: missing (the step files of rank {rank} refer to it; copy the plan.* files "
                             "along with the step files)")
        try:
            arrays = _read_npz(path)
            static = _json(arrays["plan"])
            positions = np.asarray(arrays["positions"], dtype=np.int64)
        except Exception as err:
            raise AuditError(f"{path}: not a readable audit plan file ({type(err).__name__}: {err})") from None
        if static.get("format") != FORMAT_VERSION or static.get("rank") != rank:
            raise AuditError(f"{path}: format {static.get('format')!r} rank {static.get('rank')!r}, "
                             f"expected format {FORMAT_VERSION} rank {rank}")
        if positions.size != sum(p["samples"] for p in static["params"]):
            raise AuditError(f"{path}: {positions.size} sampled positions for {sum(p['samples'] for p in static['params'])} samples")
        cache[key] = (static, positions)
    return cache[key]


def _rank_file(directory: str, path: str, step: int, rank: int, cache: dict[Any, Any]) -> RankFile:
    """One step file merged with its plan: ``meta`` (plan facts and step facts, per
    parameter ``has_grad`` / ``has_grad_after``) and arrays ``grad_before``,
    ``grad_after``, ``positions``, ``router{i}.{field}.before`` / ``.after``."""
    try:
        arrays = _read_npz(path)
        meta = _json(arrays.pop("meta"))
    except Exception as err:
        raise AuditError(f"{path}: not a readable audit file ({type(err).__name__}: {err})") from None
    if meta.get("format") != FORMAT_VERSION:
        raise AuditError(f"{path}: format {meta.get('format')!r}, this replay reads format {FORMAT_VERSION}")
    if int(meta["step"]) != step or int(meta["rank"]) != rank:
        raise AuditError(f"{path}: the file holds step {meta['step']} rank {meta['rank']}, its name says step {step} rank {rank}")
    static, positions = _read_plan(directory, rank, str(meta["plan"]), cache)
    params = [dict(p) for p in static["params"]]
    try:
        before = np.asarray(arrays["grads_before"], dtype=np.float64)
        after = np.asarray(arrays["grads_after"], dtype=np.float64)
        has = np.asarray(arrays["has_grad"], dtype=bool)
        if before.shape != (positions.size,) or after.shape != before.shape or has.shape != (2, len(params)):
            raise ValueError(f"grads {before.shape} / {after.shape}, has_grad {has.shape} do not fit the plan's "
                             f"{positions.size} samples of {len(params)} parameters")
        out = {"grad_before": before, "grad_after": after, "positions": positions}
        for when, fields in (("before", static["router_fields"]), ("after", meta.get("router_fields_after", static["router_fields"]))):
            flat = np.asarray(arrays.get(f"routers_{when}", np.zeros(0)), dtype=np.float64)
            start = 0
            for index, field, shape in fields:
                n = int(np.prod(shape, dtype=np.int64))
                out[f"router{index}.{field}.{when}"] = flat[start:start + n].reshape(shape)
                start += n
            if start != flat.size:
                raise ValueError(f"routers_{when} holds {flat.size} values, its fields {start}")
    except (KeyError, ValueError) as err:
        raise AuditError(f"{path}: does not fit its plan file ({type(err).__name__}: {err})") from None
    for p, before, after in zip(params, has[0], has[1]):
        p["has_grad"], p["has_grad_after"] = bool(before), bool(after)
    merged = {k: v for k, v in static.items() if k not in ("params", "format", "rank")}
    merged.update(meta)
    merged["params"] = params
    return RankFile(path, merged, out)


def load(directory: str) -> dict[int, list[RankFile]]:
    """All steps' files, per step ordered by rank.

    Raises:
      AuditError: no files, unreadable files, a plan file missing, a rank missing from a
        step, files from different steps or runs (world sizes differ), a file whose name
        and content disagree.
    """
    if not os.path.isdir(directory):
        raise AuditError(f"{directory}: not a directory")
    found: dict[int, dict[int, RankFile]] = {}
    cache: dict[Any, Any] = {}
    for name in sorted(os.listdir(directory)):
        match = _FILE.match(name)
        if not match:
            continue
        step, rank = int(match.group(1)), int(match.group(2))
        found.setdefault(step, {})[rank] = _rank_file(directory, os.path.join(directory, name), step, rank, cache)
    if not found:
        raise AuditError(f"{directory}: no audit files (stepNNNNNNNN.rankNNNNN.npz)")
    worlds = {f.meta["world_size"] for files in found.values() for f in files.values()}
    if len(worlds) > 1:
        raise AuditError(f"{directory}: files from runs of different world sizes {sorted(worlds)}")
    world = worlds.pop()
    _check_complete(directory, found, world)
    steps = {s: [files[r] for r in range(world)] for s, files in sorted(found.items())}
    for files in steps.values():
        _check_one_run(files)
    return steps


def _check_complete(directory: str, found: dict[int, dict[int, RankFile]], world: int) -> None:
    """Every step has every rank's file.

    Raises:
      AuditError: naming each missing rank and the steps it is missing from; "files from
        different steps" only when no rank has files of more than one step (each rank's
        files come from another step).
    """
    incomplete = {s: sorted(set(range(world)) - set(files)) for s, files in found.items() if len(files) != world}
    if not incomplete:
        return
    have = {s: sorted(files) for s, files in found.items()}
    steps_of = {r: [s for s in sorted(found) if r in found[s]] for r in range(world)}
    if len(found) > 1 and all(len(s) <= 1 for s in steps_of.values()):
        raise AuditError(
            f"{directory}: files from different steps: ranks per step {have}; every step needs all {world} ranks"
        )
    missing: dict[int, list[int]] = {}
    for s, ranks in incomplete.items():
        for r in ranks:
            missing.setdefault(r, []).append(s)
    lines = "; ".join(f"rank {r} missing from step{'s' if len(ss) > 1 else ''} {ss if len(ss) > 1 else ss[0]}"
                      + (" (no file of this rank at all)" if not steps_of[r] else "")
                      for r, ss in sorted(missing.items()))
    per_step = "; ".join(f"step {s}: missing ranks {m}" for s, m in sorted(incomplete.items()))
    raise AuditError(f"{directory}: world of {world} ranks: {lines} ({per_step}; each step needs the "
                     "stepSSSSSSSS.rankRRRRR.npz file of every rank)")


def _check_one_run(files: list[RankFile]) -> None:
    """All files of a step come from one recording (the same run id).

    Raises:
      AuditError: naming the ranks and files whose run id differs from most ranks'.
    """
    ids: dict[Any, list[RankFile]] = {}
    for f in files:
        ids.setdefault(f.meta.get("run"), []).append(f)
    if len(ids) <= 1:
        return
    main_id = max(ids, key=lambda k: (len(ids[k]), str(k)))
    odd = [f for k, fs in ids.items() if k != main_id for f in fs]
    names = "; ".join(f"rank {f.rank}: {f.path} (run {f.meta.get('run')!r})" for f in odd[:8])
    more = f" and {len(odd) - 8} more" if len(odd) > 8 else ""
    raise AuditError(
        f"step {files[0].meta['step']}: files of different recordings mixed: {len(ids[main_id])} of {len(files)} ranks "
        f"are from run {main_id!r}, these are not: {names}{more} (replace them with the files of the same run)"
    )


# =========================================================================== global view


@dataclasses.dataclass
class View:
    """The global view of one step: the reference mesh and how recorded ranks map onto it.

    Args:
      mesh: the reference mesh.
      sizes: its axis sizes by name.
      virtual: recorded rank -> reference rank.
      actual: reference rank -> recorded rank.
      config: reference config values.
      embd, pos: pp stage sets of the embedding groups.
    """

    mesh: ref.Mesh
    sizes: dict[str, int]
    virtual: list[int]
    actual: list[int]
    config: dict[str, Any]


def _index(members: list[int], rank: int) -> int:
    return sorted(members).index(rank)


def build_view(files: list[RankFile]) -> View:
    """Rebuild the mesh from the recorded groups and check every group against it.

    Raises:
      AuditError: a layout that does not match the world, or configs that differ.
    """
    world = len(files)
    lay0 = files[0].meta["layout"]
    size = {g: len(lay0["members"][g]) for g in ("pp", "tp", "dp_cp", "gtp_remat", "expt_gtp_remat")}
    for f in files:
        for g, n in size.items():
            got = len(f.meta["layout"]["members"][g])
            if got != n:
                raise AuditError(f"{f.path}: rank {f.rank}'s {g!r} group has {got} members, rank 0's has {n}")
    pp, tp, dpcp, gtp, egtp = size["pp"], size["tp"], size["dp_cp"], size["gtp_remat"], size["expt_gtp_remat"]
    if pp * dpcp * gtp * tp != world:
        raise AuditError(
            f"layout does not match the world: pp {pp} x dp_cp {dpcp} x gtp {gtp} x tp {tp} = "
            f"{pp * dpcp * gtp * tp} ranks, the run has {world}"
        )
    cfg_sizes = files[0].meta["config"]["sizes"]
    cp = cfg_sizes.get("context_parallel_size", 1)
    cp = cp if cp >= 1 and dpcp % cp == 0 else 1
    inner = dpcp * gtp * tp
    if "expt_dp" not in lay0["missing"]:
        edp = len(lay0["members"]["expt_dp"])
    else:
        ep = cfg_sizes.get("expert_model_parallel_size", 1)
        etp = cfg_sizes.get("expert_tensor_parallel_size", tp)
        edp = inner // (ep * etp * egtp) if inner % (ep * etp * egtp) == 0 else dpcp
    if inner % (edp * egtp):
        raise AuditError(f"layout does not match the world: expert data parallel {edp} x egtp {egtp} does not divide {inner}")
    sizes = dict(pp=pp, dp=dpcp // cp, cp=cp, gtp=gtp, tp=tp, edp=edp, egtp=egtp, ep=inner // (edp * egtp), etp=1)
    mesh = ref.Mesh(**sizes)
    virtual = [0] * world
    for f in files:
        m, r = f.meta["layout"]["members"], f.rank
        try:
            stage = m["pp"].index(r)
            virtual[r] = ((stage * dpcp + _index(m["dp_cp"], r)) * gtp + _index(m["gtp_remat"], r)) * tp + _index(m["tp"], r)
        except ValueError:
            raise AuditError(f"{f.path}: rank {r} is not a member of its own pp / dp_cp / gtp / tp group") from None
    if sorted(virtual) != list(range(world)):
        raise AuditError("layout does not match the world: the recorded pp / dp_cp / tp groups do not tile the ranks")
    actual = [0] * world
    for r, v in enumerate(virtual):
        actual[v] = r
    for f in files:
        lay, r = f.meta["layout"], f.rank
        for g, (axes, view) in _GROUP_AXES.items():
            members = lay["members"][g]
            if g in lay["missing"] or len(members) <= 1:
                continue
            want = next(grp for grp in mesh.groups(axes, view) if virtual[r] in grp)
            got = sorted(virtual[x] for x in members)
            if got != sorted(want):
                raise AuditError(
                    f"layout does not match the world: rank {r}'s {g!r} group {sorted(members)} is not a "
                    f"group varying {'/'.join(axes)} of the mesh {sizes} (expected ranks {sorted(actual[x] for x in want)})"
                )
    config = _config(files)
    for name, group in (("embedding_stages", "embd"), ("position_embedding_stages", "pos_embd")):
        config[name] = list(_stages(files, group, virtual, mesh))
    config["share_embeddings_and_output_weights"] = True  # the recorded roles decide (word_embedding step)
    return View(mesh, sizes, virtual, actual, config)


def _stages(files: list[RankFile], group: str, virtual: list[int], mesh: ref.Mesh) -> tuple[int, ...]:
    """The pp stage set of an embedding group, the same from every member."""
    found: set[tuple[int, ...]] = set()
    for f in files:
        members = f.meta["layout"]["members"][group]
        if not members:
            continue
        coords = [mesh.coords(virtual[m], "dense") for m in members]
        base = {k: v for k, v in mesh.coords(virtual[f.rank], "dense").items() if k != "pp"}
        if any({k: v for k, v in c.items() if k != "pp"} != base for c in coords):
            raise AuditError(f"layout does not match the world: rank {f.rank}'s {group!r} group {members} spans more than its pp column")
        found.add(tuple(sorted(c["pp"] for c in coords)))
    if len(found) > 1:
        raise AuditError(f"layout does not match the world: the {group!r} groups cover different pp stages {sorted(found)}")
    stages = found.pop() if found else ()
    for f in files:
        stage = mesh.coords(virtual[f.rank], "dense")["pp"]
        if not f.meta["layout"]["members"][group] and stage in stages:
            raise AuditError(f"layout does not match the world: rank {f.rank} (pp stage {stage}) is outside the {group!r} group of its stage")
    return stages


def _config(files: list[RankFile]) -> dict[str, Any]:
    first = files[0].meta["config"]["finalize"]
    for f in files[1:]:
        other = f.meta["config"]["finalize"]
        diff = sorted(k for k in set(first) | set(other) if first.get(k) != other.get(k))
        if diff:
            raise AuditError(f"{f.path}: config differs from rank 0's in {diff}")
        if f.meta["force_all_reduce"] != files[0].meta["force_all_reduce"]:
            raise AuditError(f"{f.path}: force_all_reduce differs from rank 0's")
    return {k: first[k] for k in ref.CONFIG_DEFAULTS if k in first}


# =========================================================================== inputs


@dataclasses.dataclass
class Param:
    """A parameter of the global view (one name, flags and dtype; any rank and chunk)."""

    vname: str
    layout: ParamLayout
    dtype: str
    labels: set[str]


def _vparams(files: list[RankFile]) -> tuple[dict[str, Param], list[dict[int, str]]]:
    """Global parameters, and per rank its parameter index -> global name.

    Word / position embeddings (by role) share one name across stages; a name with other
    flags or dtype on some rank becomes a separate parameter (``name#2``).
    """
    out: dict[str, Param] = {}
    sigs: dict[tuple[Any, ...], str] = {}
    per_rank: list[dict[int, str]] = []
    for f in files:
        names: dict[int, str] = {}
        for i, p in enumerate(f.meta["params"]):
            base = {"word_embedding": "[word embedding]", "position_embedding": "[position embedding]"}.get(p["role"], p["name"])
            sig = (base, p["expert"], p["dtype"], p["role"], tuple(p[k] for k in FLAGS))
            vname = sigs.get(sig)
            if vname is None:
                vname = base
                k = 2
                while vname in out:
                    vname, k = f"{base}#{k}", k + 1
                sigs[sig] = vname
                layout = ParamLayout(vname, (p["samples"],), expert=p["expert"], role=p["role"],
                                     **{k2: p[k2] for k2 in FLAGS})
                out[vname] = Param(vname, layout, p["dtype"], set())
            out[vname].labels.add(p["name"])
            names[i] = vname
        per_rank.append(names)
    return out, per_rank


def _check_positions(files: list[RankFile], per_rank: list[dict[int, str]]) -> None:
    """Every rank sampled the same flat positions of a parameter of one size (the reference
    adds the sampled elements of different ranks position by position; an embedding is
    one parameter across chunks and stages).

    Raises:
      AuditError: naming the parameter and the ranks that disagree.
    """
    seen: dict[tuple[Any, ...], tuple[int, np.ndarray]] = {}
    for f in files:
        start = 0
        for i, p in enumerate(f.meta["params"]):
            pos = f.arrays["positions"][start:start + p["samples"]]
            start += p["samples"]
            chunk = p["chunk"] if p["role"] == "none" else None
            first = seen.setdefault((chunk, per_rank[f.rank][i], p["numel"]), (f.rank, pos))
            if not np.array_equal(first[1], pos):
                raise AuditError(
                    f"parameter {p['name']!r} (chunk {p['chunk']}): rank {f.rank} sampled other positions than "
                    f"rank {first[0]} ({pos[:3].tolist()}... vs {first[1][:3].tolist()}...): the elements cannot be "
                    "matched (files from recorders with different sample sizes?)")


def _router_layouts(files: list[RankFile]) -> dict[str, RouterLayout]:
    """One RouterLayout per router name (the reference applies it to every chunk)."""
    out: dict[str, RouterLayout] = {}
    for f in files:
        for i, r in enumerate(f.meta["routers"]):
            has = {fld: f"router{i}.{fld}.before" in f.arrays for fld in ROUTER_FIELDS}
            layout = RouterLayout(
                r["name"], r["num_experts"], training=r["training"], frozen_expert_bias=r["frozen_expert_bias"],
                has_expert_bias=has["expert_bias"],
                has_qb_beta=has["qb_beta"] and has["qb_beta_accum"] and has["qb_beta_count"],
                has_aux_loss_tracker=r["has_aux_loss_tracker"],
            )
            key = r["name"]
            if out.setdefault(key, layout) != layout:
                raise AuditError(f"{f.path}: router {r['name']!r} (chunk {r['chunk']}) differs from another rank's: {layout} vs {out[key]}")
    return out


def _router_state(f: RankFile | None, index: int | None, layout: RouterLayout, when: str) -> RouterState:
    e = layout.num_experts
    values = {}
    for fld in ROUTER_FIELDS:
        name = f"router{index}.{fld}.{when}"
        if f is not None and name in f.arrays:
            values[fld] = np.asarray(f.arrays[name], dtype=np.float32)
        else:
            values[fld] = np.zeros(() if fld == "qb_beta_count" else (e,), np.float32)
    return RouterState(**values)


def _param_values(f: RankFile, i: int, when: str) -> np.ndarray:
    p = f.meta["params"][i]
    start = sum(q["samples"] for q in f.meta["params"][:i])
    return np.asarray(f.arrays[f"grad_{when}"][start:start + p["samples"]], dtype=np.float64)


# =========================================================================== reference


def _sampled_reference(
    scenario: Scenario, inputs: list[RankData], force: bool, shard: Any
) -> tuple[list[RankData], dict[str, set[Any]]]:
    """The steps of docs/semantics.md (dp_sync ... token_scale), with the reference's step
    functions; under a distributed optimizer the DP sync keeps, at sampled positions outside a rank's own shard, its
    pre-scaled local value (``shard(rank, key, expert) -> owned mask or None``)."""
    cfg = ref.Config.from_scenario(scenario)
    scatter = cfg.use_distributed_optimizer and not force
    if not scatter:
        result = ref.reference_finalize(scenario, inputs, force_all_reduce=force)
        return result.outputs, result.touched
    mesh = ref.Mesh.from_scenario(scenario)
    outputs = [RankData({k: None if g is None else np.array(g, np.float32) for k, g in d.grads.items()},
                        {k: dataclasses.replace(s) for k, s in d.routers.items()}, d.num_tokens) for d in inputs]
    if cfg.check_for_nan_in_grad:
        ref._check_finite(outputs)
    ctx = ref.Context(scenario=scenario, cfg=cfg, mesh=mesh, outputs=outputs)
    local = [dict(o.grads) for o in outputs]
    touched: dict[str, set[Any]] = {"dp_sync": ref.step_dp_sync(ctx, force_all_reduce=True)}
    coll_dtype = None if cfg.grad_reduce_in_fp32 else scenario.dtype
    dp_cp = mesh.dp * mesh.cp
    for p in scenario.params:
        if cfg.calculate_per_token_loss:
            pre = 1.0
        elif cfg.average_in_collective:
            pre = mesh.edp / dp_cp if p.expert else 1.0
        else:
            pre = 1.0 / dp_cp
        for r in range(mesh.world):
            for c in range(scenario.num_chunks):
                key = (c, p.name)
                owned = shard(r, key, p.expert)
                if owned is None or local[r][key] is None:
                    continue
                kept = to_dtype(ref._scale(local[r][key], pre, coll_dtype), scenario.dtype)
                g = ctx.grad(r, key).copy()
                g[~owned] = kept[~owned]
                ctx.set_grad(r, key, g)
    for name in ref.STEPS[1:]:
        touched[name] = getattr(ref, f"step_{name}")(ctx)
    return outputs, touched


def _shard_fn(files: list[RankFile], view: View, per_rank: list[dict[int, str]], scen: Scenario) -> Any:
    """owned(virtual rank, key, expert) for plain chunks under a distributed optimizer, for
    the parameters of ``scen`` (one dtype): meshgrad's layout (docs/semantics.md,
    "Reduce-scatter layout"): per group one shared buffer in plan order without the
    cross-stage-summed gradients (``reference.cross_stage_keys``), then one buffer of its
    own for each of those; shards by global rank."""
    ctx = ref.Context(scenario=scen, cfg=ref.Config.from_scenario(scen), mesh=ref.Mesh.from_scenario(scen), outputs=[])
    alone = ref.cross_stage_keys(ctx)
    names = {p.name for p in scen.params}
    masks: dict[tuple[int, Key], np.ndarray] = {}
    for f in files:
        r, lay, params = f.rank, f.meta["layout"]["members"], f.meta["params"]
        plain = [not d for d in f.meta["ddp_chunks"]]
        starts = np.cumsum([0] + [p["samples"] for p in params])
        for expert, group in ((False, "dp_cp"), (True, "expt_dp")):
            members = lay[group] if group not in f.meta["layout"]["missing"] else [r]
            if len(members) <= 1:
                continue
            chosen = [i for i, p in enumerate(params) if per_rank[r][i] in names and p["expert"] == expert
                      and p["has_grad"] and plain[p["chunk"]]]
            own = [i for i in chosen if (params[i]["chunk"], per_rank[r][i]) in alone]
            buffers = [[i for i in chosen if i not in own]] + [[i] for i in own]
            for buffer in buffers:
                _buffer_masks(f, buffer, view.virtual[r], per_rank[r], len(members), _index(members, r), starts, masks)
    return lambda rank, key, expert: masks.get((rank, key))


def _buffer_masks(f: RankFile, buffer: list[int], vrank: int, names: dict[int, str], n: int, index: int,
                  starts: np.ndarray, masks: dict[tuple[int, Key], np.ndarray]) -> None:
    """The owned sampled elements of one buffer's parameters (indices into the plan's
    params, in buffer order) for the member ``index`` of a group of ``n``."""
    params = f.meta["params"]
    total = sum(params[i]["numel"] for i in buffer)
    s = -(-total // n)
    lo, hi = index * s, min((index + 1) * s, total)
    offset = 0
    for i in buffer:
        p = params[i]
        pos = f.arrays["positions"][starts[i]:starts[i] + p["samples"]] + offset
        masks[(vrank, (p["chunk"], names[i]))] = (pos >= lo) & (pos < hi)
        offset += p["numel"]


# =========================================================================== compare


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


def _tolerance(eps: float, world: int, bound: np.ndarray) -> tuple[np.ndarray, bool]:
    """(per-element tolerance, whether any bound is NaN or inf); where the bound is not
    finite the tolerance is 0 (an exact comparison: ``inf > nan`` is false, so a NaN
    tolerance would pass anything)."""
    tol = eps * (world + 2) * np.abs(np.asarray(bound, np.float64)) + 1e-30
    finite = np.isfinite(tol)
    if finite.all():
        return tol, False
    return np.where(finite, tol, 0.0), True


def _diff(got: np.ndarray, want: np.ndarray, tol: np.ndarray) -> tuple[float, int | None]:
    """(max abs difference, first index outside the tolerance or None); NaN == NaN."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    with np.errstate(invalid="ignore"):
        d = np.where(same, 0.0, np.abs(got - want))
    d = np.nan_to_num(d, nan=np.inf)
    bad = np.flatnonzero(d > tol)
    return (float(d.max()) if d.size else 0.0), (int(bad[0]) if bad.size else None)


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
    vparams, per_rank = _vparams(files)
    _check_positions(files, per_rank)
    routers = _router_layouts(files)
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
        shard = _shard_fn(files, view, per_rank, scen) if scatter else None
        outputs, touched = _sampled_reference(scen, inputs, force, shard or (lambda *a: None))
        bounds, _ = _sampled_reference(scen, absolute, force, shard or (lambda *a: None))
        jax_out = _run_jax(scen, inputs, view, force) if use_jax and not scatter else None
        eps = _EPS.get(dtype, 2.0**-23)
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
                tol, nonfinite = _tolerance(eps, world, bounds[v].grads[key])
                diff, bad = _diff(got, want, tol)
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
                    jd, jbad = _diff(got, jax_out[key][v], tol)
                    row.jax_max_abs_diff = max(row.jax_max_abs_diff or 0.0, jd)
                    row.jax_status = "MISMATCH" if (jbad is not None or row.jax_status == "MISMATCH") else "ok"
        if k == 0:
            _compare_routers(files, view, routers, inputs, outputs, rows)
    rows[("num_tokens", 0, "num_tokens")] = _compare_tokens(files, view)
    out_rows = list(rows.values())
    ok = all(r.status not in FAILING for r in out_rows) and all(r.jax_status != "MISMATCH" for r in out_rows)
    return {
        "step": step,
        "world_size": world,
        "finalize": meta0["finalize"],
        "layout": view.sizes,
        "has_experts": any(p.layout.expert for p in vparams.values()) or bool(routers),
        "rank_map": view.virtual,
        "config": view.config,
        "force_all_reduce": force,
        "jax": bool(use_jax and not scatter),
        "rows": [dataclasses.asdict(r) for r in out_rows],
        "ok": ok,
    }


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
                routers[(c, layout.name)] = _router_state(f if i is not None else None, i, layout, "before")
        before = f.meta["num_tokens"]["before"]
        tokens = None if before is None else int(before)
        inputs.append(RankData(grads, routers, tokens))
        absolute.append(RankData({k: None if g is None else np.abs(g) for k, g in grads.items()},
                                 {k: dataclasses.replace(s) for k, s in routers.items()}, tokens))
        recorded.append(after)
    return inputs, absolute, recorded


def _compare_routers(files: list[RankFile], view: View, layouts: dict[Any, RouterLayout],
                     inputs: list[RankData], outputs: list[RankData], rows: dict[Any, Row]) -> None:
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
                diff, bad = _diff(got.ravel(), want.ravel(), np.full(want.size, eps * scale if finite else 0.0))
                detail = "" if bad is None else (
                    f"rank {f.rank}, element {bad}: recorded {float(got.ravel()[bad])!r}, expected {float(want.ravel()[bad])!r}")
                row.worse(diff, bad is not None, detail)
                if not finite:
                    row.nonfinite(f"rank {f.rank}: the recorded router values hold NaN/inf; such a step cannot be verified")


def _compare_tokens(files: list[RankFile], view: View) -> Row:
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


# =========================================================================== jax


def _run_jax(scen: Scenario, inputs: list[RankData], view: View, force: bool) -> dict[Key, np.ndarray] | None:
    """The JAX oracle on the same sampled inputs (zeros where a rank lacks a gradient)."""
    from jax_impl.mesh import ensure_host_devices

    ensure_host_devices(len(inputs))
    import jax
    import jax.numpy as jnp

    from jax_impl.finalize import finalize_stacked
    from meshgrad import FinalizeConfig, ParallelDims, ParamSpec, RouterSpec
    from meshgrad.params import Role

    sz = view.sizes
    dims = ParallelDims(pp=sz["pp"], dp=sz["dp"], cp=sz["cp"], tp=sz["tp"], gtp=sz["gtp"], ep=sz["ep"], etp=1, egtp=sz["egtp"])
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[scen.dtype]
    params, grads = [], {}
    for c in range(scen.num_chunks):
        for p in scen.params:
            key = (c, p.name)
            values = [d.grads[key] for d in inputs]
            if all(x is None for x in values):
                continue
            n = next(x for x in values if x is not None).shape
            params.append(ParamSpec(name=p.name, chunk=c, shape=n, dtype=scen.dtype, expert=p.expert, role=Role(p.role),
                                    **{k: getattr(p, k) for k in FLAGS}))
            grads[key] = np.stack([np.zeros(n, np.float32) if x is None else x for x in values]).astype(dtype)
    routers, rstate = [], {}
    for c in range(scen.num_chunks):
        for r in scen.routers:
            routers.append(RouterSpec(name=r.name, chunk=c, num_experts=r.num_experts, training=r.training,
                                      has_expert_bias=r.has_expert_bias, frozen_expert_bias=r.frozen_expert_bias,
                                      has_qb_beta=r.has_qb_beta, has_aux_loss_tracker=r.has_aux_loss_tracker))
            rstate[(c, r.name)] = {f: np.stack([getattr(d.routers[(c, r.name)], f) for d in inputs]) for f in ROUTER_FIELDS}
    tokens = None if inputs[0].num_tokens is None else np.asarray([d.num_tokens for d in inputs], np.int32)
    config = FinalizeConfig.from_mapping({k: (tuple(v) if isinstance(v, list) else v) for k, v in scen.config.items()})
    out, _ = finalize_stacked(grads, rstate, tokens, params=params, routers=routers, config=config, dims=dims,
                              devices=jax.devices("cpu")[: dims.world_size], force_all_reduce=force)
    return {k: np.asarray(jnp.asarray(v).astype(jnp.float32)) for k, v in out.items()}


# =========================================================================== CLI


def replay(directory: str, use_jax: bool = False) -> dict[str, Any]:
    """Load and replay every step of ``directory``.

    Returns:
      ``{"directory", "steps": [...], "ok"}``.

    Raises:
      AuditError: the files cannot be replayed.
    """
    steps = load(directory)
    results = [replay_step(files, use_jax) for files in steps.values()]
    return {"directory": directory, "steps": results, "ok": all(s["ok"] for s in results)}


def format_report(result: dict[str, Any]) -> str:
    """The human-readable table of :func:`replay`'s result."""
    lines = []
    for s in result["steps"]:
        expert_axes = ("edp", "egtp", "ep") if s.get("has_experts", True) else ()
        lay = " ".join(f"{'ep*etp' if k == 'ep' else k}{v}" for k, v in s["layout"].items()
                       if v > 1 and k != "etp" and (k not in ("edp", "egtp", "ep") or k in expert_axes)) or "one rank"
        lines.append(f"step {s['step']}: world {s['world_size']} ({lay}), finalize {s['finalize']}")
        width = max([len(f"{r['chunk']}/{r['name']}") for r in s["rows"]] + [20])
        head = f"  {'chunk/parameter':<{width}}  ranks  max|diff|  verdict"
        lines.append(head + ("  jax max|diff|" if s["jax"] else ""))
        for r in s["rows"]:
            label = f"{r['chunk']}/{r['name']}" if r["kind"] != "num_tokens" else "num_tokens"
            line = f"  {label:<{width}}  {r['ranks']:>5}  {r['max_abs_diff']:9.3g}  {r['status']}"
            if s["jax"]:
                line += f"  {'' if r['jax_max_abs_diff'] is None else format(r['jax_max_abs_diff'], '.3g')} {r['jax_status'] or ''}"
            if r["status"] != "ok" or r["detail"]:
                line += f"  [{r['detail']}]" if r["detail"] else ""
            if r["status"] in FAILING and r["steps"]:
                line += f"  (steps touching it: {', '.join(r['steps'])})"
            lines.append(line)
        bad = [r for r in s["rows"] if r["status"] in FAILING or r["jax_status"] == "MISMATCH"]
        counts = {v: sum(1 for r in bad if (r["status"] if r["status"] in FAILING else "MISMATCH") == v) for v in FAILING}
        summary = ", ".join(f"{n} {v}" for v, n in counts.items() if n)
        lines.append(f"step {s['step']}: {'ok' if s['ok'] else summary}"
                     + "".join(f"\n  {r['status'] if r['status'] in FAILING else 'MISMATCH'} step {s['step']} "
                               f"{r['kind']} {r['chunk']}/{r['name']}" for r in bad))
        lines.append("")
    n_bad = sum(not s["ok"] for s in result["steps"])
    lines.append(f"audit {'PASS' if result['ok'] else 'FAIL'}: {len(result['steps'])} step(s), {n_bad} with mismatches")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m parity_tests audit DIR [--jax] [--json PATH]``; exit 0 pass, 1 mismatch,
    2 unreadable records."""
    parser = argparse.ArgumentParser(prog="python -m parity_tests audit",
                                     description="Replay recorded finalize steps (torch_impl.audit) against the numpy reference.")
    parser.add_argument("directory", help="the directory every rank recorded into")
    parser.add_argument("--jax", action="store_true", help="also run the JAX oracle on the same inputs")
    parser.add_argument("--json", metavar="PATH", help="write the result as JSON to PATH ('-' for stdout)")
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.jax:
        from jax_impl.mesh import ensure_host_devices

        try:
            world = next(iter(load(args.directory).values()))[0].meta["world_size"]
            ensure_host_devices(max(world, 1))
        except AuditError:
            pass
    try:
        result = replay(args.directory, use_jax=args.jax)
    except AuditError as err:
        print(f"audit: {err}", file=sys.stderr)
        return 2
    if args.json == "-":
        print(json.dumps(result, indent=1, default=float))
    else:
        print(format_report(result))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(result, fh, indent=1, default=float)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
