"""What finalize launches on every rank of a layout, before the machines exist.

:func:`explain` plans the model with :func:`meshgrad.plan.plan_finalize` -- the plan the
backends execute -- once per *rank class* (the pp stages whose ranks hold the same
parameters and the same embedding-group membership: every tp / dp / cp / ep rank of a
stage plans alike), never once per rank, so a 16k-rank layout costs a handful of plans.
Each class lists the collectives a torch_impl rank launches, in launch order
(:func:`launches`: one per reduction over a group of size > 1, as
:mod:`torch_impl.run.execute` runs them), beside Megatron-Core's finalize on the same layout
(:func:`megatron_launches`) and the status round torch_impl adds per call
(:func:`status_round`, the one place that models it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from meshgrad.actions import ExpertBiasUpdate, QbBetaUpdate, Reduction, StageReduction, Step, TokenScale
from meshgrad.axes import GROUP_AXES, Axis, Group, ParallelDims
from meshgrad.config import FinalizeConfig
from meshgrad.errors import FinalizeInputError
from meshgrad.fusion import merge_reductions
from meshgrad.plan import FinalizePlan, GroupSizes, plan_finalize
from meshgrad.presets import ModelPreset, StageModel, json_stage, preset_stage
from meshgrad.steps import dp_scaling

#: Bytes per element of the dtypes a finalize collective carries.
ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8}

#: The status round (torch_impl/run/status.py): one MAX all-reduce of this many int64 per
#: call over the world. The one place the model of that round lives (see :func:`status_round`).
STATUS_INT64 = 7

#: Megatron DDP's default bucket size with ``overlap_grad_reduce`` (elements):
#: ``max(40_000_000, 1_000_000 * dp)`` (megatron/core/distributed/distributed_data_parallel.py).
MEGATRON_BUCKET_MIN = 40_000_000


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
class Launch:
    """One collective a rank launches.

    Args:
      step: the plan step(s) (``"+"``-joined when fused), ``"status"`` for the status round.
      kind: ``all_reduce``, ``reduce_scatter`` or ``broadcast``.
      op: ``sum``, ``avg``, ``max`` (``-`` for a broadcast).
      group: the named group (:class:`~meshgrad.axes.Group` value) or ``"world"``.
      axes: the mesh axes the group varies.
      size: ranks in the group.
      dtype: the element type on the wire.
      numel: elements of the tensor launched (a reduce-scatter's padded input).
      overlapped: launched during backward (a DDP bucket with ``overlap_grad_reduce``);
        finalize only waits for it.
    """

    step: str
    kind: str
    op: str
    group: str
    axes: tuple[str, ...]
    size: int
    dtype: str
    numel: int
    overlapped: bool = False

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]

    def line(self) -> str:
        tail = "  (overlapped with backward)" if self.overlapped else ""
        return (f"{self.step:<22} {self.kind:<14} {self.op:<4} {self.group:<16} "
                f"{'x'.join(self.axes):<14} {self.size:>6} {self.dtype:<9} {self.numel:>14,} "
                f"{_human(self.nbytes):>10}{tail}")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"  # pragma: no cover


def _launch(step: str, kind: str, op: str, group: Group, sizes: GroupSizes, dtype: str, numel: int,
            overlapped: bool = False) -> Launch | None:
    size = sizes[group]
    if size <= 1:
        return None
    axes = tuple(a.value for a in GROUP_AXES[group])
    return Launch(step, kind, op, group.value, axes, size, dtype, int(numel), overlapped)


def _scatter_numel(numel: int, size: int) -> int:
    """The padded input of a reduce-scatter (torch_impl pads to a multiple of the group)."""
    return -(-numel // size) * size


def launches(plan: FinalizePlan, stage: int, num_tokens: bool, actions: Sequence[Any] | None = None) -> tuple[Launch, ...]:
    """The collectives a torch_impl rank of pp ``stage`` launches for ``plan``, in order.

    Args:
      plan: the rank's plan.
      stage: its pp stage (a stage reduction launches only on member stages with a key).
      num_tokens: num_tokens is given (per-token loss): the token scale runs.
      actions: the actions to list (default: ``plan.actions_with(num_tokens)``).
    """
    shapes = {p.key: p.numel for p in plan.params}
    sizes = plan.sizes
    out: list[Launch | None] = []
    for a in plan.actions_with(num_tokens) if actions is None else actions:
        if isinstance(a, Reduction):
            numel = sum(shapes[k] for k in a.keys)
            size = sizes[a.group]
            if a.scatter:
                out.append(_launch(a.step_text, "reduce_scatter", str(a.op), a.group, sizes, a.work_dtype,
                                   _scatter_numel(numel, size)))
            else:
                out.append(_launch(a.step_text, "all_reduce", str(a.op), a.group, sizes, a.work_dtype, numel))
        elif isinstance(a, StageReduction):
            key = a.key_for(stage)
            if key is not None:
                out.append(_launch(str(a.step), "all_reduce", str(a.op), a.group, sizes, a.dtype, shapes[key]))
        elif isinstance(a, ExpertBiasUpdate):
            out.append(_launch(str(a.step), "all_reduce", "sum", a.group, sizes, "float32", sum(a.num_experts)))
        elif isinstance(a, QbBetaUpdate):
            out.append(_launch(str(a.step), "all_reduce", "avg", a.group, sizes, "float32", sum(a.num_experts)))
        elif isinstance(a, TokenScale):
            out.append(_launch(str(a.step), "broadcast", "-", Group.PP, sizes, "int64", 1))
            out.append(_launch(str(a.step), "all_reduce", "sum", a.group, sizes, "int64", 1))
    return tuple(x for x in out if x is not None)


def status_round(world: int) -> tuple[Launch, ...]:
    """The status round torch_impl runs once per call before any data moves: one MAX
    all-reduce of :data:`STATUS_INT64` int64 over the world (a DeviceMesh, or spanning
    groups that reach every rank). The comparison of signatures (small all-gathers) runs
    only when a plan is new, so it is not a per-step cost. Change the round here alone."""
    if world <= 1:
        return ()
    return (Launch("status", "all_reduce", "max", "world", ("world",), world, "int64", STATUS_INT64),)


def _megatron_actions(plan: FinalizePlan) -> list[Any]:
    """The plan's actions under Megatron-Core's rules: a reduction that fuses several
    steps is split back into one per step (Megatron coalesces within a step only)."""
    out: list[Any] = []
    for a in plan.actions:
        if isinstance(a, Reduction) and a.parts and len(a.steps) > 1:
            for step in a.steps:
                out += merge_reductions([p for p in a.parts if p.step is step])
        else:
            out.append(a)
    return out


def megatron_buckets(numels: Sequence[int], bucket_size: int | None, alone: Sequence[bool], dp: int,
                     distributed_optimizer: bool) -> list[int]:
    """The buckets (elements, padding included) of one Megatron DDP buffer, as
    ``_ParamAndGradBuffer`` lays them out: parameters in reverse order, each start padded to
    64 elements and each bucket end to ``lcm(dp, 128)`` under the distributed optimizer; a
    bucket closes once it holds ``bucket_size`` elements (None: never), and a shared
    embedding (``alone``, distributed optimizer only) is a bucket of its own.

    Args:
      numels: the buffer's parameters' elements, in parameter order.
      bucket_size: elements per bucket, or None.
      alone: per parameter, whether it is a shared embedding.
      dp: the buffer's data-parallel group size.
      distributed_optimizer: ``use_distributed_optimizer``.
    """
    def pad(n: int, by: int) -> int:
        return -(-n // by) * by if distributed_optimizer else n

    out: list[int] = []
    start = bucket_start = 0
    held = False
    end_divisor = math.lcm(dp, 128)
    for numel, own in zip(reversed(numels), reversed(alone)):
        start = pad(start, 64)
        own = own and distributed_optimizer
        if own and held:
            start = pad(start, end_divisor)
            out.append(start - bucket_start)
            bucket_start, held = start, False
        end = start + numel
        held = True
        if (bucket_size is not None and end - bucket_start >= bucket_size) or own:
            start = pad(end, end_divisor)
            out.append(start - bucket_start)
            bucket_start, held = start, False
        else:
            start = end
    if held:
        out.append(pad(end, end_divisor) - bucket_start)
    return out


def ddp_launches(plan: FinalizePlan, stage: int, overlap: bool, bucket_size: int | None = None) -> tuple[Launch, ...]:
    """The DP sync as Megatron's DDP launches it (its ``finish_grad_sync``, chunk by chunk):
    one buffer per gradient dtype, dense then expert (``allreduce=False``), each in buckets
    (:func:`megatron_buckets`). Bucket size: ``bucket_size`` when given, else Megatron's
    default, ``max(40M, 1M x dp)`` elements with ``overlap_grad_reduce`` and none without;
    only pp stage 0's first chunk is bucketed (Megatron's DDP turns bucketing off on later
    stages and the interleaved schedule on later chunks). The tied word embedding of a
    pipeline (``shared_embedding``) is a bucket of its own. With overlap every bucket but
    the last of each buffer is launched during backward."""
    config, sizes = plan.config, plan.sizes
    shared = {k for a in plan.actions if isinstance(a, StageReduction) and a.step is Step.WORD_EMBEDDING
              for k in a.distinct_keys()}
    op = dp_scaling(config, sizes[Group.DP_CP], sizes[Group.EDP])[0]
    kind = "reduce_scatter" if config.use_distributed_optimizer else "all_reduce"
    out: list[Launch] = []
    for chunk in sorted({p.chunk for p in plan.params}):
        for group, expert in ((Group.DP_CP, False), (Group.EDP, True)):
            mine = [p for p in plan.params if p.chunk == chunk and p.has_grad and p.expert == expert]
            dtypes = dict.fromkeys("float32" if config.grad_reduce_in_fp32 else p.dtype for p in mine)
            for dtype in dtypes:
                held = [p for p in mine if ("float32" if config.grad_reduce_in_fp32 else p.dtype) == dtype]
                size = bucket_size
                if size is None and overlap:
                    size = max(MEGATRON_BUCKET_MIN, 1_000_000 * sizes[group])
                if stage != 0 or chunk != 0:
                    size = None
                pieces = megatron_buckets([p.numel for p in held], size, [p.key in shared for p in held],
                                          sizes[group], config.use_distributed_optimizer)
                for index, numel in enumerate(pieces):
                    item = _launch(str(Step.DP_SYNC), kind, str(op), group, sizes, dtype, numel,
                                   overlap and index < len(pieces) - 1)
                    if item is not None:
                        out.append(item)
    return tuple(out)


def megatron_launches(plan: FinalizePlan, stage: int, num_tokens: bool, overlap: bool,
                      bucket_size: int | None = None) -> tuple[Launch, ...]:
    """Megatron-Core's finalize on the same rank: its DDP's DP sync (:func:`ddp_launches`),
    then the plan's other steps with Megatron's coalescing (:func:`_megatron_actions`); no
    status round."""
    rest = [a for a in _megatron_actions(plan) if not (isinstance(a, Reduction) and a.step is Step.DP_SYNC)]
    tail = (plan.token_scale,) if num_tokens else ()
    return ddp_launches(plan, stage, overlap, bucket_size) + launches(plan, stage, num_tokens, rest + list(tail))


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
            totals = ", ".join(f"{k}: {_human(v)}" for k, v in c.bytes_by_axes().items()) or "nothing"
            lines.append(f"  per axes: {totals}")
            lines.append(f"  Megatron-Core: {len(c.megatron)} collectives, "
                         + (", ".join(f"{k}: {_human(v)}" for k, v in c.bytes_by_axes('megatron').items()) or "nothing"))
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
            own = dp + launches(rest, stage, num_tokens)
        else:
            own = launches(plan, stage, num_tokens)
        mega = megatron_launches(plan, stage, num_tokens, overlap, bucket_size)
        classes.append(RankClass(tuple(stages), len(stages) * per_stage, plan, status + own, mega))
    classes.sort(key=lambda c: c.stages[0])
    return Explanation(model, layout, config, overlap, tuple(classes))


__all__ = [
    "Explanation", "ITEMSIZE", "Launch", "Layout", "MEGATRON_BUCKET_MIN", "RankClass", "STATUS_INT64",
    "ddp_launches", "explain", "megatron_buckets", "model_stages", "launches", "megatron_launches", "status_round",
]
