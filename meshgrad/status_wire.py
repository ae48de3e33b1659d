"""The status round's wire format: how many int64 a round over ``n`` ranks sends and how
its counts are packed. torch_impl's rounds (:mod:`torch_impl.run.rounds`) encode by it and
the launch model (:mod:`meshgrad.launches`) counts by it (:func:`status_elements`): one rule.

A route of at most :data:`SHORT_MAX` ranks sends ONE int64: the four flag counts and a
fifth (ranks whose token count is too large to carry) in :data:`SHORT_BITS` bits each, the
token count from bit :data:`TOKEN_SHIFT` up (each rank's below 2**31 / n, so the sum cannot
overflow); up to 2**15 - 1 ranks, the counts packed in :data:`FIELD_BITS`-bit fields of one
int64, then the token count; beyond, one int64 per count, then the token count.
"""

from __future__ import annotations

from collections.abc import Sequence

#: The flag counts a status carries: ranks that failed, ask for a comparison, found NaN /
#: Inf, are in a layout round.
FLAG_COUNT = 4
SHORT_BITS, SHORT_MAX, TOKEN_SHIFT = 6, 63, 32
#: Bits of one count in the packed word of a route of fewer than 2**15 ranks.
FIELD_BITS = 16
#: int64 elements on the wire per format (on gloo a small all-reduce costs about one ring
#: step per element; on NCCL one latency whatever the count).
ELEMENTS = {"short": 1, "packed": 2, "wide": FLAG_COUNT + 1}
#: The bits of a format's first word that hold counts (the token count lies above them): the
#: four flags and the too-large count in a short word, the four flags in a packed one.
COUNT_MASK = {"short": (1 << (SHORT_BITS * (FLAG_COUNT + 1))) - 1, "packed": (1 << (FIELD_BITS * FLAG_COUNT)) - 1}
#: What a rank whose token count is too large for the short word adds instead of the count:
#: one in the fifth field (the ranks then reduce the count in a collective of its own).
TOO_LARGE = 1 << (SHORT_BITS * FLAG_COUNT)


def wire_format(reached: int) -> str:
    """How a round that reaches ``reached`` ranks (every rank of it computes the same)
    sends its status: ``"short"`` (one int64, tokens included), ``"packed"`` (the counts in
    one int64, the tokens in a second) or ``"wide"`` (one int64 per count, then tokens)."""
    if reached <= SHORT_MAX:
        return "short"
    return "packed" if reached < 1 << (FIELD_BITS - 1) else "wide"


def token_limit(reached: int) -> int:
    """The bound on one rank's token count in a short word: with every count below it in
    magnitude, the SUM of ``reached`` counts fits the bits from :data:`TOKEN_SHIFT` up."""
    return (1 << (TOKEN_SHIFT - 1)) // reached


def token_bits(count: int, limit: int) -> int:
    """What an int64 token ``count`` adds to a short word: the count from
    :data:`TOKEN_SHIFT` up, or :data:`TOO_LARGE` when it is too large for the word
    (``limit``: :func:`token_limit` of the ranks the round reaches, worked out once per
    route by its caller). Written out in torch_impl's quiet round (``QuietRound.run``), as
    are :func:`nothing_flagged` and :func:`carried_count`: a change here is one there."""
    return count << TOKEN_SHIFT if -limit < count < limit else TOO_LARGE


def nothing_flagged(words: Sequence[int], fmt: str) -> bool:
    """Whether a round's reduced ``words`` (of format ``fmt``) count no rank in any flag,
    nor, in a short word, a count too large to carry."""
    return not any(words[:FLAG_COUNT]) if fmt == "wide" else not int(words[0]) & COUNT_MASK[fmt]


def carried_count(words: Sequence[int], fmt: str) -> int:
    """The token sum in a round's reduced ``words`` (of format ``fmt``) when every rank's
    count was carried."""
    return int(words[0]) >> TOKEN_SHIFT if fmt == "short" else int(words[-1])


def status_elements(reached: int) -> int:
    """The int64 elements a round over ``reached`` ranks sends."""
    return ELEMENTS[wire_format(reached)]


__all__ = [
    "COUNT_MASK", "ELEMENTS", "FIELD_BITS", "FLAG_COUNT", "SHORT_BITS", "SHORT_MAX", "TOKEN_SHIFT", "TOO_LARGE",
    "carried_count", "nothing_flagged", "status_elements", "token_bits", "token_limit", "wire_format",
]
