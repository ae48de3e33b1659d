"""Plan once, run many: a plan's actions bound once to one step's gradient tensors."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from meshgrad.params import ParamKey
from meshgrad.plan import Action
from torch_impl.run.stats import ExecStats
from torch_impl.run.execute import bind_action, execute_ops
from torch_impl.run.grads import GradAccess
from torch_impl.run.groups import TorchGroups
from torch_impl.run.scaling import bind_scale


class Program:
    """A plan's actions bound to one set of gradient tensors.

    Everything that depends only on the plan and the tensors -- flat spans, staging
    buffers and their views, copy lists, the groups of each collective, the spans the
    num_tokens scale multiplies -- is computed here once; :meth:`run` then does
    O(collectives) work. Valid while the parameters hold the same gradient tensors
    (:class:`~torch_impl.call.watches.GradWatch`); not for DTensor gradients (they are unsharded per step).

    Args:
      actions: the actions to run (TokenScale excluded).
      grads: gradient tensor by key (plain tensors), read key by key and, for the scale,
        as one list (:meth:`~torch_impl.run.grads.GradAccess.read`).
      routers: router modules by key.
      groups: this rank's process groups.
      stats: counters (copied bytes).
      scale_keys: the gradients :attr:`scale` multiplies.
    """

    def __init__(
        self,
        actions: Sequence[Action],
        grads: GradAccess,
        routers: Mapping[ParamKey, nn.Module],
        groups: TorchGroups,
        stats: ExecStats,
        scale_keys: Sequence[ParamKey] = (),
    ) -> None:
        self.ops = [(a, bind_action(a, grads, routers, groups, stats)) for a in actions]
        #: Multiplies the bound gradients by the 0-d float32 num_tokens factor (call it with
        #: grad mode off, as the run stage does); None when no gradient is bound to it.
        self.scale: Callable[[torch.Tensor], None] | None = (
            bind_scale(grads.read(scale_keys)) if scale_keys else None
        )
        stats.programs_bound += 1

    def run(self, on_step: Callable[[Action], None] | None = None) -> None:
        """Run every bound action in order, under ``torch.no_grad()`` (the run stage calls
        it only when one is bound: a plan whose DDP does the whole step binds none)."""
        without_grad(execute_ops, self.ops, on_step)


#: What ``torch.set_grad_enabled(mode)`` calls to switch grad mode (its own Python
#: ``__init__`` around it is a function more per switch); the class itself where this
#: torch has no such function.
_SET_GRAD_ENABLED: Callable[[bool], Any] = getattr(torch._C, "_set_grad_enabled", torch.set_grad_enabled)


def without_grad(fn: Callable[..., None], *args: Any) -> None:
    """``fn(*args)`` with grad mode off, as under ``torch.no_grad()``, and on again after
    (an error included): switched only when it is on (finalize's run stage already runs
    with it off), by torch's own switch called as a function, a third of the context
    manager's cost on every step."""
    if not torch.is_grad_enabled():
        fn(*args)
        return
    _SET_GRAD_ENABLED(False)
    try:
        fn(*args)
    finally:
        _SET_GRAD_ENABLED(True)
