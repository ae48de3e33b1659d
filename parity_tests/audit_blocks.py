"""How the streamed replay cuts a step into blocks of parameters, and reads one block.

The reference works elementwise and parameter by parameter: parameters of different
names never mix (the chunk copies of one name, and the embeddings across stages, are one
global parameter here). So a step can be replayed a few parameters at a time, holding
every rank's samples of those parameters only; :func:`plan_blocks` chooses blocks of
about ``budget`` values over all ranks. Within a block the parameters that the reference
treats alike (the same flags, role, qk-layernorm naming, and the same ranks and chunks
holding a gradient) are concatenated into one *group*, one parameter of the reference
scenario, so that its Python work per rank does not grow with the number of parameters.

A step whose ranks hold one parameter twice in one chunk, or one parameter with other
sample counts on different ranks, is not streamed (:attr:`StepTables.streamable`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from parity_tests import reference as ref
from parity_tests.audit_files import FLAGS
from parity_tests.audit_index import RankIndex
from parity_tests.audit_view import Param, View, index_in
from parity_tests.scenarios import Key, ParamLayout, Scenario


@dataclasses.dataclass
class PlanTable:
    """One plan's parameters as arrays (the ranks sharing its parameter list share it).

    Args:
      key: per parameter, its global key ``vid * num_chunks + chunk``.
      start, samples, numel, chunk: per parameter, its first sample in the step file's
        arrays, its sample count, its full size, its chunk.
      expert: per parameter, whether it is an expert parameter.
      where: global key -> parameter index.
    """

    key: np.ndarray
    start: np.ndarray
    samples: np.ndarray
    numel: np.ndarray
    chunk: np.ndarray
    expert: np.ndarray
    where: dict[int, int]


class StepTables:
    """A step's parameters by rank, as arrays: which rank holds which gradient.

    Args:
      records: the step's records by rank; view: its global view.
      vparams, per_rank: :func:`parity_tests.audit_view.global_params`'s result.
      num_chunks: chunks per rank.
    """

    def __init__(self, records: list[RankIndex], view: View, vparams: dict[str, Param],
                 per_rank: list[dict[int, str]], num_chunks: int) -> None:
        self.records, self.view, self.vparams, self.num_chunks = records, view, vparams, num_chunks
        self.names = list(vparams)
        vid = {n: k for k, n in enumerate(self.names)}
        self.samples = np.full(len(self.names), -1, dtype=np.int64)
        self.streamable = True
        self._tables: dict[int, PlanTable] = {}
        for f in records:
            params = f.meta["params"]
            if id(params) in self._tables:
                continue
            names = per_rank[f.rank]
            table = PlanTable(
                key=np.array([vid[names[i]] * num_chunks + p["chunk"] for i, p in enumerate(params)], dtype=np.int64),
                start=np.cumsum([0] + [p["samples"] for p in params])[:-1].astype(np.int64),
                samples=np.array([p["samples"] for p in params], dtype=np.int64),
                numel=np.array([p["numel"] for p in params], dtype=np.int64),
                chunk=np.array([p["chunk"] for p in params], dtype=np.int64),
                expert=np.array([bool(p["expert"]) for p in params], dtype=bool), where={})
            table.where = {int(k): i for i, k in enumerate(table.key)}
            self._tables[id(params)] = table
            if len(table.where) != len(params):
                self.streamable = False
            for k, s in zip(table.key // num_chunks, table.samples):
                if self.samples[k] not in (-1, s):
                    self.streamable = False
                self.samples[k] = s
        world = len(records)
        #: [global key, reference rank]: the rank holds that gradient before / after finalize.
        self.has = np.zeros((len(self.names) * num_chunks, world), dtype=bool)
        self.has_after = np.zeros((len(self.names) * num_chunks, world), dtype=bool)
        for v in range(world):
            f = records[view.actual[v]]
            self.has[self.table(f).key, v] = f.has_grad[0]
            self.has_after[self.table(f).key, v] = f.has_grad[1]

    def table(self, f: RankIndex) -> PlanTable:
        """The plan table of a rank's record."""
        return self._tables[id(f.meta["params"])]

    def weight(self, vid: int) -> int:
        """Values of a parameter over all ranks and chunks."""
        c = self.num_chunks
        return int(self.samples[vid]) * int(self.has[vid * c:(vid + 1) * c].sum())


