"""What a plan file records about the layout and config: group members, coordinates,
DDP chunks, config fields and parallel sizes."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from meshgrad.axes import Group
from meshgrad.config import FinalizeConfig
from torch_impl.audit.internals import CONFIG_SIZES, group_ranks


def _members(groups: Any, group: Group, rank: int) -> list[int]:
    """Global ranks of this rank's ``group`` ([] where it is not a member, [rank] for a
    group of size 1)."""
    pg = groups.groups.get(group)
    if pg is not None and groups.size(group) > 1:
        return [int(r) for r in group_ranks(pg)]
    if group in (Group.EMBD, Group.POS_EMBD) and groups.stages.get(group) is None:
        return []
    return [rank]


def _layout(groups: Any, rank: int) -> dict[str, Any]:
    members = {g.value: _members(groups, g, rank) for g in Group}
    members[Group.PP.value] = [int(r) for r in groups.pp_ranks]
    coords = {
        g: (sorted(m).index(rank) if rank in m else -1)
        for g, m in members.items()
        if g != Group.PP.value
    }
    coords["pp"] = int(groups.pp_stage)
    stages = {
        g.value: (None if groups.stages.get(g) is None else [int(s) for s in groups.stages[g]])
        for g in (Group.EMBD, Group.POS_EMBD)
    }
    return {
        "members": members,
        "coords": coords,
        "stages": stages,
        "missing": sorted(g.value for g in groups.missing),
    }


def ddp_of(chunk: Any) -> Any:
    """The Megatron DDP of a chunk: the first object of its ``.module`` chain with a
    callable ``finish_grad_sync`` (None when there is none)."""
    obj = chunk
    for _ in range(64):
        if callable(getattr(obj, "finish_grad_sync", None)):
            return obj
        if not hasattr(obj, "module"):
            return None
        obj = obj.module
    return None


def _ddp_chunks(model: Sequence[Any]) -> list[bool]:
    """Per chunk: whether its ``.module`` chain has a ``finish_grad_sync`` (Megatron DDP)."""
    return [ddp_of(chunk) is not None for chunk in model]


def _config_dict(config: FinalizeConfig, raw: Any) -> dict[str, Any]:
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(FinalizeConfig)}
    values = {k: (list(v) if isinstance(v, tuple) else v) for k, v in values.items()}
    sizes = {}
    for name in CONFIG_SIZES:
        value = getattr(raw, name, None) if raw is not None else None
        if isinstance(value, int) and not isinstance(value, bool):
            sizes[name] = value
    return {"finalize": values, "sizes": sizes}
