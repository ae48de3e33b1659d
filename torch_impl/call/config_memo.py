"""The config memo of a model: resolved configs, a helper's derived configs and the
sizes a Megatron config states, kept while their source objects hold the same values."""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

from meshgrad.config import FinalizeConfig
from meshgrad.helpers import helper_config
from meshgrad.plan import Step
from torch_impl.sources.config import CONFIG_SIZES, Requested, resolve_config
from torch_impl.call.memo import Snapshot, probe_snapshots, put
from torch_impl.call.probes import Probes

_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(FinalizeConfig))


class ConfigMemo:
    """The configs resolved for one model (owned by its ModelState)."""

    def __init__(self) -> None:
        self.last_config: tuple[Snapshot, Snapshot, FinalizeConfig] | None = None
        self.last_requested: tuple[Snapshot, Requested] | None = None
        self.helper_configs: dict[tuple[FinalizeConfig, tuple[Step, ...], bool | None], FinalizeConfig] = {}

    def config(self, raw: Any, ddp_config: Any) -> FinalizeConfig:
        """``resolve_config(raw, ddp_config)``, memoized: the same two objects with the same
        values of every attribute FinalizeConfig reads give the last result (a config
        mutated between steps is resolved again)."""
        if isinstance(raw, FinalizeConfig) and ddp_config is None:
            return raw
        if self._config_hit(raw, ddp_config):
            return self.last_config[2]  # type: ignore[index]
        snapshots = Snapshot(raw, _CONFIG_FIELDS, by_names=True), Snapshot(ddp_config, _CONFIG_FIELDS, by_names=True)
        resolved = resolve_config(raw, ddp_config)
        self.last_config = (*snapshots, resolved)
        return resolved

    def _config_hit(self, raw: Any, ddp_config: Any) -> bool:
        """Whether the last resolved config came from these two objects, holding the same values."""
        hit = self.last_config
        return (
            hit is not None and hit[0].source is raw and hit[1].source is ddp_config
            and hit[0].same() and hit[1].same()
        )

    def _requested_hit(self, raw: Any) -> bool:
        """Whether the last stated sizes came from ``raw``, holding the same values."""
        hit = self.last_requested
        return hit is not None and hit[0].source is raw and hit[0].same()

    def unchanged(self, raw: Any, ddp_config: Any, config: FinalizeConfig, requested: Requested | None) -> bool:
        """Whether :meth:`config` would give ``config`` again for these two objects (a
        FinalizeConfig is immutable), and :meth:`requested` ``requested`` (None: not asked)."""
        if isinstance(raw, FinalizeConfig) and ddp_config is None:
            same = raw is config
        else:
            same = self._config_hit(raw, ddp_config) and self.last_config[2] is config  # type: ignore[index]
        if requested is None or not same:
            return same
        if raw is None or isinstance(raw, FinalizeConfig):
            return requested == Requested()
        return self._requested_hit(raw) and self.last_requested[1] is requested  # type: ignore[index]

    def probe(self, probes: Probes, raw: Any, ddp_config: Any, requested: Requested | None) -> None:
        """Write :meth:`unchanged` down as probes, for a call it has just answered True:
        the memo's entries still the same objects, their sources holding the same values
        (``raw`` and ``ddp_config`` themselves are the caller's to probe)."""
        snapshots: list[Snapshot] = []
        if not (isinstance(raw, FinalizeConfig) and ddp_config is None):
            probes.same(partial(getattr, self, "last_config"), self.last_config)
            snapshots += self.last_config[:2]  # type: ignore[index]
        if requested is not None and raw is not None and not isinstance(raw, FinalizeConfig):
            probes.same(partial(getattr, self, "last_requested"), self.last_requested)
            snapshots.append(self.last_requested[0])  # type: ignore[index]
        probe_snapshots(probes, snapshots)

    def helper_config(self, config: FinalizeConfig, steps: tuple[Step, ...], per_token_loss: bool | None) -> FinalizeConfig:
        """A seed helper's config (:func:`meshgrad.helpers.helper_config`), memoized (a
        FinalizeConfig is immutable)."""
        key = (config, steps, per_token_loss)
        hit = self.helper_configs.get(key)
        if hit is not None:
            return hit
        return put(self.helper_configs, key, helper_config(config, steps, calculate_per_token_loss=per_token_loss))

    def last_resolved_config(self, raw: Any, ddp_config: Any) -> FinalizeConfig | None:
        """The config last resolved from these two objects (not checked again; a
        FinalizeConfig alone resolves to itself), or None."""
        if isinstance(raw, FinalizeConfig) and ddp_config is None:
            return raw
        hit = self.last_config
        return hit[2] if hit is not None and hit[0].source is raw and hit[1].source is ddp_config else None

    def requested(self, raw: Any) -> Requested:
        """``Requested.from_config(raw)``, memoized like :meth:`config`."""
        if raw is None or isinstance(raw, FinalizeConfig):
            return Requested()
        if self._requested_hit(raw):
            return self.last_requested[1]  # type: ignore[index]
        snapshot = Snapshot(raw, CONFIG_SIZES, by_names=True)
        requested = Requested.from_config(raw)
        self.last_requested = (snapshot, requested)
        return requested
