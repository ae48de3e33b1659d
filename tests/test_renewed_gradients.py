"""Gradients renewed every step: ``zero_grad(set_to_none=True)`` (torch's default) and a
backward make every ``.grad`` a new tensor. A step whose new gradients read as the old
ones (class, dtype, device, layout, shape, strides) keeps its discovery and plan; its
gradients are checked and bound anew, and, renewed twice running, not held past the call.

World of one rank (no process group): the num_tokens scale makes every gradient the plan
touches observable, so each test checks values; the watch's answers are checked exactly.
"""

from __future__ import annotations

import importlib
import random
import weakref

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from meshgrad import FinalizeConfig  # noqa: E402
from torch_impl import execution_stats, finalize_model_grads  # noqa: E402
from torch_impl.call.checks import disjoint_ranges  # noqa: E402
from torch_impl.call.model_state import ModelState  # noqa: E402
from torch_impl.call.watches import GradWatch  # noqa: E402

discover_module = importlib.import_module("torch_impl.sources.discover")
plan_module = importlib.import_module("torch_impl.call.plan")
state_module = importlib.import_module("torch_impl.call.model_state")
check_module = importlib.import_module("torch_impl.call.check")
pipeline_module = importlib.import_module("torch_impl.call.pipeline")

SHAPES = {"a": (3,), "b": (2, 2), "c": (4,)}


class Chunk(nn.Module):
    def __init__(self, nan_check: bool = False) -> None:
        super().__init__()
        self.config = FinalizeConfig(calculate_per_token_loss=True, check_for_nan_in_grad=nan_check)
        for name, shape in SHAPES.items():
            setattr(self, name, nn.Parameter(torch.zeros(shape)))


def renew(model: list[Chunk], value: float) -> dict[str, torch.Tensor]:
    """A training step's new gradients (what zero_grad(set_to_none=True) and a backward
    leave): each a new tensor of the old facts, filled with ``value`` + its index."""
    for i, p in enumerate(model[0].parameters()):
        p.grad = torch.full(p.shape, value + i)
    return {n: p.grad.clone() for n, p in model[0].named_parameters()}


def assert_scaled(model: list[Chunk], before: dict[str, torch.Tensor], n: int) -> None:
    for name, p in model[0].named_parameters():
        assert torch.equal(p.grad, before[name] / n), name


def watch_of(model: list[Chunk]):
    (_, found, watch, _), = ModelState.existing(model).found.values()
    return found, watch


# ============================================================ the watch's own answers


def _params() -> list[nn.Parameter]:
    params = [nn.Parameter(torch.zeros(shape)) for shape in SHAPES.values()]
    for p in params:
        p.grad = torch.ones(p.shape)
    return params


def _answers(watch: GradWatch) -> tuple[bool, bool]:
    """(same, renewed): what the watch answers now."""
    return watch.same(), watch.renewed()


def test_new_gradients_of_the_same_facts_read_as_renewed_not_same():
    params = _params()
    watch = GradWatch(params)
    assert watch.renewable and _answers(watch) == (True, True)
    for p in params:
        p.grad = torch.full(p.shape, 7.0)
    assert _answers(watch) == (False, True)
    watch.renew()
    assert _answers(watch) == (True, True)
    params[0].grad = None  # presence is a fact of the plan: not renewed
    assert _answers(watch) == (False, False)


