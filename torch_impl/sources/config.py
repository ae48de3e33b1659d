"""Megatron configs and DDP chunks: the configs along a chunk's ``.module`` chain, the
DDP object that syncs a chunk, and :class:`Requested` -- the one reader of the config's
parallel sizes, with one strictness."""

from __future__ import annotations

import dataclasses
import inspect
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from meshgrad.config import MEGATRON_SIZE_FIELDS, FinalizeConfig
from meshgrad.errors import FinalizeInputError, FinalizeTypeError
from torch_impl.sources.wrappers import NO_ATTR, attr_or, find_attr
from torch_impl.run.groups import world_rank


def chunk_configs(model: Sequence[Any], read: Callable[..., Any] = attr_or) -> tuple[Any, Any]:
    """The ``config`` and ``ddp_config`` found along the ``.module`` chain of the chunks
    (Megatron's ``get_model_config``; ``read`` as in
    :func:`~torch_impl.sources.wrappers.unwrap`)."""
    config = ddp_config = None
    for chunk in model:
        config = config if config is not None else find_attr(chunk, "config", read)
        ddp_config = ddp_config if ddp_config is not None else find_attr(chunk, "ddp_config", read)
    return config, ddp_config


def ddp_object(chunk: Any, read: Callable[..., Any] = attr_or) -> Any:
    """The object in the ``.module`` chain that does Megatron DDP's grad sync, or None
    (``read`` as in :func:`~torch_impl.sources.wrappers.unwrap`)."""
    for _ in range(64):
        if callable(read(chunk, "finish_grad_sync", None)):
            return chunk
        chunk = read(chunk, "module", NO_ATTR)
        if chunk is NO_ATTR:
            return None
    return None


def accepts(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` takes a keyword argument ``name``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def config_size(config: Any, name: str, default: int | None) -> int | None:
    """A parallel size from a Megatron config: a positive int (numpy ints too); absent or
    None gives ``default``.

    Raises:
      ValueError: any other value.
    """
    value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
        raise FinalizeInputError(f"rank {world_rank()}: config.{name} must be a positive int, got {value!r}")
    return int(value)


#: The parallel sizes a Megatron config states (what :class:`Requested` reads): the core's list.
CONFIG_SIZES = MEGATRON_SIZE_FIELDS


@dataclasses.dataclass(frozen=True)
class Requested:
    """The parallel sizes a Megatron config states (checked against the groups only in
    strict mode; Megatron itself takes the groups as the truth).

    Args:
      tp: ``tensor_model_parallel_size`` (None: not stated).
      pp: ``pipeline_model_parallel_size``.
      cp: ``context_parallel_size``.
      ep: ``expert_model_parallel_size`` (None: not stated; :attr:`ep_size` is then 1).
      etp: ``expert_tensor_parallel_size`` (None = tp).
      gtp: ``gtp_weight_remat_size`` (1 = GTP inactive).
      egtp: ``expert_gtp_weight_remat_size``.
    """

    tp: int | None = None
    pp: int | None = None
    cp: int | None = None
    ep: int | None = None
    etp: int | None = None
    gtp: int = 1
    egtp: int = 1
    #: Whether Megatron fences against in-flight GTP gradient work (``gtp`` or ``egtp`` over
    #: 1): worked out once, a plain attribute for the run stage to read on every step.
    gtp_active: bool = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "gtp_active", self.gtp > 1 or self.egtp > 1)

    @property
    def ep_size(self) -> int:
        """The expert-parallel size to build groups with (1 when not stated)."""
        return self.ep or 1

    @classmethod
    def from_config(cls, config: Any) -> "Requested":
        """The sizes ``config`` states (an object or a mapping; numpy integers too).

        Raises:
          ValueError: a size that is not a positive integer.
        """
        if config is None or type(config).__name__ == "FinalizeConfig":
            return cls()
        return cls(
            tp=config_size(config, "tensor_model_parallel_size", None),
            pp=config_size(config, "pipeline_model_parallel_size", None),
            cp=config_size(config, "context_parallel_size", None),
            ep=config_size(config, "expert_model_parallel_size", None),
            etp=config_size(config, "expert_tensor_parallel_size", None),
            gtp=config_size(config, "gtp_weight_remat_size", 1),
            egtp=config_size(config, "expert_gtp_weight_remat_size", 1),
        )


def resolve_config(config: Any, ddp_config: Any = None) -> FinalizeConfig:
    """A FinalizeConfig from a Megatron TransformerConfig, a duck-typed object, a mapping or
    a FinalizeConfig, merged with a DDP config.

    Raises:
      TypeError: neither a config nor a DDP config is given.
    """
    if isinstance(config, FinalizeConfig) and ddp_config is None:
        return config
    if config is None and ddp_config is None:
        raise FinalizeTypeError(
            f"rank {world_rank()}: no config found: set `config` (a Megatron TransformerConfig or a "
            "meshgrad.FinalizeConfig) on the first model chunk (or on a module along its `.module` chain)"
        )
    return FinalizeConfig.from_megatron(config, ddp_config)
