"""The collectives of the status round and its follow-ups, and the status's wire format.

A round SUM-reduces a rank's status (:func:`status_vector`: how many ranks failed, ask for a
comparison, found NaN / Inf or are in a layout round) over a route of process groups, one
hop after another (:func:`reduce_status`); :func:`encode` packs the counts into one int64 on
a route of up to 63 ranks (the token count from bit 32 up), two up to 2**15, one per count
beyond, and :func:`decode` reads the reduced elements back. The follow-up rounds (which rank
raised a flag, equal layout digests) are MAX reductions (:func:`reduce_max`); error texts
travel by :func:`gather_texts`. What each rank decides from a round lives in
:mod:`torch_impl.run.status`.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from meshgrad.errors import CollectiveError
from meshgrad.status_wire import (
    ELEMENTS, FIELD_BITS, SHORT_BITS, SHORT_MAX, TOKEN_SHIFT, TOO_LARGE, carried_count, nothing_flagged,
    token_bits, token_limit, wire_format,
)
from torch_impl.run.modes import kept_host_tensor

#: Positions in a reduced status vector (:func:`decode`): the ranks the round reached, and
#: how many of them failed, ask for a comparison, found NaN / Inf or are in a layout round.
REACHED, ERROR, COMPARE, NONFINITE, KIND = range(5)
FLAGS = (ERROR, COMPARE, NONFINITE, KIND)
_FLAG_VALUES = operator.itemgetter(*FLAGS)  # a status's flags, in one C call
#: int64 elements on the wire for a route of 64 to 2**15 - 1 ranks (the format:
#: :mod:`meshgrad.status_wire`).
STATUS_SIZE = ELEMENTS["packed"]
BIG = 1 << 40

#: One hop of a route: (a name for errors, the process group, the device of its
#: tensors, its size).
Hop = tuple[str, Any, torch.device, int]

def capturing() -> bool:
    """Inside a CUDA graph capture (no host sync possible: the checks are skipped). A
    capture needs an initialized CUDA context, so none is asked for before one exists
    (``torch.cuda.is_available`` costs a device query on every call)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


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


def wire_words(status: Sequence[int], reached: int, tokens: int | None = None) -> list[int]:
    """The int64 elements one rank contributes (:func:`encode`), as Python ints."""
    fmt = wire_format(reached)
    if not any(_FLAG_VALUES(status)):  # a healthy status: zeros, then the tokens
        words = [0] * ELEMENTS[fmt]
    elif fmt == "wide":
        words = [*(int(status[f]) for f in FLAGS), 0]
    else:  # the counts in one word, then the token element of a packed round
        bits = SHORT_BITS if fmt == "short" else FIELD_BITS
        words = [sum(int(status[f]) << (bits * i) for i, f in enumerate(FLAGS))] + [0] * (ELEMENTS[fmt] - 1)
    if tokens is not None:
        if fmt == "short":
            words[0] += token_bits(tokens, token_limit(reached))
        else:
            words[-1] = tokens
    return words


def encode(status: Sequence[int], reached: int, tokens: int | None = None) -> torch.Tensor:
    """The int64 elements one rank contributes, on the host: a healthy status (no flag) is
    all zeros. ``tokens``: this rank's token count (an int64 value) known on the host
    (:func:`token_bits`); None: none, or one added on its device by :func:`place_tokens`."""
    return torch.tensor(wire_words(status, reached, tokens), dtype=torch.int64, device="cpu")


class HostWire:
    """An int64 host tensor for a round's words and a memoryview of its memory (written and
    read back in plain Python, without a torch or numpy operation: inside a step every
    library a round calls into comes back cold from memory). A route's status rounds reuse
    one (:func:`reduce_status`): a healthy round then makes no torch operation besides its
    collective. A round reads its result back before it returns, so the next round may
    overwrite it; the owner drops a wire whose round failed (the failed collective may
    still hold the tensor). Other rounds make a fresh one each.

    Args:
      size: the wire's int64 elements (:data:`meshgrad.status_wire.ELEMENTS`).
    """

    __slots__ = ("tensor", "words", "zeros")

    def __init__(self, size: int) -> None:
        self.tensor, self.words = kept_host_tensor(torch.int64, (size,))  # a route's wire is kept between calls
        self.zeros = memoryview(bytes(8 * size)).cast("q")  # what :meth:`clear` copies in

    def clear(self) -> None:
        """Every word zero again (the last round's sum overwritten, one C-level copy; written
        out in :meth:`~torch_impl.run.quiet_round.QuietRound.run`)."""
        self.words[:] = self.zeros

    def load(self, words: Sequence[int]) -> tuple[torch.Tensor, memoryview]:
        """The tensor holding ``words`` (as many as the wire's elements) and its memoryview."""
        view = self.words
        for index, word in enumerate(words):
            view[index] = word
        return self.tensor, view


