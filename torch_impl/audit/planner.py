"""How a recorder chooses its samples: per-parameter entries and the plan they form."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import operator
from typing import Any

import numpy as np
import torch

from meshgrad.config import FinalizeConfig
from torch_impl.audit.fileformat import FORMAT_VERSION
from torch_impl.audit.internals import CONFIG_SIZES, FLAG_ATTRS
from torch_impl.audit.layout import _config_dict, _ddp_chunks, _layout
from torch_impl.audit.plan import _Plan, _same
from torch_impl.audit.sampling import _Entry, _router_values, _sampler, sample_key, sample_positions

#: Parameter flags recorded (docs/semantics.md): those discovery reads.
PARAM_FLAGS = FLAG_ATTRS

Facts = tuple[FinalizeConfig, Any, Any, Any]


class Planner:
    """Keeps a recorder's current plan and the entries (sampled positions) of its parameters.

    Attributes:
      plan: the last plan made or re-bound (None before the first step).
      made: how many plans were made.
    """

    def __init__(self) -> None:
        self.plan: _Plan | None = None
        self.made = 0
        self._entries: dict[tuple[Any, ...], _Entry] = {}

    def current(self, chunks: list[Any], source: Any, facts: Facts, finalize: Any, sample: int,
                check: bool = True) -> _Plan:
        """The plan for these facts: the last one while nothing it was made from changed.

        Args:
          chunks, source: the model chunks and the group source of this step.
          facts: (config, groups, raw config, discovered model), as resolved.
          finalize, sample: the recorder's wrapped function and sample size.
          check: also check the gradient tensors and router buffers (new gradient tensors
            of the same parameters only re-bind the sampler).

        Returns:
          The plan (a new one when anything changed).
        """
        config, groups, raw, found = facts
        sizes = tuple(getattr(raw, name, None) if raw is not None else None for name in CONFIG_SIZES)
        key = (found, groups, config, raw, sizes, tuple(map(id, chunks)), source, tuple(_ddp_chunks(chunks)), finalize)
        plan = self.plan
        if plan is None or len(plan.key) != len(key) or not all(map(_same, plan.key, key)):
            return self._new(key, chunks, source, facts, finalize, sample)
        if not check:
            return plan
        if _router_values(plan.routers)[0] != plan.router_fields:
            return self._new(key, chunks, source, facts, finalize, sample)
        if not plan.sampler.watch.same():
            entries = [self.entry(spec, param, sample) for spec, param in zip(found.params, plan.params)]
            if not all(map(operator.is_, entries, plan.entries)):
                return self._new(key, chunks, source, facts, finalize, sample)
            self.plan = plan = dataclasses.replace(plan, sampler=_sampler(plan.entries, plan.params, plan.fsdp))
        return plan

    def _new(self, key: tuple[Any, ...], chunks: list[Any], source: Any, facts: Facts, finalize: Any,
             sample: int) -> _Plan:
        """Make a plan, keep it and count it: entries (cached per parameter), sampler,
        the static facts and their digest."""
        config, groups, raw, found = facts
        fsdp = bool(config.use_megatron_fsdp)
        params = [found.tensors[spec.key] for spec in found.params]
        entries = [self.entry(spec, param, sample) for spec, param in zip(found.params, params)]
        sampler = _sampler(entries, params, fsdp)
        routers = [found.router_modules[spec.key] for spec in found.routers]
        fields, _ = _router_values(routers)
        rank = int(groups.rank)
        static = _static(rank, sample, finalize, chunks, config, raw, groups, found, fields, entries)
        positions = np.concatenate([e.positions for e in entries]) if entries else np.zeros(0, np.int64)
        if not positions.size or int(positions.max()) < 2**31:
            positions = positions.astype(np.int32)
        text = json.dumps(static, sort_keys=True).encode()
        digest = hashlib.blake2b(text + positions.tobytes(), digest_size=8).hexdigest()
        arrays = {"plan": np.frombuffer(text, dtype=np.uint8), "positions": positions}
        self.plan = plan = _Plan(key, tuple(map(id, chunks)), source, rank, fsdp, entries, params, sampler, routers,
                                 fields, digest, arrays)
        self.made += 1
        return plan

    def entry(self, spec: Any, param: torch.Tensor, sample: int) -> _Entry:
        """The static facts and sampled positions of one parameter (cached by its name,
        shape, dtype, role and flags).

        Args:
          spec: the discovered parameter.
          param: the parameter (its gradient's shape and dtype are recorded).
          sample: positions sampled per gradient.

        Returns:
          The entry.
        """
        grad = getattr(param, "main_grad", None) if hasattr(param, "main_grad") else param.grad
        shape = tuple(grad.shape) if grad is not None and not hasattr(grad, "to_local") else tuple(param.shape)
        dtype = str((grad if grad is not None else param).dtype).removeprefix("torch.")
        key = (spec.chunk, spec.name, shape, dtype, spec.role, spec.expert, tuple(getattr(spec, f) for f in PARAM_FLAGS))
        entry = self._entries.get(key)
        if entry is None:
            numel = int(np.prod(shape, dtype=np.int64))
            positions = sample_positions(sample_key(spec.name, str(spec.role)), numel, sample)
            info = {
                "name": spec.name,
                "chunk": int(spec.chunk),
                "shape": list(shape),
                "numel": numel,
                "dtype": dtype,
                "expert": bool(spec.expert),
                "role": str(spec.role),
                "samples": int(positions.size),
                **{f: bool(getattr(spec, f)) for f in PARAM_FLAGS},
            }
            entry = _Entry(info, positions)
            self._entries[key] = entry
        return entry


def _static(rank: int, sample: int, finalize: Any, chunks: list[Any], config: FinalizeConfig, raw: Any, groups: Any,
            found: Any, fields: list[list[Any]], entries: list[_Entry]) -> dict[str, Any]:
    """What the plan file records besides the positions (its digest covers both).

    Returns:
      A JSON-able dict.
    """
    return {
        "format": FORMAT_VERSION,
        "rank": rank,
        "world_size": int(torch.distributed.get_world_size()) if torch.distributed.is_initialized() else 1,
        "sample": sample,
        "finalize": f"{getattr(finalize, '__module__', '?')}.{getattr(finalize, '__qualname__', type(finalize).__name__)}",
        "num_chunks": len(chunks),
        "ddp_chunks": _ddp_chunks(chunks),
        "config": _config_dict(config, raw),
        "layout": _layout(groups, rank),
        "routers": [
            {"name": spec.name, "chunk": spec.chunk, "training": spec.training,
             "frozen_expert_bias": spec.frozen_expert_bias, "num_experts": spec.num_experts,
             "has_aux_loss_tracker": spec.has_aux_loss_tracker}
            for spec in found.routers
        ],
        "router_fields": fields,
        "params": [e.info for e in entries],
    }
