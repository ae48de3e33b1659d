"""The compiled metadata guard of the watches (torch_impl.call.tensor_guard) and the
gradient watch on both of its paths: through the guard, and attribute by attribute where
torch has none (the guard replaced by None). Every change must be seen on each path."""

from __future__ import annotations

import importlib
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from torch_impl.call.tensor_guard import MAX_REARMS, GuardedCheck, metadata_guard  # noqa: E402
from torch_impl.call.watches import GradWatch  # noqa: E402

guard_module = importlib.import_module("torch_impl.call.tensor_guard")


def test_this_torch_has_a_usable_guard():
    """The probe accepts torch's guard on the pinned torch, so the fast path is the one
    the other tests (and the benchmarks) run."""
    p = nn.Parameter(torch.zeros(2, 3))
    assert metadata_guard([p]) is not None


@pytest.mark.parametrize(
    "change, seen",
    [
        (lambda ts: None, False),
        (lambda ts: ts[1].requires_grad_(False), True),
        (lambda ts: setattr(ts[0], "data", torch.zeros(5, 3)), True),  # other sizes, the same strides
        (lambda ts: setattr(ts[0], "data", torch.zeros(3, 2)), True),
        (lambda ts: setattr(ts[1], "data", torch.zeros(4, dtype=torch.float64)), True),
        (lambda ts: setattr(ts[0], "data", torch.zeros(3, 2).t()), True),  # the same shape, other strides
        (lambda ts: setattr(ts[0], "data", torch.ones(2, 3)), False),  # same metadata, other values
    ],
    ids=["unchanged", "requires_grad", "sizes", "shape", "dtype", "strides", "values"],
)
def test_the_guard_fails_exactly_on_a_metadata_change(change, seen):
    tensors = [nn.Parameter(torch.zeros(2, 3)), nn.Parameter(torch.zeros(4))]
    guard = metadata_guard(tensors)
    change(tensors)
    assert guard.check(*tensors) is not seen


@pytest.mark.parametrize("mode", ["normal", "inference"])
def test_a_guard_on_kinds_fails_on_another_device_layout_or_inference_flag(mode):
    """``kinds=True`` (a watch of new tensors against recorded facts): a new tensor of the
    same shape and dtype passes; one on the meta device, sparse, or made under inference
    mode fails. The probe behind it answers the same when first asked in inference mode."""
    guard_module._guard_type.cache_clear()
    try:
        with torch.inference_mode(mode == "inference"):
            assert guard_module._guard_type(True) is not None  # the probe, first asked in this mode
        guard = metadata_guard([torch.zeros(2, 3)], kinds=True)
    finally:
        guard_module._guard_type.cache_clear()
    assert guard is not None
    with torch.inference_mode():
        frozen = torch.zeros(2, 3)
    assert guard.check(torch.ones(2, 3))
    for other in (torch.zeros(2, 3, device="meta"), torch.zeros(2, 3).to_sparse(), frozen):
        assert not guard.check(other), other


def test_the_guard_sees_requires_grad_flipped_under_no_grad():
    p = nn.Parameter(torch.zeros(3))
    with torch.no_grad():
        guard = metadata_guard([p])
        p.requires_grad_(False)
        assert guard.check(p) is False
        p.requires_grad_(True)
        assert guard.check(p) is True


def test_no_guard_for_nothing_or_what_it_cannot_describe():
    assert metadata_guard([]) is None
    with warnings.catch_warnings():  # torch's prototype notice for nested tensors
        warnings.simplefilter("ignore")
        ragged = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])  # no sizes
    assert metadata_guard([nn.Parameter(torch.zeros(2)), ragged]) is None


@pytest.fixture(params=["guard", "attributes"])
def path(request, monkeypatch):
    """The watch's path: torch's guard, or attribute by attribute (no guard)."""
    if request.param == "attributes":
        monkeypatch.setattr(guard_module, "metadata_guard", lambda tensors, strides=True, kinds=False: None)
    return request.param


def _watched(grad_shapes):
    params = [nn.Parameter(torch.zeros(s)) for s in grad_shapes]
    for p in params:
        p.main_grad = torch.zeros(p.shape)
    return params, GradWatch(params)


@pytest.mark.parametrize(
    "change",
    [
        lambda ps: ps[1].requires_grad_(False),
        lambda ps: setattr(ps[0], "data", torch.zeros(3, 2)),
        lambda ps: setattr(ps[0], "data", ps[0].data.view(6)),  # its own storage, another shape
        lambda ps: ps[1].main_grad.resize_(2),
        lambda ps: ps[0].main_grad.unsqueeze_(0),
    ],
    ids=["requires_grad", "param shape", "param view", "grad resized", "grad unsqueezed"],
)
def test_the_watch_sees_each_change_on_each_path(path, change):
    params, watch = _watched([(2, 3), (4,)])
    assert watch.param_check.guard is None  # armed by the first check that passes
    assert watch.same()
    assert (watch.param_check.guard is not None) is (path == "guard")
    assert watch.same()
    change(params)
    assert not watch.same()
    assert not watch.same()  # and stays changed


