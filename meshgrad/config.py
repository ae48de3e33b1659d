"""FinalizeConfig: the TransformerConfig / DDP-config fields that finalization reads."""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from meshgrad.errors import FinalizeInputError

#: Values of FinalizeConfig.consistency_check (see torch_impl.call.agree).
CONSISTENCY_CHECKS = ("off", "once", "every_step")

#: Load-balancing types Megatron knows; anything else is rejected as a typo.
LOAD_BALANCING_TYPES = frozenset(
    {"aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none", "quantile_balancing"}
)

#: Megatron TransformerConfig sizes that torch_impl checks against the groups; a mapping
#: config may hold them besides FinalizeConfig's fields.
MEGATRON_SIZE_FIELDS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "gtp_weight_remat_size",
    "expert_gtp_weight_remat_size",
)


@dataclasses.dataclass(frozen=True)
class FinalizeConfig:
    """Every option that changes what finalization does (docs/semantics.md).

    Args:
      sequence_parallel: sum ``sequence_parallel`` params over tp (2.4).
      qk_layernorm: sum params named ``q_layernorm``/``k_layernorm`` over tp (2.4).
      has_cond_embedder: sync ``pipeline_parallel`` params over pp (2.2).
      flextron: sync ``flextron_router_pp_sync`` params over pp (2.3).
      calculate_per_token_loss: DP sync is a plain SUM, num_tokens divides later.
      average_in_collective: DP sync is an AVG (else pre-scale by 1/DP_CP and SUM).
      use_distributed_optimizer: DP sync is a reduce-scatter unless forced to all-reduce.
      grad_reduce_in_fp32: the DP collective runs in float32.
      share_embeddings_and_output_weights: input and output embeddings are tied (2.6).
      mtp_num_layers: multi-token-prediction layers (None or 0 = none).
      embedding_stages: pp stages of the embd group (None = first and last).
      position_embedding_stages: pp stages of the pos_embd group (None = first).
      moe_router_enable_expert_bias: update router expert bias (2.8).
      moe_router_bias_update_rate: its rate.
      moe_router_load_balancing_type: a string (e.g. ``"aux_loss"``,
        ``"quantile_balancing"``) or a tuple of strings, as Megatron accepts; a list is
        stored as a tuple. Only the string ``"quantile_balancing"`` enables the qb_beta
        step inside finalize (Megatron compares with ``==``).
      moe_router_quantile_balancing_ema: EMA factor of 2.9 (Megatron's default 0.0).
      check_for_nan_in_grad: raise on NaN/Inf before any collective.
      use_megatron_fsdp: reduce local shards of DTensor grads (2.12).
      consistency_check: cross-rank check that the members of every group would launch
        the same collectives (torch_impl): ``"off"``, ``"once"`` per plan (default) or
        ``"every_step"``. Must be the same on every rank.
      strict_groups: raise (instead of warning once) when the groups disagree with the
        config's ``*_parallel_size`` or with meshgrad's rank order; Megatron takes the
        groups as the truth, so the default only warns.
    """

    sequence_parallel: bool = False
    qk_layernorm: bool = False
    has_cond_embedder: bool = False
    flextron: bool = False
    calculate_per_token_loss: bool = False
    average_in_collective: bool = False
    use_distributed_optimizer: bool = False
    grad_reduce_in_fp32: bool = False
    share_embeddings_and_output_weights: bool = True
    mtp_num_layers: int | None = None
    embedding_stages: tuple[int, ...] | None = None
    position_embedding_stages: tuple[int, ...] | None = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_router_load_balancing_type: str | tuple[str, ...] = "aux_loss"
    moe_router_quantile_balancing_ema: float = 0.0
    check_for_nan_in_grad: bool = False
    use_megatron_fsdp: bool = False
    consistency_check: str = "once"
    strict_groups: bool = False

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def has_mtp(self) -> bool:
        return bool(self.mtp_num_layers)

    @property
    def quantile_balancing(self) -> bool:
        """Whether finalize runs the qb_beta step: the type is the string
        ``"quantile_balancing"`` (a list never is, as in Megatron's ``==``)."""
        return self.moe_router_load_balancing_type == "quantile_balancing"

    @property
    def global_aux_loss(self) -> bool:
        """Whether the reset step resets the global aux-loss tracker: ``"global_aux_loss"``
        is a substring of the type string, or an element of the list."""
        return "global_aux_loss" in self.moe_router_load_balancing_type

    def replace(self, **changes: Any) -> "FinalizeConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_megatron(
        cls, config: Any, ddp_config: Any = None, **overrides: Any
    ) -> "FinalizeConfig":
        """Build from a Megatron ``TransformerConfig`` (and DDP config), duck-typed.

        Args:
          config: any object with TransformerConfig attribute names (other attributes
            are ignored), or a mapping with the keys meshgrad reads (FinalizeConfig's
            fields and :data:`MEGATRON_SIZE_FIELDS`); missing ones take the defaults
            above. numpy scalars count as the Python ones.
          ddp_config: the same for DistributedDataParallelConfig names.
          overrides: explicit values that win over both.

        Returns:
          A validated FinalizeConfig.

        Raises:
          TypeError: a source is neither an object nor a mapping (a str, a number, a
            list), or a flag is not a bool (None counts as False).
          FinalizeInputError: a mapping holds a key meshgrad does not read (a typo); the
            message names it and the closest known key.
        """
        values = _megatron_values([f.name for f in dataclasses.fields(cls)], config, ddp_config)
        values.update(overrides)
        return cls(**_normalize(values))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "FinalizeConfig":
        """A FinalizeConfig from a mapping of its field names.

        Raises:
          FinalizeInputError: a key that is not a field, named with the closest field.
        """
        reject_unknown_keys(values, [f.name for f in dataclasses.fields(cls)], "config")
        return cls(**dict(values))


