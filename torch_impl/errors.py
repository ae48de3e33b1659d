"""Exception types of torch_impl, defined once.

:class:`MegatronAssertionError` is raised where Megatron-Core's own
``finalize_model_grads`` module asserts (or fails on a ``None`` group): it derives from
both ``ValueError`` (meshgrad's convention for bad input) and ``AssertionError`` (what
code and tests written against Megatron catch). It is always a real ``raise``, raised
before any collective or mutation.
"""

from __future__ import annotations


class MegatronAssertionError(ValueError, AssertionError):
    """Bad input that Megatron-Core rejects with an assertion (or a crash on None)."""


__all__ = ["MegatronAssertionError"]
