"""What finalize launches on every rank of a layout, before the machines exist.

:func:`explain` plans the model with :func:`meshgrad.plan.plan_finalize` -- the plan the
backends execute -- once per *rank class* (the pp stages whose ranks hold the same
parameters and the same embedding-group membership: every tp / dp / cp / ep rank of a
stage plans alike), never once per rank, so a 16k-rank layout costs a handful of plans.
Each class lists the collectives a torch_impl rank launches, in launch order
(:func:`meshgrad.launches.launches`), beside Megatron-Core's finalize on the same layout
(:func:`meshgrad.megatron_launches.megatron_launches`) and the status round torch_impl
adds per call (:func:`meshgrad.launches.status_round`, the one place that models it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from meshgrad.axes import Axis, Group, ParallelDims
from meshgrad.config import FinalizeConfig
from meshgrad.errors import FinalizeInputError
from meshgrad.launches import ITEMSIZE, STATUS_INT64, Launch, human_bytes, launches, status_round
from meshgrad.megatron_launches import ddp_launches, megatron_launches
from meshgrad.plan import FinalizePlan, GroupSizes, plan_finalize
from meshgrad.presets import ModelPreset, StageModel, json_stage, preset_stage


@dataclasses.dataclass(frozen=True)
class Layout:
    """The parallel layout: dense ``pp x dp x cp x gtp x tp``, experts ``ep x etp``, ``vpp``
    virtual chunks per stage."""

    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    etp: int | None = None
    gtp: int = 1
    vpp: int = 1

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.name == "etp":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise FinalizeInputError(f"Layout.{f.name} must be a positive int, got {value!r}")

    @property
    def dims(self) -> ParallelDims:
        """The :class:`ParallelDims` of this layout (raises ValueError when the views disagree)."""
        return ParallelDims(pp=self.pp, dp=self.dp, cp=self.cp, tp=self.tp, gtp=self.gtp, ep=self.ep, etp=self.etp)

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.gtp * self.tp

    def text(self) -> str:
        parts = [f"{k.upper()}{v}" for k, v in dataclasses.asdict(self).items() if v not in (None, 1)]
        return " x ".join(parts) or "1 rank"


@dataclasses.dataclass(frozen=True)
class RankClass:
    """The ranks that plan alike: every rank of the pp ``stages``.

    Args:
      stages: the pp stages of the class.
      ranks: how many ranks it holds.
      plan: the plan of its first stage (the backends' object).
      meshgrad: what a torch_impl rank of the class launches (status round first).
      megatron: what Megatron-Core's finalize launches there.
    """

    stages: tuple[int, ...]
    ranks: int
    plan: FinalizePlan
    meshgrad: tuple[Launch, ...]
    megatron: tuple[Launch, ...]

    @property
    def name(self) -> str:
        s = self.stages
        if len(s) == 1:
            return f"pp stage {s[0]}"
        if s == tuple(range(s[0], s[-1] + 1)):
            return f"pp stages {s[0]}-{s[-1]}"
        return "pp stages " + ",".join(map(str, s))

    def bytes_by_axes(self, which: str = "meshgrad") -> dict[str, int]:
        """Bytes launched per group axes (``"dp"``, ``"dp x cp"``, ``"tp"``, ``"world"`` ...)."""
        out: dict[str, int] = {}
        for item in getattr(self, which):
            name = " x ".join(item.axes)
            out[name] = out.get(name, 0) + item.nbytes
        return out


@dataclasses.dataclass(frozen=True)
class Explanation:
    """Every rank class of a layout, with its collectives (:func:`explain`)."""

    model: str
    layout: Layout
    config: FinalizeConfig
    overlap: bool
    classes: tuple[RankClass, ...]

    @property
    def num_tokens(self) -> bool:
        return self.config.calculate_per_token_loss

    def class_of(self, rank: int) -> RankClass:
        """The class of global ``rank``."""
        stage = self.layout.dims.coords(rank)[Axis.PP]
        return next(c for c in self.classes if stage in c.stages)

    def rank_launches(self, rank: int, which: str = "meshgrad") -> list[tuple[Launch, tuple[int, ...]]]:
        """What global ``rank`` launches, each with its group's members (global ranks)."""
        dims = self.layout.dims
        sizes = GroupSizes.from_dims(dims, self.config)
        out = []
        for item in getattr(self.class_of(rank), which):
            if item.group == "world":
                members = tuple(range(dims.world_size))
            else:
                group = Group(item.group)
                stages = {Group.EMBD: sizes.embd_stages, Group.POS_EMBD: sizes.pos_embd_stages}.get(group)
                members = tuple(dims.group_ranks(group, rank, stages))
            out.append((item, members))
        return out

    def to_json(self) -> dict[str, Any]:
        """The explanation as plain data (``--json``)."""
        def rows(items: Sequence[Launch]) -> list[dict[str, Any]]:
            return [{**dataclasses.asdict(i), "axes": list(i.axes), "bytes": i.nbytes} for i in items]

        return {
            "model": self.model,
            "layout": {**dataclasses.asdict(self.layout), "world": self.layout.world},
            "config": dataclasses.asdict(self.config),
            "overlap_grad_reduce": self.overlap,
            "num_tokens": self.num_tokens,
            "classes": [
                {
                    "name": c.name, "stages": list(c.stages), "ranks": c.ranks,
                    "params": len(c.plan.params), "grad_elements": sum(p.numel for p in c.plan.params),
                    "plan": c.plan.describe().splitlines(),
                    "meshgrad": rows(c.meshgrad), "megatron": rows(c.megatron),
                    "bytes_by_axes": c.bytes_by_axes(), "megatron_bytes_by_axes": c.bytes_by_axes("megatron"),
                }
                for c in self.classes
            ],
        }

    def text(self) -> str:
        """The explanation as a report, one section per rank class."""
        head = (f"{self.model} on {self.layout.text()} ({self.layout.world} ranks), "
                f"{'per-token loss' if self.num_tokens else 'mean loss'}"
                f"{', distributed optimizer' if self.config.use_distributed_optimizer else ''}"
                f"{', sequence parallel' if self.config.sequence_parallel else ''}"
                f"{', overlap_grad_reduce (DP sync by Megatron DDP)' if self.overlap else ''}")
        lines = [head, f"{len(self.classes)} rank class(es), one plan each", ""]
        cols = f"  {'step':<22} {'collective':<14} {'op':<4} {'group':<16} {'axes':<14} {'size':>6} {'dtype':<9} {'elements':>14} {'bytes':>10}"
        for c in self.classes:
            grads = sum(p.numel for p in c.plan.params)
            lines.append(f"== {c.name}: {c.ranks} ranks, {len(c.plan.params)} gradients ({grads:,} elements) ==")
            lines.append(cols)
            lines += ["  " + item.line() for item in c.meshgrad]
            totals = ", ".join(f"{k}: {human_bytes(v)}" for k, v in c.bytes_by_axes().items()) or "nothing"
            lines.append(f"  per axes: {totals}")
            lines.append(f"  Megatron-Core: {len(c.megatron)} collectives, "
                         + (", ".join(f"{k}: {human_bytes(v)}" for k, v in c.bytes_by_axes('megatron').items()) or "nothing"))
            lines.append("")
        return "\n".join(lines).rstrip() + "\n"


#: ``stage -> StageModel``: one pp stage's parameters and routers.
StageSource = Callable[[int], StageModel]


def model_stages(model: ModelPreset | str | Sequence[Any] | Mapping[str, Any], layout: Layout) -> StageSource:
    """The stage source of a preset (:func:`~meshgrad.presets.preset_stage`) or of a JSON
    model description (:func:`~meshgrad.presets.json_stage`) on ``layout``."""
    if isinstance(model, ModelPreset):
        preset = model
        return lambda stage: preset_stage(preset, pp=layout.pp, stage=stage, vpp=layout.vpp, tp=layout.tp,
                                          ep=layout.ep, etp=layout.etp, gtp=layout.gtp)
    return lambda stage: json_stage(model, pp=layout.pp, stage=stage)


def _class_key(model: StageModel, stage: int, sizes: GroupSizes) -> tuple[Any, ...]:
    """What makes two stages plan and launch alike: the same parameters and routers, the
    same embedding-group memberships, and whether it is stage 0 (Megatron's DDP buckets
    there alone)."""
    return (model.params, model.routers, stage in sizes.embd_stages, stage in sizes.pos_embd_stages, stage == 0)


def explain(
    stage_model: StageSource | ModelPreset,
    layout: Layout,
    config: FinalizeConfig,
    *,
    model: str = "model",
    overlap: bool = False,
    bucket_size: int | None = None,
) -> Explanation:
    """Plan every rank class of ``layout`` and list its collectives.

    Args:
      stage_model: a preset, or ``stage -> StageModel`` (:func:`model_stages`).
      layout: the parallel layout.
      config: the finalize options.
      model: a name for the report.
      overlap: ``overlap_grad_reduce``: Megatron's DDP runs the DP sync during backward
        (torch_impl delegates it to that DDP then: the plan's DP sync is left out).
      bucket_size: Megatron DDP's ``bucket_size`` (elements); None: its default.

    Raises:
      FinalizeInputError: the layout or the model does not fit.
    """
    try:
        dims = layout.dims
    except ValueError as err:
        raise FinalizeInputError(f"layout {layout.text()}: {err}") from err
    if isinstance(stage_model, ModelPreset):
        model = stage_model.name if model == "model" else model
        stage_model = model_stages(stage_model, layout)
    sizes = GroupSizes.from_dims(dims, config)
    per_stage = dims.world_size // dims.pp
    found: dict[tuple[Any, ...], list[int]] = {}
    models: dict[tuple[Any, ...], StageModel] = {}
    for stage in range(dims.pp):
        m = stage_model(stage)
        key = _class_key(m, stage, sizes)
        found.setdefault(key, []).append(stage)
        models.setdefault(key, m)
    status = status_round(dims.world_size)
    classes = []
    for key, stages in found.items():
        m, stage = models[key], stages[0]
        plan = plan_finalize(m.params, config, sizes, m.routers, stage=stage)
        num_tokens = config.calculate_per_token_loss
        if overlap:
            dp = ddp_launches(plan, stage, True, bucket_size)
            rest = plan_finalize(m.params, config, sizes, m.routers, stage=stage, dp_sync=False)
            own = dp + launches(rest, stage, num_tokens, world=dims.world_size)
        else:
            own = launches(plan, stage, num_tokens, world=dims.world_size)
        mega = megatron_launches(plan, stage, num_tokens, overlap, bucket_size)
        classes.append(RankClass(tuple(stages), len(stages) * per_stage, plan, status + own, mega))
    classes.sort(key=lambda c: c.stages[0])
    return Explanation(model, layout, config, overlap, tuple(classes))



__all__ = [
    # Launch, launches and status_round are re-exported: the names a reader of a listing needs.
    "Explanation", "ITEMSIZE", "Launch", "Layout", "RankClass", "STATUS_INT64", "explain", "launches",
    "model_stages", "status_round",
]
