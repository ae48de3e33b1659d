"""The status round: the one kind of cross-rank round a call runs before data moves.

Every rank of a call MAX-all-reduces one vector of :data:`STATUS_SIZE` int64 over the
same route (the world, or the call's spanning groups in turn): whether any rank failed
while reading or checking its inputs, needs a comparison of signatures, found NaN / Inf,
and the digest of its DeviceMesh group layout with the kind of round it is in. The
layout agreement of a DeviceMesh (:class:`~torch_impl.sources.mesh_groups.MeshGroups`) is this same
round, so no rank can wait in one kind of round while its peers are in another: a
layout changed on one rank, or a rank resolving a new layout while its peers check a
cached one, shows as differing digests or kinds in the reduced vector, and every rank
raises. Error texts then travel by :func:`gather_texts` over the same route.

How long a rank can wait: the round's collective waits at most the process group's
timeout (``init_process_group(timeout=)``; torch's default is 30 minutes for gloo and
10 for NCCL), then raises the :class:`~meshgrad.errors.CollectiveError` of
:func:`reduce_max`, which names the round and says that a peer may not have entered
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

#: Positions in the status vector (MAX-reduced): ``BIG - rank`` of the lowest rank that
#: set the flag (0: none), the layout digest and its negation (equal digests everywhere
#: iff ``max == -max(-d)``), the round kind (1: a layout round) and its negation.
ERROR, COMPARE, NONFINITE, LAYOUT, NEG_LAYOUT, KIND, NEG_KIND = range(7)
STATUS_SIZE = 7
BIG = 1 << 40

#: One hop of a route: (a name for errors, the process group, the device of its
#: tensors, its size).
Hop = tuple[str, Any, torch.device, int]

#: Groups whose sequential MAX-reduction reaches every rank of a model (docs/semantics.md (ranks, axes and groups) axes).
SPANNING_GROUPS = (Group.TP, Group.DP_CP, Group.GTP, Group.PP)


def capturing() -> bool:
    """Inside a CUDA graph capture (no host sync possible: the checks are skipped)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class AgreedInputError(FinalizeInputError):
    """Bad input that every rank raises together from one round (a DeviceMesh layout that
    differs across ranks or does not fit the mesh): nothing is left to share."""


_PEER_HINT = (
    "a peer rank may have died, stalled past the process-group timeout, raised before this "
    "round, or not entered finalize (or this seed helper) at all; nothing was reduced"
)


def status_vector(
    rank: int,
    *,
    error: bool = False,
    compare: bool = False,
    nonfinite: bool = False,
    layout: int = 0,
    layout_round: bool = False,
) -> list[int]:
    """This rank's status vector (flags as ``BIG - rank`` so MAX picks the lowest rank)."""
    me = BIG - rank
    kind = int(layout_round)
    return [me if error else 0, me if compare else 0, me if nonfinite else 0, layout, -layout, kind, -kind]


def flagged_rank(value: int) -> int:
    """The rank a reduced flag names."""
    return BIG - value


def layouts_differ(reduced: Sequence[int]) -> bool:
    """Whether the ranks' layout digests or round kinds differ (after the reduction)."""
    return reduced[LAYOUT] != -reduced[NEG_LAYOUT] or reduced[KIND] != -reduced[NEG_KIND]


def layout_digest(key: Any) -> int:
    """A positive 62-bit digest of a group layout (equal layouts, equal digests)."""
    raw = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return (int.from_bytes(raw, "little") >> 2) or 1


def device_for(pg: Any) -> torch.device:
    """Where a small tensor for a collective over ``pg`` must live."""
    if backend(pg) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def backend(pg: Any) -> str:
    """The backend name of a process group ("" for a fake or foreign group)."""
    try:
        return str(dist.get_backend(pg))
    except Exception:  # pragma: no cover - a fake or foreign group
        return ""


def world_route() -> list[Hop]:
    """The route of a round over the whole world."""
    world = dist.group.WORLD
    return [("the world", world, device_for(world), dist.get_world_size())]


def all_reduce_max(value: torch.Tensor, pg: Any) -> None:
    """MAX-all-reduce ``value`` in place over ``pg``, through the process group itself: the
    rounds stay apart from the ``torch.distributed`` calls that move data (which tests and
    benchmarks count) and skip their Python layer (a few microseconds a step)."""
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MAX
    pg.allreduce([value], options).wait()


def reduce_max(values: Sequence[int], route: Sequence[Hop], rank: int, what: str) -> list[int]:
    """MAX-reduce ``values`` over every hop of ``route`` in turn (the result is the maximum
    over every rank the route reaches).

    Raises:
      CollectiveError: a hop failed (timeout): names ``what``, the hop and this rank.
    """
    if not route:
        return list(values)
    value = torch.tensor(list(values), dtype=torch.int64, device=route[0][2])
    for name, pg, _, _ in route:
        try:
            all_reduce_max(value, pg)
        except RuntimeError as err:
            raise round_failed(rank, what, name, err) from err
    return value.tolist()


