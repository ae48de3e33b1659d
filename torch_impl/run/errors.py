"""Exception types of torch_impl and the texts that name what failed, defined once.

:class:`MegatronAssertionError` is raised where Megatron-Core's own
``finalize_model_grads`` module asserts (or fails on a ``None`` group): it derives from
both :class:`~meshgrad.errors.FinalizeInputError` (a ``ValueError``: meshgrad's type
for bad input) and ``AssertionError`` (what
code and tests written against Megatron catch). It is always a real ``raise``, raised
before any collective or mutation.

:class:`ConsistencyError` and :class:`NonFiniteGradError` (defined once in
:mod:`meshgrad.errors`, shared with jax_impl) are raised on every rank by the
cross-rank rounds (:mod:`torch_impl.call.agree`) before any gradient moves;
:class:`CollectiveError` names a collective that failed (:func:`collective_guard`,
:func:`action_failed`). :func:`describe` is the one line that names an action.
"""

from __future__ import annotations

from typing import Any

from meshgrad.axes import Group
# The cross-rank and NaN error types are meshgrad's, shared with jax_impl (same class for
# the same failure in both backends).
from meshgrad.errors import (
    CollectiveError,
    ConsistencyError,
    FinalizeInputError,
    FinalizeTypeError,
    MissingInputError,
    NonFiniteGradError,
)
from meshgrad.actions import Action
from torch_impl.run.groups import TorchGroups, group_ranks, world_rank
from torch_impl.run.status import first_line


class MegatronAssertionError(FinalizeInputError, AssertionError):
    """Bad input that Megatron-Core rejects with an assertion (or a crash on None)."""


_HINT = (
    "a peer rank may have died, stalled past the process-group timeout or raised before "
    "this collective; this step's gradients may be partly finalized"
)


def raise_ranked(err: BaseException) -> None:
    """Raise ``err`` (a ValueError / TypeError) again with this rank's prefix when its
    message lacks one; return when it has one or is of another type (the caller re-raises)."""
    if not isinstance(err, (ValueError, TypeError)):
        return
    text = str(err)
    if text.startswith("rank "):
        return
    try:
        renamed = type(err)(f"rank {world_rank()}: {text}")
    except Exception:  # an exception type with another constructor
        raise err from None
    raise renamed from err


class ranked:  # noqa: N801 -- used like a function
    """Prefix the message of a ValueError / TypeError raised inside with this rank when it
    lacks one (:func:`raise_ranked`), as a context manager (the entry points' decorator,
    :func:`~torch_impl.sources.wrappers.eager_under_compile`, does the same in its wrapper)."""

    def __enter__(self) -> "ranked":
        return self

    def __exit__(self, kind: Any, err: BaseException | None, trace: Any) -> bool:
        if err is not None:
            raise_ranked(err)
        return False


def _ranks_text(groups: TorchGroups, group: Group | None) -> str:
    if group is None:
        return ""
    pg = groups.group(group)
    if pg is None:
        return ""
    try:
        return f" (global ranks {group_ranks(pg)})"
    except Exception:  # pragma: no cover - a group torch no longer knows
        return ""


def describe(action: Action, groups: TorchGroups | None = None) -> str:
    """One line saying what an action communicates (the action's own
    :meth:`describe`), with each group's size when ``groups`` is given."""
    return action.describe(groups.size if groups is not None else None)


def action_failed(action: Action, index: int, err: BaseException) -> CollectiveError:
    """The :class:`CollectiveError` for action ``index`` of a plan that raised ``err``
    (the executor raises it ``from err``)."""
    return CollectiveError(
        f"rank {world_rank()}: finalize action #{index + 1} ({describe(action)}) failed: "
        f"{first_line(err)} -- {_HINT}"
    )


class collective_guard:  # noqa: N801 -- used like a function
    """Re-raise a RuntimeError of the collectives inside as a :class:`CollectiveError`
    that names this rank, ``description`` and the group's global ranks (a plain class:
    it is entered on every step).

    Args:
      description: what the collectives inside do (named in the error).
      groups: this rank's groups.
      group: the group they run over (its global ranks are named), or None.
    """

    __slots__ = ("description", "groups", "group")

    def __init__(self, description: str, groups: TorchGroups, group: Group | None = None) -> None:
        self.description, self.groups, self.group = description, groups, group

    def __enter__(self) -> "collective_guard":
        return self

    def __exit__(self, kind: Any, err: BaseException | None, trace: Any) -> bool:
        if err is not None and collective_failure(err):
            raise collective_error(self.description, self.groups, self.group, err) from err
        return False


def collective_failure(err: BaseException) -> bool:
    """Whether ``err`` is a collective's own failure (a RuntimeError that is not already
    meshgrad's error), to be re-raised as a :class:`CollectiveError`."""
    return isinstance(err, RuntimeError) and not isinstance(err, (CollectiveError, ConsistencyError))


def collective_error(description: str, groups: TorchGroups, group: Group | None, err: BaseException) -> CollectiveError:
    """The :class:`CollectiveError` for a collective (``description``, over ``group``)
    that raised ``err``: it names this rank and the group's global ranks."""
    return CollectiveError(
        f"rank {groups.rank}: {description}{_ranks_text(groups, group)} failed: {first_line(err)} -- {_HINT}"
    )


__all__ = [
    "CollectiveError",
    "ConsistencyError",
    "FinalizeInputError",
    "FinalizeTypeError",
    "MegatronAssertionError",
    "MissingInputError",
    "NonFiniteGradError",
    "action_failed",
    "collective_error",
    "collective_failure",
    "collective_guard",
    "describe",
    "first_line",
    "raise_ranked",
    "ranked",
]
