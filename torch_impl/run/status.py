"""The status round: the one kind of cross-rank round a call runs before data moves.

Every rank of a call SUM-all-reduces one status over the same route (the world, or the
call's spanning groups in turn): how many ranks failed while reading or checking their
inputs, need a comparison of signatures, found NaN / Inf, or are in a layout round,
packed as counts in one int64 (:func:`encode`), and -- where the route is the token
count's own group -- the ``num_tokens`` of the call (:func:`fused_tokens`), so a healthy
per-token step spends no collective of its own on the count. One int64 in all on a route
of up to 63 ranks, two up to 2**15: on gloo a small all-reduce costs about one ring step
per element, on NCCL one latency.

The layout agreement of a DeviceMesh (:class:`~torch_impl.sources.mesh_groups.MeshGroups`)
is this same round, with the layout-round flag set: a layout met for the first time, or
switched to, on some ranks only shows as differing round kinds in the reduced counts, and
every rank raises; when every rank is in a layout round their layout digests are compared
in one more (MAX) round. So no rank can wait in one kind of round while its peers are in
another. Error texts then travel by :func:`gather_texts` over the same route.

Host syncs: one per round, reading the reduced vector back (:func:`read_back`); the
vector goes to the route's device without one (a non-blocking copy), and the token count
stays on the device. Under a CUDA graph capture no round runs (:func:`capturing`).

How long a rank can wait: the round's collective waits at most the process group's
timeout (``init_process_group(timeout=)``; torch's default is 30 minutes for gloo and
10 for NCCL), then raises the :class:`~meshgrad.errors.CollectiveError` of
:func:`reduce_status`, which names the round and says that a peer may not have entered
finalize. Bound it with a shorter timeout of the groups the call uses.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from meshgrad.axes import Group
from meshgrad.errors import CollectiveError, ConsistencyError, FinalizeInputError
from torch_impl.run.groups import TorchGroups, world_size
from torch_impl.run.quiet_round import QuietRound
from torch_impl.run.rounds import (  # the round's collectives and wire format, re-exported
    BIG, COMPARE, ERROR, FIELD_BITS, FLAGS, Hop, KIND, NONFINITE, REACHED, SHORT_BITS, SHORT_MAX, STATUS_SIZE,
    TOKEN_SHIFT, all_reduce_max, all_reduce_status, backend, capturing, decode, device_for, encode, first_line,
    gather_texts, layout_digest, layouts_differ, lowest_flagged, reached, read_back, received, reduce_max,
    reduce_status, round_failed, status_vector, wire_format, world_route,
)

#: Groups whose sequential MAX-reduction reaches every rank of a model (docs/semantics.md (ranks, axes and groups) axes).
SPANNING_GROUPS = (Group.TP, Group.DP_CP, Group.GTP, Group.PP)


class AgreedInputError(FinalizeInputError):
    """Bad input that every rank raises together from one round (a DeviceMesh layout that
    differs across ranks or does not fit the mesh): nothing is left to share."""


def settle(
    reduced: Sequence[int], route: Sequence[Hop], rank: int, what: str, *,
    error: BaseException | None = None, layout: int = 0, layout_text: str = "",
) -> None:
    """After a round, the same path on every rank (they hold the same ``reduced``): when a
    rank failed, every rank gathers the error texts and raises (this rank its own error,
    the others a :class:`ConsistencyError` naming it); when round kinds differ, or every
    rank is in a layout round and their layout digests differ (one MAX round of
    ``[digest, -digest]``: equal everywhere iff ``max == -max(-d)``), every rank gathers
    the layouts and raises a :class:`FinalizeInputError` naming them.

    Args:
      reduced: the reduced status vector.
      route: the round's route (the texts travel over it).
      rank: this rank.
      what: the round's name (for a failed collective).
      error: this rank's held error (raised as itself), or None.
      layout: this rank's layout digest (compared when every rank is in a layout round).
      layout_text: this rank's DeviceMesh layout, in words ("" when none).
    """
    if reduced[ERROR]:
        texts = gather_texts(first_line(error) if error is not None else None, route, rank, what)
        if error is not None:
            raise error
        who = min(texts) if texts else -1
        raise ConsistencyError(
            f"rank {rank}: rank {who} failed its own checks: {texts.get(who, '(no message)')}; "
            "found before any collective: nothing was reduced or changed"
        )
    differ = layouts_differ(reduced)
    if not differ and reduced[KIND] and reduced[KIND] == reduced[REACHED]:  # every rank: a layout round
        high, neg_low = reduce_max([layout, -layout], route, rank, f"{what} (layout digests)")
        differ = high != -neg_low
    if differ:
        texts = gather_texts(layout_text or "no DeviceMesh group layout", route, rank, what)
        by_text: dict[str, list[int]] = {}
        for r in sorted(texts):
            by_text.setdefault(texts[r], []).append(r)
        described = "; ".join(f"ranks {ranks}: {text}" for text, ranks in by_text.items())
        raise AgreedInputError(
            f"rank {rank}: the ranks ask for different DeviceMesh group layouts ({described}); expert sizes "
            "and embedding stages must be the same on every rank (and every rank must meet a new layout in "
            "the same call). No group was created and nothing was reduced"
        )


def timeout_of(pg: Any) -> Any:
    """A process group's timeout (timedelta), or None when unknown."""
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except Exception:  # that backend is not bound
            continue
    return None


