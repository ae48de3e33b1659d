"""Persistent flat gradient buffers laid out in plan order, so finalization copies nothing.

:func:`attach_grad_buffers` plans the model once, allocates one flat buffer per gradient
dtype and device in the plan's :attr:`~meshgrad.plan.FinalizePlan.layout`, and makes each
trainable parameter's gradient a view into it:

* ``attr="main_grad"`` (default, Megatron's convention): ``param.main_grad`` is the view,
  and a post-accumulate-grad hook adds each backward's ``param.grad`` into it and frees
  ``param.grad`` (as Megatron's DDP does). Zero it with :meth:`GradBuffers.zero_`.
* ``attr="grad"``: ``param.grad`` itself is the view (like torch DDP's
  ``gradient_as_bucket_view``); autograd accumulates into it in place. Zero it with
  :meth:`GradBuffers.zero_` or ``optimizer.zero_grad(set_to_none=False)`` --
  ``set_to_none=True`` drops the views, and finalization then falls back to copying.

Every reduction the layout could make contiguous (all the usual ones: DP sync, non-TP
grads nested inside it, the pp syncs) then runs in place on a slice of a buffer, and the
num_tokens scale is one multiply per buffer. ``ModelState.stats.bytes_copied`` (see
:func:`torch_impl.finalize.execution_stats`) stays 0. The model is planned by
:func:`torch_impl.call.pipeline.prepare_layout`: the read and plan stages of ``finalize_model_grads``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from meshgrad.params import ParamKey
from meshgrad.errors import FinalizeInputError, FinalizeTypeError
from torch_impl.call.pipeline import prepare_layout
from torch_impl.call.read import as_chunks
from torch_impl.sources.discover import dtype_name
from torch_impl.run.collectives import TORCH_DTYPES
from torch_impl.run.groups import world_rank
from torch_impl.run.modes import outside_inference_mode
from torch_impl.sources.config import ddp_object


@dataclasses.dataclass(eq=False)
class GradBuffers:
    """Flat gradient buffers attached to a model's parameters.

    Args:
      buffers: the flat tensors, one per (dtype, device), in plan layout order.
      views: the gradient view of each parameter, by (chunk, name) key.
      attr: ``"main_grad"`` or ``"grad"``.
      params: the parameters that received a view, by key.
      hooks: the post-accumulate-grad hook handles (``attr="main_grad"``).
    """

    buffers: tuple[torch.Tensor, ...]
    views: dict[ParamKey, torch.Tensor]
    attr: str
    params: dict[ParamKey, nn.Parameter]
    hooks: list[Any] = dataclasses.field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers."""
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def zero_(self) -> None:
        """Zero every gradient (one fill per buffer); re-points ``.grad`` at its view when
        ``attr="grad"`` and something set it to None."""
        with torch.no_grad():
            for buffer in self.buffers:
                buffer.zero_()
        if self.attr == "grad":
            for key, param in self.params.items():
                if param.grad is not self.views[key]:
                    param.grad = self.views[key]

    def detach(self) -> None:
        """Remove the hooks and the views (``main_grad`` deleted / ``.grad`` set to None)."""
        for handle in self.hooks:
            handle.remove()
        self.hooks.clear()
        for key, param in self.params.items():
            if self.attr == "main_grad":
                if getattr(param, "main_grad", None) is self.views[key]:
                    del param.main_grad
            elif param.grad is self.views[key]:
                param.grad = None


def _accumulate(param: torch.Tensor) -> None:
    """Post-accumulate-grad hook: move the fresh ``.grad`` into ``main_grad``."""
    if param.grad is not None:
        param.main_grad.add_(param.grad)
        param.grad = None


def _buffer_keys(
    layout: Sequence[tuple[str, Sequence[ParamKey]]],
    params: dict[ParamKey, nn.Parameter],
    attr: str,
    device: torch.device | str | None,
) -> dict[tuple[str, Any], list[ParamKey]]:
    """The keys of each flat buffer, per (gradient dtype, device), in layout order (a
    parameter under two keys gets one view).

    Raises:
      ValueError: ``attr="grad"`` with a dtype other than the parameter's.
    """
    seen: set[int] = set()
    groups: dict[tuple[str, Any], list[ParamKey]] = {}
    for dtype, keys in layout:
        for key in keys:
            param = params[key]
            if id(param) in seen:  # one parameter under two keys: one view
                continue
            seen.add(id(param))
            where = torch.device(device) if device is not None else param.device
            if attr == "grad" and dtype != dtype_name(param.dtype):
                raise FinalizeInputError(
                    f"attach_grad_buffers: parameter {key[1]!r} (chunk {key[0]}) is {dtype_name(param.dtype)} but "
                    f"its gradient would be {dtype}; use attr='main_grad' (e.g. with grad_reduce_in_fp32)"
                )
            groups.setdefault((dtype, where), []).append(key)
    return groups


