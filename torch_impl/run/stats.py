"""The counters of one model's finalize calls."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class ExecStats:
    """Counters of one model's finalize calls (kept on its cached state, never global).

    Args:
      calls: finalize calls run.
      bytes_copied: gradient bytes copied to coalesce: into a staging buffer and back
        (plus reduce-scatter padding and shard write-back). 0 when every reduced
        gradient lies in place in a flat buffer in plan order.
      programs_bound: times a plan was bound to gradient tensors (rebinding happens when
        the gradient tensor objects change, e.g. ``zero_grad(set_to_none=True)``).
      plans_built: times a plan was built (the O(parameters) work).
    """

    calls: int = 0
    bytes_copied: int = 0
    programs_bound: int = 0
    plans_built: int = 0