@dataclasses.dataclass
class Group:
    """Parameters concatenated into one parameter of the reference scenario.

    Args:
      layout: the scenario's parameter (its name is the first member's, marked when merged).
      members: global parameter ids, in order.
      offsets: each member's first value in the group's values.
    """

    layout: ParamLayout
    members: list[int]
    offsets: list[int]


def plan_blocks(tables: StepTables, dtype: str, budget: int, merge: bool) -> list[list[Group]]:
    """The blocks of one dtype's parameters: consecutive parameters, about ``budget`` values
    over all ranks each (at least one parameter), each block as its groups.

    Args:
      tables: the step's tables.
      dtype: the gradient dtype.
      budget: values per block; 0 for one block.
      merge: concatenate alike parameters (False: a group per parameter).
    """
    vids = [k for k, n in enumerate(tables.names) if tables.vparams[n].dtype == dtype]
    blocks: list[list[int]] = []
    size = 0
    for k in vids:
        w = tables.weight(k)
        if not blocks or (budget and size + w > budget and size):
            blocks.append([])
            size = 0
        blocks[-1].append(k)
        size += w
    taken = set(tables.names)
    return [_groups(tables, block, merge, taken) for block in blocks]


def _groups(tables: StepTables, block: list[int], merge: bool, taken: set[str]) -> list[Group]:
    """A block's parameters grouped by what the reference does with them."""
    c = tables.num_chunks
    by_sig: dict[Any, list[int]] = {}
    for k in block:
        layout = tables.vparams[tables.names[k]].layout
        name = tables.names[k]
        qk = "q_layernorm" in name or "k_layernorm" in name
        alone = not merge or layout.role != "none"
        sig = (k,) if alone else (layout.expert, qk, tuple(getattr(layout, f) for f in FLAGS),
                                  tables.has[k * c:(k + 1) * c].tobytes())
        by_sig.setdefault(sig, []).append(k)
    groups = []
    for members in by_sig.values():
        first = tables.vparams[tables.names[members[0]]].layout
        name = first.name
        if len(members) > 1:
            name = f"{first.name} [+{len(members) - 1}]"
            while name in taken:
                name += "'"
            taken.add(name)
        offsets = np.cumsum([0] + [int(tables.samples[k]) for k in members]).tolist()
        layout = dataclasses.replace(first, name=name, shape=(offsets[-1],))
        groups.append(Group(layout, members, offsets[:-1]))
    return groups


Shards = dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]


