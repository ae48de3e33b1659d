"""Black-box oracle: megatron-core 0.19.2 (the seed's ``finalize_model_grads``) against
torch_impl, every seed function, in gloo worlds of 4 and 8 ranks.

The harness (:mod:`parity_tests.megatron019`) runs megatron-core 0.19.2 from its unpacked
wheel in its own process world (one per world size; 0.16.1, the older oracle of
``tests/test_megatron_oracle.py``, stays installed). For each layout below every rank
initializes megatron-core's ``parallel_state`` (gtp / egtp sizes of 2 and a non-default
``order=`` included) and runs each case on two identical builds of one model -- the
parameters of ``parity_tests.scenarios.gpt_params`` plus real ``TopKRouter`` modules --
with megatron-core's own ``TransformerConfig``, ``DistributedDataParallelConfig`` and
``ProcessGroupCollection`` (from ``use_mpu_process_groups()``, built explicitly from
``dist.new_group``, or none at all). Data are small integers: every gradient (value,
dtype, tensor type), every router buffer and ``num_tokens`` must be bit-identical. Where
megatron-core raises, torch_impl must raise too (catchable as ``AssertionError`` where
megatron-core asserts) and leave every gradient and buffer unchanged.
A case whose subject does not depend on the layout (``LAYOUT_FREE``: a config field's type
or default, the count's dtype, a local reset) runs on the first layout of each world only.

megatron-core 0.19.2's ``_allreduce_replicated_grads_over_gtp_remat_group(model,
calculate_per_token_loss)`` takes its groups from ``parallel_state``; torch_impl's (the
seed's signature) is given the same groups explicitly.

Skipped when the 0.19.2 sources cannot be had (``python -m parity_tests.megatron019 fetch``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

from parity_tests import megatron019 as m19  # noqa: E402
from parity_tests.megatron019 import EVAL_FROZEN, MISSING, Case, Layout  # noqa: E402
from parity_tests.scenarios import POS_EMB, gpt_params  # noqa: E402

LAYOUTS: dict[int, tuple[Layout, ...]] = {
    4: (
        Layout("tp2pp2-pos01", 4, tp=2, pp=2, pos=(0, 1)),
        Layout("gtp2dp2-egtp2", 4, gtp=2, egtp=2),
    ),
    8: (
        Layout("pp2dp2tp2-ep2", 8, pp=2, tp=2, ep=2),
        Layout("pp2dp2tp2-order-tp-cp-ep-pp-dp", 8, pp=2, tp=2, order="tp-cp-ep-pp-dp"),
        Layout("tp2gtp2dp2-ep2-egtp2", 8, tp=2, gtp=2, ep=2, etp=1, egtp=2),
        Layout("pp2cp2gtp2-egtp2", 8, pp=2, cp=2, gtp=2, egtp=2),
    ),
}

ALL_ON = dict(sequence_parallel=True, qk_layernorm=True, has_cond_embedder=True)
BIAS = dict(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.25, num_moe_experts=4)
EVERYTHING = dict(ALL_ON, **BIAS, moe_router_load_balancing_type="global_aux_loss")
QB = dict(moe_router_load_balancing_type="quantile_balancing", moe_router_quantile_balancing_ema=0.25)
VPP2 = dict(num_chunks=2)


def _ours(impl: Any) -> bool:
    return impl.__name__ == "torch_impl"


def _pos_frozen() -> tuple[Any, ...]:
    return tuple(dataclasses.replace(p, requires_grad=False) if p.name == POS_EMB else p
                 for p in gpt_params(experts=True, gtp_remat=True))


def _namespace_without(*names: str) -> Callable[[Any], Any]:
    """torch_impl's side gets a plain namespace copy of megatron's config lacking ``names``
    (megatron's side keeps the TransformerConfig with its defaults)."""
    def make(cfg: Any) -> Any:
        return types.SimpleNamespace(**{k: v for k, v in vars(cfg).items() if k not in names})
    return make


#: Cases whose subject does not depend on the layout (a config field's type or default, the
#: count's dtype, a local reset): run on the first layout of each world only. Their
#: reductions run on every layout in the case they vary ("qb", "router-grads", "fin", ...).
LAYOUT_FREE = frozenset({
    "router-grads-flextron", "qb-config-without-ema", "reset", "reset-list", "reset-qb",
    "fin-tokens-int32", "fin-tokens-float32", "fin-type-list-qb", "fin-type-list-aux",
})


def cases(layout: Layout) -> dict[str, Case]:
    """Every comparison on ``layout``, by name (the same on every rank)."""
    out: dict[str, Case] = {}
    first = layout == LAYOUTS[layout.world][0]

    def add(name: str, call: Callable[..., Any], **kw: Any) -> None:
        if first or name not in LAYOUT_FREE:
            out[name] = Case(call=call, **kw)

    # ---- 2.4 non-tensor-parallel grads
    add("nontp", lambda impl, m, cfg, env, n: impl._allreduce_non_tensor_model_parallel_grads(m, cfg, env.mpu.tp),
        config=ALL_ON, wrap=False)
    add("nontp-explicit", lambda impl, m, cfg, env, n: impl._allreduce_non_tensor_model_parallel_grads(
        m, cfg, env.explicit.tp), config=ALL_ON, wrap=False)
    add("nontp-none-group", lambda impl, m, cfg, env, n: impl._allreduce_non_tensor_model_parallel_grads(m, cfg),
        config=ALL_ON, wrap=False)
    add("layernorm-alias", lambda impl, m, cfg, env, n: impl._allreduce_layernorm_grads(m, cfg, env.mpu.tp),
        config=dict(sequence_parallel=True), wrap=False)
    # ---- 2.2 conditional embedder / 2.3 router grads
    add("cond", lambda impl, m, cfg, env, n: impl._allreduce_conditional_embedding_grads(m, cfg, env.mpu.pp),
        config=dict(has_cond_embedder=True), scenario=VPP2, wrap=False)
    add("cond-none-group", lambda impl, m, cfg, env, n: impl._allreduce_conditional_embedding_grads(m, cfg),
        config=dict(has_cond_embedder=True), scenario=VPP2, wrap=False)
    # megatron's helper ignores config.flextron (0.19.2's TransformerConfig has no such field)
    add("router-grads", lambda impl, m, cfg, env, n: impl._allreduce_router_grads(m, cfg),
        scenario=VPP2, wrap=False)
    add("router-grads-flextron", lambda impl, m, cfg, env, n: impl._allreduce_router_grads(m, cfg),
        config=dict(flextron=True), scenario=VPP2, wrap=False)
    # ---- 2.6 / 2.7 embeddings
    word = lambda impl, m, cfg, env, n: impl._allreduce_word_embedding_grads(m, cfg, env.mpu.embd, env.mpu.pp)  # noqa: E731
    add("word", word, scenario=VPP2, wrap=False)
    add("word-explicit", lambda impl, m, cfg, env, n: impl._allreduce_word_embedding_grads(
        m, cfg, env.explicit.embd, env.explicit.pp), scenario=VPP2, wrap=False)
    add("word-none-groups", lambda impl, m, cfg, env, n: impl._allreduce_word_embedding_grads(m, cfg),
        scenario=VPP2, wrap=False)
    add("word-untied-mtp", word, config=dict(mtp_num_layers=1), wrap=False,
        scenario=dict(num_chunks=2, config=dict(share_embeddings_and_output_weights=False)))
    add("word-untied", word, wrap=False, scenario=dict(config=dict(share_embeddings_and_output_weights=False)))
    getter = lambda mod: mod.get_parameter("decoder.final_layernorm.weight")  # noqa: E731
    add("embedding-grad", lambda impl, m, cfg, env, n: impl._allreduce_embedding_grad(
        m, env.mpu.embd, env.mpu.pp, getter, config=cfg), config=dict(mtp_num_layers=1), scenario=VPP2, wrap=False)
    add("embedding-grad-none-embd", lambda impl, m, cfg, env, n: impl._allreduce_embedding_grad(
        m, None, env.mpu.pp, getter), wrap=False)
    add("pos", lambda impl, m, cfg, env, n: impl._allreduce_position_embedding_grads(
        m, cfg, env.mpu.pos_embd, env.mpu.pp), scenario=VPP2, wrap=False)
    add("pos-explicit", lambda impl, m, cfg, env, n: impl._allreduce_position_embedding_grads(
        m, cfg, env.explicit.pos_embd, env.explicit.pp), wrap=False)
    # ---- 2.8 expert bias (the helper does not look at moe_router_enable_expert_bias)
    add("expert-bias", lambda impl, m, cfg, env, n: impl._update_router_expert_bias(m, cfg, env.mpu.tp_dp_cp),
        config=BIAS, routers=EVAL_FROZEN, wrap=False)
    add("expert-bias-none-group", lambda impl, m, cfg, env, n: impl._update_router_expert_bias(m, cfg),
        config=BIAS, wrap=False, scenario=VPP2)
    add("expert-bias-flag-off", lambda impl, m, cfg, env, n: impl._update_router_expert_bias(
        m, cfg, env.explicit.tp_dp_cp), config=dict(moe_router_bias_update_rate=0.5), wrap=False)
    # ---- 2.9 quantile balancing (the helper ignores the balancing type)
    add("qb", lambda impl, m, cfg, env, n: impl._update_router_qb_beta(m, cfg, env.mpu.dp_cp), config=QB,
        routers=EVAL_FROZEN, wrap=False)
    add("qb-type-aux", lambda impl, m, cfg, env, n: impl._update_router_qb_beta(m, cfg, env.mpu.dp_cp),
        config=dict(moe_router_quantile_balancing_ema=0.5), wrap=False)
    add("qb-dp_cp_gtp", lambda impl, m, cfg, env, n: impl._update_router_qb_beta(m, cfg, env.mpu.dp_cp_gtp_remat),
        config=QB, wrap=False, scenario=VPP2)
    # None is passed on to all_reduce: torch.distributed's default (WORLD) group
    add("qb-none-group", lambda impl, m, cfg, env, n: impl._update_router_qb_beta(m, cfg), config=QB, wrap=False)
    # a config lacking the EMA field: megatron's default (0.0)
    add("qb-config-without-ema", lambda impl, m, cfg, env, n: impl._update_router_qb_beta(m, cfg, env.mpu.dp_cp),
        config=dict(moe_router_load_balancing_type="quantile_balancing"), wrap=False,
        ours_config=_namespace_without("moe_router_quantile_balancing_ema"))
    # ---- 2.10 reset
    reset = lambda impl, m, cfg, env, n: impl.reset_model_temporary_tensors(cfg, m)  # noqa: E731
    add("reset", reset, config=dict(BIAS, moe_router_load_balancing_type="global_aux_loss"), wrap=False)
    add("reset-list", reset, config=dict(moe_router_load_balancing_type=["aux_loss", "global_aux_loss"]), wrap=False)
    add("reset-qb", reset, config=QB, wrap=False)
    # ---- 2.5 GTP replicated grads (megatron 0.19.2 looks its groups up in parallel_state)
    def gtp(per_token: bool, groups: str = "mpu") -> Callable[..., Any]:
        def call(impl: Any, m: list[Any], cfg: Any, env: Any, n: Any) -> Any:
            if _ours(impl):
                pgc = getattr(env, groups)
                return impl._allreduce_replicated_grads_over_gtp_remat_group(
                    m, pgc.gtp_remat, pgc.expt_gtp_remat, calculate_per_token_loss=per_token)
            return impl._allreduce_replicated_grads_over_gtp_remat_group(m, calculate_per_token_loss=per_token)
        return call

    add("gtp", gtp(False), wrap=False)
    add("gtp-per-token", gtp(True), wrap=False, scenario=VPP2)
    add("gtp-explicit", gtp(False, "explicit"), wrap=False, scenario=dict(dtype="bfloat16"))

    # ---- finalize_model_grads (DDP-like chunks)
    def fin(pgc: str = "mpu", force: bool = False, **override: Any) -> Callable[..., Any]:
        def call(impl: Any, m: list[Any], cfg: Any, env: Any, n: Any) -> Any:
            return impl.finalize_model_grads(m, num_tokens=n, pg_collection=env.collection(pgc, **override),
                                             force_all_reduce=force)
        return call

    per_token = dict(EVERYTHING, calculate_per_token_loss=True)
    add("fin", fin(), config=EVERYTHING, scenario=VPP2)
    add("fin-explicit", fin("explicit"), config=EVERYTHING, scenario=VPP2)
    add("fin-none", fin("none"), config=EVERYTHING, scenario=VPP2)
    add("fin-routers-eval-frozen", fin(), config=EVERYTHING, routers=EVAL_FROZEN)
    add("fin-force", fin(force=True), config=ALL_ON, ddp=dict(use_distributed_optimizer=True))
    for dtype in ("int64", "int32", "float32"):
        add(f"fin-tokens-{dtype}", fin(), config=per_token, scenario=VPP2, tokens=dtype)
    add("fin-tokens-int32-none", fin("none"), config=per_token, tokens="int32")
    add("fin-tokens-explicit-bf16", fin("explicit"), config=per_token, tokens="int64", scenario=dict(dtype="bfloat16"))
    add("fin-mtp", fin(), config=dict(ALL_ON, mtp_num_layers=1), scenario=VPP2)
    add("fin-mtp-untied", fin(), config=dict(ALL_ON, mtp_num_layers=1),
        scenario=dict(num_chunks=2, config=dict(share_embeddings_and_output_weights=False)))
    add("fin-untied", fin(), config=ALL_ON, scenario=dict(config=dict(share_embeddings_and_output_weights=False)))
    add("fin-flextron", fin(), config=dict(ALL_ON, flextron=True), scenario=VPP2)
    add("fin-qb", fin(), config=dict(ALL_ON, **QB), routers=EVAL_FROZEN)
    add("fin-qb-tokens", fin(), config=dict(QB, calculate_per_token_loss=True), tokens="int64")
    add("fin-qb-none", fin("none"), config=dict(QB, moe_router_enable_expert_bias=True))
    # a list of balancing types (megatron compares the whole value with "quantile_balancing")
    add("fin-type-list-qb", fin(), config=dict(QB, moe_router_load_balancing_type=["quantile_balancing"]))
    add("fin-type-list-aux", fin(), config=dict(BIAS, moe_router_load_balancing_type=["aux_loss", "global_aux_loss"]))
    # groups are the truth: config sizes left at their defaults; a tp field holding another group
    add("fin-config-default-sizes", fin(), config=EVERYTHING, sizes=False, tokens="int64")
    add("fin-tp-is-dp-group", fin(tp="dp"), config=ALL_ON)
    # fields never set (missing) vs set to None
    if layout == LAYOUTS[4][0]:
        # asserted from the config and the collection alone, before anything else: one layout suffices
        add("fin-missing-tp_dp_cp", fin(tp_dp_cp=MISSING), config=EVERYTHING)
    add("fin-missing-tp_dp_cp-bias-off", fin(tp_dp_cp=MISSING), config=ALL_ON)
    add("fin-missing-dp_cp-tokens", fin(dp_cp=MISSING, dp_cp_gtp_remat=MISSING),
        config=dict(ALL_ON, calculate_per_token_loss=True), tokens="int64")
    add("fin-missing-dp_cp_gtp_remat-tokens", fin(dp_cp_gtp_remat=MISSING),
        config=dict(ALL_ON, calculate_per_token_loss=True, **QB), tokens="int64")
    add("fin-missing-tp", fin(tp=MISSING), config=ALL_ON)
    add("fin-missing-pp", fin(pp=MISSING), config=ALL_ON, scenario=VPP2)
    add("fin-missing-pp-tokens", fin(pp=MISSING), config=dict(ALL_ON, calculate_per_token_loss=True), tokens="int64")
    add("fin-missing-pp-embd", fin(pp=MISSING, embd=MISSING), config=ALL_ON, scenario=VPP2)
    add("fin-missing-embd", fin(embd=MISSING), config=ALL_ON)
    add("fin-missing-pos_embd", fin(pos_embd=MISSING), config=ALL_ON)
    add("fin-none-embd", fin(embd=None), config=ALL_ON)
    add("fin-missing-gtp", fin(gtp_remat=MISSING, expt_gtp_remat=MISSING), config=ALL_ON)
    # errors (only where every rank is a position-embedding member: elsewhere only members can tell)
    if layout.pp > 1 and layout.pos is not None and len(layout.pos) == layout.pp:
        add("fin-pos-frozen", fin(), config=ALL_ON, scenario=dict(params=_pos_frozen()))
    return out


# =========================================================================== parent side

#: Cases that change nothing on any layout, by design.
NO_EFFECT = {"embedding-grad-none-embd", "word-untied"}
#: Cases where megatron-core must raise on some rank of some layout.
MUST_RAISE = {"fin-missing-tp_dp_cp", "fin-pos-frozen"}

#: Deliberate differences (README, "Deliberate differences from Megatron-Core"), by case:
#: keys containing the text are not compared; everything else of the case is, bit for bit.
KNOWN_DIFFERENCES: dict[str, str] = {}
#: Where current Megatron-Core asserts and 0.19.2 did not (tests/test_megatron_head_diffs.py):
#: GTP active (gtp_weight_remat_size > 1) and no gtp_remat in the collection. Ours raises
#: MegatronAssertionError there, with nothing changed.
CURRENT_RAISES = {"fin-missing-gtp"}

_WORLDS: dict[int, Any] = {}


def _names(world: int) -> list[str]:
    return [f"{layout.name}:{name}" for layout in LAYOUTS[world] for name in cases(layout)]


def _only(name: str) -> bool:
    only = os.environ.get("MESHGRAD_ORACLE019_ONLY")  # a regex over "layout:case", for debugging
    return not only or re.search(only, name) is not None


def _world(world: int) -> dict[str, list[Any]]:
    src = m19.source_dir()
    if src is None:
        pytest.skip(m19.skip_reason())
    if world not in _WORLDS:
        from parity_tests.process_world import spawn_world

        wanted = {layout.name: [n for n in cases(layout) if _only(f"{layout.name}:{n}")] for layout in LAYOUTS[world]}
        outcome = spawn_world(m19.world_main, world, (str(src), __name__, wanted), timeout=420,
                              prepare=functools.partial(m19.import_megatron, str(src)), crash_retries=1)
        why = outcome.why()
        _WORLDS[world] = {
            name: [outcome.results[r].get(name, ("missing", why)) for r in range(world)] for name in _names(world)
        }
    return _WORLDS[world]


def _per_rank(world: int, name: str) -> list[dict[str, Any]]:
    if not _only(name):
        pytest.skip("not selected by MESHGRAD_ORACLE019_ONLY")
    got = _world(world)[name]
    problems = [f"rank {r}: {s}: {v}" for r, (s, v) in enumerate(got) if s != "ok"]
    if problems:
        pytest.fail("harness: " + "\n".join(problems[:4]))
    return [v for _, v in got]


def _same(x: Any, y: Any) -> bool:
    if x is None or y is None or not isinstance(x, tuple):
        return x == y
    return x[:3] == y[:3] and x[3].shape == y[3].shape and np.array_equal(x[3], y[3], equal_nan=True)


def _show(v: Any) -> str:
    if isinstance(v, tuple) and len(v) == 4:
        kind, dtype, shape, values = v
        return f"{kind}[{dtype}]{values.tolist()}"
    return repr(v)


def _diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    out = []
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key, "<absent>"), b.get(key, "<absent>")
        if not _same(x, y):
            out.append(f"{key}: megatron {_show(x)} ours {_show(y)}")
    return out


