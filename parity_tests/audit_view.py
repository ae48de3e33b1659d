"""The global view of one recorded step: the reference mesh rebuilt from the recorded
groups, the parameters matched across ranks, the routers.

Every function here reads only the files' metadata (``meta`` and the sampled
``positions``), never the gradient values, so both the whole-load replay and the
streamed one use them; ranks that share one plan's parameter list (the same object) are
checked once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from parity_tests import reference as ref
from parity_tests.audit_files import FLAGS, ROUTER_FIELDS, AuditError, RankFile
from parity_tests.scenarios import ParamLayout, RouterLayout, RouterState

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


@dataclasses.dataclass
class View:
    """The global view of one step: the reference mesh and how recorded ranks map onto it.

    Args:
      mesh: the reference mesh.
      sizes: its axis sizes by name.
      virtual: recorded rank -> reference rank.
      actual: reference rank -> recorded rank.
      config: reference config values.
    """

    mesh: ref.Mesh
    sizes: dict[str, int]
    virtual: list[int]
    actual: list[int]
    config: dict[str, Any]


def index_in(members: list[int], rank: int) -> int:
    """The index of ``rank`` in its group (members by ascending rank)."""
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
            virtual[r] = ((stage * dpcp + index_in(m["dp_cp"], r)) * gtp + index_in(m["gtp_remat"], r)) * tp + index_in(m["tp"], r)
        except ValueError:
            raise AuditError(f"{f.path}: rank {r} is not a member of its own pp / dp_cp / gtp / tp group") from None
    if sorted(virtual) != list(range(world)):
        raise AuditError("layout does not match the world: the recorded pp / dp_cp / tp groups do not tile the ranks")
    actual = [0] * world
    for r, v in enumerate(virtual):
        actual[v] = r
    _check_groups(files, mesh, sizes, virtual, actual)
    config = _config(files)
    for name, group in (("embedding_stages", "embd"), ("position_embedding_stages", "pos_embd")):
        config[name] = list(_stages(files, group, virtual, mesh))
    config["share_embeddings_and_output_weights"] = True  # the recorded roles decide (word_embedding step)
    return View(mesh, sizes, virtual, actual, config)


def _check_groups(files: list[RankFile], mesh: ref.Mesh, sizes: dict[str, int], virtual: list[int],
                  actual: list[int]) -> None:
    """Every recorded group is the group of the mesh that varies its axes.

    The mesh's groups are computed once per axes; a member list already checked (the same
    object, as the streamed index shares them) is checked again only for the rank's place in it.

    Raises:
      AuditError: naming the rank, the group and the ranks expected.
    """
    by_rank: dict[tuple[tuple[str, ...], str], dict[int, list[int]]] = {}
    checked: dict[tuple[str, int], set[int]] = {}
    for f in files:
        lay, r = f.meta["layout"], f.rank
        for g, (axes, view) in _GROUP_AXES.items():
            members = lay["members"][g]
            if g in lay["missing"] or len(members) <= 1:
                continue
            seen = checked.get((g, id(members)))
            if seen is not None and virtual[r] in seen:
                continue
            if (axes, view) not in by_rank:
                by_rank[(axes, view)] = {x: grp for grp in mesh.groups(axes, view) for x in grp}
            want = by_rank[(axes, view)][virtual[r]]
            got = sorted(virtual[x] for x in members)
            if got != sorted(want):
                raise AuditError(
                    f"layout does not match the world: rank {r}'s {g!r} group {sorted(members)} is not a "
                    f"group varying {'/'.join(axes)} of the mesh {sizes} (expected ranks {sorted(actual[x] for x in want)})"
                )
            checked[(g, id(members))] = set(got)


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
    """The reference config values, the same on every rank.

    Raises:
      AuditError: a rank's config or ``force_all_reduce`` differs from rank 0's.
    """
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


def global_params(files: list[RankFile]) -> tuple[dict[str, Param], list[dict[int, str]]]:
    """Global parameters, and per rank its parameter index -> global name (ranks whose
    ``meta["params"]`` is one shared list share one dict).

    Word / position embeddings (by role) share one name across stages; a name with other
    flags or dtype on some rank becomes a separate parameter (``name#2``).
    """
    out: dict[str, Param] = {}
    sigs: dict[tuple[Any, ...], str] = {}
    per_rank: list[dict[int, str]] = []
    done: dict[int, dict[int, str]] = {}
    for f in files:
        if id(f.meta["params"]) in done:  # the same parameter list as a rank before: the same names
            per_rank.append(done[id(f.meta["params"])])
            continue
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
        done[id(f.meta["params"])] = names
    return out, per_rank


def check_positions(files: list[RankFile], per_rank: list[dict[int, str]]) -> None:
    """Every rank sampled the same flat positions of a parameter of one size (the reference
    adds the sampled elements of different ranks position by position; an embedding is
    one parameter across chunks and stages).

    Raises:
      AuditError: naming the parameter and the ranks that disagree.
    """
    seen: dict[tuple[Any, ...], tuple[int, np.ndarray]] = {}
    done: set[tuple[int, int]] = set()
    for f in files:
        combo = (id(f.meta["params"]), id(f.arrays["positions"]))
        if combo in done:  # the same parameters and positions as a rank before: already matched
            continue
        done.add(combo)
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


def router_layouts(files: list[RankFile]) -> dict[str, RouterLayout]:
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


def router_state(f: RankFile | None, index: int | None, layout: RouterLayout, when: str) -> RouterState:
    """A router's recorded buffers (``when``: "before" or "after"); zeros where absent."""
    e = layout.num_experts
    values = {}
    for fld in ROUTER_FIELDS:
        name = f"router{index}.{fld}.{when}"
        if f is not None and name in f.arrays:
            values[fld] = np.asarray(f.arrays[name], dtype=np.float32)
        else:
            values[fld] = np.zeros(() if fld == "qb_beta_count" else (e,), np.float32)
    return RouterState(**values)
