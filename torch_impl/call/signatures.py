"""The comparison of a cross-rank round: per group, a hash of what each rank will launch
on it (:func:`signatures`), all-gathered by the group's members; only on a mismatch are
the full lines gathered, and :class:`~torch_impl.run.errors.ConsistencyError` names the
group, the ranks and the first differing line (:func:`exchange_signatures`)."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from meshgrad.axes import Group
from meshgrad.config import FinalizeConfig
from meshgrad.plan import FinalizePlan
from torch_impl.run.errors import ConsistencyError, collective_guard
from torch_impl.run.groups import TorchGroups, group_ranks
from torch_impl.run.status import ERROR, Hop, device_for, flagged_rank, reduce_max, status_vector


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
        extra.setdefault(plan.token_scale.group, []).append(f"token_scale sum {what}")
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


def _digest(lines: Sequence[str]) -> int:
    raw = hashlib.blake2b("\n".join(lines).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


def _mismatch(group: Group, ranks: Sequence[int], gathered: Sequence[Sequence[str]], rank: int) -> str:
    """The error text for one group whose members' lines differ."""
    variants: dict[tuple[str, ...], list[int]] = {}
    for r, lines in zip(ranks, gathered):
        variants.setdefault(tuple(lines), []).append(r)
    ordered = sorted(variants.items(), key=lambda item: (-len(item[1]), item[1][0]))
    (lines_a, ranks_a), (lines_b, ranks_b) = ordered[0], ordered[1]
    index = next(
        (i for i, (a, b) in enumerate(zip(lines_a, lines_b)) if a != b), min(len(lines_a), len(lines_b))
    )
    line_a = lines_a[index] if index < len(lines_a) else "(nothing more)"
    line_b = lines_b[index] if index < len(lines_b) else "(nothing more)"
    more = f" (and {len(ordered) - 2} more variant(s))" if len(ordered) > 2 else ""
    return (
        f"rank {rank}: the ranks of group {group.value!r} (global ranks {list(ranks)}) would launch "
        f"different collectives: ranks {ranks_a} vs ranks {ranks_b}{more}; first difference, line "
        f"{index + 1}: ranks {ranks_a}: {line_a!r}; ranks {ranks_b}: {line_b!r}. Nothing was reduced"
    )


def exchange_signatures(
    lines: Mapping[Group, Sequence[str]], groups: TorchGroups, compared: Sequence[Group] | None = None
) -> list[str]:
    """All-gather a hash of ``lines`` in every group (Group order); gather the full lines
    of the groups whose hashes differ.

    Args:
      lines: per group, what this rank will launch on it (:func:`signatures`).
      groups: this rank's groups.
      compared: the groups to compare (default: every group of size > 1).

    Returns:
      One :func:`_mismatch` message per group of this rank whose members differ.
    """
    differing: list[Group] = []
    for group in Group if compared is None else compared:
        pg = groups.group(group)
        if pg is None:
            continue
        mine = tuple(lines.get(group, ()))
        local = torch.tensor([_digest(mine), len(mine)], dtype=torch.int64, device=device_for(pg))
        out = [torch.empty_like(local) for _ in range(groups.size(group))]
        with collective_guard(f"consistency check over {group.value!r}", groups, group):
            dist.all_gather(out, local, group=pg)
        if len({tuple(t.tolist()) for t in out}) > 1:
            differing.append(group)
    messages = []
    for group in differing:
        pg = groups.group(group)
        gathered: list[Any] = [None] * groups.size(group)
        with collective_guard(f"consistency check (details) over {group.value!r}", groups, group):
            dist.all_gather_object(gathered, tuple(lines.get(group, ())), group=pg)
        messages.append(_mismatch(group, group_ranks(pg), gathered, groups.rank))
    return messages


def compare_signatures(
    plan: FinalizePlan, groups: TorchGroups, config: FinalizeConfig, num_tokens: Any,
    compared: Sequence[Group] | None, route: Sequence[Hop],
) -> None:
    """The consistency comparison: the signatures exchanged in every compared group
    (:func:`exchange_signatures`), then one round over ``route`` so that every rank
    raises when any group differs.

    Raises:
      ConsistencyError: naming the group, its ranks and the first differing line (on the
        ranks of that group), or the rank that found it (elsewhere).
    """
    messages = exchange_signatures(signatures(plan, groups, config, num_tokens), groups, compared)
    (mismatch,) = reduce_max([status_vector(groups.rank, error=bool(messages))[ERROR]], route, groups.rank,
                             "finalize consistency status")
    if messages:
        raise ConsistencyError("\n".join(messages))
    if mismatch:
        raise ConsistencyError(
            f"rank {groups.rank}: rank {flagged_rank(mismatch)} found ranks of one of its groups that would launch "
            "different collectives (its error names them); nothing was reduced"
        )


__all__ = ["compare_signatures", "exchange_signatures", "signatures"]