def _compare(per_rank: list[dict[str, Any]], skip: str | None = None, current_raises: bool = False) -> None:
    problems = []
    for rank, pair in enumerate(per_rank):
        meg, ours = pair["megatron"], pair["ours"]
        if meg[0] == "error":
            if ours[0] != "error":
                problems.append(f"rank {rank}: megatron raised {meg[1]}: {meg[2]!r}; ours did not")
                continue
            if meg[3] and not ours[3]:
                problems.append(f"rank {rank}: megatron asserts ({meg[2]!r}); ours raised {ours[1]} "
                                f"(not an AssertionError): {ours[2]!r}")
            changed = _diff(pair["inputs"], ours[4])
            problems += [f"rank {rank}: ours raised but changed {d}" for d in changed[:5]]
            continue
        if ours[0] != "ok":
            if current_raises and ours[1] == "MegatronAssertionError" and not _diff(pair["inputs"], ours[4]):
                continue
            problems.append(f"rank {rank}: ours raised {ours[1]}: {ours[2]!r}; megatron did not")
            continue
        problems += [f"rank {rank}: {d}" for d in _diff(meg[1], ours[1]) if skip is None or skip not in d.split(":")[0]]
        if meg[2] != ours[2]:
            problems.append(f"rank {rank}: calls differ: megatron {meg[2]} ours {ours[2]}")
    assert not problems, "\n".join(problems[:24]) + (f"\n... {len(problems) - 24} more" if len(problems) > 24 else "")


