"""The predicted table of docs/performance.md "At scale": finalize's communication per
step for the presets at 1k, 4k and 16k GPUs, meshgrad beside Megatron-Core, next to a
rough backward time (``python -m meshgrad at-scale``)."""

from __future__ import annotations

from typing import Any

from meshgrad.config import FinalizeConfig
from meshgrad.cost import CostModel, backward_seconds, finalize_cost
from meshgrad.explain import Layout, explain
from meshgrad.presets import PRESETS, ModelPreset

#: World sizes of the table.
WORLDS = (1024, 4096, 16384)
#: Global batch per step (tokens), as large pre-training runs use at these scales.
GLOBAL_BATCH_TOKENS = 16 * 2**20


def layout_for(preset: str, world: int) -> Layout:
    """The layout of a preset at ``world`` ranks: tp and pp fixed per model, dp fills the
    rest (the MoE spreads its experts over ep = 8 with etp = 1)."""
    if preset == "gpt-8b":
        return Layout(tp=4, dp=world // 4)
    if preset == "gpt-70b":
        return Layout(tp=8, pp=4, dp=world // 32)
    if preset == "moe-8x7b":
        return Layout(tp=2, pp=4, dp=world // 8, ep=8, etp=1)
    raise KeyError(f"no at-scale layout for preset {preset!r}; known: gpt-8b, gpt-70b, moe-8x7b")


def config_for(m: ModelPreset, **flags: Any) -> FinalizeConfig:
    """The finalize config of a preset: its tying, qk layernorm and expert bias, with ``flags``."""
    return FinalizeConfig(
        share_embeddings_and_output_weights=m.tied, qk_layernorm=m.qk_layernorm,
        moe_router_enable_expert_bias=m.expert_bias and bool(m.experts), **flags,
    )


def predict_row(preset: str, world: int, cost: CostModel | None = None, overlap: bool = False,
                **flags: Any) -> dict[str, Any]:
    """One row: the slowest class's predicted finalize time (meshgrad, its status round,
    Megatron-Core) and the backward estimate, for ``preset`` at ``world`` ranks."""
    m = PRESETS[preset]
    layout = layout_for(preset, world)
    flags = {"use_distributed_optimizer": True, "sequence_parallel": layout.tp > 1, **flags}
    explained = explain(m, layout, config_for(m, **flags), overlap=overlap)
    costs = finalize_cost(explained, cost)
    worst = max(costs, key=lambda c: c.seconds)
    backward = backward_seconds(m.active_params(), GLOBAL_BATCH_TOKENS // layout.dp, layout.world // layout.dp)
    return {
        "preset": preset, "world": world, "layout": layout.text(), "classes": len(costs),
        "meshgrad_s": worst.seconds, "status_s": worst.status_seconds, "status_share": worst.status_share,
        "megatron_s": max(c.megatron_seconds for c in costs), "backward_s": backward,
        "slowest_class": worst.name, "overlap": overlap,
    }


def predict_table(cost: CostModel | None = None, overlap: bool = False, **flags: Any) -> list[dict[str, Any]]:
    """Every preset (but the toy) at every :data:`WORLDS` size."""
    return [predict_row(p, w, cost, overlap, **flags) for p in ("gpt-8b", "gpt-70b", "moe-8x7b") for w in WORLDS]


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table."""
    lines = [
        "| model | GPUs | layout | meshgrad finalize | status round (share) | Megatron-Core finalize | backward (est.) | finalize / backward |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['preset']} | {r['world']:,} | {r['layout']} | {1e3 * r['meshgrad_s']:.1f} ms | "
            f"{1e6 * r['status_s']:.0f} us ({100 * r['status_share']:.2f} %) | {1e3 * r['megatron_s']:.1f} ms | "
            f"{r['backward_s']:.2f} s | {100 * r['meshgrad_s'] / r['backward_s']:.1f} % |"
        )
    return "\n".join(lines)


__all__ = ["GLOBAL_BATCH_TOKENS", "WORLDS", "config_for", "format_table", "layout_for", "predict_row", "predict_table"]