def _validate(config: FinalizeConfig) -> None:
    """Check and normalize a new FinalizeConfig's fields in place (its ``__post_init__``).

    Args:
      config: the config being constructed (stage tuples and a load-balancing list are
        stored back as tuples).

    Raises:
      TypeError: a flag that is not a bool, a rate that is not a real number, or a
        load-balancing type that is not a string or a list of strings.
      ValueError: a bad ``mtp_num_layers``, stage list or ``consistency_check``, or a
        rate that is not finite.
    """
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.type == "bool" and not isinstance(value, bool):
            raise TypeError(f"FinalizeConfig.{field.name} must be a bool, got {value!r}")
    if config.mtp_num_layers is not None and (
        isinstance(config.mtp_num_layers, bool)
        or not isinstance(config.mtp_num_layers, int)
        or config.mtp_num_layers < 0
    ):
        raise ValueError(
            f"FinalizeConfig.mtp_num_layers must be None or an int >= 0, "
            f"got {config.mtp_num_layers!r}"
        )
    for name in ("embedding_stages", "position_embedding_stages"):
        value = getattr(config, name)
        if value is not None:
            if isinstance(value, (str, bytes)) or not isinstance(value, Iterable) or not all(
                isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 0 for v in value
            ):
                raise ValueError(f"FinalizeConfig.{name} must be None or a sequence of ints >= 0, got {value!r}")
            object.__setattr__(config, name, tuple(int(v) for v in value))
    for name in ("moe_router_bias_update_rate", "moe_router_quantile_balancing_ema"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"FinalizeConfig.{name} must be a real number, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"FinalizeConfig.{name} must be finite, got {value!r}")
    if config.consistency_check not in CONSISTENCY_CHECKS:
        raise ValueError(
            f"FinalizeConfig.consistency_check must be one of {list(CONSISTENCY_CHECKS)}, "
            f"got {config.consistency_check!r}"
        )
    lbt = config.moe_router_load_balancing_type
    if isinstance(lbt, (list, tuple)) and all(isinstance(t, str) for t in lbt):
        lbt = tuple(lbt)
        object.__setattr__(config, "moe_router_load_balancing_type", lbt)
    elif not isinstance(lbt, str):
        raise TypeError(
            "FinalizeConfig.moe_router_load_balancing_type must be a string or a list of strings, "
            f"got {lbt!r}"
        )
    for doubt in doubtful_values(config):
        warnings.warn(f"FinalizeConfig.{doubt} (used as given, as Megatron-Core does)", stacklevel=4)


def doubtful_values(config: FinalizeConfig) -> list[str]:
    """The values of ``config`` that Megatron-Core accepts without a word but that are most
    likely typos: an unknown ``moe_router_load_balancing_type`` (Megatron's routers and
    finalize give it no step) and a ``moe_router_quantile_balancing_ema`` outside [0, 1].
    Alone they are warnings; where they make the ranks disagree, the rank holding one
    raises it (``torch_impl.call.agree``).

    Returns:
      One line per doubtful field, naming the field, the value and what is allowed.
    """
    out = []
    ema = config.moe_router_quantile_balancing_ema
    if not 0.0 <= float(ema) <= 1.0:
        out.append(f"moe_router_quantile_balancing_ema should lie in [0, 1], got {ema!r}")
    lbt = config.moe_router_load_balancing_type
    values = [lbt] if isinstance(lbt, str) else list(lbt)
    for value in values:
        if value in LOAD_BALANCING_TYPES:
            continue
        close = difflib.get_close_matches(value, sorted(LOAD_BALANCING_TYPES), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        out.append(
            f"moe_router_load_balancing_type: {value!r} is not among the types Megatron-Core knows "
            f"({sorted(LOAD_BALANCING_TYPES)}{hint}); finalize treats it as a type without a step"
        )
    return out


def reject_unknown_keys(values: Mapping[Any, Any], known: Iterable[str], label: str) -> None:
    """Raise when ``values`` holds a key outside ``known``.

    Args:
      values: a mapping config.
      known: the keys meshgrad reads from it.
      label: what the mapping is (``"config"``, ``"ddp_config"``), for the message.

    Raises:
      FinalizeInputError: naming every unknown key and, for each, the closest known key.
    """
    known = list(known)
    unknown = sorted((k for k in values if k not in known), key=repr)
    if not unknown:
        return
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
        hints.append(f"{key!r}: did you mean {close[0]!r}?" if close else f"{key!r}: no close match")
    raise FinalizeInputError(
        f"FinalizeConfig: unknown option(s) {unknown} in {label} ({'; '.join(hints)}); a mapping config "
        "holds only the fields meshgrad reads: FinalizeConfig's and Megatron's group sizes "
        "(docs/migrating.md#config-fields-read)"
    )


_MISSING = object()


def config_get(source: Any, name: str, default: Any = None) -> Any:
    """``source[name]`` for a mapping, else ``getattr(source, name)``; ``default`` when
    absent. numpy scalars come back as Python scalars (``np.int64(2)`` -> ``2``)."""
    if isinstance(source, Mapping):
        value = source.get(name, default)
    else:
        value = getattr(source, name, default)
    return _python_scalar(value)


def _megatron_values(names: list[str], config: Any, ddp_config: Any) -> dict[str, Any]:
    """The fields ``names`` found in a Megatron config and DDP config (for
    :meth:`FinalizeConfig.from_megatron`; the DDP config's ``average_in_collective`` wins).

    Args:
      names: FinalizeConfig's field names.
      config: a TransformerConfig-like object or a mapping, or None.
      ddp_config: the same for DistributedDataParallelConfig, or None.

    Returns:
      The values present, by field name (numpy scalars as Python ones).

    Raises:
      TypeError: a source is neither an object nor a mapping.
      FinalizeInputError: a mapping holds a key meshgrad does not read.
    """
    values: dict[str, Any] = {}
    for label, source in (("config", config), ("ddp_config", ddp_config)):
        if source is None:
            continue
        if isinstance(source, (str, bytes, numbers.Number, list, tuple, set)):
            raise TypeError(
                f"FinalizeConfig.from_megatron: {label} must be a config object or a mapping, "
                f"got {type(source).__name__}"
            )
        if isinstance(source, Mapping):
            reject_unknown_keys(source, (*names, *MEGATRON_SIZE_FIELDS), label)
        for name in names:
            value = config_get(source, name, _MISSING)
            if value is not _MISSING:
                values[name] = value
    if ddp_config is not None and config_get(ddp_config, "average_in_collective", _MISSING) is not _MISSING:
        values["average_in_collective"] = config_get(ddp_config, "average_in_collective")
    return values


def _python_scalar(value: Any) -> Any:
    """numpy (and other) scalars as Python bool / int / float / str; anything else as is."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "shape", None) == () and type(value).__module__.startswith("numpy"):
        return item()
    if isinstance(value, numbers.Integral):
        return int(value)
    return value


def _normalize(values: dict[str, Any]) -> dict[str, Any]:
    """Coerce Megatron's loosely typed fields (None for False, numpy scalars, ...).

    Raises:
      TypeError: a flag that is not a bool, None, or the int 0 / 1.
    """
    out = {k: _python_scalar(v) for k, v in values.items()}
    for name in ("moe_router_load_balancing_type",):
        if name in out and out[name] is None:
            out[name] = "none"
    if "moe_router_bias_update_rate" in out and out["moe_router_bias_update_rate"] is None:
        out.pop("moe_router_bias_update_rate")
    if out.get("moe_router_quantile_balancing_ema") is None:
        out.pop("moe_router_quantile_balancing_ema", None)
    for field in dataclasses.fields(FinalizeConfig):
        if field.type == "bool" and field.name in out:
            value = out[field.name]
            if value is None or value is False or value is True:
                out[field.name] = bool(value)
            elif isinstance(value, int) and value in (0, 1):
                out[field.name] = bool(value)
            else:
                raise TypeError(f"FinalizeConfig.{field.name} must be a bool, got {value!r}")
    return out
