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

import numpy as np
import torch
import torch.distributed as dist

from meshgrad.axes import Group
from meshgrad.errors import CollectiveError, ConsistencyError, FinalizeInputError
from torch_impl.run.groups import TorchGroups, world_size

#: Positions in a reduced status vector (:func:`decode`): the ranks the round reached, and
#: how many of them failed, ask for a comparison, found NaN / Inf or are in a layout round.
REACHED, ERROR, COMPARE, NONFINITE, KIND = range(5)
FLAGS = (ERROR, COMPARE, NONFINITE, KIND)
#: Bits of one count in the packed word of a route of fewer than 2**15 ranks.
FIELD_BITS = 16
#: A route of at most SHORT_MAX ranks sends ONE int64: the four counts and a fifth (ranks
#: whose token count is too large to carry) in SHORT_BITS bits each, the token count from
#: bit TOKEN_SHIFT up (each rank's below 2**31 / n, so the sum cannot overflow).
SHORT_BITS, SHORT_MAX, TOKEN_SHIFT = 6, 63, 32
#: int64 elements on the wire for a route of 64 to 2**15 - 1 ranks: the packed counts and
#: the token count (on gloo a small all-reduce costs about one ring step per element; on
#: NCCL one latency whatever the count).
STATUS_SIZE = 2
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
    *, error: bool = False, compare: bool = False, nonfinite: bool = False, layout_round: bool = False,
) -> list[int]:
    """This rank's status, as the reduced vector reads (:data:`REACHED` ... :data:`KIND`):
    itself, and each flag as a count of 0 or 1."""
    return [1, int(error), int(compare), int(nonfinite), int(layout_round)]


def wire_format(reached: int) -> str:
    """How a round that reaches ``reached`` ranks (every rank of it computes the same)
    sends its status: ``"short"`` (one int64, tokens included), ``"packed"`` (the counts in
    one int64, the tokens in a second) or ``"wide"`` (one int64 per count, then tokens)."""
    if reached <= SHORT_MAX:
        return "short"
    return "packed" if reached < 1 << (FIELD_BITS - 1) else "wide"


def encode(status: Sequence[int], reached: int) -> np.ndarray:
    """The int64 elements one rank contributes (its token count is added on its device by
    :func:`reduce_status`)."""
    fmt = wire_format(reached)
    if fmt == "wide":
        return np.array([*(int(status[f]) for f in FLAGS), 0], dtype=np.int64)
    bits = SHORT_BITS if fmt == "short" else FIELD_BITS
    word = sum(int(status[f]) << (bits * i) for i, f in enumerate(FLAGS))
    return np.array([word] if fmt == "short" else [word, 0], dtype=np.int64)


def decode(wire: Sequence[int], reached: int) -> list[int]:
    """The reduced elements as counts (:data:`REACHED` ... :data:`KIND`, then the ranks whose
    token count did not fit the short word): a SUM of packed words is the word of the sums,
    as no count can carry into the next field."""
    fmt = wire_format(reached)
    if fmt == "wide":
        return [reached, *wire[: len(FLAGS)], 0]
    bits = SHORT_BITS if fmt == "short" else FIELD_BITS
    fields = len(FLAGS) + (fmt == "short")
    mask = (1 << bits) - 1
    return [reached, *((int(wire[0]) >> (bits * i)) & mask for i in range(fields))] + ([] if fmt == "short" else [0])


def _place_tokens(value: torch.Tensor, tokens: torch.Tensor, reached: int) -> None:
    """Add this rank's token count to its wire elements, on their device (no host sync): in
    the short word from :data:`TOKEN_SHIFT` up, or, when it is too large for the word to
    hold the sum, as a count in the fifth field instead (the ranks then reduce the count
    in a collective of its own); else in the last element."""
    count = tokens.detach().reshape(()).to(device=value.device, dtype=torch.int64)
    if wire_format(reached) != "short":
        value[-1].copy_(count)
        return
    limit = (1 << (TOKEN_SHIFT - 1)) // reached
    too_large = (count >= limit) | (count <= -limit)
    flag = torch.full((), 1 << (SHORT_BITS * len(FLAGS)), dtype=torch.int64, device=value.device)
    value[0] += torch.where(too_large, flag, count * (1 << TOKEN_SHIFT))


def layouts_differ(reduced: Sequence[int]) -> bool:
    """Whether the ranks were in different kinds of round (a layout round on some ranks
    only: a layout met for the first time, or switched to, on some ranks only)."""
    return reduced[KIND] not in (0, reduced[REACHED])


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


def _all_reduce(value: torch.Tensor, pg: Any, op: Any) -> None:
    """All-reduce ``value`` in place over ``pg``, through the process group itself: the
    rounds stay apart from the ``torch.distributed`` calls that move data (which tests and
    benchmarks count) and skip their Python layer (a few microseconds a step)."""
    options = dist.AllreduceOptions()
    options.reduceOp = op
    pg.allreduce([value], options).wait()


def all_reduce_status(value: torch.Tensor, pg: Any) -> None:
    """SUM-all-reduce a status vector in place over ``pg`` (the status round's one reduction)."""
    _all_reduce(value, pg, dist.ReduceOp.SUM)


