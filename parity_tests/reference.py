"""Independent numpy reference of docs/semantics.md (gradient finalization), global view.

All ranks' inputs go in, all ranks' outputs come out. Written from docs/semantics.md alone: this
module imports nothing from ``meshgrad``, ``torch_impl`` or ``jax_impl`` (it exists to
check them). Each step of docs/semantics.md is one small function below; they run in the
order of docs/semantics.md on a deep copy of the inputs.

Numerics (the project's conventions):

- A collective sums its operands in float64, rounds to float32, then to the gradient dtype
  (``to_dtype``); AVG is that float64 sum divided by the group size. On the integer data of
  exact mode this is exact, whatever order a backend sums in.
- A scaling (DP pre-scale, per-token scale) is a float32 product rounded to the dtype.
- Router state stays float32 (expert-bias and qb_beta arithmetic is float32).

``touched`` (step -> {(rank, kind, key)}) lists what each step operates on, decided from
the layout and config as a plan would: an entry is listed when the step reduces it over a
group of size > 1, multiplies it by a static factor other than 1, writes a computed value
into it (router updates, chunk-copy syncs), or applies a data-dependent operation to it
(the per-token scale, listed even when the global count makes it 1). A size-1 group with
no scale is "no communication" and lists nothing.

Decisions where docs/semantics.md is open are marked ``DECISION`` in the code.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from parity_tests.scenarios import Key, ParamLayout, RankData, RouterLayout, Scenario, to_dtype

#: Step names of ``ReferenceResult.touched``, in the order of docs/semantics.md.
STEPS: tuple[str, ...] = (
    "dp_sync",
    "cond_embedder",
    "router",
    "non_tp",
    "gtp",
    "word_embedding",
    "pos_embedding",
    "expert_bias",
    "qb_beta",
    "reset",
    "token_scale",
)

#: Axis order, slowest to fastest varying, of the two views of one rank (docs/semantics.md: ranks, axes and groups).
DENSE_AXES: tuple[str, ...] = ("pp", "dp", "cp", "gtp", "tp")
EXPERT_AXES: tuple[str, ...] = ("pp", "edp", "egtp", "ep", "etp")

#: FinalizeConfig field names and their defaults (copied, not imported: independence).
CONFIG_DEFAULTS: Mapping[str, Any] = {
    "sequence_parallel": False,
    "qk_layernorm": False,
    "has_cond_embedder": False,
    "flextron": False,
    "calculate_per_token_loss": False,
    "average_in_collective": False,
    "use_distributed_optimizer": False,
    "grad_reduce_in_fp32": False,
    "share_embeddings_and_output_weights": True,
    "mtp_num_layers": None,
    "embedding_stages": None,
    "position_embedding_stages": None,
    "moe_router_enable_expert_bias": False,
    "moe_router_bias_update_rate": 1e-3,
    "moe_router_load_balancing_type": "aux_loss",
    "moe_router_quantile_balancing_ema": 0.0,
    "check_for_nan_in_grad": False,
    "use_megatron_fsdp": False,
}

Touch = tuple[int, str, Key]


@dataclasses.dataclass
class ReferenceResult:
    """What the reference computed.

    Args:
      outputs: per global rank, the same structure as the inputs.
      touched: step name (``STEPS``) -> set of ``(rank, kind, key)`` the step changed or
        reduced; ``kind`` is ``"grad"`` or ``"router"``, ``key`` is ``(chunk, name)``.
    """

    outputs: list[RankData]
    touched: dict[str, set[Touch]]


# --------------------------------------------------------------------------- mesh


@dataclasses.dataclass(frozen=True)
class Mesh:
    """Axis sizes of both views of the job; ranks in Megatron order (docs/semantics.md: ranks, axes and groups).

    Dense rank = ((((pp*DP + dp)*CP + cp)*GTP + gtp)*TP + tp); expert rank =
    ((((pp*EDP + edp)*EGTP + egtp)*EP + ep)*ETP + etp).
    """

    pp: int
    dp: int
    cp: int
    gtp: int
    tp: int
    edp: int
    egtp: int
    ep: int
    etp: int

    @classmethod
    def from_scenario(cls, scenario: Scenario) -> "Mesh":
        """Build and validate the mesh of ``scenario``.

        Args:
          scenario: the parity case.

        Returns:
          The mesh. Raises ValueError when the expert view does not tile the dense one.
        """
        sizes = dict(
            pp=scenario.pp, dp=scenario.dp, cp=scenario.cp, gtp=scenario.gtp, tp=scenario.tp,
            egtp=scenario.egtp, ep=scenario.ep, etp=scenario.expert_tp,
        )
        for name, size in sizes.items():
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"scenario {scenario.name}: axis {name} must be an int >= 1, got {size!r}")
        inner = scenario.dp * scenario.cp * scenario.gtp * scenario.tp
        expert_inner = scenario.ep * scenario.expert_tp * scenario.egtp
        if inner % expert_inner:
            raise ValueError(
                f"scenario {scenario.name}: EP*ETP*EGTP={expert_inner} does not divide "
                f"DP*CP*GTP*TP={inner}"
            )
        return cls(edp=inner // expert_inner, **sizes)

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.gtp * self.tp

    def size(self, axis: str) -> int:
        return int(getattr(self, axis))

    def coords(self, rank: int, view: str) -> dict[str, int]:
        """Coordinates of ``rank`` in the ``"dense"`` or ``"expert"`` view.

        Args:
          rank: global rank.
          view: ``"dense"`` or ``"expert"``.

        Returns:
          axis name -> index.
        """
        axes = DENSE_AXES if view == "dense" else EXPERT_AXES
        out: dict[str, int] = {}
        rest = rank
        for axis in reversed(axes):
            out[axis] = rest % self.size(axis)
            rest //= self.size(axis)
        return out

    def groups(self, axes: Sequence[str], view: str) -> list[list[int]]:
        """Partition of all ranks into the groups that vary ``axes`` (others fixed).

        Args:
          axes: the varying axes, all of one view.
          view: ``"dense"`` or ``"expert"``.

        Returns:
          The groups, each a sorted list of ranks.
        """
        names = DENSE_AXES if view == "dense" else EXPERT_AXES
        unknown = set(axes) - set(names)
        if unknown:
            raise ValueError(f"axes {sorted(unknown)} are not in the {view} view {names}")
        by_key: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world):
            c = self.coords(rank, view)
            key = tuple(c[a] for a in names if a not in axes)
            by_key.setdefault(key, []).append(rank)
        return list(by_key.values())


# --------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class Config:
    """The finalize options of a scenario, defaults filled in (names as FinalizeConfig)."""

    values: Mapping[str, Any]

    @classmethod
    def from_scenario(cls, scenario: Scenario) -> "Config":
        """Read ``scenario.config``; unknown keys are an error.

        Args:
          scenario: the parity case.

        Returns:
          The config.
        """
        unknown = set(scenario.config) - set(CONFIG_DEFAULTS)
        if unknown:
            raise ValueError(f"scenario {scenario.name}: unknown config option(s) {sorted(unknown)}")
        return cls({**CONFIG_DEFAULTS, **dict(scenario.config)})

    def __getattr__(self, name: str) -> Any:
        if name == "values":
            raise AttributeError(name)
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None


# --------------------------------------------------------------------------- state


@dataclasses.dataclass
class Context:
    """Everything the steps read, and the outputs they write (passed explicitly)."""

    scenario: Scenario
    cfg: Config
    mesh: Mesh
    outputs: list[RankData]

    @property
    def dtype(self) -> str:
        return self.scenario.dtype

    def chunks(self) -> range:
        return range(self.scenario.num_chunks)

    def grad(self, rank: int, key: Key) -> np.ndarray | None:
        return self.outputs[rank].grads[key]

    def set_grad(self, rank: int, key: Key, value: np.ndarray) -> None:
        self.outputs[rank].grads[key] = value


def _round(values: np.ndarray, dtype: str) -> np.ndarray:
    """Round float64/float32 values to float32, then to ``dtype`` (held as float32)."""
    return to_dtype(np.asarray(values, dtype=np.float64).astype(np.float32), dtype)


def _reduce(arrays: Sequence[np.ndarray], op: str, dtype: str | None) -> np.ndarray:
    """One all-reduce: float64 sum (divided by the group size for AVG), then rounded.

    Args:
      arrays: one operand per participating rank.
      op: ``"sum"`` or ``"avg"``.
      dtype: round the float32 result to this dtype; None keeps float32.

    Returns:
      The reduced value, float32.
    """
    total = np.sum([np.asarray(a, dtype=np.float64) for a in arrays], axis=0)
    if op == "avg":
        total = total / len(arrays)
    elif op != "sum":
        raise ValueError(f"unknown reduction {op!r}")
    result = total.astype(np.float32)
    return result if dtype is None else to_dtype(result, dtype)


def _scale(values: np.ndarray, factor: float, dtype: str | None) -> np.ndarray:
    """``values * float32(factor)`` in float32, rounded to ``dtype`` (None: float32)."""
    result = np.asarray(values, dtype=np.float32) * np.float32(factor)
    return result if dtype is None else to_dtype(result, dtype)


def _allreduce_param(
    ctx: Context,
    key: Key,
    groups: Iterable[Sequence[int]],
    op: str,
    *,
    pre_scale: float | None = None,
    dtype: str | None = None,
) -> set[Touch]:
    """All-reduce the grad ``key`` within each group, optionally pre-scaled.

    DECISION: a rank whose grad is None contributes nothing and keeps None (the contract: a None
    gradient is skipped); in the scenarios None is consistent across ranks.

    Args:
      ctx: the state.
      key: ``(chunk, name)``.
      groups: partition of the ranks.
      op: ``"sum"`` or ``"avg"``.
      pre_scale: a factor applied on every rank before the collective (even on a group of
        size 1), or None.
      dtype: dtype the collective runs in (default: the scenario's).

    Returns:
      The entries touched.
    """
    dtype = ctx.dtype if dtype is None else dtype
    touched: set[Touch] = set()
    scaled = pre_scale is not None and float(pre_scale) != 1.0
    for group in groups:
        members = [r for r in group if ctx.grad(r, key) is not None]
        if not members or (len(group) == 1 and not scaled):
            continue
        operands = []
        for r in members:
            g = ctx.grad(r, key)
            operands.append(_scale(g, pre_scale, dtype) if scaled else g)
        result = _reduce(operands, op, dtype) if len(group) > 1 else operands[0]
        for r in members:
            ctx.set_grad(r, key, result.copy())
            touched.add((r, "grad", key))
    return touched


def _params(ctx: Context, **flags: bool) -> list[ParamLayout]:
    """The params of the layout whose flags equal ``flags`` and that require grad."""
    return [
        p for p in ctx.scenario.params
        if p.requires_grad and all(getattr(p, k) == v for k, v in flags.items())
    ]


# --------------------------------------------------------------------------- steps


def step_dp_sync(ctx: Context, *, force_all_reduce: bool = False) -> set[Touch]:
    """semantics `dp_sync`: DP sync of dense grads over dp_cp and expert grads over edp.

    Args:
      ctx: the state.
      force_all_reduce: forces an all-reduce under a distributed optimizer.

    Returns:
      The entries touched.
    """
    cfg, mesh = ctx.cfg, ctx.mesh
    scatter = cfg.use_distributed_optimizer and not force_all_reduce
    local = [dict(out.grads) for out in ctx.outputs] if scatter else None
    dp_cp = mesh.dp * mesh.cp
    # DECISION: grad_reduce_in_fp32 runs the collective (and its pre-scale) in float32 and
    # rounds the result once to the gradient dtype.
    coll_dtype = None if cfg.grad_reduce_in_fp32 else ctx.dtype
    touched: set[Touch] = set()
    for expert in (False, True):
        if cfg.calculate_per_token_loss:
            op, pre_scale = "sum", None
        elif cfg.average_in_collective:
            op, pre_scale = "avg", (mesh.edp / dp_cp if expert else None)
        else:
            op, pre_scale = "sum", 1.0 / dp_cp
        groups = mesh.groups(("edp",), "expert") if expert else mesh.groups(("dp", "cp"), "dense")
        for p in _params(ctx, expert=expert):
            for chunk in ctx.chunks():
                key = (chunk, p.name)
                touched |= _allreduce_param(ctx, key, groups, op, pre_scale=pre_scale, dtype=coll_dtype)
                if coll_dtype is None:
                    for r in range(mesh.world):
                        g = ctx.grad(r, key)
                        if g is not None:
                            ctx.set_grad(r, key, to_dtype(g, ctx.dtype))
        if scatter:
            _keep_own_shard(ctx, local, expert, groups, 1.0 if pre_scale is None else pre_scale, coll_dtype)
    return touched


def cross_stage_keys(ctx: Context) -> set[Key]:
    """The gradients a later step sums across pp stages (semantics `dp_sync`: own buffers).

    Every stage's key of the tied word embedding (when `word_embedding` runs) and of the
    position embedding (when `pos_embedding` runs), and every chunk copy of the
    conditional-embedder / flextron-router parameters (when those steps run). The same
    set on every rank.
    """
    cfg, mesh = ctx.cfg, ctx.mesh
    keys: set[Key] = set()
    word = _role_param(ctx, "word_embedding")
    if word is not None and (cfg.share_embeddings_and_output_weights or cfg.mtp_num_layers):
        stages = _stage_set(ctx, cfg.embedding_stages, (0, mesh.pp - 1), "embedding_stages")
        if len(stages) > 1:
            keys |= {(_embedding_chunk(ctx, s, "word_embedding"), word.name) for s in stages}
    pos = _role_param(ctx, "position_embedding")
    if pos is not None:
        stages = _stage_set(ctx, cfg.position_embedding_stages, (0,), "position_embedding_stages")
        if len(stages) > 1:
            keys |= {(_embedding_chunk(ctx, s, "position_embedding"), pos.name) for s in stages}
    for flag, on in (("pipeline_parallel", cfg.has_cond_embedder), ("flextron_router_pp_sync", cfg.flextron)):
        if mesh.pp > 1 and on:
            keys |= {(c, p.name) for p in _params(ctx, **{flag: True}) for c in ctx.chunks()}
    return keys


def scatter_buffers(ctx: Context, expert: bool) -> list[list[Key]]:
    """The reduce-scatter buffers of the dense (or expert) DP sync, each a list of keys.

    One buffer holds chunk 0's params in layout order, then chunk 1's, ..., except the
    keys of :func:`cross_stage_keys`; each of those is a buffer of its own, after it, so
    that its shards cover the same elements on every stage and chunk copy.
    """
    keys = [(c, p.name) for c in ctx.chunks() for p in _params(ctx, expert=expert)]
    alone = cross_stage_keys(ctx)
    shared = [k for k in keys if k not in alone]
    return ([shared] if shared else []) + [[k] for k in keys if k in alone]


def _keep_own_shard(
    ctx: Context,
    local: list[dict[Key, np.ndarray | None]],
    expert: bool,
    groups: list[list[int]],
    pre_scale: float,
    coll_dtype: str | None,
) -> None:
    """Reduce-scatter layout (meshgrad's documented contract, not Megatron's buckets).

    Per buffer of :func:`scatter_buffers` (its gradients flattened, in order, zero-padded
    to a multiple of the group size n), the member with group index i (members by
    ascending rank) keeps elements [i*s, (i+1)*s), s = ceil(L/n), reduced. Every other
    element keeps the rank's local value after the pre-scale.
    """
    for keys in scatter_buffers(ctx, expert):
        for group in groups:
            n = len(group)
            if n == 1:
                continue
            for index, rank in enumerate(group):
                _keep_buffer_shard(ctx, local, keys, rank, n, index, pre_scale, coll_dtype)


def _keep_buffer_shard(
    ctx: Context,
    local: list[dict[Key, np.ndarray | None]],
    keys: list[Key],
    rank: int,
    n: int,
    index: int,
    pre_scale: float,
    coll_dtype: str | None,
) -> None:
    """One buffer on one rank: keep the reduced shard, restore the local value elsewhere."""
    sizes = [ctx.grad(rank, k).size for k in keys]
    total = sum(sizes)
    shard = -(-total // n)
    start, stop = min(index * shard, total), min((index + 1) * shard, total)
    offset = 0
    for key, size in zip(keys, sizes):
        reduced = ctx.grad(rank, key).reshape(-1).copy()
        mine = np.zeros(size, dtype=bool)
        lo, hi = max(start - offset, 0), min(stop - offset, size)
        if lo < hi:
            mine[lo:hi] = True
        kept = _scale(local[rank][key], pre_scale, coll_dtype).reshape(-1)
        kept = to_dtype(kept, ctx.dtype)
        reduced[~mine] = kept[~mine]
        ctx.set_grad(rank, key, reduced.reshape(ctx.grad(rank, key).shape))
        offset += size


def _pp_chunk_sync(ctx: Context, flag: str) -> set[Touch]:
    """semantics `cond_embedder`/`router`: sum the chunk copies, SUM over pp, write into every copy.

    Megatron adds each later chunk copy into the first one in place (one rounding to the
    dtype per addition), then all-reduces the first copy.

    Args:
      ctx: the state.
      flag: the ParamLayout flag selecting the params.

    Returns:
      The entries touched.
    """
    touched: set[Touch] = set()
    pp_groups = ctx.mesh.groups(("pp",), "dense")
    for p in _params(ctx, **{flag: True}):
        keys = [(c, p.name) for c in ctx.chunks()]
        local: dict[int, np.ndarray] = {}
        for r in range(ctx.mesh.world):
            acc: np.ndarray | None = None
            for key in keys:
                g = ctx.grad(r, key)
                if g is None:
                    continue
                acc = g.copy() if acc is None else _round(acc.astype(np.float64) + g, ctx.dtype)
            if acc is not None:
                local[r] = acc
        for group in pp_groups:
            members = [r for r in group if r in local]
            if not members:
                continue
            result = _reduce([local[r] for r in members], "sum", ctx.dtype)
            for r in members:
                for key in keys:
                    if ctx.grad(r, key) is not None:
                        ctx.set_grad(r, key, result.copy())
                        touched.add((r, "grad", key))
    return touched


def step_cond_embedder(ctx: Context) -> set[Touch]:
    """semantics `cond_embedder`: ``pipeline_parallel`` params, if PP > 1 and ``has_cond_embedder``."""
    if ctx.mesh.pp <= 1 or not ctx.cfg.has_cond_embedder:
        return set()
    return _pp_chunk_sync(ctx, "pipeline_parallel")


def step_router(ctx: Context) -> set[Touch]:
    """semantics `router`: ``flextron_router_pp_sync`` params, if PP > 1 and ``flextron``."""
    if ctx.mesh.pp <= 1 or not ctx.cfg.flextron:
        return set()
    return _pp_chunk_sync(ctx, "flextron_router_pp_sync")


def step_non_tp(ctx: Context) -> set[Touch]:
    """semantics `non_tp`: AVG over tp (``average_gradients_across_tp_domain``) or SUM over tp
    (sequence-parallel / qk-layernorm), only if TP > 1.

    Expert params are included when flagged, over the dense tp group (the contract, literally).

    Returns:
      The entries touched.
    """
    cfg = ctx.cfg
    if ctx.mesh.tp <= 1:
        return set()
    groups = ctx.mesh.groups(("tp",), "dense")
    touched: set[Touch] = set()
    for p in _params(ctx):
        qk = "q_layernorm" in p.name or "k_layernorm" in p.name
        if p.average_gradients_across_tp_domain:
            op = "avg"
        elif (cfg.sequence_parallel and p.sequence_parallel) or (cfg.qk_layernorm and qk):
            op = "sum"
        else:
            continue
        for chunk in ctx.chunks():
            touched |= _allreduce_param(ctx, (chunk, p.name), groups, op)
    return touched


def step_gtp(ctx: Context) -> set[Touch]:
    """semantics `gtp`: params not ``is_gtp_weight_remat``: dense over gtp, expert over egtp;
    SUM under per-token loss, else AVG. No-op on size-1 axes.

    Returns:
      The entries touched.
    """
    op = "sum" if ctx.cfg.calculate_per_token_loss else "avg"
    touched: set[Touch] = set()
    for expert, axis, view in ((False, "gtp", "dense"), (True, "egtp", "expert")):
        if ctx.mesh.size(axis) <= 1:
            continue
        groups = ctx.mesh.groups((axis,), view)
        for p in _params(ctx, expert=expert, is_gtp_weight_remat=False):
            for chunk in ctx.chunks():
                touched |= _allreduce_param(ctx, (chunk, p.name), groups, op)
    return touched


def _stage_set(ctx: Context, stages: Sequence[int] | None, default: Sequence[int], what: str) -> list[int]:
    """The sorted, de-duplicated pp stages of an embedding group; validated."""
    chosen = sorted({int(s) for s in (default if stages is None else stages)})
    bad = [s for s in chosen if not 0 <= s < ctx.mesh.pp]
    if bad:
        raise ValueError(f"{what}: stages {bad} outside 0..{ctx.mesh.pp - 1}")
    return chosen


def _embedding_chunk(ctx: Context, stage: int, role: str) -> int:
    """Chunk holding the embedding on ``stage`` (semantics `word_embedding`): first stage -> first chunk,
    last stage -> last chunk, other stages -> last chunk with MTP, else first chunk.

    DECISION (megatron-core 0.16.1 wins over semantics `pos_embedding`'s "same"): the MTP rule applies to
    the word embedding only; a middle stage's position embedding comes from the first
    chunk even with MTP layers.
    """
    last = ctx.scenario.num_chunks - 1
    if stage == 0:
        return 0
    if stage == ctx.mesh.pp - 1:
        return last
    return last if ctx.cfg.mtp_num_layers and role == "word_embedding" else 0


def _role_param(ctx: Context, role: str) -> ParamLayout | None:
    """The single param with ``role``, or None when the layout has none."""
    found = [p for p in ctx.scenario.params if p.role == role]
    if len(found) > 1:
        raise ValueError(f"scenario {ctx.scenario.name}: {len(found)} params with role {role!r}")
    return found[0] if found else None


def _embedding_sync(ctx: Context, role: str, stages: list[int], *, none_is_error: bool) -> set[Touch]:
    """SUM the ``role`` grad over the ranks of ``stages`` with equal (dp, cp, gtp, tp).

    Args:
      ctx: the state.
      role: ``"word_embedding"`` or ``"position_embedding"``.
      stages: the member pp stages; a set of one stage is size 1, a no-op.
      none_is_error: raise on a member whose grad is None (position embedding) instead
        of leaving it out (word embedding: frozen).

    Returns:
      The entries touched.
    """
    param = _role_param(ctx, role)
    if param is None or len(stages) <= 1:
        # DECISION: a layout without the weight has nothing to reduce.
        return set()
    touched: set[Touch] = set()
    for pp_group in ctx.mesh.groups(("pp",), "dense"):
        members: list[tuple[int, Key]] = []
        for r in pp_group:
            stage = ctx.mesh.coords(r, "dense")["pp"]
            if stage not in stages:
                continue
            key = (_embedding_chunk(ctx, stage, role), param.name)
            if ctx.grad(r, key) is None:
                if none_is_error:
                    raise ValueError(f"rank {r}: {role} grad {key} is None (semantics `pos_embedding`: an error)")
                continue
            members.append((r, key))
        if not members:
            continue
        result = _reduce([ctx.grad(r, key) for r, key in members], "sum", ctx.dtype)
        for r, key in members:
            ctx.set_grad(r, key, result.copy())
            touched.add((r, "grad", key))
    return touched


def step_word_embedding(ctx: Context) -> set[Touch]:
    """semantics `word_embedding`: tied word embedding, SUM over the embd stages (default first and last)."""
    cfg = ctx.cfg
    if not (cfg.share_embeddings_and_output_weights or cfg.mtp_num_layers):
        return set()
    stages = _stage_set(ctx, cfg.embedding_stages, (0, ctx.mesh.pp - 1), "embedding_stages")
    return _embedding_sync(ctx, "word_embedding", stages, none_is_error=False)


def step_pos_embedding(ctx: Context) -> set[Touch]:
    """semantics `pos_embedding`: position embedding, SUM over the pos_embd stages (default first only)."""
    stages = _stage_set(ctx, ctx.cfg.position_embedding_stages, (0,), "position_embedding_stages")
    return _embedding_sync(ctx, "position_embedding", stages, none_is_error=True)


def _router_keys(ctx: Context, pred: Any) -> list[tuple[RouterLayout, Key]]:
    """(layout, key) of every router in every chunk for which ``pred(layout)`` holds."""
    return [(r, (c, r.name)) for r in ctx.scenario.routers if pred(r) for c in ctx.chunks()]


def step_expert_bias(ctx: Context) -> set[Touch]:
    """semantics `expert_bias`: tokens SUM over tp_dp_cp (tp x gtp x dp x cp), ``bias += rate * sign(mean - tokens)``.

    Each router is updated separately (layers may have different expert counts). All
    arithmetic after the reduction is float32; sign(0) = 0. ``local_tokens_per_expert``
    itself is left as is (Megatron reduces a stacked copy); step 10 zeroes it.

    Returns:
      The routers touched.
    """
    cfg = ctx.cfg
    if not cfg.moe_router_enable_expert_bias:
        return set()
    rate = np.float32(cfg.moe_router_bias_update_rate)
    groups = ctx.mesh.groups(("tp", "gtp", "dp", "cp"), "dense")  # tp_dp_cp spans gtp
    touched: set[Touch] = set()
    for _, key in _router_keys(ctx, lambda r: r.has_expert_bias and r.training and not r.frozen_expert_bias):
        for group in groups:
            tokens = _reduce([ctx.outputs[r].routers[key].local_tokens_per_expert for r in group], "sum", None)
            mean = np.float32(np.sum(tokens, dtype=np.float64)) / np.float32(tokens.shape[-1])
            step = rate * np.sign(mean - tokens).astype(np.float32)
            for r in group:
                state = ctx.outputs[r].routers[key]
                state.expert_bias = (state.expert_bias.astype(np.float32) + step).astype(np.float32)
                touched.add((r, "router", key))
    return touched


def step_qb_beta(ctx: Context) -> set[Touch]:
    """semantics `qb_beta`: quantile-balancing bias EMA over dp_cp (dp_cp_gtp when GTP > 1).

    ``local = accum / max(count, 1)``; AVG over the group; ``new = ema*qb_beta +
    (1-ema)*local``; ``new -= mean(new)``; float32 arithmetic in that order.

    DECISION: the factors are ``float32(ema)`` and ``float32(1 - ema)`` (1 - ema taken in
    Python floats, as torch and jax do with a Python scalar); the mean is the float64 sum
    of the float32 values divided by E, rounded to float32 (independent of any summation
    order).

    Returns:
      The routers touched.
    """
    cfg = ctx.cfg
    if cfg.moe_router_load_balancing_type != "quantile_balancing":
        return set()
    ema = float(cfg.moe_router_quantile_balancing_ema)
    axes = ("dp", "cp", "gtp") if ctx.mesh.gtp > 1 else ("dp", "cp")
    groups = ctx.mesh.groups(axes, "dense")
    touched: set[Touch] = set()
    for _, key in _router_keys(ctx, lambda r: r.has_qb_beta and r.training):
        for group in groups:
            local = []
            for r in group:
                state = ctx.outputs[r].routers[key]
                count = np.maximum(state.qb_beta_count.astype(np.float32), np.float32(1))
                local.append(state.qb_beta_accum.astype(np.float32) / count)
            mean_local = _reduce(local, "avg", None)
            for r in group:
                state = ctx.outputs[r].routers[key]
                new = np.float32(ema) * state.qb_beta.astype(np.float32) + np.float32(1.0 - ema) * mean_local
                new = new.astype(np.float32)
                centre = np.float32(np.sum(new, dtype=np.float64) / new.shape[-1])
                state.qb_beta = (new - centre).astype(np.float32)
                touched.add((r, "router", key))
    return touched


def step_reset(ctx: Context) -> set[Touch]:
    """semantics `reset`: zero the per-batch router temporaries, training or not.

    Returns:
      The routers touched.
    """
    cfg = ctx.cfg
    bias = bool(cfg.moe_router_enable_expert_bias)
    global_aux = "global_aux_loss" in str(cfg.moe_router_load_balancing_type)
    touched: set[Touch] = set()
    for layout, key in _router_keys(ctx, lambda r: True):
        for rank, out in enumerate(ctx.outputs):
            state = out.routers[key]
            hit = False
            if bias and layout.has_expert_bias:
                state.local_tokens_per_expert = np.zeros_like(state.local_tokens_per_expert, dtype=np.float32)
                hit = True
            if global_aux and layout.has_aux_loss_tracker:
                state.aux_loss_resets += 1
                hit = True
            if layout.has_qb_beta:
                state.qb_beta_accum = np.zeros_like(state.qb_beta_accum, dtype=np.float32)
                state.qb_beta_count = np.zeros_like(state.qb_beta_count, dtype=np.float32)
                hit = True
            if hit:
                touched.add((rank, "router", key))
    return touched


def step_token_scale(ctx: Context) -> set[Touch]:
    """semantics `token_scale`: n = last stage's num_tokens, SUM over dp_cp (dp_cp_gtp when GTP > 1);
    every grad is multiplied by ``float32(1) / float32(max(n, 1))``.

    Returns:
      The entries touched (every non-None grad when num_tokens is given).
    """
    given = [out.num_tokens is not None for out in ctx.outputs]
    if not any(given):
        return set()
    if not all(given):
        missing = [r for r, g in enumerate(given) if not g]
        raise ValueError(f"num_tokens given on some ranks but not on ranks {missing}")
    mesh = ctx.mesh
    # Broadcast from the last pp stage: each rank takes the value of its pp peer there.
    broadcast: dict[int, int] = {}
    for group in mesh.groups(("pp",), "dense"):
        source = max(group, key=lambda r: mesh.coords(r, "dense")["pp"])
        for r in group:
            broadcast[r] = int(ctx.outputs[source].num_tokens)
    axes = ("dp", "cp", "gtp") if mesh.gtp > 1 else ("dp", "cp")
    touched: set[Touch] = set()
    for group in mesh.groups(axes, "dense"):
        total = sum(broadcast[r] for r in group)
        scale = np.float32(1) / np.float32(max(total, 1))
        for r in group:
            for key, g in ctx.outputs[r].grads.items():
                if g is None:
                    continue
                ctx.set_grad(r, key, to_dtype(np.asarray(g, dtype=np.float32) * scale, ctx.dtype))
                touched.add((r, "grad", key))
    return touched


# --------------------------------------------------------------------------- driver


def _check_inputs(scenario: Scenario, mesh: Mesh, inputs: Sequence[RankData]) -> None:
    """Validate the per-rank inputs against the layout; raise ValueError on mismatch."""
    if len(inputs) != mesh.world:
        raise ValueError(f"scenario {scenario.name}: {len(inputs)} ranks given, world size is {mesh.world}")
    grad_keys = {(c, p.name) for c in range(scenario.num_chunks) for p in scenario.params}
    router_keys = {(c, r.name) for c in range(scenario.num_chunks) for r in scenario.routers}
    for rank, data in enumerate(inputs):
        if set(data.grads) != grad_keys:
            raise ValueError(f"rank {rank}: gradient keys differ from the layout: {sorted(set(data.grads) ^ grad_keys)}")
        if set(data.routers) != router_keys:
            raise ValueError(f"rank {rank}: router keys differ from the layout: {sorted(set(data.routers) ^ router_keys)}")


def _check_finite(outputs: Sequence[RankData]) -> None:
    """check_for_nan_in_grad: raise before any step when a grad holds NaN or Inf."""
    for rank, data in enumerate(outputs):
        for key, g in data.grads.items():
            if g is not None and not np.all(np.isfinite(g)):
                raise RuntimeError(f"rank {rank}: NaN or Inf in grad {key}")


def reference_finalize(
    scenario: Scenario, inputs: list[RankData], *, force_all_reduce: bool = False
) -> ReferenceResult:
    """Run docs/semantics.md, every step, over all ranks at once.

    Args:
      scenario: mesh, layout, config and dtype.
      inputs: per global rank; not mutated.
      force_all_reduce: semantics `dp_sync`: an all-reduce even under a distributed optimizer
        (also taken from ``scenario.force_all_reduce``).

    Returns:
      The per-rank outputs and, per step, what it touched.
    """
    mesh = Mesh.from_scenario(scenario)
    cfg = Config.from_scenario(scenario)
    _check_inputs(scenario, mesh, inputs)
    outputs = copy.deepcopy(list(inputs))
    for data in outputs:
        for key, g in data.grads.items():
            if g is not None:
                data.grads[key] = np.array(g, dtype=np.float32)
    if cfg.check_for_nan_in_grad:
        _check_finite(outputs)
    ctx = Context(scenario=scenario, cfg=cfg, mesh=mesh, outputs=outputs)
    touched: dict[str, set[Touch]] = {}
    force = force_all_reduce or scenario.force_all_reduce
    touched["dp_sync"] = step_dp_sync(ctx, force_all_reduce=force)
    touched["cond_embedder"] = step_cond_embedder(ctx)
    touched["router"] = step_router(ctx)
    touched["non_tp"] = step_non_tp(ctx)
    touched["gtp"] = step_gtp(ctx)
    touched["word_embedding"] = step_word_embedding(ctx)
    touched["pos_embedding"] = step_pos_embedding(ctx)
    touched["expert_bias"] = step_expert_bias(ctx)
    touched["qb_beta"] = step_qb_beta(ctx)
    touched["reset"] = step_reset(ctx)
    touched["token_scale"] = step_token_scale(ctx)
    return ReferenceResult(outputs=outputs, touched=touched)
