"""Exception types for bad input and failed finalization, shared by every backend.

The input errors derive from the builtin a caller would catch without meshgrad
(``ValueError``, ``TypeError``, ``KeyError``), so code written against either backend
catches the same class for the same bad input. Every input error is raised before
anything is communicated or changed.
"""

from __future__ import annotations


class FinalizeInputError(ValueError):
    """An input that does not fit the plan: a shape, leading dims, an unknown key, a group."""


class PlanMismatchError(FinalizeInputError):
    """A plan made for other group sizes or stages than the mesh it is run on."""


class NonFiniteGradError(FinalizeInputError):
    """A gradient holds NaN or Inf (``check_for_nan_in_grad``); nothing was finalized."""


class FinalizeTypeError(TypeError):
    """An input of the wrong type or dtype: a non-floating gradient, a non-integer
    num_tokens, a key that is not ``(chunk, name)``."""


class MissingInputError(KeyError):
    """A planned gradient, router or router field is missing."""


class ConsistencyError(RuntimeError):
    """Ranks of one group would launch different collectives (raised on every rank)."""


class CollectiveError(RuntimeError):
    """A collective of finalize failed: a peer died, stalled past the timeout or raised."""


class LikelyMistakeWarning(UserWarning):
    """An input Megatron accepts silently but that is most likely a mistake (its numbers
    are kept): see :func:`meshgrad.mistakes.likely_mistakes`. Silence it with
    ``warnings.filterwarnings("ignore", category=LikelyMistakeWarning)``."""


class LayoutWarning(UserWarning):
    """A Megatron DDP's bucket layout shards a cross-stage-summed parameter differently on
    its stages: the distributed optimizer reads wrong values there (Megatron's numbers are
    kept); see :func:`meshgrad.ddp_layout.misaligned_cross_stage_params`."""


__all__ = [
    "CollectiveError",
    "ConsistencyError",
    "FinalizeInputError",
    "FinalizeTypeError",
    "LayoutWarning",
    "LikelyMistakeWarning",
    "MissingInputError",
    "NonFiniteGradError",
    "PlanMismatchError",
]
