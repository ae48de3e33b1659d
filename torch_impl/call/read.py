"""The read stage of a call: everything it reads from the user's objects.

:func:`read` takes the model chunks, their configs (or a helper's), the group source and
the model's parameters, gradients, flags and routers into an immutable
:class:`CallInputs`, memoized on the model (:mod:`torch_impl.call.model_state`) while
the model watch sees the same objects. It is the only stage that touches user objects;
whatever it raises, of any type, is held by the pipeline for the status round
(:func:`torch_impl.call.pipeline.call`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from torch import nn

from meshgrad.axes import Group
from meshgrad.config import FinalizeConfig
from meshgrad.errors import FinalizeTypeError
from meshgrad.plan import Step
from meshgrad.steps import ROLE_STEPS, ROUTER_ONLY_STEPS
from torch_impl.call.model_state import ModelState, Reads
from torch_impl.run.groups import TorchGroups, world_rank
from torch_impl.sources.config import Requested, chunk_configs
from torch_impl.sources.discover import Discovered, discover, dtype_name
from torch_impl.sources.embedding_read import EmbeddingRead


class Request(NamedTuple):
    """What one call asks of the pipeline (:func:`torch_impl.call.pipeline.call`):
    immutable, and built on every call of an entry point (a named tuple: half a frozen
    dataclass's construction cost).

    Args:
      steps: the steps a seed helper runs; empty: every step (``finalize_model_grads``).
      config: a helper's config (a Megatron config, a mapping or a FinalizeConfig; None:
        the chunks' ``config``), merged with the chunks' ``ddp_config`` unless
        ``merge_ddp_config`` is False.
      merge_ddp_config: merge the chunks' ``ddp_config`` into ``config``.
      config_default: chunks without a config or DDP config are read with
        FinalizeConfig's defaults (Megatron's GTP helper), not refused.
      per_token_loss: the GTP helper's ``calculate_per_token_loss`` argument (None: none).
      num_tokens: the call's ``num_tokens`` (checked every step).
      force_all_reduce: all-reduce instead of the distributed optimizer's reduce-scatter.
      embedding: what an embedding helper reads (its one weight) instead of the model's
        discovery.
      over: the groups a helper communicates over: its status round and comparison.
    """

    steps: tuple[Step, ...] = ()
    config: Any = None
    merge_ddp_config: bool = True
    config_default: bool = False
    per_token_loss: bool | None = None
    num_tokens: Any = None
    force_all_reduce: bool = False
    embedding: EmbeddingRead | None = None
    over: tuple[Group, ...] = ()

    @property
    def finalize(self) -> bool:
        """Whether this is ``finalize_model_grads``: every step."""
        return not self.steps

    @property
    def reads(self) -> Reads:
        """What the call's plan may read: every watched parameter and the embedding roles
        (finalize; an embedding step), the routers only (router steps), else what a step
        besides the DP sync may touch (no role: :data:`~meshgrad.steps.ROLE_STEPS`)."""
        if self.finalize or not ROLE_STEPS.isdisjoint(self.steps):
            return "all"
        return "routers" if ROUTER_ONLY_STEPS.issuperset(self.steps) else "touched"


class CallInputs(NamedTuple):
    """What the read stage read for one call (immutable): the model state it is memoized
    on, the config, the sizes the config states, the groups, the discovery (with its
    fingerprint token) and each chunk's DDP object (None: meshgrad syncs it)."""

    state: ModelState
    config: FinalizeConfig
    requested: Requested
    groups: TorchGroups
    token: Any
    found: Discovered
    ddp: tuple[Any, ...]


def helper_groups(source: Any, request: Request) -> bool:
    """Whether ``source`` is a seed helper's own groups (a mapping of its groups by name)."""
    return not request.finalize and isinstance(source, Mapping)


def chunks_of(model: Any) -> Sequence[Any] | None:
    """The chunks of ``model`` (a module, or a non-empty list or tuple of modules), or None
    where :func:`as_chunks` refuses it (:func:`~torch_impl.call.replay.replayed` writes it
    out)."""
    if isinstance(model, nn.Module):
        return (model,)
    if not isinstance(model, (list, tuple)) or not model:
        return None
    for chunk in model:
        if not isinstance(chunk, nn.Module):
            return None
    return model


def as_chunks(model: Any) -> list[Any]:
    """The model as a non-empty list of chunks.

    Raises:
      TypeError: ``model`` is not a module or a sequence of modules.
    """
    chunks = chunks_of(model)
    if chunks is not None:
        return list(chunks)
    if not isinstance(model, (list, tuple)) or not model:
        raise FinalizeTypeError(
            f"rank {world_rank()}: model must be a non-empty list of nn.Module chunks, got {type(model).__name__}"
        )
    i, chunk = next((i, c) for i, c in enumerate(model) if not isinstance(c, nn.Module))
    raise FinalizeTypeError(f"rank {world_rank()}: model[{i}] is a {type(chunk).__name__}, not an nn.Module")


