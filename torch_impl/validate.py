"""Where the reliability checks lived before the split: re-exports, kept for importers.

Local checks before communication are in :mod:`torch_impl.checks`, the cross-rank
status round and consistency check in :mod:`torch_impl.consensus`, the exception types
and the texts naming a failed collective in :mod:`torch_impl.errors`.
"""

from __future__ import annotations

from torch_impl.checks import (
    GRAD_DTYPES,
    check_gradients,
    check_layout,
    check_modes,
    check_num_tokens,
    collection_source,
    nonfinite,
    plan_keys,
)
from torch_impl.consensus import (
    SPANNING_GROUPS,
    agree,
    before_communication,
    exchange_signatures,
    share_local_error,
    signatures,
)
from torch_impl.errors import (
    CollectiveError,
    ConsistencyError,
    NonFiniteGradError,
    action_failed,
    collective_guard,
    describe,
)
from torch_impl.megatron import status_groups as fallback_groups

__all__ = [
    "GRAD_DTYPES",
    "SPANNING_GROUPS",
    "CollectiveError",
    "ConsistencyError",
    "NonFiniteGradError",
    "action_failed",
    "agree",
    "before_communication",
    "check_gradients",
    "check_layout",
    "check_modes",
    "check_num_tokens",
    "collection_source",
    "collective_guard",
    "describe",
    "exchange_signatures",
    "fallback_groups",
    "nonfinite",
    "plan_keys",
    "share_local_error",
    "signatures",
]
