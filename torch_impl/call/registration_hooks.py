"""torch's global module registration hooks of one model watch (:func:`register`), and
their removal, safe at any point of a program (:func:`retire`, :func:`drop_retired`).

A watch's hooks go when it is closed or collected. The cyclic garbage collector may collect
a watch anywhere -- on Python 3.12, between any two bytecodes -- including inside torch's
own loop over these hooks (``add_module``, ``register_parameter``, ``register_buffer``, a
module's ``__setattr__``). Deleting an entry of the dict that loop walks makes it raise
``RuntimeError: OrderedDict mutated during iteration`` in the user's code. So a collected
watch's hooks are only retired: each entry's value becomes :func:`_retired`, a hook that
does nothing. That keeps the dicts' keys and their order, which is all their iteration
checks. Retired entries are deleted the next time meshgrad registers hooks or closes a
watch, in its own calls (the read stage, `invalidate_plans`), where no such loop runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch.nn.modules import module as torch_module


def _retired(module: Any, name: str, value: Any) -> None:
    """A collected watch's hook: nothing to do (deleted by :func:`drop_retired`)."""


def register(ids: set[int], dirty: list[bool]) -> list[Any]:
    """Register torch's three global module registration hooks, filtered to ``ids``, and
    delete the retired entries of their dicts.

    Args:
      ids: the ids of the watched modules.
      dirty: a one-element flag list, set True when a watched module registers an
        object other than the one its dict already holds under that name.

    Returns:
      The hook handles (:func:`retire` them, then :func:`drop_retired`).
    """

    def hook(kind: str) -> Callable[[Any, str, Any], None]:
        def seen(module: Any, name: str, value: Any) -> None:
            if id(module) in ids and not dirty[0]:
                store = module.__dict__.get(kind)
                if store is None or store.get(name) is not value:
                    dirty[0] = True

        return seen

    handles = [
        torch_module.register_module_parameter_registration_hook(hook("_parameters")),
        torch_module.register_module_buffer_registration_hook(hook("_buffers")),
        torch_module.register_module_module_registration_hook(hook("_modules")),
    ]
    drop_retired(handles)
    return handles


def retire(handles: Sequence[Any]) -> None:
    """Make each hook of ``handles`` one that does nothing, its entry kept (a watch's
    finalizer: safe inside torch's loop over the hooks)."""
    for handle in handles:
        hooks = handle.hooks_dict_ref()
        if hooks is not None and handle.id in hooks:
            hooks[handle.id] = _retired  # the same key: the dict's iteration is not disturbed


def drop_retired(handles: Sequence[Any]) -> None:
    """Delete every retired entry of the hook dicts that ``handles`` are in (only where
    torch is not looping over them: meshgrad's own stages)."""
    for handle in handles:  # a watch's three handles: one in each of torch's three dicts
        hooks = handle.hooks_dict_ref()
        if hooks is None:
            continue
        for key in [key for key, hook in hooks.items() if hook is _retired]:
            hooks.pop(key, None)


__all__ = ["drop_retired", "register", "retire"]
