"""Parity scenarios: mesh shapes x config flags x model layouts x dtypes x seeds.

Plain data only (numpy, no meshgrad import), so that the numpy reference, the torch world
and the jax world all build the same per-rank inputs from ``(scenario, rank)``.

Layout convention: every chunk of every rank holds the same parameters (``params``) and
routers (``routers``); gradients differ per (seed, rank, chunk, name).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

try:  # bfloat16 for numpy (ships with jax); only needed by bf16 scenarios.
    import ml_dtypes

    BFLOAT16: Any = ml_dtypes.bfloat16
except ImportError:  # pragma: no cover
    BFLOAT16 = None

Key = tuple[int, str]

# Parameter names used by the GPT-like layout.
WORD_EMB = "embedding.word_embeddings.weight"
POS_EMB = "embedding.position_embeddings.weight"


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """One parameter present in every chunk; flags as in docs/semantics.md."""

    name: str
    shape: tuple[int, ...]
    expert: bool = False  # Megatron allreduce=False
    sequence_parallel: bool = False
    average_gradients_across_tp_domain: bool = False
    pipeline_parallel: bool = False
    flextron_router_pp_sync: bool = False
    is_gtp_weight_remat: bool = False
    requires_grad: bool = True
    role: str = "none"  # "none" | "word_embedding" | "position_embedding"


@dataclasses.dataclass(frozen=True)
class RouterLayout:
    """One MoE router module present in every chunk."""

    name: str
    num_experts: int
    training: bool = True
    frozen_expert_bias: bool = False
    has_expert_bias: bool = True
    has_qb_beta: bool = False
    has_aux_loss_tracker: bool = True


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One parity case.

    Args:
      name: unique, readable id.
      pp, dp, cp, tp, gtp: dense mesh; ep, etp (None = tp), egtp: expert mesh.
      num_chunks: virtual pipeline chunks per rank.
      params, routers: the per-chunk layout.
      config: FinalizeConfig keyword values (plain types).
      dtype: gradient dtype, "float32", "bfloat16" or "float16".
      grad_attr: "main_grad" or "grad".
      mode: "exact" (small integers, bit-exact), "random" (normal data, tolerances) or
        "wide" (integers up to 2**12 in the dtype; bit-exact when every collective over
        more than two ranks runs in float32, i.e. with grad_reduce_in_fp32).
      num_tokens: None (not passed), "random" or "zero" (global count 0).
      seed: data seed.
      force_all_reduce: passed to finalize (an all-reduce despite a distributed optimizer).
    """

    name: str
    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1
    gtp: int = 1
    ep: int = 1
    etp: int | None = None
    egtp: int = 1
    num_chunks: int = 1
    params: tuple[ParamLayout, ...] = ()
    routers: tuple[RouterLayout, ...] = ()
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    dtype: str = "float32"
    grad_attr: str = "main_grad"
    mode: str = "exact"
    num_tokens: str | None = None
    seed: int = 0
    force_all_reduce: bool = False

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.gtp * self.tp

    @property
    def mesh(self) -> tuple[int, int, int, int]:
        """The dense (pp, dp, cp, tp) sizes (gtp, when active, sits between cp and tp)."""
        return (self.pp, self.dp, self.cp, self.tp)

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def edp(self) -> int:
        """Expert data-parallel size: the expert view covers the same ranks."""
        inner = self.dp * self.cp * self.gtp * self.tp
        if inner % (self.ep * self.expert_tp * self.egtp):
            raise ValueError(f"scenario {self.name}: ep*etp*egtp does not divide dp*cp*gtp*tp")
        return (self.dp * self.cp * self.gtp * self.tp) // (self.ep * self.expert_tp * self.egtp)

    def cfg(self, name: str, default: Any = False) -> Any:
        return self.config.get(name, default)