def decode(wire: Sequence[int], reached: int) -> list[int]:
    """The reduced elements as counts (:data:`REACHED` ... :data:`KIND`, then the ranks whose
    token count did not fit the short word): a SUM of packed words is the word of the sums,
    as no count can carry into the next field."""
    fmt = wire_format(reached)
    if nothing_flagged(wire, fmt):  # a healthy round: every count zero
        return [reached, 0, 0, 0, 0, 0]
    if fmt == "wide":
        return [reached, *wire[: len(FLAGS)], 0]
    word = int(wire[0])
    bits = SHORT_BITS if fmt == "short" else FIELD_BITS
    fields = len(FLAGS) + (fmt == "short")
    mask = (1 << bits) - 1
    return [reached, *((word >> (bits * i)) & mask for i in range(fields))] + ([] if fmt == "short" else [0])


def place_tokens(value: torch.Tensor, tokens: torch.Tensor, reached: int) -> None:
    """Add this rank's token count to its wire elements on their device (no host sync), as
    :func:`encode` does on the host."""
    count = tokens.detach().reshape(()).to(device=value.device, dtype=torch.int64)
    if wire_format(reached) != "short":
        value[-1].copy_(count)
        return
    limit = token_limit(reached)
    kept = count.clamp(1 - limit, limit - 1)  # equal to the count exactly when it fits
    value[0] += torch.where(kept == count, kept * (1 << TOKEN_SHIFT), TOO_LARGE)


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


def reduce_options(op: Any) -> Any:
    """The options of an all-reduce with ``op`` (a ``ReduceOp``), the process group's
    default timeout, for a call of the process group itself. The rounds call it so: they
    stay apart from the ``torch.distributed`` calls that move data (which tests and
    benchmarks count) and skip their Python layer (a few microseconds a step). The data
    collectives start from them too (:func:`torch_impl.run.collectives.bind_all_reduce`)."""
    options = dist.AllreduceOptions()
    options.reduceOp = op
    return options


def all_reduce_status(value: torch.Tensor, pg: Any, options: Any = None) -> None:
    """SUM-all-reduce a status vector in place over ``pg`` (the status round's one
    reduction); ``options``: ``reduce_options(ReduceOp.SUM)`` kept by the caller (None:
    made here)."""
    pg.allreduce([value], options if options is not None else reduce_options(dist.ReduceOp.SUM)).wait()


def all_reduce_max(value: torch.Tensor, pg: Any) -> None:
    """MAX-all-reduce ``value`` in place over ``pg`` (the rounds that only run after a
    status round found something: a comparison's outcome, the rank that found NaN)."""
    pg.allreduce([value], reduce_options(dist.ReduceOp.MAX)).wait()


def read_back(value: torch.Tensor, host: memoryview | None = None) -> list[int]:
    """The reduced vector on the host: a round's one host sync (on a GPU it waits for the
    work queued before it, as any read of a device value does). ``host``: the memoryview
    of a host tensor's memory (:class:`HostWire`, read directly)."""
    return host.tolist() if host is not None else value.tolist()


def _reduce(words: list[int], route: Sequence[Hop], rank: int, what: str,
            reduce: Callable[[torch.Tensor, Any], None], place: Callable[[torch.Tensor], None] | None = None,
            wire: HostWire | None = None) -> tuple[list[int], torch.Tensor]:
    """Reduce ``words`` (in ``wire`` on a CPU route without ``place``, else in a fresh int64
    tensor, the round's own) over every hop of ``route`` in turn; returns (the reduced
    elements on the host, the reduced tensor)."""
    device = route[0][2]
    if wire is None or place is not None or device.type != "cpu":
        wire = HostWire(len(words))
    value, host = wire.load(words)
    if device.type != "cpu":
        value, host = value.to(device, non_blocking=True), None
    if place is not None:
        place(value)
    for name, pg, _, _ in route:
        try:
            reduce(value, pg)
        except RuntimeError as err:
            raise round_failed(rank, what, name, err) from err
    return read_back(value, host), value


def reached(route: Sequence[Hop]) -> int:
    """How many ranks a SUM over ``route`` counts (each hop multiplies by its size: the
    world's size for a route whose groups form a grid over it)."""
    n = 1
    for _, _, _, size in route:
        n *= size
    return n