def all_reduce_max(value: torch.Tensor, pg: Any) -> None:
    """MAX-all-reduce ``value`` in place over ``pg`` (the rounds that only run after a
    status round found something: a comparison's outcome, the rank that found NaN)."""
    _all_reduce(value, pg, dist.ReduceOp.MAX)


def read_back(value: torch.Tensor) -> list[int]:
    """The reduced vector on the host: a round's one host sync (on a GPU it waits for the
    work queued before it, as any read of a device value does)."""
    return value.tolist()


def _reduce(values: Sequence[int] | np.ndarray, route: Sequence[Hop], rank: int, what: str,
            reduce: Callable[[torch.Tensor, Any], None], place: Callable[[torch.Tensor], None] | None = None,
            ) -> tuple[list[int], torch.Tensor]:
    value = torch.from_numpy(np.array(values, dtype=np.int64))  # a copy of the caller's values
    device = route[0][2]
    if device.type != "cpu":
        value = value.to(device, non_blocking=True)
    if place is not None:
        place(value)
    for name, pg, _, _ in route:
        try:
            reduce(value, pg)
        except RuntimeError as err:
            raise round_failed(rank, what, name, err) from err
    return read_back(value), value


def reached(route: Sequence[Hop]) -> int:
    """How many ranks a SUM over ``route`` counts (each hop multiplies by its size: the
    world's size for a route whose groups form a grid over it)."""
    n = 1
    for _, _, _, size in route:
        n *= size
    return n


def reduce_status(status: Sequence[int], route: Sequence[Hop], rank: int, what: str,
                  tokens: torch.Tensor | None = None) -> tuple[list[int], torch.Tensor | None]:
    """SUM-reduce a status over every hop of ``route`` in turn (:func:`encode`: one int64
    for a route of up to :data:`SHORT_MAX` ranks, two up to 2**15, else five), with
    ``tokens`` when given.

    Args:
      status: this rank's :func:`status_vector`.
      route: the round's route.
      rank: this rank (for errors).
      what: the round's name (for errors).
      tokens: this rank's ``num_tokens`` for the token slot (:func:`fused_tokens`), or None.

    Returns:
      (the reduced counts (:data:`REACHED` ... :data:`KIND`), the reduced token count as a
      0-d int64 tensor on the route's device -- None when ``tokens`` is None, the route is
      empty, or some rank's count was too large for the short word: then the caller
      reduces the count itself, on every rank alike).

    Raises:
      CollectiveError: a hop failed (timeout): names ``what``, the hop and this rank.
    """
    if not route:
        return list(status), None
    n = reached(route)
    place = (lambda value: _place_tokens(value, tokens, n)) if tokens is not None else None
    wire, value = _reduce(encode(status, n), route, rank, what, all_reduce_status, place)
    counts = decode(wire, n)
    if tokens is None or counts[-1]:  # some rank's count did not fit: a collective of its own
        return counts[:-1], None
    total = value[0] >> TOKEN_SHIFT if wire_format(n) == "short" else value[-1]
    return counts[:-1], total


def reduce_max(values: Sequence[int], route: Sequence[Hop], rank: int, what: str) -> list[int]:
    """MAX-reduce ``values`` over every hop of ``route`` in turn (the result is the maximum
    over every rank the route reaches).

    Raises:
      CollectiveError: a hop failed (timeout): names ``what``, the hop and this rank.
    """
    if not route:
        return list(values)
    return _reduce(values, route, rank, what, all_reduce_max)[0]


def lowest_flagged(flagged: bool, route: Sequence[Hop], rank: int, what: str) -> int:
    """The lowest rank of the route that raised a flag (one MAX round, run by every rank
    once a status round counted the flag), or -1 when none did."""
    (value,) = reduce_max([BIG - rank if flagged else 0], route, rank, what)
    return BIG - value if value else -1


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
    numel, device type) is compared across ranks whenever it changes.
    """
    if group is None or not isinstance(num_tokens, torch.Tensor) or num_tokens.numel() != 1:
        return None
    if num_tokens.is_floating_point() or num_tokens.is_complex() or num_tokens.dtype == torch.bool:
        return None
    if groups.group(Group.PP) is not None or groups.token_broadcast is not None:
        return None
    route = status_route(groups, over)
    token_pg = groups.group(group)
    if len(route) != 1 or token_pg is None or num_tokens.device != route[0][2]:
        return None
    _, pg, _, size = route[0]
    return num_tokens if pg is token_pg or groups.size(group) == size == world_size() else None


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
) -> tuple[list[int], torch.Tensor | None]:
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
      (the reduced vector, the global token count on the route's device or None).
    """
    route = status_route(groups, over)
    mine = status_vector(error=error is not None, compare=compare, nonfinite=nonfinite)
    reduced, total = reduce_status(mine, route, groups.rank, "finalize status check", tokens)
    settle(reduced, route, groups.rank, "finalize status check", error=error, layout_text=groups.layout_text)
    if reduced[COMPARE]:
        compare_round(lines(), groups, compared, route, doubt() if doubt is not None else None)
    return reduced, total


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