@dataclasses.dataclass
class RouterState:
    """Per-router buffers (all float32, shape [E] except the scalar count)."""

    local_tokens_per_expert: np.ndarray
    expert_bias: np.ndarray
    qb_beta: np.ndarray
    qb_beta_accum: np.ndarray
    qb_beta_count: np.ndarray  # shape ()
    aux_loss_resets: int = 0  # times reset_global_aux_loss_tracker() was called


@dataclasses.dataclass
class RankData:
    """Inputs or outputs of one rank.

    grads maps (chunk, name) to a float32 array holding values representable in the
    scenario dtype, or None for a parameter without gradient.
    """

    grads: dict[Key, np.ndarray | None]
    routers: dict[Key, RouterState]
    num_tokens: int | None = None


def _rng(scenario: Scenario, rank: int, *parts: object) -> np.random.Generator:
    text = "|".join(str(p) for p in (scenario.seed, rank, *parts))
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return np.random.default_rng(int.from_bytes(digest, "little"))


def to_dtype(values: np.ndarray, dtype: str) -> np.ndarray:
    """Round float32/64 values to ``dtype`` and return them as float32."""
    values = np.asarray(values, dtype=np.float32)
    if dtype == "bfloat16":
        return values.astype(BFLOAT16).astype(np.float32)
    if dtype == "float16":
        return values.astype(np.float16).astype(np.float32)
    return values


