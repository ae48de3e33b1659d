"""The global token count reduced on the host, for a call whose status round did not carry
it (``consistency_check="off"``, or a round over other groups than the count's): the same
collectives as the device path of :func:`torch_impl.run.scaling.global_token_scale`, bound
once per token group and run on a reused one-word host tensor (:class:`HostCount`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from meshgrad.axes import Group
from meshgrad.plan import ReduceOp, TokenScale
from torch_impl.run.collectives import bind_all_reduce, broadcast
from torch_impl.run.errors import collective_error, collective_failure
from torch_impl.run.groups import TorchGroups
from torch_impl.run.rounds import HostWire, capturing

#: The count dtypes one int64 word holds every value of (the checks refuse bool and complex
#: counts; uint64 and floating counts take the device path).
HOST_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})


def token_scale_text(action: TokenScale) -> str:
    """What the count's collectives do, as a :class:`~meshgrad.errors.CollectiveError` names them."""
    return f"token_scale: num_tokens broadcast over 'pp' and sum over {action.group.value!r}"


class HostCount:
    """The token count's collectives over one rank's groups, bound once: the broadcast from
    the count's source (the collection's ``token_broadcast``, else the last pp stage), then
    the SUM over the plan's token group, on one reused int64 host word, as the device path
    runs them on its int64 copy of the count (the same collectives, in the same order, over
    the same groups: a peer cannot tell which path a rank took).

    Args:
      action: the plan's TokenScale (its group).
      groups: this rank's groups.
    """

    __slots__ = ("wire", "steps", "what", "group")

    def __init__(self, action: TokenScale, groups: TorchGroups) -> None:
        self.wire = HostWire(1)
        steps: list[Callable[[torch.Tensor], None]] = []
        pp = groups.group(Group.PP)
        if groups.token_broadcast is not None:
            group, source = groups.token_broadcast
            steps.append(partial(_broadcast_from, source, group))
        elif pp is not None:
            steps.append(partial(_broadcast_from, groups.pp_last_rank, pp))
        if groups.group(action.group) is not None:
            steps.append(bind_all_reduce(groups.group(action.group), ReduceOp.SUM, groups.size(action.group)))
        self.steps = steps
        self.what = token_scale_text(action)

    def total(self, num_tokens: torch.Tensor, groups: TorchGroups) -> int:
        """The global count of this rank's ``num_tokens`` (one element, on the CPU, a dtype
        of :data:`HOST_DTYPES`): in int64, wrapped as the device path's int64 sum wraps.

        Raises:
          CollectiveError: a collective failed (names this rank and the collectives); the
            caller drops this object (the failed collective may still hold its word).
        """
        words = self.wire.words
        words[0] = int(num_tokens)
        try:
            for step in self.steps:
                step(self.wire.tensor)
        except BaseException as err:
            if collective_failure(err):
                raise collective_error(self.what, groups, None, err) from err
            raise
        return words[0]


def _broadcast_from(source: int, group: object, tensor: torch.Tensor) -> None:
    broadcast(tensor, source, group)


def host_count(action: TokenScale, groups: TorchGroups | None, num_tokens: torch.Tensor) -> HostCount | None:
    """The groups' bound :class:`HostCount` for ``action``'s group when ``num_tokens`` can be
    reduced on the host (on the CPU, a dtype of :data:`HOST_DTYPES`, outside a CUDA graph
    capture, which reads nothing back), else None: the device path reduces it."""
    if groups is None or num_tokens.device.type != "cpu" or num_tokens.dtype not in HOST_DTYPES or capturing():
        return None
    counts = groups.host_counts
    count = counts.get(action.group)
    if count is None:
        count = counts[action.group] = HostCount(action, groups)
    return count


__all__ = ["HOST_DTYPES", "HostCount", "host_count", "token_scale_text"]