def shard_bounds(tables: StepTables, dtype: str, scen: Scenario) -> Shards:
    """Per recorded rank, where each parameter's owned elements are under a distributed
    optimizer: ``(lo, hi, has)`` per parameter, the owned flat positions ``[lo, hi)``
    relative to the parameter, and whether it has a shard at all (a DP group of more than
    one rank, and a buffer of this dtype: otherwise every element keeps its reduced value).

    meshgrad's layout (docs/semantics.md, "Reduce-scatter layout"): per DP group one shared
    buffer in plan order without the cross-stage-summed gradients
    (``reference.cross_stage_keys``), then a buffer of its own for each of those; shards
    by global rank. ``scen`` holds every parameter of the dtype (it decides those keys).
    """
    ctx = ref.Context(scenario=scen, cfg=ref.Config.from_scenario(scen), mesh=ref.Mesh.from_scenario(scen), outputs=[])
    vid = {n: k for k, n in enumerate(tables.names)}
    c = tables.num_chunks
    alone = {vid[name] * c + chunk for chunk, name in ref.cross_stage_keys(ctx) if name in vid}
    in_dtype = np.array([tables.vparams[n].dtype == dtype for n in tables.names], dtype=bool)
    own_of: dict[int, np.ndarray] = {}
    out: Shards = {}
    for f in tables.records:
        t = tables.table(f)
        if id(t) not in own_of:
            own_of[id(t)] = np.array([int(k) in alone for k in t.key], dtype=bool)
        own = own_of[id(t)]
        lo = np.zeros(t.key.size, dtype=np.int64)
        hi = np.zeros(t.key.size, dtype=np.int64)
        has = np.zeros(t.key.size, dtype=bool)
        lay = f.meta["layout"]
        plain = np.array([not d for d in f.meta["ddp_chunks"]], dtype=bool)
        base = in_dtype[t.key // c] & f.has_grad[0] & plain[t.chunk]
        for expert, group in ((False, "dp_cp"), (True, "expt_dp")):
            members = lay["members"][group] if group not in lay["missing"] else [f.rank]
            if len(members) <= 1:
                continue
            n, index = len(members), index_in(members, f.rank)
            chosen = base & (t.expert == expert)
            buffers = [np.flatnonzero(chosen & ~own)] + [np.array([i]) for i in np.flatnonzero(chosen & own)]
            for buffer in buffers:
                sizes = t.numel[buffer]
                total = int(sizes.sum())
                s = -(-total // n)
                offset = np.cumsum(sizes) - sizes
                lo[buffer] = index * s - offset
                hi[buffer] = min((index + 1) * s, total) - offset
                has[buffer] = True
        out[f.rank] = (lo, hi, has)
    return out


@dataclasses.dataclass
class BlockValues:
    """One block's recorded values, per (group index, chunk) with a gradient somewhere.

    Args:
      ranks: the reference ranks holding it, ascending.
      params: ``[ranks, members]`` each member's parameter index on the rank.
      before: ``[ranks, values]`` float32; after: ``[ranks, values]`` float64.
      owned: per rank the owned elements, None where no shard applies (None: on no rank).
    """

    ranks: dict[tuple[int, int], np.ndarray]
    params: dict[tuple[int, int], np.ndarray]
    before: dict[tuple[int, int], np.ndarray]
    after: dict[tuple[int, int], np.ndarray]
    owned: dict[tuple[int, int], list[np.ndarray | None] | None]


def read_block(tables: StepTables, groups: list[Group], shards: Shards | None) -> BlockValues:
    """Every rank's sampled values of one block's groups, one read per rank and array."""
    c = tables.num_chunks
    world = len(tables.records)
    slots = [(g, ch) for g in range(len(groups)) for ch in range(c)]
    keys = {s: [m * c + s[1] for m in groups[s[0]].members] for s in slots}
    holds = {s: tables.has[keys[s][0]] for s in slots}
    ranks = {s: np.flatnonzero(holds[s]) for s in slots if holds[s].any()}
    rows: dict[tuple[int, int], list[Any]] = {s: [] for s in ranks}
    cache: dict[tuple[int, bytes], tuple[int, int, list[tuple[tuple[int, int], np.ndarray, np.ndarray]]]] = {}
    for v in range(world):
        f = tables.records[tables.view.actual[v]]
        t = tables.table(f)
        mine = [s for s in ranks if holds[s][v]]
        if not mine:
            continue
        plan_key = (id(f.meta["params"]), np.array([s in mine for s in ranks], dtype=bool).tobytes())
        if plan_key not in cache:
            index = {s: np.array([t.where[k] for k in keys[s]], dtype=np.int64) for s in mine}
            lo = min(int(t.start[i].min()) for i in index.values())
            hi = max(int((t.start[i] + t.samples[i]).max()) for i in index.values())
            gather = [(s, i, np.concatenate([np.arange(t.start[j], t.start[j] + t.samples[j]) for j in i]) - lo)
                      for s, i in index.items()]
            cache[plan_key] = (lo, hi, gather)
        lo, hi, gather = cache[plan_key]
        before, after = f.read(lo, hi)
        for s, i, at in gather:
            owned = None
            if shards is not None:
                slo, shi, shas = shards[f.rank]
                if shas[i].any():
                    pos = f.arrays["positions"][at + lo]
                    owned = (pos >= np.repeat(slo[i], t.samples[i])) & (pos < np.repeat(shi[i], t.samples[i]))
                    owned |= np.repeat(~shas[i], t.samples[i])
            rows[s].append((i, before[at].astype(np.float32), after[at], owned))
    return BlockValues(
        ranks=ranks,
        params={s: np.array([r[0] for r in rs]) for s, rs in rows.items()},
        before={s: np.stack([r[1] for r in rs]) for s, rs in rows.items()},
        after={s: np.stack([r[2] for r in rs]) for s, rs in rows.items()},
        owned={s: (None if all(r[3] is None for r in rs) else [r[3] for r in rs]) for s, rs in rows.items()},
    )


def group_key(groups: list[Group], slot: tuple[int, int]) -> Key:
    """The reference scenario's key of a (group, chunk) slot."""
    return (slot[1], groups[slot[0]].layout.name)