#: The config of chunks without one, for a request with ``config_default`` (immutable).
DEFAULT_CONFIG = FinalizeConfig()


def config_sources(chunks: Sequence[Any], request: Request) -> tuple[Any, Any]:
    """The config and DDP config a call resolves: the chunks' (``.module`` chains), a
    helper's own config instead, FinalizeConfig's defaults where the request allows."""
    raw, ddp_config = chunk_configs(chunks)
    if request.config is not None:
        raw = request.config
    elif raw is None and ddp_config is None and request.config_default:
        raw = DEFAULT_CONFIG
    return raw, ddp_config if request.merge_ddp_config else None


def _config(state: ModelState, chunks: Sequence[Any], request: Request) -> tuple[FinalizeConfig, tuple[Any, Any]]:
    """The call's FinalizeConfig and the raw configs it came from."""
    raw, ddp_config = config_sources(chunks, request)
    config = state.config_memo.config(raw, ddp_config)
    if not request.finalize:  # a helper plans with its own rules (meshgrad.helpers)
        config = state.config_memo.helper_config(config, request.steps, request.per_token_loss)
    return config, (raw, ddp_config)


def _layout_found(chunks: Sequence[Any], config: FinalizeConfig) -> Discovered:
    """The model as ``attach_grad_buffers`` plans it: every trainable parameter with a
    gradient of the dtype the DP sync will reduce."""
    found = discover(chunks, config)
    grad_dtype = "float32" if config.grad_reduce_in_fp32 else None
    specs = tuple(
        dataclasses.replace(
            spec,
            has_grad=bool(found.tensors[spec.key].requires_grad),
            dtype=grad_dtype or dtype_name(found.tensors[spec.key].dtype),
        )
        for spec in found.params
    )
    return dataclasses.replace(found, params=specs)


def _read_sources(chunks: list[Any], source: Any, request: Request, known: dict[str, Any]) -> tuple[Any, ...]:
    """The read stage's first half: the model state, config, stated sizes and groups."""
    state = ModelState.of(chunks)
    config, known["raw"] = _config(state, chunks, request)
    known["config"] = config
    requested = state.config_memo.requested(known["raw"][0]) if request.finalize else Requested()
    memo = state.group_memo
    if source is None:
        source = memo.parallel_state_groups()
    elif helper_groups(source, request):
        source = memo.explicit(source)
    groups = memo.resolve_groups(source, config, requested)
    known["groups"] = groups
    return state, config, requested, groups


#: The key of ``known`` under which the steady path hands the read stage an embedding
#: helper's discovery it read for this call (its getter is called once per call).
EMBEDDING_FOUND = "embedding_found"


def read(model: Any, source: Any, request: Request, known: dict[str, Any]) -> CallInputs:
    """The read stage: everything the call reads from the user's objects (chunks, config,
    group source, parameters, gradients, routers), memoized on the model while unchanged.

    Args:
      model: the model chunks (or one module).
      source: the group source.
      request: what the call asks for.
      known: filled with what resolved, for sharing an error raised here.
    """
    chunks = as_chunks(model)
    state, config, requested, groups = _read_sources(chunks, source, request, known)
    if request.embedding is not None:
        found = known.pop(EMBEDDING_FOUND, None)  # read by the steady path's check already
        if found is None:
            found = state.embedding(chunks, groups, request.embedding)
        token, ddp = (found.params, found.routers), (None,) * len(chunks)
    else:
        gtp = groups.size(Group.GTP) > 1 or groups.size(Group.EGTP) > 1
        token, found, ddp = state.discovered(chunks, config, complete=gtp, reads=request.reads)
    if not request.finalize:
        ddp = (None,) * len(chunks)
    return CallInputs(state, config, requested, groups, token, found, ddp)


def read_layout(model: Any, source: Any) -> CallInputs:
    """The read stage of ``attach_grad_buffers``: the model as ``finalize_model_grads``
    will plan it, every trainable parameter counted as having a gradient."""
    chunks = as_chunks(model)
    state, config, requested, groups = _read_sources(chunks, source, Request(), {})
    found = _layout_found(chunks, config)
    return CallInputs(state, config, requested, groups, None, found, (None,) * len(chunks))


__all__ = [
    "DEFAULT_CONFIG", "EMBEDDING_FOUND", "CallInputs", "Request", "as_chunks", "chunks_of", "config_sources",
    "helper_groups", "read", "read_layout",
]
