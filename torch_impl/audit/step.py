"""What is read and written per step: the values before and after the call, the header."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np
import torch

from torch_impl.audit.fileformat import FORMAT_VERSION
from torch_impl.audit.plan import _Plan
from torch_impl.audit.sampling import _concat64, _host, _numpy, _router_values, _sampler, _scalar


@dataclasses.dataclass
class Reading:
    """One side of a step, as read.

    Args:
      values: the sampled gradient values (a new tensor).
      present: per parameter, whether it had a gradient of its recorded size.
      routers: the router buffers, flattened into one new float64 tensor (None: no buffers).
      fields: [router index, field, shape] of every router buffer present.
      tokens: before: a copy of ``num_tokens`` (or None); after: (value before, value
        after) (or None).
    """

    values: torch.Tensor
    present: np.ndarray
    routers: torch.Tensor | None
    fields: list[list[Any]]
    tokens: Any


def read_before(plan: _Plan, fields: list[list[Any]], buffers: list[torch.Tensor],
                num_tokens: torch.Tensor | None) -> Reading:
    """Read the step before the wrapped call.

    Args:
      plan: the plan of this step.
      fields, buffers: the router buffers present and their tensors.
      num_tokens: what the call is given.

    Returns:
      The reading (``tokens``: a copy of ``num_tokens``).
    """
    with torch.no_grad():
        values = plan.sampler.read(plan.fsdp)
        present = plan.sampler.present
        routers = _concat64(buffers)
        tokens = None if num_tokens is None else num_tokens.detach().clone()
    return Reading(values, present, routers, fields, tokens)


def read_after(plan: _Plan, num_tokens: torch.Tensor | None, tokens_before: torch.Tensor | None) -> Reading:
    """Read the step after the wrapped call (re-binding the sampler to new gradient tensors).

    Args:
      plan: the plan of this step.
      num_tokens: what the call was given.
      tokens_before: the copy of ``num_tokens`` taken before the call.

    Returns:
      The reading (``tokens``: (value before, value after), or None).
    """
    with torch.no_grad():
        sampler = plan.sampler if plan.sampler.watch.same_tensors() else _sampler(plan.entries, plan.params, plan.fsdp)
        values = sampler.read(plan.fsdp)
        fields, buffers = _router_values(plan.routers)
        routers = _concat64(buffers)
        tokens = None if tokens_before is None else (_scalar(tokens_before), _scalar(num_tokens))
    return Reading(values, sampler.present, routers, fields, tokens)


def step_meta(step: int, plan: _Plan, run_id: str | None, num_tokens: torch.Tensor | None, tokens: Any,
              force_all_reduce: Any) -> dict[str, Any]:
    """The step file's header: format, step, rank, plan digest, run id and num_tokens.

    Args:
      step, plan, run_id: the step index, its plan and the recording's id.
      num_tokens: what the call was given (its dtype is recorded).
      tokens: (value before, value after), or None.
      force_all_reduce: what the call was given.

    Returns:
      A JSON-able dict.
    """
    return {
        "format": FORMAT_VERSION,
        "step": step,
        "rank": plan.rank,
        "plan": plan.digest,
        "run": run_id,
        "force_all_reduce": bool(force_all_reduce),
        "num_tokens": {
            "before": None if tokens is None else tokens[0],
            "after": None if tokens is None else tokens[1],
            "dtype": None if num_tokens is None else str(num_tokens.dtype).removeprefix("torch."),
        },
    }


def step_values(meta: dict[str, Any], before: Reading, after: Reading) -> tuple[Any, ...]:
    """What the writer is given: (meta, values before, values after, has_grad before,
    has_grad after, router buffers before, after), the tensors copied to the host."""
    values_before, values_after, routers_before, routers_after = map(
        _host, (before.values, after.values, before.routers, after.routers))
    return meta, values_before, values_after, before.present, after.present, routers_before, routers_after


def step_arrays(values: tuple[Any, ...]) -> dict[str, np.ndarray]:
    """The step file's arrays.

    Args:
      values: what :func:`step_values` returned.

    Returns:
      name -> array, as saved.
    """
    meta, before, after, present_before, present_after, routers_before, routers_after = values
    arrays: dict[str, np.ndarray] = {
        "meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
        "grads_before": _numpy(before),
        "grads_after": _numpy(after),
        "has_grad": np.stack([present_before, present_after]),
    }
    if routers_before is not None:
        arrays["routers_before"] = _numpy(routers_before)
    if routers_after is not None:
        arrays["routers_after"] = _numpy(routers_after)
    return arrays
