"""What a rank will launch on each of its groups, in lines (:func:`signatures`): what the
consistency comparison of the status round compares
(:func:`torch_impl.run.status.compare_round`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from meshgrad.axes import Group
from meshgrad.config import FinalizeConfig
from meshgrad.plan import FinalizePlan
from torch_impl.run.groups import TorchGroups
from torch_impl.run.status import SPANNING_GROUPS, fused_tokens


def signatures(
    plan: FinalizePlan, groups: TorchGroups, config: FinalizeConfig, num_tokens: Any
) -> dict[Group, tuple[str, ...]]:
    """Per group of size > 1, what this rank will launch on it, one line per item: the
    config (one line per field), the plan's collectives with their identities (the
    actions' :class:`~meshgrad.actions.Signature`) and the num_tokens collectives.

    Over pp (whose members hold different layers) parameter names are dropped: the
    coalesced pp reductions need equal shapes and order, not equal names.
    """
    config_lines = tuple(f"config.{f.name} = {getattr(config, f.name)!r}" for f in dataclasses.fields(config))
    planned = plan.signatures(groups.pp_stage)
    if groups.first_stage_for:
        first = plan.signatures(0)
        planned = {**planned, **{g: first.get(g, ()) for g in groups.first_stage_for}}
    extra: dict[Group, list[str]] = {}
    if isinstance(num_tokens, torch.Tensor):
        wide = "float64" if num_tokens.is_floating_point() else "int64"  # reduced in this dtype
        # A floating count's own dtype is the dtype of the factor it gives: one everywhere.
        own = f" ({str(num_tokens.dtype).removeprefix('torch.')})" if num_tokens.is_floating_point() else ""
        what = f"num_tokens {wide}[{num_tokens.numel()}]{own}"
        extra.setdefault(Group.PP, []).append(f"token_scale broadcast {what} from the last stage")
        fused = fused_tokens(groups, SPANNING_GROUPS, plan.token_scale.group, num_tokens) is not None
        where = " in the status round" if fused else ""  # every rank must carry it alike
        extra.setdefault(plan.token_scale.group, []).append(f"token_scale sum {what}{where}")
    out: dict[Group, tuple[str, ...]] = {}
    for group in Group:
        if groups.group(group) is None:
            continue
        sigs = planned.get(group, ())
        if group is Group.PP:
            sigs = tuple(s.without_names() for s in sigs)
        lines = [s.line() for s in sigs] + [line for s in sigs for line in s.identity_lines()]
        out[group] = config_lines + tuple(lines + extra.get(group, []))
    return out


__all__ = ["signatures"]
