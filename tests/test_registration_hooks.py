"""A model watch's torch registration hooks, removed safely wherever the garbage collector
collects the watch (``torch_impl.call.registration_hooks``).

The cyclic collector may run inside torch's own loop over its global registration hooks
(on Python 3.12 between any two bytecodes). Here it is made to, deterministically: a hook
registered before meshgrad's runs ``gc.collect()`` while torch loops, and a model that only
the cyclic collector frees holds the watch. The user's registration must go through, the
collected watch's entries must do nothing until meshgrad's next registration deletes them,
and the next model's finalize must keep its numbers. World of one rank (no process group).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn.modules import module as torch_module  # noqa: E402

from meshgrad import FinalizeConfig  # noqa: E402
from torch_impl import finalize_model_grads  # noqa: E402
from torch_impl.call import registration_hooks  # noqa: E402
from torch_impl.call.model_state import STATE_ATTR  # noqa: E402

GLOBAL_HOOKS = (
    torch_module._global_parameter_registration_hooks,
    torch_module._global_buffer_registration_hooks,
    torch_module._global_module_registration_hooks,
)


def _model(grad: float) -> nn.Linear:
    """A per-token-loss chunk whose gradients all hold ``grad``."""
    model = nn.Linear(3, 2)
    model.config = FinalizeConfig(calculate_per_token_loss=True)
    for param in model.parameters():
        param.main_grad = torch.full(param.shape, grad)
    return model


def _finalized(model: nn.Linear, tokens: int) -> list[float]:
    """The model's gradients after one finalize with ``num_tokens=tokens``, flattened."""
    finalize_model_grads([model], num_tokens=torch.tensor(tokens))
    return [v for p in model.parameters() for v in p.main_grad.flatten().tolist()]


def _ours(hooks: Any) -> list[Any]:
    """meshgrad's live hooks in one of torch's hook dicts."""
    return [h for h in hooks.values()
            if (getattr(h, "__module__", None) or "").startswith("torch_impl.") and h is not registration_hooks._retired]


def _retired(hooks: Any) -> list[Any]:
    """The retired entries of one of torch's hook dicts."""
    return [h for h in hooks.values() if h is registration_hooks._retired]


@pytest.fixture
def collector_first() -> Iterator[list[int]]:
    """The cyclic collector off, and a module registration hook of the user's, registered
    before any of meshgrad's, that runs it (counting its calls)."""
    enabled, calls = gc.isenabled(), [0]
    gc.collect()
    gc.disable()

    def collect(*args: Any) -> None:
        calls[0] += 1
        gc.collect()

    handles = [register(collect) for register in (torch_module.register_module_parameter_registration_hook,
                                                  torch_module.register_module_buffer_registration_hook,
                                                  torch_module.register_module_module_registration_hook)]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()
        if enabled:
            gc.enable()


#: Each way to register: (the name, a factory of the value, the store torch puts it in).
REGISTRATIONS: dict[str, tuple[str, Callable[[], Any], str]] = {
    "add_module": ("child", lambda: nn.Linear(2, 2), "_modules"),
    "register_parameter": ("weight2", lambda: nn.Parameter(torch.ones(2)), "_parameters"),
    "register_buffer": ("count", lambda: torch.arange(3.0), "_buffers"),
    "setattr": ("head", lambda: nn.Linear(2, 1), "_modules"),
}


@pytest.mark.parametrize("how", list(REGISTRATIONS))
def test_a_watch_collected_inside_torchs_hook_loop_leaves_the_registration_working(
    collector_first: list[int], how: str
) -> None:
    """A watch collected while torch loops over the registration hooks (its model freed by
    the cyclic collector from inside the user's hook) does not break the registration
    (torch would raise ``OrderedDict mutated during iteration``); its entries only do
    nothing until meshgrad registers hooks again, and a new model's finalize is exact."""
    garbage = _model(6.0)
    assert _finalized(garbage, 3) == [2.0] * 8  # 6 / 3: the plan and its watch are made
    assert all(len(_ours(hooks)) == 1 for hooks in GLOBAL_HOOKS)
    garbage.cycle = [garbage]  # only the cyclic collector frees it
    del garbage

    target = nn.Module()
    name, make, store = REGISTRATIONS[how]
    value = make()
    if how == "add_module":
        target.add_module(name, value)
    elif how == "register_parameter":
        target.register_parameter(name, value)
    elif how == "register_buffer":
        target.register_buffer(name, value)
    else:
        setattr(target, name, value)
    assert getattr(target, store)[name] is value and collector_first[0] >= 1
    retired = sum(len(_retired(hooks)) for hooks in GLOBAL_HOOKS)
    assert retired == 3, "the collected watch's three entries are kept, doing nothing"

    model = _model(8.0)
    assert _finalized(model, 4) == [2.0] * 8  # a new watch: the retired entries are deleted
    assert [len(_retired(hooks)) for hooks in GLOBAL_HOOKS] == [0, 0, 0]
    assert all(len(_ours(hooks)) == 1 for hooks in GLOBAL_HOOKS)
    model.extra = nn.Parameter(torch.zeros(2))  # seen by the new watch's hook: replanned, values still exact
    model.extra.main_grad = torch.full((2,), 10.0)
    assert _finalized(model, 2) == [1.0] * 8 + [5.0, 5.0]


def test_close_removes_the_watchs_entries_and_retired_ones() -> None:
    """``ModelWatch.close()`` (a replan) deletes the closed watch's hooks at once, and
    every retired entry with them; a retired hook returns None (torch keeps the object)."""
    model = _model(4.0)
    assert _finalized(model, 2) == [2.0] * 8
    (_, _, watch, _), = getattr(model, STATE_ATTR).found.values()
    handles = watch._hooks
    assert [handle.id in hooks for handle, hooks in zip(handles, GLOBAL_HOOKS)] == [True] * 3
    registration_hooks.retire(handles[:1])  # as if collected: only retired
    assert GLOBAL_HOOKS[0][handles[0].id] is registration_hooks._retired
    assert registration_hooks._retired(model, "weight", model.weight) is None
    watch.close()
    assert [handle.id in hooks for handle, hooks in zip(handles, GLOBAL_HOOKS)] == [False] * 3
    assert [len(_retired(hooks)) for hooks in GLOBAL_HOOKS] == [0, 0, 0]