def _distinct(groups: TorchGroups, over: Sequence[Group]) -> list[tuple[Group, Any]]:
    """The process groups of ``over`` of size > 1, each process group once."""
    out: list[tuple[Group, Any]] = []
    for group in over:
        pg = groups.group(group)
        if pg is not None and all(pg is not seen for _, seen in out):
            out.append((group, pg))
    return out


def status_route(groups: TorchGroups, over: Sequence[Group] = SPANNING_GROUPS) -> list[Hop]:
    """The hops a status round MAX-reduces over, in turn (computed once per groups and
    ``over``): the world at once for groups built from a DeviceMesh (their layout round
    runs over the world: the same kind of round), or when the spanning groups together
    reach every rank of it and the world's timeout is no longer than theirs (or no
    backend tells any timeout); else the distinct groups of ``over`` of size > 1."""
    key = tuple(over)
    route = groups.routes.get(key)
    if route is None:
        route = groups.routes[key] = _route(groups, key)
    return route


def _route(groups: TorchGroups, over: tuple[Group, ...]) -> list[Hop]:
    pgs = _distinct(groups, over)
    own = [(group.value, pg, device_for(pg), groups.size(group)) for group, pg in pgs]
    if groups.layout and over == SPANNING_GROUPS and world_size() > 1:
        return world_route()
    if len(pgs) < 2 or over != SPANNING_GROUPS:
        return own
    span = 1
    for group, _ in pgs:
        span *= groups.size(group)
    if span != world_size():
        return own
    limit, timeouts = timeout_of(dist.group.WORLD), [timeout_of(pg) for _, pg in pgs]
    unknown = limit is None and all(t is None for t in timeouts)  # no backend tells: as good as any
    no_longer = limit is not None and None not in timeouts and limit <= min(timeouts)
    return world_route() if unknown or no_longer else own


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
    index = next((i for i, (a, b) in enumerate(zip(lines_a, lines_b)) if a != b), min(len(lines_a), len(lines_b)))
    line_a = lines_a[index] if index < len(lines_a) else "(nothing more)"
    line_b = lines_b[index] if index < len(lines_b) else "(nothing more)"
    more = f" (and {len(ordered) - 2} more variant(s))" if len(ordered) > 2 else ""
    return (
        f"rank {rank}: the ranks of group {group.value!r} (global ranks {list(ranks)}) would launch "
        f"different collectives: ranks {ranks_a} vs ranks {ranks_b}{more}; first difference, line "
        f"{index + 1}: ranks {ranks_a}: {line_a!r}; ranks {ranks_b}: {line_b!r}. Nothing was reduced"
    )


def _gathered(what: str, group: Group, rank: int, gather: Callable[[], Any]) -> Any:
    """Run one all-gather of the comparison; a failure becomes a CollectiveError."""
    try:
        return gather()
    except RuntimeError as err:
        raise round_failed(rank, what, group.value, err) from err


