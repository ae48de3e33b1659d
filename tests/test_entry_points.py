"""The public entry points' one wrapper (``torch_impl.sources.wrappers.eager_under_compile``): a
ValueError / TypeError raised anywhere below an entry point, by meshgrad or by the user's
objects it reads, reaches the caller as the same type with this rank's prefix (once), eager
and inside a ``torch.compile``d step, and nothing changes (a world of one rank, no
process group)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import torch_impl  # noqa: E402


class _UnreadableConfig(nn.Linear):
    """A chunk whose ``config`` raises ``error`` when read (a user's object failing)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(2, 2)
        self.error = error

    @property
    def config(self) -> Any:
        raise self.error


def _chunk(error: BaseException) -> _UnreadableConfig:
    chunk = _UnreadableConfig(error)
    chunk.weight.grad = torch.arange(4.0).reshape(2, 2)
    chunk.bias.grad = torch.tensor([5.0, -6.0])
    return chunk


#: Entry points that read the chunks' config (a helper given None as its config).
ENTRIES: dict[str, Callable[[list[nn.Module]], None]] = {
    "finalize_model_grads": lambda m: torch_impl.finalize_model_grads(m),
    "_allreduce_non_tensor_model_parallel_grads": lambda m: torch_impl._allreduce_non_tensor_model_parallel_grads(
        m, None, None),
    "_allreduce_conditional_embedding_grads": lambda m: torch_impl._allreduce_conditional_embedding_grads(m, None),
    "_update_router_expert_bias": lambda m: torch_impl._update_router_expert_bias(m, None),
}


def _raised(fn: Callable[[], None]) -> BaseException:
    with pytest.raises(BaseException) as info:
        fn()
    return info.value


@pytest.mark.parametrize("entry", sorted(ENTRIES))
@pytest.mark.parametrize("error", [ValueError("config unreadable"), TypeError("config of the wrong kind")])
def test_an_error_below_an_entry_point_gets_the_rank_prefix_once(entry: str, error: BaseException) -> None:
    chunk = _chunk(error)
    raised = _raised(lambda: ENTRIES[entry]([chunk]))
    assert type(raised) is type(error) and str(raised) == f"rank 0: {error}", (type(raised), str(raised))
    assert raised.__cause__ is error
    assert chunk.weight.grad.tolist() == [[0.0, 1.0], [2.0, 3.0]] and chunk.bias.grad.tolist() == [5.0, -6.0]


def test_a_prefixed_error_is_not_prefixed_again() -> None:
    raised = _raised(lambda: torch_impl.finalize_model_grads("not a model"))  # type: ignore[arg-type]
    assert isinstance(raised, TypeError) and str(raised).startswith("rank 0: model must be")
    assert str(raised).count("rank 0:") == 1, str(raised)


@pytest.mark.parametrize("entry", ["finalize_model_grads", "_allreduce_non_tensor_model_parallel_grads"])
def test_inside_a_compiled_step_the_error_is_the_eager_one(entry: str) -> None:
    chunk = _chunk(ValueError("config unreadable"))

    @torch.compile(backend="eager")
    def step(x: torch.Tensor) -> torch.Tensor:
        ENTRIES[entry]([chunk])
        return x * 2

    raised = _raised(lambda: step(torch.ones(1)))
    assert type(raised) is ValueError and str(raised) == "rank 0: config unreadable", str(raised)
    assert chunk.weight.grad.tolist() == [[0.0, 1.0], [2.0, 3.0]] and chunk.bias.grad.tolist() == [5.0, -6.0]
