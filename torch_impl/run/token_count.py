"""The global token count's collectives, bound once per token group (:class:`TokenCount`):
the broadcast from the count's source, then the SUM over the plan's token group, as
:func:`torch_impl.run.scaling.global_token_scale` runs them on its int64 / float64 copy of
the count (the device path), or on one reused int64 host word for an integer count on the
CPU (:func:`host_total`) when no status round carried it (``consistency_check="off"``, or a
round over other groups than the count's).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from meshgrad.axes import Group
from meshgrad.plan import ReduceOp, TokenScale
from torch_impl.run.collectives import bind_all_reduce, bind_broadcast
from torch_impl.run.errors import collective_guard
from torch_impl.run.groups import TorchGroups
from torch_impl.run.rounds import HostWire, capturing

#: The count dtypes one int64 word holds every value of (the checks refuse bool and complex
#: counts; uint64 and floating counts take the device path).
HOST_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})


def token_scale_text(action: TokenScale) -> str:
    """What the count's collectives do, as a :class:`~meshgrad.errors.CollectiveError` names them."""
    return f"token_scale: num_tokens broadcast over 'pp' and sum over {action.group.value!r}"


class TokenCount:
    """The token count's collectives over one rank's groups, bound once: the broadcast from
    the count's source (the collection's ``token_broadcast``, else the last pp stage), then
    the SUM over the plan's token group. The device path and the host word run the same
    collectives, in the same order, over the same groups: a peer cannot tell which path a
    rank took.

    Args:
      action: the plan's TokenScale (its group).
      groups: this rank's groups.
    """

    __slots__ = ("steps", "what", "_wire")

    def __init__(self, action: TokenScale, groups: TorchGroups) -> None:
        steps: list[Callable[[torch.Tensor], None]] = []
        pp = groups.group(Group.PP)
        if groups.token_broadcast is not None:
            group, source = groups.token_broadcast
            steps.append(bind_broadcast(source, group))
        elif pp is not None:
            steps.append(bind_broadcast(groups.pp_last_rank, pp))
        token_group = groups.group(action.group)
        if token_group is not None:
            steps.append(bind_all_reduce(token_group, ReduceOp.SUM, groups.size(action.group)))
        self.steps = steps
        self.what = token_scale_text(action)
        self._wire: HostWire | None = None  # made by the first count reduced on the host

    def reduce(self, count: torch.Tensor) -> None:
        """Broadcast, then SUM ``count`` in place (the device path's int64 / float64 copy)."""
        for step in self.steps:
            step(count)

    def total(self, num_tokens: torch.Tensor, groups: TorchGroups) -> int:
        """The global count of this rank's ``num_tokens`` (:func:`on_host`), reduced on the
        host word: in int64, wrapped as the device path's int64 sum wraps.

        Raises:
          CollectiveError: a collective failed (names this rank and the collectives); the
            caller drops this object (the failed collective may still hold its word).
        """
        wire = self._wire
        if wire is None:
            wire = self._wire = HostWire(1)
        words = wire.words
        words[0] = int(num_tokens)
        with collective_guard(self.what, groups):
            self.reduce(wire.tensor)
        return words[0]


def token_count(action: TokenScale, groups: TorchGroups) -> TokenCount:
    """The groups' bound :class:`TokenCount` for ``action``'s group (bound on first use)."""
    counts = groups.token_counts
    count = counts.get(action.group)
    if count is None:
        count = counts[action.group] = TokenCount(action, groups)
    return count


def on_host(num_tokens: torch.Tensor) -> bool:
    """Whether ``num_tokens`` is reduced on the host word (:func:`host_total`): a plain
    tensor (a subclass keeps its own ``__torch_function__`` on the device path's copy), on
    the CPU, of a dtype of :data:`HOST_DTYPES`, outside a CUDA graph capture (which reads
    nothing back); else the device path reduces it."""
    return (type(num_tokens) is torch.Tensor and num_tokens.device.type == "cpu" and num_tokens.dtype in HOST_DTYPES
            and not capturing())


def host_total(num_tokens: torch.Tensor, action: TokenScale, groups: TorchGroups) -> int:
    """The global count of ``num_tokens`` (:func:`on_host`) over the groups' bound
    collectives (:meth:`TokenCount.total`); a failure drops them, the next call binds anew.

    Raises:
      CollectiveError: a collective failed.
    """
    try:
        return token_count(action, groups).total(num_tokens, groups)
    except BaseException:
        groups.token_counts.pop(action.group, None)
        raise


__all__ = ["HOST_DTYPES", "TokenCount", "host_total", "on_host", "token_count", "token_scale_text"]
