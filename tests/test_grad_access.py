"""torch_impl.run.grads.GradAccess.read: a list of gradients read at once is what reading
them key by key gives (the same tensor objects, or for meshgrad's own buffer views the
same kind of private alias), on its C-level path (plain ``.grad`` tensors) and on the
key-by-key one; a gradient lost after planning is refused either way."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from meshgrad.errors import FinalizeInputError  # noqa: E402
from torch_impl.run.grads import GradAccess  # noqa: E402

Marked = type("Marked", (torch.Tensor,), {})


def _params(kind: str) -> dict[tuple[int, str], nn.Parameter]:
    """Three parameters whose gradients are plain ``.grad`` tensors, or one of them a
    ``main_grad``, a tensor subclass, or one of meshgrad's own buffer views."""
    params = {(0, name): nn.Parameter(torch.zeros(n)) for name, n in (("a", 2), ("b", 3), ("c", 4))}
    for i, p in enumerate(params.values()):
        p.grad = torch.arange(float(i), float(i + p.numel()))
    b = params[(0, "b")]
    if kind == "main_grad":
        b.main_grad = torch.full((3,), 7.0)
    elif kind == "subclass":
        b.grad = torch.full((3,), 5.0).as_subclass(Marked)
    return params


@pytest.mark.parametrize("kind", ["plain", "main_grad", "subclass", "own view"])
def test_a_read_list_is_the_key_by_key_read(kind: str) -> None:
    params = _params(kind)
    own = {}
    if kind == "own view":
        buffer = torch.arange(10.0, 13.0)
        params[(0, "b")].grad = buffer[0:3]
        own = {id(params[(0, "b")].grad): params[(0, "b")].grad}
    keys = [(0, "c"), (0, "a"), (0, "b")]
    got = GradAccess(params, own_views=own).read(keys)
    want = [GradAccess(params, own_views=own)[k] for k in keys]
    assert [t.data_ptr() for t in got] == [t.data_ptr() for t in want]
    assert all(map(torch.equal, got, want))
    by_key_is_the_param = [g is (p.main_grad if hasattr(p, "main_grad") else p.grad)
                           for g, p in zip(got, map(params.__getitem__, keys))]
    # an own view is read through an alias of its memory (never the view object itself)
    assert by_key_is_the_param == [True, True, kind != "own view"]
    if kind == "main_grad":
        assert torch.equal(got[2], torch.full((3,), 7.0))


def test_a_gradient_lost_after_planning_is_refused_by_a_read_list() -> None:
    params = _params("plain")
    params[(0, "b")].grad = None
    with pytest.raises(FinalizeInputError, match="'b'.*lost its gradient after planning"):
        GradAccess(params).read([(0, "a"), (0, "b")])