def test_the_watch_sees_requires_grad_flipped_under_no_grad(path):
    params, watch = _watched([(3,)])
    with torch.no_grad():
        assert watch.same()
        params[0].requires_grad_(False)
        assert not watch.same()


def test_a_stricter_change_falls_back_to_the_callers_check_and_re_arms_the_guard():
    """Strides, which a guard built with them checks and this caller's check does not: the
    guard fails, the caller's check says the same, and the guard is rebuilt on the new
    strides (the next check is the guard's one call again); a later shape change is seen."""
    tensor = torch.zeros(2, 3)
    check = GuardedCheck()
    sizes = lambda: tensor.shape == (2, 3)  # noqa: E731 -- the caller's check: sizes only
    assert check.same([tensor], sizes)
    tensor.set_(tensor.untyped_storage(), 0, (2, 3), (1, 2))  # the same storage, other strides
    old_guard = check.guard
    assert not old_guard.check(tensor)
    assert check.same([tensor], sizes)
    assert check.guard is not old_guard and check.guard.check(tensor) and check.rearms == 1
    tensor.set_(tensor.untyped_storage(), 0, (3, 2), (2, 1))
    assert not check.same([tensor], sizes)


def test_the_parameters_guard_compares_no_strides():
    """A parameter's strides are no question of the watch: restrided over its own storage
    (``set_`` under no_grad), its guard still passes in one call (no fall back, no
    re-arm); its shape, dtype and ``requires_grad`` are still seen."""
    params, watch = _watched([(2, 3)])
    assert watch.same() and watch.param_check.guard is not None
    guard = watch.param_check.guard
    with torch.no_grad():
        params[0].set_(params[0].untyped_storage(), 0, (2, 3), (1, 2))
    assert guard.check(*watch.params) and watch.same()
    assert watch.param_check.guard is guard and watch.param_check.rearms == 0
    with torch.no_grad():
        params[0].set_(params[0].untyped_storage(), 0, (3, 2), (2, 1))
    assert not guard.check(*watch.params) and not watch.same()


def test_a_check_without_a_guard_answers_by_the_slow_check_and_stops_trying():
    """Tensors the guard cannot describe: the slow check answers every time (its value
    is the answer), and no guard is built again after the first try."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tensors = [nn.Parameter(torch.zeros(2)), torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])]
    check = GuardedCheck()
    answers = iter([True, False, True])
    assert [check.same(tensors, lambda: next(answers)) for _ in range(3)] == [True, False, True]
    assert check.guard is None and check.usable is False


def test_strides_that_keep_changing_stop_the_re_arming():
    """A tensor whose strides flip between two layouts every check, under a caller that
    asks about sizes only: the guard is re-armed MAX_REARMS times, then dropped; every
    answer stays right (the same while only strides change, changed once the shape does)."""
    tensor = torch.zeros(2, 3)
    storage = tensor.untyped_storage()
    check = GuardedCheck()
    sizes = lambda: tensor.shape == (2, 3)  # noqa: E731 -- the caller's check: sizes only
    assert check.same([tensor], sizes)
    for i in range(MAX_REARMS + 3):
        tensor.set_(storage, 0, (2, 3), ((1, 2), (3, 1))[i % 2])
        assert check.same([tensor], sizes)
    assert check.guard is None and check.usable is False
    assert check.rearms == MAX_REARMS + 1
    tensor.set_(storage, 0, (3, 2), (2, 1))
    assert not check.same([tensor], sizes)


def test_a_tensor_listed_twice_fails_the_guard_and_the_slow_check_answers():
    """torch's guard requires distinct tensors: with one tensor twice it never passes, so
    every answer is the slow check's (right both ways), and after MAX_REARMS re-arms no
    guard is built again."""
    tensor = torch.zeros(2, 3)
    assert metadata_guard([tensor, tensor]).check(tensor, tensor) is False
    check = GuardedCheck()
    answers = [True] * (MAX_REARMS + 3) + [False]
    got = [check.same([tensor, tensor], lambda a=a: a) for a in answers]
    assert got == answers
    assert check.guard is None and check.usable is False and check.rearms == MAX_REARMS + 1


def test_a_caller_that_asked_the_guard_gets_the_slow_checks_answer():
    """``asked=True`` (the watches ask the armed guard themselves first): the slow check
    answers, the guard is not asked again, and a passing slow check re-arms it."""
    tensor = torch.zeros(2, 3)
    check = GuardedCheck()
    assert check.same([tensor], lambda: True)  # arms a guard
    armed = check.guard
    assert armed is not None and armed.check(tensor)
    slow: list[bool] = []
    assert check.same([tensor], lambda: slow.append(False) or False, asked=True) is False
    assert slow == [False] and check.guard is armed  # the slow check answered; a failed one re-arms nothing
    assert check.same([tensor], lambda: slow.append(True) or True, asked=True) is True
    assert slow == [False, True] and check.rearms == 1  # counted as a guard that failed where the slow check passed
