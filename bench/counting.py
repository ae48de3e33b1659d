"""Counting collectives and copied bytes, for the benchmark only.

:class:`CollectiveCounter` wraps the torch.distributed collectives (module attributes, so
both meshgrad and megatron-core, which call ``torch.distributed.<name>`` at call time,
are seen) while it is active. :class:`FlattenCounter` wraps megatron-core's
``_flatten_dense_tensors`` in its finalize module to count the bytes Megatron copies to
coalesce (in with the flatten, back with ``copy_``).
"""

from __future__ import annotations

import collections
import importlib
import warnings
from typing import Any

import torch
import torch.distributed as dist

COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "_reduce_scatter_base",
    "reduce_scatter",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather",
    "all_reduce_coalesced",
    "all_to_all_single",
)


#: Collectives that torch_impl's checks use (a few bytes per rank; never for data).
CHECK_COLLECTIVES = frozenset({"all_gather", "all_gather_into_tensor", "all_gather_single"})


#: Which positional argument is the tensor a collective sends (the input of a reduce-scatter).
_SENT_ARG = {"reduce_scatter_tensor": 1, "reduce_scatter_single": 1, "_reduce_scatter_base": 1,
             "all_gather_into_tensor": 1, "all_gather_single": 1}


def launch_record(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, tuple[int, ...], str, int]:
    """``(collective, group members as global ranks, dtype, elements sent)`` of one call."""
    group = kwargs.get("group")
    members = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))
    sent = kwargs.get("input", args[_SENT_ARG.get(name, 0)] if len(args) > _SENT_ARG.get(name, 0) else None)
    if isinstance(sent, torch.Tensor):
        return name, members, str(sent.dtype).removeprefix("torch."), sent.numel()
    return name, members, "", 0


class CollectiveCounter:
    """Context manager: ``counts[name]`` = calls of each torch.distributed collective.

    Args:
      log: also record every call in ``records`` (:func:`launch_record`: collective, group
        members, dtype, elements), in call order.
    """

    def __init__(self, log: bool = False) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.records: list[tuple[str, tuple[int, ...], str, int]] | None = [] if log else None
        self._saved: dict[str, Any] = {}

    @property
    def total(self) -> int:
        """Collectives that move gradients, tokens or router state (all but all-gathers:
        torch_impl uses those only for its cross-rank status / consistency checks)."""
        return sum(n for name, n in self.counts.items() if name not in CHECK_COLLECTIVES)

    @property
    def checks(self) -> int:
        """All-gathers: torch_impl's cross-rank status and consistency checks."""
        return sum(n for name, n in self.counts.items() if name in CHECK_COLLECTIVES)

    def __enter__(self) -> "CollectiveCounter":
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._saved[name] = fn

            def wrapper(*args: Any, _fn: Any = fn, _name: str = name, **kwargs: Any) -> Any:
                self.counts[_name] += 1
                if self.records is not None:
                    self.records.append(launch_record(_name, args, kwargs))
                return _fn(*args, **kwargs)

            setattr(dist, name, wrapper)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved.clear()


def megatron_finalize_module() -> Any | None:
    """megatron-core's ``core.distributed.finalize_model_grads`` module, or None."""
    try:
        with warnings.catch_warnings():  # its CPU-only import warns about TE / Apex
            warnings.simplefilter("ignore", UserWarning)
            return importlib.import_module("megatron.core.distributed.finalize_model_grads")
    except Exception:  # not installed, or it fails to import here
        return None


class FlattenCounter:
    """Context manager: bytes megatron-core's finalize copies to coalesce gradients."""

    def __init__(self) -> None:
        self.bytes = 0
        self._module = megatron_finalize_module()
        self._saved: Any = None

    def __enter__(self) -> "FlattenCounter":
        if self._module is not None:
            self._saved = self._module._flatten_dense_tensors

            def flatten(tensors: Any) -> torch.Tensor:
                # Megatron copies each gradient into the flat buffer and back (copy_).
                self.bytes += 2 * sum(t.numel() * t.element_size() for t in tensors)
                return self._saved(tensors)

            self._module._flatten_dense_tensors = flatten
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._module is not None and self._saved is not None:
            self._module._flatten_dense_tensors = self._saved