def gather_texts(text: str | None, route: Sequence[Hop], rank: int, what: str) -> dict[int, str]:
    """Every rank's text (rank -> text; ranks without one left out), all-gathered over
    each hop of ``route`` in turn; run only when a round found something to report."""
    known = {rank: text} if text else {}
    for name, pg, _, size in route:
        out: list[Any] = [None] * size
        try:
            dist.all_gather_object(out, known, group=pg)
        except RuntimeError as err:
            raise round_failed(rank, f"{what} (error report)", name, err) from err
        for item in out:
            known.update(item or {})
    return known


def first_line(err: BaseException) -> str:
    """``TypeName: first line of the message`` (what is shared with other ranks)."""
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"


def round_failed(rank: int, what: str, over: str, err: BaseException) -> CollectiveError:
    """The error of a round's collective that raised ``err`` (a peer may be gone)."""
    return CollectiveError(f"rank {rank}: {what} over {over!r} failed: {first_line(err)} -- {_PEER_HINT}")


def settle(
    reduced: Sequence[int], route: Sequence[Hop], rank: int, what: str, *,
    error: BaseException | None = None, layout_text: str = "",
) -> None:
    """After a round, the same path on every rank (they hold the same ``reduced``): when a
    rank failed, every rank gathers the error texts and raises (this rank its own error,
    the others a :class:`ConsistencyError` naming it); when layouts or round kinds differ,
    every rank gathers the layouts and raises a :class:`FinalizeInputError` naming them.

    Args:
      reduced: the reduced status vector.
      route: the round's route (the texts travel over it).
      rank: this rank.
      what: the round's name (for a failed collective).
      error: this rank's held error (raised as itself), or None.
      layout_text: this rank's DeviceMesh layout, in words ("" when none).
    """
    if reduced[ERROR]:
        texts = gather_texts(first_line(error) if error is not None else None, route, rank, what)
        if error is not None:
            raise error
        who = flagged_rank(reduced[ERROR])
        raise ConsistencyError(
            f"rank {rank}: rank {who} failed its own checks: {texts.get(who, '(no message)')}; "
            "found before any collective: nothing was reduced or changed"
        )
    if layouts_differ(reduced):
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
    flags = status_vector(rank, error=bool(messages), compare=doubt is not None)[:2]
    mismatch, doubted = reduce_max(flags, route, rank, "finalize consistency status")
    raise_mismatch(rank, messages, mismatch, doubted, doubt, route)


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
        who = flagged_rank(doubted)
        detail = "\n".join(messages) if messages else (
            f"rank {flagged_rank(mismatch)} found ranks of one of its groups that would launch different collectives")
        raise ConsistencyError(
            f"rank {rank}: rank {who} failed its own checks: {texts.get(who, '(no message)')}; found before any "
            f"collective: nothing was reduced or changed\n{detail}"
        )
    if messages:
        raise ConsistencyError("\n".join(messages))
    raise ConsistencyError(
        f"rank {rank}: rank {flagged_rank(mismatch)} found ranks of one of its groups that would launch "
        "different collectives (its error names them); nothing was reduced"
    )


def status_round(
    groups: TorchGroups,
    over: Sequence[Group],
    *,
    error: BaseException | None,
    compare: bool,
    nonfinite: bool,
    lines: Callable[[], Mapping[Group, Sequence[str]]],
    compared: Sequence[Group] | None = None,
    doubt: Callable[[], BaseException | None] | None = None,
) -> list[int]:
    """A call's status round over the route of ``over`` (:func:`status_route`): this
    rank's vector (:func:`status_vector`, with its DeviceMesh layout digest) MAX-reduced
    (:func:`reduce_max`), then the same path on every rank (:func:`settle`): raise, or
    compare (:func:`compare_round`, when any rank asked) and go on.

    Args:
      groups: this rank's groups.
      over: the groups of the round.
      error: this rank's held error, or None.
      compare: a comparison is due on this rank.
      nonfinite: this rank found NaN / Inf.
      lines: what this rank will launch per group, called only when a comparison runs.
      compared: the groups compared (None: every group of size > 1).
      doubt: this rank's held-back local error, looked up only when a comparison runs
        (:func:`compare_round`).

    Returns:
      The reduced vector (the flag of :data:`NONFINITE` names the lowest rank with NaN / Inf).
    """
    route = status_route(groups, over)
    mine = status_vector(groups.rank, error=error is not None, compare=compare, nonfinite=nonfinite, layout=groups.layout)
    reduced = reduce_max(mine, route, groups.rank, "finalize status check")
    settle(reduced, route, groups.rank, "finalize status check", error=error, layout_text=groups.layout_text)
    if reduced[COMPARE]:
        compare_round(lines(), groups, compared, route, doubt() if doubt is not None else None)
    return reduced


def share_error(error: BaseException, route: Sequence[Hop], rank: int, what: str) -> None:
    """For a rank that failed before its own round: join the peers' round (any kind: they
    all reduce one status vector over ``route``) with ``error`` flagged; returns so that
    the caller raises ``error`` itself."""
    reduced = reduce_max(status_vector(rank, error=True), route, rank, what)
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
    "AgreedInputError", "BIG", "SPANNING_GROUPS", "STATUS_SIZE", "all_reduce_max", "already_shared",
    "backend", "capturing", "compare_round", "device_for", "first_line", "flagged_rank", "gather_texts",
    "layout_digest", "layouts_differ", "raise_mismatch", "reduce_max", "settle", "share_error", "status_round",
    "status_route", "status_vector", "timeout_of", "world_route",
]