def allocate(
    layout: Sequence[tuple[str, Sequence[ParamKey]]],
    params: dict[ParamKey, nn.Parameter],
    *,
    attr: str = "main_grad",
    device: torch.device | str | None = None,
    lazy: bool = False,
) -> GradBuffers:
    """Allocate flat buffers in ``layout`` order and attach parameter views.

    Args:
      layout: per gradient dtype name, keys in buffer order (``FinalizePlan.layout``).
      params: the parameter of each key.
      attr: ``"main_grad"`` or ``"grad"``.
      device: where buffers live (default: each parameter's device).
      lazy: allocate with ``torch.empty`` and do not copy existing gradients (pages are
        committed on first touch; for benchmarks of very large layouts). Default: zeros,
        with any existing gradient copied in.

    Returns:
      The attached :class:`GradBuffers`.

    Raises:
      ValueError: ``attr`` is unknown, or ``attr="grad"`` with a dtype other than the
        parameter's (torch requires ``.grad`` to match).
    """
    if attr not in ("main_grad", "grad"):
        raise FinalizeInputError(f"attach_grad_buffers: attr must be 'main_grad' or 'grad', got {attr!r}")
    groups = _buffer_keys(layout, params, attr, device)
    buffers: list[torch.Tensor] = []
    views: dict[ParamKey, torch.Tensor] = {}
    attached: dict[ParamKey, nn.Parameter] = {}
    out = GradBuffers((), views, attr, attached)
    # Made outside inference mode: the buffers serve backward and every later call.
    with outside_inference_mode():
        for (dtype, where), keys in groups.items():
            total = sum(params[k].numel() for k in keys)
            make = torch.empty if lazy else torch.zeros
            flat = make(total, dtype=TORCH_DTYPES[dtype], device=where)
            buffers.append(flat)
            offset = 0
            for key in keys:
                param = params[key]
                view = flat[offset : offset + param.numel()].view(param.shape)
                offset += param.numel()
                old = getattr(param, attr, None)
                if not lazy and isinstance(old, torch.Tensor) and old.shape == view.shape:
                    with torch.no_grad():
                        view.copy_(old)
                if attr == "main_grad":
                    param.main_grad = view
                    param.grad = None
                    out.hooks.append(param.register_post_accumulate_grad_hook(_accumulate))
                else:
                    param.grad = view
                views[key] = view
                attached[key] = param
    out.buffers = tuple(buffers)
    return out


def attach_grad_buffers(
    model: Any,
    pg_collection: Any = None,
    *,
    attr: str = "main_grad",
    force_all_reduce: bool = False,
    device: torch.device | str | None = None,
    lazy: bool = False,
) -> GradBuffers:
    """Give every trainable parameter of ``model`` a gradient that is a view into a flat
    buffer laid out in the order ``finalize_model_grads`` reduces them.

    Plans the model exactly as ``finalize_model_grads(model, pg_collection=...,
    force_all_reduce=...)`` will (same config, same groups), so each collective of that
    call runs in place. Call it once, after the model is built and before training.

    Args:
      model: the model chunks (or one module). Chunks wrapped in a DDP that does its own
        grad sync (``finish_grad_sync``) own their gradient storage: rejected.
      pg_collection: the groups ``finalize_model_grads`` will get.
      attr: ``"main_grad"`` (Megatron convention, with accumulate hooks) or ``"grad"``.
      force_all_reduce: as ``finalize_model_grads`` will be called (it changes the layout
        of a distributed optimizer's reduce-scatter).
      device: where buffers live (default: each parameter's device).
      lazy: uninitialized buffers, existing gradients not copied (benchmarks).

    Returns:
      The :class:`GradBuffers` (keep it to zero or detach the buffers).

    Raises:
      TypeError: a chunk is wrapped in a DDP with its own buffers.
      ValueError: as :func:`allocate`, or from group validation.
    """
    chunks = as_chunks(model)
    for i, chunk in enumerate(chunks):
        if ddp_object(chunk) is not None:
            raise FinalizeTypeError(
                f"rank {world_rank()}: attach_grad_buffers: model[{i}] is wrapped in {type(ddp_object(chunk)).__name__}, "
                "which owns its gradient buffers (finish_grad_sync); attach to unwrapped chunks only"
            )
    bound, inputs = prepare_layout(chunks, pg_collection, force_all_reduce)
    params = {k: p for k, p in inputs.found.tensors.items() if p.requires_grad}
    layout = tuple((d, tuple(k for k in keys if k in params)) for d, keys in bound.plan.layout)
    buffers = allocate(layout, params, attr=attr, device=device, lazy=lazy)
    inputs.state.own_views.update({id(view): view for view in buffers.views.values()})
    inputs.state.programs.clear()
    return buffers
