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
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from meshgrad.axes import Group
from meshgrad.errors import CollectiveError, ConsistencyError, FinalizeInputError

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
            first = (str(err).strip().splitlines() or [""])[0]
            raise CollectiveError(
                f"rank {rank}: {what} over {name!r} failed: {type(err).__name__}: {first} -- {_PEER_HINT}"
            ) from err
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
            raise CollectiveError(f"rank {rank}: {what} (error report) over {name!r} failed: {err} -- {_PEER_HINT}") from err
        for item in out:
            known.update(item or {})
    return known


def first_line(err: BaseException) -> str:
    """``TypeName: first line of the message`` (what is shared with other ranks)."""
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"


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
    "SPANNING_GROUPS",
    "capturing",
    "AgreedInputError",
    "already_shared",
    "share_error",
    "first_line",
    "settle",
    "BIG",
    "STATUS_SIZE",
    "all_reduce_max",
    "backend",
    "device_for",
    "flagged_rank",
    "gather_texts",
    "layout_digest",
    "layouts_differ",
    "reduce_max",
    "status_vector",
    "world_route",
]