def host_count(tokens: torch.Tensor, route: Sequence[Hop]) -> bool:
    """Whether a token count is encoded on the host: it and the route are on the CPU (its
    read syncs nothing) and int64 holds every value of its dtype (not uint64). The status
    round (:func:`~torch_impl.run.status.status_round`) writes it out."""
    return tokens.device.type == "cpu" == route[0][2].type and tokens.dtype != torch.uint64


def reduce_status(status: Sequence[int], route: Sequence[Hop], rank: int, what: str,
                  tokens: torch.Tensor | None = None, wire: HostWire | None = None,
                  ) -> tuple[list[int], int | torch.Tensor | None]:
    """SUM-reduce a status over every hop of ``route`` in turn (:func:`encode`: one int64
    for a route of up to :data:`SHORT_MAX` ranks, two up to 2**15, else five), with
    ``tokens`` when given.

    Args:
      status: this rank's :func:`status_vector`.
      route: the round's route.
      rank: this rank (for errors).
      what: the round's name (for errors).
      tokens: this rank's ``num_tokens`` for the token slot (:func:`fused_tokens`), or None.
      wire: the route's reused host wire (:class:`HostWire`), or None: a fresh tensor.

    Returns:
      (the reduced counts (:data:`REACHED` ... :data:`KIND`), the reduced token count: an
      int when it was encoded on the host (the read-back wire holds it), else a 0-d int64
      tensor on the route's device -- None when ``tokens`` is None, the route is empty, or
      some rank's count was too large for the short word: then the caller reduces the
      count itself, on every rank alike).

    Raises:
      CollectiveError: a hop failed (timeout): names ``what``, the hop and this rank.
    """
    if not route:
        return list(status), None
    n = reached(route)
    place = None
    if tokens is not None and host_count(tokens, route):
        words = wire_words(status, n, int(tokens))  # no tensor op
    else:
        words = wire_words(status, n)
        place = (lambda elements: place_tokens(elements, tokens, n)) if tokens is not None else None
    reduced, value = _reduce(words, route, rank, what, all_reduce_status, place, wire)
    return received(reduced, n, tokens, None if place is None else value)


def received(reduced: Sequence[int], n: int, tokens: Any, value: torch.Tensor | None = None,
             ) -> tuple[list[int], int | torch.Tensor | None]:
    """What the reduced words of a status round over ``n`` ranks say.

    Args:
      reduced: the reduced words, on the host.
      n: the ranks the round reached.
      tokens: this rank's count if the round carried counts, else None.
      value: the reduced tensor when the counts were placed on its device, else None (they
        were encoded on the host: the words hold the sum).

    Returns:
      (the counts (:data:`REACHED` ... :data:`KIND`), the token sum -- an int read from the
      words, or a 0-d tensor of ``value`` -- or None when no counts were carried or some
      rank's count did not fit the short word: then the caller reduces the count itself).
    """
    counts = decode(reduced, n)
    if tokens is None or counts[-1]:  # some rank's count did not fit: a collective of its own
        return counts[:-1], None
    fmt = wire_format(n)
    if value is None:  # encoded on the host: the read-back words hold the count
        return counts[:-1], carried_count(reduced, fmt)
    return counts[:-1], value[0] >> TOKEN_SHIFT if fmt == "short" else value[-1]


def reduce_max(values: Sequence[int], route: Sequence[Hop], rank: int, what: str) -> list[int]:
    """MAX-reduce ``values`` over every hop of ``route`` in turn (the result is the maximum
    over every rank the route reaches).

    Raises:
      CollectiveError: a hop failed (timeout): names ``what``, the hop and this rank.
    """
    if not route:
        return list(values)
    return _reduce(list(values), route, rank, what, all_reduce_max)[0]


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



__all__ = [
    "BIG", "COMPARE", "ERROR", "FIELD_BITS", "FLAGS", "Hop", "HostWire", "KIND", "NONFINITE", "REACHED",
    "SHORT_BITS", "SHORT_MAX", "STATUS_SIZE", "TOKEN_SHIFT", "TOO_LARGE", "all_reduce_max", "all_reduce_status",
    "backend", "capturing", "decode", "device_for", "encode", "first_line", "gather_texts", "host_count",
    "layout_digest", "layouts_differ", "lowest_flagged", "place_tokens", "reached", "read_back", "received",
    "reduce_max", "reduce_options", "reduce_status", "round_failed", "token_bits", "token_limit", "wire_format",
    "wire_words", "world_route",
]
