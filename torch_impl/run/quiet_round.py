"""The status round of a rank with nothing to report, on a CPU route: the same words and
collectives as :func:`torch_impl.run.rounds.reduce_status`, with the route's shape worked out
once (:class:`QuietRound`). A healthy steady step runs its round through it.

Its one method is written out flat: the wire's clearing
(:meth:`~torch_impl.run.rounds.HostWire.clear`), the count's bits
(:func:`~meshgrad.status_wire.token_bits`) and the reading of the reduced words
(:func:`~meshgrad.status_wire.nothing_flagged`, :func:`~meshgrad.status_wire.carried_count`)
are each one expression here, by the constants of :mod:`meshgrad.status_wire`, instead of a
call (the collective and the read-back stay calls: the tests count the host syncs by them).
Inside a step each function a call enters comes back cold from memory, a few microseconds
each; ``tests/test_status_round.py`` holds the words it sends and its reading of the
reduced ones equal to the full round's for every format.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

from meshgrad.status_wire import COUNT_MASK, ELEMENTS, FLAG_COUNT, TOKEN_SHIFT, TOO_LARGE, token_limit, wire_format
from torch_impl.run import rounds
from torch_impl.run.rounds import Hop


class QuietRound:
    """The status round of one CPU route, its shape worked out once: the route's reused
    host wire (:class:`~torch_impl.run.rounds.HostWire`), and the round of a rank with
    nothing to report (no error, no comparison due, no NaN / Inf; its token count, if the
    round carries one, an int on the host). That rank sends the words
    :func:`~torch_impl.run.rounds.wire_words` gives a healthy status (zeros, then the
    count) and runs the same collectives over the same hops, so its peers cannot tell
    which path it took. When the reduced words flag nothing anywhere, they say what
    :func:`~torch_impl.run.rounds.reduce_status` would: the healthy counts and the token
    sum; otherwise the caller reads them as that function does
    (:func:`~torch_impl.run.rounds.received`).

    Args:
      route: the round's route (every hop on the CPU).
    """

    __slots__ = ("route", "wire", "hops", "reached", "limit", "options", "short", "mask")

    def __init__(self, route: Sequence[Hop]) -> None:
        self.route = route
        self.reached = n = rounds.reached(route)
        fmt = wire_format(n)
        self.limit = token_limit(n)  # a short word's bound on one rank's count
        self.wire = rounds.HostWire(ELEMENTS[fmt])
        self.short = fmt == "short"
        self.mask = COUNT_MASK.get(fmt)  # the first word's count bits (None: a wide wire, a word per count)
        self.hops = [(name, pg) for name, pg, _, _ in route]
        # the options of the round's all-reduces, made once (torch only reads them)
        self.options = rounds.reduce_options(dist.ReduceOp.SUM)

    def run(self, tokens: int | None, rank: int, what: str) -> tuple[list[int], bool, int | None]:
        """Send this rank's healthy words (with ``tokens``: this rank's count, or None).

        Returns:
          (the reduced words, whether every rank was healthy -- nothing flagged, every count
          carried --, and then the token sum when counts were carried, else None).

        Raises:
          CollectiveError: a hop failed (timeout): names ``what``, the hop and this rank.
        """
        wire = self.wire
        words, tensor = wire.words, wire.tensor
        words[:] = wire.zeros  # the last round's sum: zeros again (HostWire.clear)
        if tokens is not None:
            if self.short:  # the count from TOKEN_SHIFT up, or the too-large flag
                words[0] = tokens << TOKEN_SHIFT if -self.limit < tokens < self.limit else TOO_LARGE
            else:
                words[-1] = tokens
        for name, pg in self.hops:
            try:
                rounds.all_reduce_status(tensor, pg, self.options)
            except RuntimeError as err:
                raise rounds.round_failed(rank, what, name, err) from err
        reduced = rounds.read_back(tensor, words)  # the round's one read-back (a host wire: its memory)
        mask = self.mask
        healthy = not reduced[0] & mask if mask is not None else not any(reduced[:FLAG_COUNT])
        if not healthy or tokens is None:
            return reduced, healthy, None
        return reduced, True, reduced[0] >> TOKEN_SHIFT if self.short else reduced[-1]


__all__ = ["QuietRound"]
