"""Real torch modules and process groups for the models ``python -m meshgrad explain``
describes: what the gloo checks of explain (tests/test_explain_world.py) and the at-scale
calibration (bench/at_scale.py) run torch_impl's finalize on."""

from __future__ import annotations

from typing import Any

from meshgrad.config import FinalizeConfig
from meshgrad.params import Role


def named_groups(dims: Any, config: FinalizeConfig) -> Any:
    """A ProcessGroupCollection-like namespace: every named group of ``dims`` (new_group on
    every rank, the same order everywhere)."""
    from meshgrad.axes import stage_set
    from parity_tests.torch_world import groups_of

    embd = stage_set(config.embedding_stages, dims.pp, "first_last")
    pos = stage_set(config.position_embedding_stages, dims.pp, "first")
    return groups_of(dims, embd, pos)


def device_mesh(dims: Any) -> Any:
    """A torch DeviceMesh over the dense axes of ``dims`` larger than 1 (``pp, dp, cp, gtp, tp``)."""
    from torch.distributed.device_mesh import init_device_mesh

    named = [(a, getattr(dims, a)) for a in ("pp", "dp", "cp", "gtp", "tp") if getattr(dims, a) > 1] or [("dp", 1)]
    return init_device_mesh("cpu", tuple(n for _, n in named), mesh_dim_names=tuple(a for a, _ in named))


def build_chunks(stage_model: Any, config: FinalizeConfig, rank: int) -> list[Any]:
    """Real modules holding the stage's parameters (flags as Megatron sets them) and
    routers, with integer-valued gradients."""
    import torch
    from torch import nn

    from parity_tests.torch_world import _child, _model_classes

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    chunk_class = _model_classes()["Chunk"]
    count = 1 + max([p.chunk for p in stage_model.params] + [r.chunk for r in stage_model.routers], default=0)
    chunks = []
    for c in range(count):
        specs = [p for p in stage_model.params if p.chunk == c]
        word = next((p.name for p in specs if p.role is Role.WORD_EMBEDDING), None)
        pos = next((p.name for p in specs if p.role is Role.POSITION_EMBEDDING), None)
        chunk = chunk_class(word, pos)
        chunk.share_embeddings_and_output_weights = config.share_embeddings_and_output_weights
        chunk.config = config
        for router in (r for r in stage_model.routers if r.chunk == c):
            module = _child(chunk, router.name)
            module.register_buffer("local_tokens_per_expert", torch.arange(router.num_experts, dtype=torch.float32))
            if router.has_expert_bias:
                module.register_buffer("expert_bias", torch.zeros(router.num_experts))
        for index, spec in enumerate(specs):
            parent, _, leaf = spec.name.rpartition(".")
            param = nn.Parameter(torch.zeros(spec.shape, dtype=dtypes[spec.dtype]))
            for flag in ("sequence_parallel", "average_gradients_across_tp_domain", "is_gtp_weight_remat"):
                if getattr(spec, flag):
                    setattr(param, flag, True)
            if spec.expert:
                param.allreduce = False
            _child(chunk, parent).register_parameter(leaf, param)
            if not spec.has_grad:  # frozen: no gradient, as a requires_grad=False parameter
                param.requires_grad_(False)
                continue
            values = (torch.arange(param.numel()) % 5 + rank + index % 3).reshape(spec.shape)
            param.grad = values.to(param.dtype)
        chunks.append(chunk)
    return chunks


