"""The plan memo of a model: plans by key (:class:`BoundPlan`), the program each is
bound to and what its once-per-plan checks found, evicted together, oldest first."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from meshgrad.config import FinalizeConfig
from meshgrad.params import ParamKey
from meshgrad.plan import FinalizePlan
from torch_impl.call.check import CheckSpec, PlanRecord
from torch_impl.sources.discover import Discovered
from torch_impl.run.stats import ExecStats
from torch_impl.run.grads import GradAccess
from torch_impl.run.groups import TorchGroups
from torch_impl.run.modes import outside_inference_mode
from torch_impl.call.memo import MAX_PLANS, put
from torch_impl.run.program import Program


@dataclasses.dataclass(frozen=True, eq=False)
class BoundPlan:
    """A plan with everything a step needs to run it (immutable; what the checks found
    per plan is kept by :class:`PlanMemo`).

    Args:
      plan: the FinalizePlan (all steps; DP sync only for plain chunks).
      ddp: the DDP objects whose ``finish_grad_sync`` does step 1 for their chunks.
      ddp_force_kwarg: per DDP object, whether it accepts ``force_all_reduce``.
      plain_scale_keys: gradients this backend scales by num_tokens (plain chunks).
      checks: what a call of this plan checks before communicating (None: nothing).
      helper: a seed helper's plan (its kept discovery is checked for what it touches:
        :meth:`~torch_impl.call.model_watch.ModelWatch.touched_same`).
    """

    plan: FinalizePlan
    ddp: tuple[Any, ...]
    ddp_force_kwarg: tuple[bool, ...]
    plain_scale_keys: tuple[ParamKey, ...]
    checks: CheckSpec | None = None
    helper: bool = False


class PlanMemo:
    """The plans, programs and check records of one model (owned by its ModelState).

    Args:
      stats: the model's counters (plans built; bindings are counted by Program).
    """

    def __init__(self, stats: ExecStats) -> None:
        self.stats = stats
        self.plans: dict[tuple[Any, ...], BoundPlan] = {}
        self.programs: dict[int, tuple[BoundPlan, Program | None, Discovered]] = {}  # None: DTensor gradients
        self.records: dict[int, tuple[BoundPlan, PlanRecord]] = {}

    def bind(self, bound: BoundPlan, found: Discovered, groups: TorchGroups, config: FinalizeConfig,
             own_views: Mapping[int, Any] | None = None) -> Program:
        """Bind ``bound`` to the gradient tensors of ``found`` (meshgrad's own buffer views,
        ``own_views``, through private aliases: :class:`GradAccess`) and keep the program."""
        with outside_inference_mode():  # what it binds is kept between calls
            grads = GradAccess(found.tensors, config.use_megatron_fsdp, own_views)
            program = Program(bound.plan.actions, grads, found.router_modules, groups, self.stats,
                              bound.plain_scale_keys)
        put(self.programs, id(bound), (bound, program, found))
        return program

    def plan(self, key: tuple[Any, ...], make: Callable[[], BoundPlan]) -> tuple[BoundPlan, PlanRecord | None]:
        """The cached plan for ``key``, or ``make()``'s (evicting the oldest plan, with its
        program and record, when :data:`MAX_PLANS` are kept), with what its once-per-plan
        checks found (:meth:`record`)."""
        bound = self.plans.get(key)
        if bound is None:
            bound = make()
            self.stats.plans_built += 1
            if len(self.plans) >= MAX_PLANS:
                old = self.plans.pop(next(iter(self.plans)))
                self.programs.pop(id(old), None)
                self.records.pop(id(old), None)
            self.plans[key] = bound
        return bound, self.record(bound)

    def record(self, bound: BoundPlan) -> PlanRecord | None:
        """What the once-per-plan checks found for ``bound`` (None before they passed); read
        the same way, written out, by :func:`~torch_impl.call.replay.replayed`."""
        hit = self.records.get(id(bound))
        return hit[1] if hit is not None and hit[0] is bound else None

    def keep_record(self, bound: BoundPlan, record: PlanRecord | None) -> None:
        """Keep what the checks found for ``bound`` (bounded like the plans)."""
        if record is not None:
            put(self.records, id(bound), (bound, record))