@pytest.mark.parametrize("armed", [False, True], ids=["attributes", "guard"])
@pytest.mark.parametrize("change", [
    "dtype", "strides", "shape", "sparse", "subclass", "inference", "overlapping", "param_class", "frozen",
])  # (another device: torch refuses a gradient off its parameter's device, .data included)
def test_new_gradients_of_other_facts_are_not_renewed(change, armed):
    """Each change a plan, a spec or a check reads: neither same nor renewed; put back
    (as new tensors of the old facts), renewed again. ``armed``: a renewal was accepted
    first, so the renewal's compiled guard (where torch has one) answers before the
    attribute-by-attribute check."""
    params = _params()
    watch = GradWatch(params)
    if armed:
        assert watch.renewed() and watch.renewal_check.guard is not None
    b = params[1]
    new = b.grad = torch.ones(2, 2)  # a new tensor, changed through .data where .grad = refuses
    if change == "dtype":
        new.data = torch.ones(2, 2, dtype=torch.float64)
    elif change == "strides":
        b.grad = torch.ones(2, 2).t()  # the shape kept, strides (1, 2)
    elif change == "shape":
        new.data = torch.ones(4)
    elif change == "inference":
        with torch.inference_mode():
            b.grad = torch.ones(2, 2)
    elif change == "overlapping":  # the old facts, but one element shared with a's gradient
        buffer = torch.ones(8)
        params[0].grad, params[2].grad = buffer[:3], buffer[2:6]
    elif change == "sparse":
        b.grad = torch.ones(2, 2).to_sparse()
    elif change == "subclass":
        b.grad = torch.ones(2, 2).as_subclass(type("Marked", (torch.Tensor,), {}))
    elif change == "param_class":
        b.__class__ = type("Flagged", (nn.Parameter,), {"sequence_parallel": property(lambda self: True)})
    else:
        b.requires_grad_(False)
    assert _answers(watch) == (False, False), change
    b.__class__ = nn.Parameter
    b.requires_grad_(True)
    if change == "overlapping":  # side by side in one buffer: no element shared
        buffer = torch.ones(7)
        params[0].grad, params[2].grad = buffer[:3], buffer[3:]
        assert _answers(watch) == (False, True)
    for p in params:
        p.grad = torch.zeros(p.shape)
    assert _answers(watch) == (False, True), change


def test_a_renewal_keeps_the_lineage_a_refresh_does_not():
    """What the checks found for a discovery holds for its renewals (the same lineage),
    not for a re-read of its specs."""
    found = discover_module.discover([Chunk()], FinalizeConfig())
    renewal = found.renewal()
    assert renewal is not found and renewal.lineage is found.lineage
    assert (renewal.params, renewal.tensors) == (found.params, found.tensors)
    assert found.refresh().lineage is not found.lineage
    assert discover_module.discover([Chunk()], FinalizeConfig()).lineage is not found.lineage


def test_only_plain_grad_watches_are_renewable():
    """main_grad, a meshgrad buffer view or a DTensor among the gradients: not renewable
    (each is watched its own way)."""
    params = _params()
    params[2].main_grad = torch.ones(4)
    assert not GradWatch(params).renewable
    params = _params()
    assert not GradWatch(params, own_views={id(params[0].grad): params[0].grad}).renewable


def test_a_released_watch_holds_no_gradient_and_knows_them_when_they_return():
    params = _params()
    watch = GradWatch(params)
    grads = [weakref.ref(p.grad) for p in params]
    kept = [p.grad for p in params]
    watch.release()
    assert _answers(watch) == (False, True) and watch.returned()
    assert watch.returned(watch.renewal())  # what renewal() read answers alike
    del kept
    for p in params:
        p.grad = None
    assert [ref() for ref in grads] == [None] * 3  # nothing of them held
    for p in params:
        p.grad = torch.ones(p.shape)
    assert _answers(watch) == (False, True) and not watch.returned()
    renewal = watch.renewal()
    assert not watch.returned(renewal)
    watch.renew(renewal)  # what renewal() read: the new tensors and their pointers, held
    assert _answers(watch) == (True, True) and watch.weak is None
    assert [id(t) for t in watch.tensors] == [id(p.grad) for p in params]
    assert watch.ptrs == [p.grad.data_ptr() for p in params]


# ============================================================ finalize on renewed gradients