def compare_round(
    lines: Mapping[Group, Sequence[str]], groups: TorchGroups, compared: Sequence[Group] | None, route: Sequence[Hop],
    doubt: BaseException | None = None,
) -> None:
    """The consistency comparison, when a status round asks for one: in every compared
    group (default: every group of size > 1), its members all-gather a hash of ``lines``;
    only where hashes differ are the full lines gathered. Then one round over ``route``,
    so that every rank raises when any group differs.

    Args:
      lines: what this rank will launch, per group.
      groups: this rank's groups.
      compared: the groups compared (None: every group of size > 1).
      route: the route of the outcome round.
      doubt: this rank's held-back local error (a value Megatron accepts but that is most
        likely wrong), raised only when the ranks differ: then it wins on this rank, and
        the peers' error names it (:func:`raise_mismatch`).

    Raises:
      ConsistencyError: naming the group, its ranks and the first differing line (on the
        ranks of that group), or the rank that found it (elsewhere); naming a rank's
        doubt when one was held back.
      BaseException: ``doubt`` itself, when the ranks differ.
    """
    rank, messages = groups.rank, []
    for group in Group if compared is None else compared:
        pg = groups.group(group)
        if pg is None:
            continue
        mine = tuple(lines.get(group, ()))
        local = torch.tensor([_digest(mine), len(mine)], dtype=torch.int64, device=device_for(pg))
        out = [torch.empty_like(local) for _ in range(groups.size(group))]
        _gathered("consistency check", group, rank, lambda: dist.all_gather(out, local, group=pg))
        if len({tuple(t.tolist()) for t in out}) > 1:
            every: list[Any] = [None] * groups.size(group)  # (global rank, lines) of each member
            _gathered("consistency check (details)", group, rank,
                      lambda: dist.all_gather_object(every, (rank, mine), group=pg))
            messages.append(_mismatch(group, [r for r, _ in every], [lines for _, lines in every], rank))
    flags = [BIG - rank if messages else 0, BIG - rank if doubt is not None else 0]
    mismatch, doubted = reduce_max(flags, route, rank, "finalize consistency status")
    raise_mismatch(rank, messages, mismatch, doubted, doubt, route)


def _flagged(value: int) -> int:
    """The rank a MAX-reduced ``BIG - rank`` flag names (the lowest that raised it)."""
    return BIG - value


def raise_mismatch(
    rank: int, messages: Sequence[str], mismatch: int, doubted: int, doubt: BaseException | None,
    route: Sequence[Hop],
) -> None:
    """After the comparison's outcome round (the same ``mismatch`` / ``doubted`` flags on
    every rank): nothing when no group differs; else, when some rank held back a doubt,
    that rank raises it and every other rank a :class:`ConsistencyError` naming it (its
    first line) above its own mismatch; else the mismatch itself."""
    if not mismatch:
        return
    if doubted:
        texts = gather_texts(first_line(doubt) if doubt is not None else None, route, rank, "finalize consistency status")
        if doubt is not None:
            raise doubt
        who = _flagged(doubted)
        detail = "\n".join(messages) if messages else (
            f"rank {_flagged(mismatch)} found ranks of one of its groups that would launch different collectives")
        raise ConsistencyError(
            f"rank {rank}: rank {who} failed its own checks: {texts.get(who, '(no message)')}; found before any "
            f"collective: nothing was reduced or changed\n{detail}"
        )
    if messages:
        raise ConsistencyError("\n".join(messages))
    raise ConsistencyError(
        f"rank {rank}: rank {_flagged(mismatch)} found ranks of one of its groups that would launch "
        "different collectives (its error names them); nothing was reduced"
    )


def fused_tokens(groups: TorchGroups, over: Sequence[Group], group: Group | None, num_tokens: Any) -> torch.Tensor | None:
    """``num_tokens`` when the call's status round can carry its count, else None.

    It can when the round's route is one hop over exactly the ranks of the token group
    ``group`` (the world being that group, for instance: pure data parallelism), no pp
    broadcast comes first, and the count is one integer on the route's device: the SUM the
    round computes is then the count Megatron all-reduces, bit for bit. Every rank decides
    alike: the route and groups are the layout's, and the kind of ``num_tokens`` (dtype,
    numel, device type) is compared across ranks whenever it changes. The answer depends
    on nothing else, so the groups keep it per round, group and kind of count.
    """
    if group is None or not isinstance(num_tokens, torch.Tensor):
        return None
    key = (tuple(over), group, num_tokens.dtype, num_tokens.device, num_tokens.numel())
    fused = groups.fused.get(key)
    if fused is None:
        fused = groups.fused[key] = _carries_tokens(groups, over, group, num_tokens)
    return num_tokens if fused else None


def _carries_tokens(groups: TorchGroups, over: Sequence[Group], group: Group, num_tokens: torch.Tensor) -> bool:
    """:func:`fused_tokens`' answer for one kind of count."""
    if num_tokens.numel() != 1 or num_tokens.is_floating_point() or num_tokens.is_complex():
        return False
    if num_tokens.dtype == torch.bool or groups.group(Group.PP) is not None or groups.token_broadcast is not None:
        return False
    route = status_route(groups, over)
    token_pg = groups.group(group)
    if len(route) != 1 or token_pg is None or num_tokens.device != route[0][2]:
        return False
    _, pg, _, size = route[0]
    return pg is token_pg or groups.size(group) == size == world_size()