def make_rank_inputs(scenario: Scenario, rank: int) -> RankData:
    """Deterministic inputs of ``rank`` (same on every backend)."""
    grads: dict[Key, np.ndarray | None] = {}
    for chunk in range(scenario.num_chunks):
        for p in scenario.params:
            rng = _rng(scenario, rank, chunk, p.name)
            if not p.requires_grad:
                grads[(chunk, p.name)] = None
            elif scenario.mode == "exact":
                grads[(chunk, p.name)] = rng.integers(-3, 4, size=p.shape).astype(np.float32)
            elif scenario.mode == "wide":
                # Integers up to 2**12 rounded to the dtype: exact in it, but their partial
                # sums are not (a reduction in the dtype rounds; one in float32 does not).
                grads[(chunk, p.name)] = to_dtype(rng.integers(-(2**12), 2**12 + 1, size=p.shape), scenario.dtype)
            else:
                grads[(chunk, p.name)] = to_dtype(rng.standard_normal(p.shape), scenario.dtype)
    routers: dict[Key, RouterState] = {}
    stage = rank // (scenario.world_size // scenario.pp)
    for chunk in range(scenario.num_chunks):
        for r in scenario.routers:
            rng = _rng(scenario, rank, chunk, r.name, "router")
            # Router parameters are replicated across a stage, as in training.
            shared = _rng(scenario, -1 - stage, chunk, r.name, "router-state")
            e = r.num_experts
            count = float(rng.integers(0, 3)) if scenario.mode != "exact" else float(rng.choice([0, 1, 2, 4]))
            routers[(chunk, r.name)] = RouterState(
                local_tokens_per_expert=rng.integers(0, 6, size=e).astype(np.float32),
                expert_bias=(shared.integers(-4, 5, size=e) / 4).astype(np.float32),
                qb_beta=(shared.integers(-4, 5, size=e) / 4).astype(np.float32),
                qb_beta_accum=rng.integers(0, 9, size=e).astype(np.float32),
                qb_beta_count=np.array(count, dtype=np.float32),
            )
    num_tokens = None
    if scenario.num_tokens == "zero":
        num_tokens = 0
    elif scenario.num_tokens == "random":
        last_stage = stage == scenario.pp - 1
        # Tensor-parallel peers see the same tokens: the count ignores the tp coordinate.
        rng = _rng(scenario, rank // scenario.tp, "num_tokens")
        if scenario.mode == "exact":
            # Global count is a power of two (4 * dp*cp*gtp) on the last stage; other
            # stages hold a value that must be overwritten by the broadcast.
            num_tokens = 4 if last_stage else 7
        else:
            num_tokens = int(rng.integers(1, 50)) if last_stage else 1000
    return RankData(grads=grads, routers=routers, num_tokens=num_tokens)


# --------------------------------------------------------------------------- catalog

H = 4


def gpt_params(
    *,
    position_embedding: bool = True,
    frozen_embedding: bool = False,
    experts: bool = False,
    gtp_remat: bool = False,
) -> tuple[ParamLayout, ...]:
    """A small GPT-like chunk with one of every kind of flagged parameter."""
    params = [
        ParamLayout(WORD_EMB, (8, H), role="word_embedding", requires_grad=not frozen_embedding),
        ParamLayout("decoder.layers.0.input_layernorm.weight", (H,), sequence_parallel=True),
        ParamLayout("decoder.layers.0.self_attention.q_layernorm.weight", (2,)),
        ParamLayout("decoder.layers.0.self_attention.k_layernorm.weight", (2,)),
        ParamLayout("decoder.layers.0.self_attention.linear_qkv.weight", (6, H)),
        ParamLayout("decoder.layers.0.mlp.linear_fc1.weight", (3, H)),
        ParamLayout("decoder.layers.0.mlp.tp_avg.weight", (3,), average_gradients_across_tp_domain=True),
        ParamLayout("decoder.final_layernorm.weight", (H,), sequence_parallel=True),
        ParamLayout("cond_embedder.timestep.weight", (3,), pipeline_parallel=True),
        ParamLayout("flextron_router.weight", (2,), flextron_router_pp_sync=True),
        ParamLayout("decoder.layers.0.frozen.weight", (2,), requires_grad=False),
    ]
    if position_embedding:
        params.insert(1, ParamLayout(POS_EMB, (4, H), role="position_embedding"))
    if experts:
        params += [
            ParamLayout("decoder.layers.0.mlp.experts.linear_fc1.weight", (4, H), expert=True),
            ParamLayout("decoder.layers.0.mlp.experts.norm.weight", (H,), expert=True, sequence_parallel=True),
        ]
    if gtp_remat:
        params += [
            ParamLayout("decoder.layers.0.mlp.linear_fc2.weight", (H, 3), is_gtp_weight_remat=True),
            ParamLayout("decoder.layers.0.mlp.experts.linear_fc2.weight", (H, 4), expert=True, is_gtp_weight_remat=True),
        ]
    return tuple(params)


DENSE_MESHES: tuple[tuple[int, int, int, int], ...] = (
    (2, 2, 1, 2),
    (4, 1, 1, 2),
    (1, 2, 2, 2),
    (2, 1, 2, 2),
    (1, 8, 1, 1),
    (1, 1, 1, 8),
    (1, 1, 1, 1),
)


def _name(mesh: tuple[int, ...], tag: str) -> str:
    return "pp{}dp{}cp{}tp{}".format(*mesh) + "-" + tag


def dense_scenarios() -> Iterator[Scenario]:
    """The foundation issue's dense cases, on every mesh."""
    for mesh in DENSE_MESHES:
        pp, dp, cp, tp = mesh
        base = dict(pp=pp, dp=dp, cp=cp, tp=tp, params=gpt_params())
        all_on = dict(sequence_parallel=True, qk_layernorm=True, has_cond_embedder=True, flextron=True)
        yield Scenario(_name(mesh, "base"), **base, config={})
        yield Scenario(_name(mesh, "flags-vpp2"), **base, num_chunks=2, config=all_on)
        yield Scenario(
            _name(mesh, "avgcoll-bf16-grad"),
            **base,
            config=dict(all_on, average_in_collective=True),
            dtype="bfloat16",
            grad_attr="grad",
        )
        yield Scenario(
            _name(mesh, "pertoken"),
            **base,
            num_chunks=2,
            config=dict(all_on, calculate_per_token_loss=True),
            num_tokens="random",
        )
        yield Scenario(
            _name(mesh, "pertoken-zero"),
            **base,
            config=dict(calculate_per_token_loss=True, sequence_parallel=True),
            num_tokens="zero",
        )
        yield Scenario(_name(mesh, "random-f32"), **base, num_chunks=2, config=all_on, mode="random", seed=1)
        yield Scenario(
            _name(mesh, "random-bf16-pertoken"),
            **base,
            config=dict(all_on, calculate_per_token_loss=True),
            dtype="bfloat16",
            mode="random",
            num_tokens="random",
            seed=2,
        )
        yield Scenario(
            _name(mesh, "untied-frozen"),
            pp=pp, dp=dp, cp=cp, tp=tp,
            params=gpt_params(frozen_embedding=True),
            config=dict(share_embeddings_and_output_weights=False, qk_layernorm=True),
        )
        yield Scenario(
            _name(mesh, "tied-frozen"),
            pp=pp, dp=dp, cp=cp, tp=tp,
            params=gpt_params(frozen_embedding=True),
            num_chunks=2,
            config=dict(sequence_parallel=True),
        )
        yield Scenario(
            _name(mesh, "untied-nopos"),
            pp=pp, dp=dp, cp=cp, tp=tp,
            params=gpt_params(position_embedding=False),
            num_chunks=2,
            config=dict(share_embeddings_and_output_weights=False, sequence_parallel=True),
        )
        yield Scenario(
            _name(mesh, "distopt-scatter"),
            **base,
            num_chunks=2,
            config=dict(use_distributed_optimizer=True, sequence_parallel=True),
        )
        yield Scenario(
            _name(mesh, "distopt-forced-allreduce"),
            **base,
            config=dict(use_distributed_optimizer=True, average_in_collective=True),
            force_all_reduce=True,
        )
        if pp >= 2:
            stages = tuple(range(pp))
            # Every cross-stage-summed gradient (tied word and position embedding, cond
            # embedder, flextron router; two chunk copies each) in a reduce-scatter of its own.
            yield Scenario(
                _name(mesh, "distopt-scatter-cross-stage"),
                **base,
                num_chunks=2,
                config=dict(all_on, use_distributed_optimizer=True, position_embedding_stages=stages),
            )
            yield Scenario(
                _name(mesh, "pos-embd-all-stages"),
                **base,
                num_chunks=2,
                config=dict(position_embedding_stages=stages, sequence_parallel=True),
            )
        if pp >= 3:
            yield Scenario(
                _name(mesh, "mtp-middle"),
                **base,
                num_chunks=2,
                config=dict(mtp_num_layers=1, embedding_stages=(0, pp - 2, pp - 1)),
            )
            yield Scenario(
                _name(mesh, "mtp-middle-pos-embd"),
                **base,
                num_chunks=2,
                config=dict(
                    mtp_num_layers=1,
                    embedding_stages=(0, pp - 2, pp - 1),
                    position_embedding_stages=(0, 1, pp - 2),
                ),
            )
            yield Scenario(
                _name(mesh, "no-mtp-middle"),
                **base,
                num_chunks=2,
                config=dict(embedding_stages=(0, 1, pp - 1), share_embeddings_and_output_weights=True),
            )


def moe_routers(*, qb: bool = False) -> tuple[RouterLayout, ...]:
    """Two trained MoE routers of 4 and 8 experts (ragged), one in eval mode, one frozen."""
    return (
        RouterLayout("decoder.layers.0.mlp.router", 4, has_qb_beta=qb),
        RouterLayout("decoder.layers.1.mlp.router", 8, has_qb_beta=qb),
        RouterLayout("decoder.layers.2.mlp.router", 4, training=False, has_qb_beta=qb),
        RouterLayout("decoder.layers.3.mlp.router", 8, frozen_expert_bias=True, has_qb_beta=qb),
    )


#: (pp, dp, cp, tp, edp, ep, etp) of the experts issue.
EXPERT_MESHES: tuple[tuple[int, ...], ...] = (
    (1, 4, 1, 2, 2, 2, 2),
    (1, 4, 1, 2, 1, 4, 2),
    (2, 2, 1, 2, 1, 2, 2),
    (1, 2, 1, 2, 2, 2, 1),
    (1, 1, 1, 1, 1, 1, 1),
)


def expert_scenarios() -> Iterator[Scenario]:
    """Expert DP sync, router expert bias, quantile balancing and GTP-remat cases."""
    for pp, dp, cp, tp, edp, ep, etp in EXPERT_MESHES:
        mesh = dict(pp=pp, dp=dp, cp=cp, tp=tp, ep=ep, etp=etp)
        tag = "pp{}dp{}cp{}tp{}-edp{}ep{}etp{}".format(pp, dp, cp, tp, edp, ep, etp)
        params = gpt_params(experts=True)
        bias = dict(sequence_parallel=True, moe_router_enable_expert_bias=True)
        yield Scenario(f"{tag}-experts", **mesh, params=params, routers=moe_routers(), config={})
        yield Scenario(
            f"{tag}-bias0.25-avgcoll",
            **mesh,
            params=params,
            num_chunks=2,
            routers=moe_routers(),
            config=dict(bias, moe_router_bias_update_rate=0.25, average_in_collective=True),
        )
        yield Scenario(
            f"{tag}-bias1e-3-pertoken-global-aux",
            **mesh,
            params=params,
            routers=moe_routers(),
            config=dict(
                bias,
                moe_router_bias_update_rate=1e-3,
                calculate_per_token_loss=True,
                moe_router_load_balancing_type="global_aux_loss",
            ),
            num_tokens="random",
        )
        for ema in (0.0, 0.9):
            yield Scenario(
                f"{tag}-qb-ema{ema}",
                **mesh,
                params=params,
                routers=moe_routers(qb=True),
                config=dict(
                    moe_router_load_balancing_type="quantile_balancing",
                    moe_router_quantile_balancing_ema=ema,
                ),
            )
        yield Scenario(
            f"{tag}-distopt-scatter-avgcoll",
            **mesh,
            params=params,
            config=dict(use_distributed_optimizer=True, average_in_collective=True),
        )
        yield Scenario(
            f"{tag}-random-bf16",
            **mesh,
            params=params,
            routers=moe_routers(qb=True),
            num_chunks=2,
            config=dict(
                bias,
                moe_router_bias_update_rate=0.25,
                moe_router_load_balancing_type="quantile_balancing",
            ),
            dtype="bfloat16",
            mode="random",
            seed=3,
        )


#: (pp, dp, cp, gtp, tp, egtp, ep, etp) meshes with GTP-remat active.
GTP_MESHES: tuple[tuple[int, ...], ...] = (
    (1, 2, 1, 2, 2, 1, 2, 2),
    (1, 2, 1, 2, 2, 2, 2, 1),
    (2, 1, 1, 2, 2, 2, 1, 2),
)


def gtp_scenarios() -> Iterator[Scenario]:
    """GTP-remat (gtp / egtp = 2) with and without per-token loss."""
    for pp, dp, cp, gtp, tp, egtp, ep, etp in GTP_MESHES:
        mesh = dict(pp=pp, dp=dp, cp=cp, gtp=gtp, tp=tp, egtp=egtp, ep=ep, etp=etp)
        tag = "pp{}dp{}cp{}gtp{}tp{}-egtp{}ep{}etp{}".format(pp, dp, cp, gtp, tp, egtp, ep, etp)
        params = gpt_params(experts=True, gtp_remat=True)
        qb = dict(moe_router_load_balancing_type="quantile_balancing", moe_router_quantile_balancing_ema=0.5)
        yield Scenario(f"{tag}-gtp-avg", **mesh, params=params, routers=moe_routers(qb=True), config=qb)
        yield Scenario(
            f"{tag}-gtp-pertoken",
            **mesh,
            params=params,
            num_chunks=2,
            routers=moe_routers(qb=True),
            config=dict(qb, calculate_per_token_loss=True, sequence_parallel=True),
            num_tokens="random",
        )
        yield Scenario(
            f"{tag}-gtp-random",
            **mesh,
            params=params,
            config=dict(average_in_collective=True, sequence_parallel=True),
            mode="random",
            seed=4,
        )


def dtype_scenarios() -> Iterator[Scenario]:
    """float16 gradients, and grad_reduce_in_fp32 for bfloat16 / float16 DP sync.

    The "wide" cases are bit-exact only if the DP collective really runs in float32 and
    rounds once: their DP groups have 4 members (a sum of two is rounded once either way)
    and every other group at most 2.
    """
    all_on = dict(sequence_parallel=True, qk_layernorm=True, has_cond_embedder=True, flextron=True)
    fp32 = dict(grad_reduce_in_fp32=True, sequence_parallel=True)
    params = gpt_params(experts=True)
    pipeline = dict(pp=2, dp=2, tp=2)  # world 8: fp16 through every pipeline step
    dp_cp4 = dict(dp=2, cp=2, tp=2, ep=2, etp=1)  # world 8: dp_cp = 4, edp = 4
    dp4 = dict(dp=4, ep=2, etp=1)  # world 4: dp_cp = 4, edp = 2
    cases = [
        ("pp2dp2cp1tp2-fp16-grad", pipeline, dict(num_chunks=2, config=all_on, grad_attr="grad")),
        ("pp1dp2cp2tp2-fp16-random-pertoken", dp_cp4,
         dict(config=dict(all_on, calculate_per_token_loss=True), mode="random", num_tokens="random", seed=5)),
        ("pp1dp4cp1tp1-fp16-distopt-scatter", dp4,
         dict(num_chunks=2, config=dict(use_distributed_optimizer=True, average_in_collective=True))),
        ("pp1dp2cp2tp2-bf16-fp32reduce-wide", dp_cp4, dict(num_chunks=2, config=fp32, mode="wide", seed=6)),
        ("pp1dp2cp2tp2-fp16-fp32reduce-wide-scatter", dp_cp4,
         dict(config=dict(fp32, use_distributed_optimizer=True), mode="wide", seed=7)),
        ("pp1dp4cp1tp1-fp16-fp32reduce-wide", dp4, dict(num_chunks=2, config=fp32, mode="wide", seed=6)),
        ("pp1dp4cp1tp1-bf16-fp32reduce-wide-scatter-avgcoll", dp4,
         dict(config=dict(fp32, use_distributed_optimizer=True, average_in_collective=True), mode="wide", seed=7)),
        ("pp1dp2cp2tp2-bf16-fp32reduce-random-avgcoll", dp_cp4,
         dict(config=dict(fp32, average_in_collective=True, qk_layernorm=True), mode="random", seed=8)),
    ]
    for name, mesh, kw in cases:
        dtype = "float16" if "-fp16-" in name else "bfloat16"
        yield Scenario(name, **mesh, params=params, dtype=dtype, **kw)


def all_scenarios() -> tuple[Scenario, ...]:
    """Every scenario of the parity suite, names unique."""
    scenarios = tuple(dense_scenarios()) + tuple(expert_scenarios()) + tuple(gtp_scenarios())
    scenarios += tuple(dtype_scenarios())
    names = [s.name for s in scenarios]
    if len(names) != len(set(names)):
        raise RuntimeError("duplicate scenario names")
    return scenarios


def by_world_size(scenarios: tuple[Scenario, ...]) -> dict[int, list[Scenario]]:
    out: dict[int, list[Scenario]] = {}
    for s in scenarios:
        out.setdefault(s.world_size, []).append(s)
    return out