def test_renewed_gradients_keep_the_discovery_and_plan(monkeypatch):
    """Steps on new gradients: each scaled right, on the steady path (no read stage), without
    discovery, spec or plan work; the watch kept; each step's gradients bound anew; the old
    ones left alone. A call on the same gradients between them (its probes written) and the
    renewed steps after it take the steady path too."""
    model = [Chunk()]
    before = renew(model, 1.0)
    finalize_model_grads(model, num_tokens=torch.tensor(2))
    assert_scaled(model, before, 2)
    _, watch = watch_of(model)

    def boom(*args, **kwargs):
        raise AssertionError("re-discovered for renewed gradients")

    monkeypatch.setattr(state_module, "discover", boom)
    monkeypatch.setattr(discover_module, "param_spec", boom)
    monkeypatch.setattr(discover_module.Discovered, "refresh", boom)
    monkeypatch.setattr(plan_module, "plan_finalize", boom)
    monkeypatch.setattr(check_module, "check_gradients", boom)  # what it judged holds for them
    monkeypatch.setattr(pipeline_module, "read", boom)  # the steady path renews them
    old = model[0].a.grad
    for step, n in enumerate((4, 8, 16), start=1):
        before = renew(model, 10.0 * step)
        finalize_model_grads(model, num_tokens=torch.tensor(n))
        assert_scaled(model, before, n)
        assert watch_of(model)[1] is watch
    assert torch.equal(old, torch.full((3,), 0.5))  # the first step's tensor is left alone
    for n in (2, 4):  # the same gradients again: steady, then replayed
        before = {name: p.grad.clone() for name, p in model[0].named_parameters()}
        finalize_model_grads(model, num_tokens=torch.tensor(n))
        assert_scaled(model, before, n)
    before = renew(model, 100.0)
    finalize_model_grads(model, num_tokens=torch.tensor(8))
    assert_scaled(model, before, 8)
    assert watch_of(model)[1] is watch
    stats = execution_stats(model)
    # bound: the first call, each renewal, and the first call on the same gradients again
    # (the renewed ones' program was let go after their call)
    assert (stats.calls, stats.plans_built, stats.programs_bound) == (7, 1, 6)


@pytest.mark.parametrize("nan_check", [False, True])
def test_gradients_renewed_twice_running_are_not_held(nan_check):
    """After the second renewal running, nothing of a step's gradients outlives the call:
    not the watch, not a bound program, not the NaN scan's spans."""
    model = [Chunk(nan_check)]
    alive = []
    refs: list[weakref.ref] = []
    for step in range(5):
        for p in model[0].parameters():
            p.grad = None  # zero_grad(set_to_none=True)
        alive.append(sum(ref() is not None for ref in refs))
        before = renew(model, float(step))
        finalize_model_grads(model, num_tokens=torch.tensor(2))
        assert_scaled(model, before, 2)
        refs = [weakref.ref(p.grad) for p in model[0].parameters()]
    assert alive == [0, 3, 3, 0, 0]
    assert execution_stats(model).plans_built == 1


@pytest.mark.parametrize("nan_check", [False, True])
def test_gradients_that_return_are_held_again(nan_check):
    """A released model whose gradients then stay (a step without set_to_none): the call on
    them binds them and holds them again (its NaN scan's spans kept), and the next call is
    a plain repeated step (no binding, the same discovery)."""
    model = [Chunk(nan_check)]
    for step in range(3):
        renew(model, float(step))
        finalize_model_grads(model, num_tokens=torch.tensor(2))
    found, watch = watch_of(model)
    assert watch.grads.weak is not None  # released
    kept = []
    for n in (4, 8):
        before = {name: p.grad.clone() for name, p in model[0].named_parameters()}
        finalize_model_grads(model, num_tokens=torch.tensor(n))
        assert_scaled(model, before, n)
        kept.append(watch_of(model))
    assert kept[0][1] is kept[1][1] is watch and kept[0][0] is kept[1][0]
    assert kept[0][0] is not found and kept[0][0].lineage is found.lineage
    assert watch.grads.weak is None and watch.grads.same()
    (_, record), = ModelState.existing(model).plan_memo.records.values()
    assert (record.nan_spans is not None) == nan_check
    stats = execution_stats(model)
    assert (stats.plans_built, stats.programs_bound) == (1, 4)  # 3 steps, then one binding


