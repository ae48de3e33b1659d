"""Warnings that point at the user's line.

A warning meshgrad gives (a group size that differs from the config, and the likely
mistakes of the plan stage) is attributed to the first frame outside ``meshgrad`` and
``torch_impl`` (and torch's own compile machinery in between) -- the user's call of
finalize or of one of Megatron's helpers -- so that the warnings
filter shows the user's file and line, and its default action ("once per location")
keeps one per call site. Each is given once per plan: the stage that warns runs when a
plan is built, not on the cached calls after it.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

import meshgrad

_OURS = (
    os.path.dirname(os.path.abspath(meshgrad.__file__)) + os.sep,
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,  # torch_impl/, every stage
    # A call made inside a torch.compile'd step passes through dynamo's frames on its way.
    os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "_dynamo") + os.sep,
)


def user_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside meshgrad and torch_impl, for a
    ``warnings.warn`` called by the caller of this function."""
    frame = sys._getframe(2)  # the caller of our caller: where warnings.warn's level 2 points
    level = 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_OURS):
        frame = frame.f_back
        level += 1
    return level


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the user's line."""
    warnings.warn(message, category, stacklevel=user_stacklevel())


__all__ = ["user_stacklevel", "warn_user"]