@pytest.mark.parametrize("name", _names(4))
def test_oracle019_world4(name: str) -> None:
    _compare(_per_rank(4, name), KNOWN_DIFFERENCES.get(name.split(":")[-1]), name.split(":")[-1] in CURRENT_RAISES)


@pytest.mark.parametrize("name", _names(8))
def test_oracle019_world8(name: str) -> None:
    _compare(_per_rank(8, name), KNOWN_DIFFERENCES.get(name.split(":")[-1]), name.split(":")[-1] in CURRENT_RAISES)


def test_layout_free_cases_run_on_the_first_layout_of_each_world_only() -> None:
    for layouts in LAYOUTS.values():
        assert LAYOUT_FREE <= set(cases(layouts[0]))
        assert all(not LAYOUT_FREE & set(cases(layout)) for layout in layouts[1:])


def test_oracle019_cases_are_not_vacuous() -> None:
    """Each case exercises something: on some rank of some layout megatron-core changed a
    value, or raised where it must."""
    effect: dict[str, bool] = {}
    raised: dict[str, bool] = {}
    for world in sorted(LAYOUTS):
        results = _world(world)
        for layout in LAYOUTS[world]:
            for name in cases(layout):
                for status, pair in results[f"{layout.name}:{name}"]:
                    if status != "ok":
                        continue
                    meg = pair["megatron"]
                    raised[name] = raised.get(name, False) or meg[0] == "error"
                    moved = meg[0] == "ok" and (bool(_diff(pair["inputs"], meg[1])) or meg[2]["fence"] > 0)
                    effect[name] = effect.get(name, False) or moved
    assert sorted(n for n in MUST_RAISE if not raised.get(n)) == []
    idle = sorted(n for n in effect if not effect[n] and n not in NO_EFFECT and n not in MUST_RAISE)
    assert idle == [], f"cases where megatron-core changed nothing: {idle}"
    assert sorted(n for n in NO_EFFECT if effect.get(n)) == []