def status_round(
    groups: TorchGroups,
    over: Sequence[Group],
    *,
    error: BaseException | None,
    compare: bool,
    nonfinite: bool,
    lines: Callable[[], Mapping[Group, Sequence[str]]],
    compared: Sequence[Group] | None = None,
    tokens: torch.Tensor | None = None,
    doubt: Callable[[], BaseException | None] | None = None,
) -> tuple[list[int], int | torch.Tensor | None]:
    """A call's status round over the route of ``over`` (:func:`status_route`): this
    rank's status (:func:`status_vector`, with ``tokens`` in the token slot) SUM-reduced
    (:func:`reduce_status`), then the same path
    on every rank (:func:`settle`): raise, or compare (:func:`compare_round`, when any
    rank asked) and go on.

    Args:
      groups: this rank's groups.
      over: the groups of the round.
      error: this rank's held error, or None.
      compare: a comparison is due on this rank.
      nonfinite: this rank found NaN / Inf.
      lines: what this rank will launch per group, called only when a comparison runs.
      compared: the groups compared (None: every group of size > 1).
      tokens: the call's ``num_tokens`` when the round carries its count
        (:func:`fused_tokens`), else None.
      doubt: this rank's held-back local error, looked up only when a comparison runs
        (:func:`compare_round`).

    Returns:
      (the reduced vector, the global token count (:func:`reduce_status`) or None).
    """
    quiet = groups.quiet_rounds.get(tuple(over))
    if quiet is not None:  # it holds its route
        route = quiet.route
    else:
        route = status_route(groups, over)
        quiet = _new_quiet_round(groups, over, route)
    try:
        nothing_to_report = error is None and not (compare or nonfinite)
        # rounds.host_count, written out (one function fewer per step)
        if quiet is not None and nothing_to_report and (tokens is None or (
                tokens.device.type == "cpu" == route[0][2].type and tokens.dtype != torch.uint64)):
            count = None if tokens is None else int(tokens)
            words, healthy, total = quiet.run(count, groups.rank, "finalize status check")
            if healthy:  # nothing to settle or compare: the counts a healthy round decodes to
                return [quiet.reached, 0, 0, 0, 0], total
            reduced, total = received(words, quiet.reached, tokens)
        else:
            mine = status_vector(error=error is not None, compare=compare, nonfinite=nonfinite)
            wire = quiet.wire if quiet is not None else None
            reduced, total = reduce_status(mine, route, groups.rank, "finalize status check", tokens, wire)
    except BaseException:
        groups.quiet_rounds.pop(tuple(over), None)  # the failed collective may still hold its wire
        raise
    settle(reduced, route, groups.rank, "finalize status check", error=error, layout_text=groups.layout_text)
    if reduced[COMPARE]:
        compare_round(lines(), groups, compared, route, doubt() if doubt is not None else None)
    return reduced, total


def _new_quiet_round(groups: TorchGroups, over: Sequence[Group], route: Sequence[Hop]) -> QuietRound | None:
    """The round over ``over`` with its reused host wire, made on its first round and kept
    on the groups, or None when the route is empty or not on the CPU (a device round gets a
    fresh tensor)."""
    if not route or route[0][2].type != "cpu":
        return None
    groups.quiet_rounds[tuple(over)] = quiet = QuietRound(route)
    return quiet


def share_error(error: BaseException, route: Sequence[Hop], rank: int, what: str) -> None:
    """For a rank that failed before its own round: join the peers' round (any kind: they
    all reduce one status vector over ``route``) with ``error`` flagged; returns so that
    the caller raises ``error`` itself."""
    reduced, _ = reduce_status(status_vector(error=True), route, rank, what)
    try:
        settle(reduced, route, rank, what, error=error)
    except BaseException as raised:  # noqa: BLE001 -- the caller raises its own error
        if raised is not error:
            raise


def already_shared(err: BaseException) -> bool:
    """Whether every rank already learned of ``err`` in a round (or a round failed): it
    must not be shared again (no peer waits for it)."""
    return isinstance(err, (AgreedInputError, ConsistencyError, CollectiveError))


__all__ = [
    "AgreedInputError", "BIG", "SPANNING_GROUPS", "STATUS_SIZE", "all_reduce_max", "all_reduce_status",
    "already_shared", "backend", "capturing", "compare_round", "decode", "device_for", "encode", "first_line",
    "fused_tokens", "gather_texts", "layout_digest", "layouts_differ", "lowest_flagged", "raise_mismatch",
    "reached", "read_back", "reduce_max", "reduce_status", "wire_format", "settle", "share_error", "status_round", "status_route", "status_vector", "timeout_of",
    "world_route",
]
