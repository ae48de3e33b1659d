"""RouterSpecs from torch modules, with Megatron's attribute conventions: a module with an
``expert_bias`` / ``qb_beta`` buffer or a ``reset_global_aux_loss_tracker()`` method holds
router state (:func:`router_spec`)."""

from __future__ import annotations

import torch
from torch import nn

from meshgrad.errors import FinalizeInputError
from meshgrad.params import RouterSpec
from torch_impl.sources.wrappers import NO_ATTR, attr_or


def router_spec(name: str, chunk: int, module: nn.Module) -> RouterSpec | None:
    """The RouterSpec of a module, or None when it holds no router state.

    Raises:
      ValueError: its per-expert buffers disagree in length, or expert_bias comes
        without local_tokens_per_expert.
    """
    # attr_or: a miss costs no AttributeError (every submodule is asked, once per discovery)
    bias = attr_or(module, "expert_bias", NO_ATTR)
    qb = attr_or(module, "qb_beta", NO_ATTR)
    reset = attr_or(module, "reset_global_aux_loss_tracker", None)
    if bias is NO_ATTR and qb is NO_ATTR and not callable(reset):
        return None
    bias = None if bias is NO_ATTR else bias
    qb = None if qb is NO_ATTR else qb
    local = attr_or(module, "local_tokens_per_expert", None)
    accum = attr_or(module, "qb_beta_accum", None)
    buffers = {"expert_bias": bias, "local_tokens_per_expert": local, "qb_beta": qb, "qb_beta_accum": accum}
    lengths = {
        attr: int(value.shape[-1]) if value.dim() else 1
        for attr, value in buffers.items() if isinstance(value, torch.Tensor)
    }
    if len(set(lengths.values())) > 1:
        raise FinalizeInputError(f"router {name!r} (chunk {chunk}): per-expert buffers differ in length: {lengths}")
    if bias is not None and not isinstance(local, torch.Tensor):
        raise FinalizeInputError(f"router {name!r} (chunk {chunk}) has expert_bias but no local_tokens_per_expert tensor")
    return RouterSpec(
        name=name,
        chunk=chunk,
        num_experts=next(iter(lengths.values()), 1),
        training=bool(attr_or(module, "training", True)),
        has_expert_bias=bias is not None,
        frozen_expert_bias=bool(attr_or(module, "frozen_expert_bias", False)),
        has_qb_beta=qb is not None,
        qb_accum_present=accum is not None,
        has_aux_loss_tracker=callable(reset),
    )


__all__ = ["router_spec"]