def test_disjoint_ranges_answers_as_every_pair_compared():
    """The renewal's memory test, held to a comparison of every pair of ranges (a shared
    address: max of the starts below min of the ends) on 20,000 random sets, empty ranges,
    touching and nested ones among them."""
    rng = random.Random(0)
    answers = set()
    for _ in range(20_000):
        count = rng.randint(0, 6)
        starts = [rng.randint(0, 30) for _ in range(count)]
        extents = [rng.randint(0, 8) for _ in range(count)]
        ends = list(map(int.__add__, starts, extents))
        shared = any(max(starts[i], starts[j]) < min(ends[i], ends[j])
                     for i in range(count) for j in range(i + 1, count))
        assert disjoint_ranges(starts, extents) is not shared, (starts, extents)
        answers.add(shared)
    assert answers == {True, False}
    assert disjoint_ranges([8, 0, 4], [4, 4, 4]) and not disjoint_ranges([0, 4, 2], [4, 4, 4])  # side by side; nested


def test_renewed_gradients_that_share_memory_are_refused_before_anything_changes():
    """New gradients of the old facts that overlap (views of one buffer) pass the watch's
    facts but not the checks redone for them: the call raises, nothing changes, and the
    next step on gradients of their own runs right."""
    model = [Chunk()]
    for step in range(3):
        renew(model, float(step))
        finalize_model_grads(model, num_tokens=torch.tensor(2))
    buffer = torch.arange(11.0)
    model[0].a.grad, model[0].b.grad, model[0].c.grad = buffer[0:3], torch.ones(2, 2), buffer[2:6]
    with pytest.raises(ValueError, match="share|overlap"):
        finalize_model_grads(model, num_tokens=torch.tensor(2))
    assert torch.equal(buffer, torch.arange(11.0))
    before = renew(model, 5.0)
    finalize_model_grads(model, num_tokens=torch.tensor(2))
    assert_scaled(model, before, 2)


def test_every_step_consistency_checks_renewed_gradients_in_full(monkeypatch):
    """``consistency_check="every_step"``: the gradient checks run on every call, renewed
    gradients included."""
    model = [Chunk()]
    model[0].config = FinalizeConfig(calculate_per_token_loss=True, consistency_check="every_step")
    calls = []
    checked = check_module.check_gradients
    monkeypatch.setattr(check_module, "check_gradients", lambda *a: calls.append(1) or checked(*a))
    for step in range(4):
        before = renew(model, float(step))
        finalize_model_grads(model, num_tokens=torch.tensor(2))
        assert_scaled(model, before, 2)
    assert len(calls) == 4


def test_renewed_gradients_with_nan_are_found():
    """The NaN scan of a renewed step reads the new gradients, not the released spans."""
    model = [Chunk(nan_check=True)]
    for step in range(3):
        renew(model, float(step))
        finalize_model_grads(model, num_tokens=torch.tensor(2))
    before = renew(model, 1.0)
    model[0].c.grad[1] = float("nan")
    before["c"] = model[0].c.grad.clone()
    with pytest.raises(Exception, match="NaN|Inf|non-finite|nan"):
        finalize_model_grads(model, num_tokens=torch.tensor(2))
    for name, p in model[0].named_parameters():  # nothing scaled (NaN read as NaN)
        assert torch.equal(p.grad.nan_to_num(), before[name].nan_to_num()), name


def test_renewed_gradients_with_a_new_parameter_rediscover():
    """New gradients of the old facts and a parameter registered since: not a renewal (the
    structure changed); the model is discovered again and the new parameter is scaled too."""
    model = [Chunk()]
    for step in range(3):
        renew(model, float(step))
        finalize_model_grads(model, num_tokens=torch.tensor(2))
    found, _ = watch_of(model)
    model[0].d = nn.Parameter(torch.zeros(2))
    before = renew(model, 4.0)
    assert set(before) == {"a", "b", "c", "d"}
    finalize_model_grads(model, num_tokens=torch.tensor(2))
    assert_scaled(model, before, 2)
    assert watch_of(model)[0].lineage is not found.lineage
    assert execution_stats(model).plans_built == 2
