"""Plan once, run many: what finalize_model_grads caches per model and when it replans.

World of one rank (no process group): num_tokens scaling makes every gradient the plan
touches observable, so each test checks values after each step, plus the counters of
the model's cached state (plans built, programs bound).
"""

from __future__ import annotations

import importlib
import types

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from meshgrad import FinalizeConfig  # noqa: E402
from torch_impl import finalize_model_grads, reset_model_temporary_tensors  # noqa: E402
discover_module = importlib.import_module("torch_impl.sources.discover")
read_module = importlib.import_module("torch_impl.call.read")
plan_module = importlib.import_module("torch_impl.call.plan")
state_module = importlib.import_module("torch_impl.call.model_state")
from torch_impl.call.model_watch import ModelWatch  # noqa: E402
from torch_impl.call.watches import GradWatch  # noqa: E402
from torch_impl.finalize import ModelState, execution_stats  # noqa: E402

CONFIG = FinalizeConfig(calculate_per_token_loss=True, sequence_parallel=True)


class Chunk(nn.Module):
    def __init__(self, main_grad: bool = True) -> None:
        super().__init__()
        self.config = CONFIG
        self.a = nn.Parameter(torch.zeros(3))
        self.b = nn.Parameter(torch.zeros(2, 2))
        self.c = nn.Parameter(torch.zeros(4))
        for i, p in enumerate(self.parameters()):
            value = torch.full(p.shape, float(i + 1))
            if main_grad:
                p.main_grad = value
            else:
                p.grad = value


def grads(model) -> dict[tuple[int, str], torch.Tensor | None]:
    out = {}
    for i, chunk in enumerate(model):
        for name, p in chunk.named_parameters():
            g = getattr(p, "main_grad", p.grad)
            out[(i, name)] = None if g is None else g.clone()
    return out


def step(model, n: int = 2) -> dict:
    before = grads(model)
    finalize_model_grads(model, num_tokens=torch.tensor(n))
    return before


def assert_scaled(model, before, n, skipped=()):
    after = grads(model)
    for key, value in before.items():
        if value is None or key in skipped:
            assert (after[key] is None and value is None) or torch.equal(after[key], value), key
        else:
            assert torch.equal(after[key], value / n), key


def test_repeated_steps_plan_and_bind_once():
    model = [Chunk(), Chunk()]
    for n in (2, 4, 8):
        before = step(model, n)
        assert_scaled(model, before, n)
    stats = execution_stats(model)
    assert (stats.calls, stats.plans_built, stats.programs_bound, stats.bytes_copied) == (3, 1, 1, 0)


def test_a_repeated_step_does_no_per_parameter_python(monkeypatch):
    model = [Chunk(), Chunk()]
    step(model)

    def boom(*args, **kwargs):
        raise AssertionError("O(parameters) work in a repeated step")

    monkeypatch.setattr(read_module, "discover", boom)
    monkeypatch.setattr(state_module, "discover", boom)
    monkeypatch.setattr(plan_module, "plan_finalize", boom)
    monkeypatch.setattr(discover_module, "param_spec", boom)
    monkeypatch.setattr(discover_module.Discovered, "fingerprint", boom)
    monkeypatch.setattr(state_module, "Program", boom)
    before = step(model, 4)
    assert_scaled(model, before, 4)


def test_freezing_and_unfreezing_replans_and_skips_the_frozen_grad():
    model = [Chunk()]
    step(model)
    param = model[0].b
    param.requires_grad_(False)
    before = step(model, 2)
    assert_scaled(model, before, 2, skipped={(0, "b")})
    assert execution_stats(model).plans_built == 2
    param.requires_grad_(True)
    before = step(model, 2)
    assert_scaled(model, before, 2)
    stats = execution_stats(model)
    assert stats.plans_built == 2  # the first plan is still cached
    assert stats.programs_bound == 3


@pytest.mark.parametrize("attr", ["main_grad", "grad"])
def test_a_gradient_disappearing_and_reappearing_replans(attr):
    model = [Chunk(main_grad=attr == "main_grad")]
    step(model)
    param = model[0].c
    if attr == "main_grad":
        del param.main_grad  # falls back to .grad, which is None
    else:
        param.grad = None
    before = step(model, 2)
    assert_scaled(model, before, 2)
    assert before[(0, "c")] is None
    assert execution_stats(model).plans_built == 2
    setattr(param, attr, torch.full((4,), 6.0))
    before = step(model, 3)
    assert_scaled(model, before, 3)
    assert torch.equal(getattr(param, attr), torch.full((4,), 2.0))


def test_new_gradient_tensors_rebind_without_replanning():
    model = [Chunk(main_grad=False)]
    step(model)
    old = model[0].a.grad
    model[0].a.grad = torch.full((3,), 9.0)  # e.g. zero_grad(set_to_none=True) + backward
    before = step(model, 3)
    assert_scaled(model, before, 3)
    assert torch.equal(old, torch.full((3,), 0.5))  # the stale tensor is left alone
    stats = execution_stats(model)
    assert (stats.plans_built, stats.programs_bound) == (1, 2)


@pytest.mark.parametrize("attr", ["main_grad", "grad"])
def test_a_parameter_reshaped_in_place_raises_as_a_fresh_call(attr):
    """``param.data = param.data.view(-1)`` keeps the data pointer: the cached step sees the
    new shape and raises the fresh call's error; nothing is scaled. Restored, the step
    runs from its cached plan again."""
    model = [Chunk(main_grad=attr == "main_grad")]
    step(model)
    param = model[0].b
    param.data = param.data.view(-1)
    before = grads(model)
    with pytest.raises(ValueError) as cached:
        finalize_model_grads(model, num_tokens=torch.tensor(2))
    assert "(2, 2)" in str(cached.value) and "(4,)" in str(cached.value), cached.value
    after = grads(model)
    assert all(torch.equal(after[k], v) for k, v in before.items())
    fresh = [Chunk(main_grad=attr == "main_grad")]
    fresh[0].b.data = fresh[0].b.data.view(-1)
    with pytest.raises(ValueError) as first:
        finalize_model_grads(fresh, num_tokens=torch.tensor(2))
    assert str(first.value) == str(cached.value)
    param.data = param.data.view(2, 2)
    before = step(model, 4)
    assert_scaled(model, before, 4)
    assert execution_stats(model).plans_built == 1


def test_a_dtype_change_replans():
    model = [Chunk()]
    step(model)
    model[0].a.main_grad = torch.full((3,), 4.0, dtype=torch.bfloat16)
    before = step(model, 2)
    assert_scaled(model, before, 2)
    assert model[0].a.main_grad.dtype == torch.bfloat16
    assert execution_stats(model).plans_built == 2


def test_a_changed_chunk_list_gets_its_own_state():
    first, second = Chunk(), Chunk()
    step([first])
    before = step([first, second], 2)
    assert_scaled([first, second], before, 2)
    assert ModelState.of([first, second]).stats.plans_built == 1
    assert ModelState.of([first]).stats.calls == 0  # replaced: one state per chunk list
    before = step([first], 2)
    assert_scaled([first], before, 2)


def _with_one_element_and_inner(chunk: Chunk) -> Chunk:
    """``chunk`` plus a one-element parameter ``s`` and a submodule ``inner.w``."""
    chunk.s = nn.Parameter(torch.zeros(1))
    chunk.s.main_grad = torch.full((1,), 7.0)
    chunk.inner = nn.Module()
    chunk.inner.w = nn.Parameter(torch.zeros(2))
    chunk.inner.w.main_grad = torch.full((2,), 5.0)
    return chunk


def _param(numel: int, value: float) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(numel))
    p.main_grad = torch.full((numel,), value)
    return p


def _replace_one_element_directly(chunk: Chunk) -> None:
    chunk._parameters["s"] = _param(1, 7.0)  # equal value, another object; no hook sees it


def _replace_the_parameter_dict(chunk: Chunk) -> None:
    chunk._parameters = {**chunk._parameters, "a": _param(3, 9.0)}  # a new dict object


def _remove_directly(chunk: Chunk) -> None:
    del chunk._parameters["c"]


def _replace_a_submodule_directly(chunk: Chunk) -> None:
    inner = nn.Module()
    inner.w = _param(2, 5.0)
    chunk._modules["inner"] = inner


@pytest.mark.parametrize(
    "change",
    [_replace_one_element_directly, _replace_the_parameter_dict, _remove_directly, _replace_a_submodule_directly],
    ids=["one-element param replaced", "_parameters dict replaced", "param removed", "submodule replaced"],
)
def test_module_dicts_changed_without_a_hook_are_seen(change):
    """Edits of a module's ``_parameters`` / ``_modules`` that no registration hook
    reports (direct dict assignment, a new dict, a removal) make the next step read the
    model again: the new parameters are scaled, the old ones left alone."""
    model = [_with_one_element_and_inner(Chunk())]
    step(model)
    old = {name: (p, p.main_grad.clone()) for name, p in model[0].named_parameters()}
    change(model[0])
    before = step(model, 2)
    assert_scaled(model, before, 2)
    assert execution_stats(model).programs_bound == 2  # read again, bound again
    live = dict(model[0].named_parameters())
    gone = [name for name, (p, _) in old.items() if live.get(name) is not p]
    assert len(gone) == 1
    for name in gone:  # replaced or removed: left as the first step left it
        param, after_first = old[name]
        assert torch.equal(param.main_grad, after_first), name


def test_a_covered_parameter_is_watched_in_its_module_dicts_too():
    """A parameter a bound plan reads but discovery did not watch (``cover``) is checked
    like a watched one: replacing it in its module's dict (no hook sees it) is seen."""
    chunk = _with_one_element_and_inner(Chunk())
    found = discover_module.discover([chunk], CONFIG)
    watch = ModelWatch(found, [chunk], lambda roles=True: (), [(0, "a")])
    watch.cover([(0, "inner.w")])
    assert watch.same()
    chunk.inner._parameters["w"] = _param(2, 5.0)
    assert not watch.same()
    watch.close()


def test_a_plan_covered_stays_covered_and_is_covered_once():
    """``cover_plan``: a plan's keys are covered on its first binding (its parameter then
    watched in its module's dict), asked again only for another plan, and a plan covered
    before another stays covered (the watched keys only grow)."""
    chunk = _with_one_element_and_inner(Chunk())
    found = discover_module.discover([chunk], CONFIG)
    watch = ModelWatch(found, [chunk], lambda roles=True: (), [(0, "a")])
    asked = []

    class Plan:
        def __init__(self, keys):
            self.keys = keys

        def gradient_keys(self, scale_keys):
            asked.append(self.keys)
            return [*self.keys, *scale_keys]

    inner, first = (types.SimpleNamespace(plan=Plan(keys), plain_scale_keys=(), helper=False)
                    for keys in ([(0, "inner.w")], [(0, "a")]))
    for bound in (inner, inner, first, inner):
        watch.cover_plan(bound)
    assert asked == [[(0, "inner.w")], [(0, "a")], [(0, "inner.w")]]  # once per change of plan
    assert watch.keys == {(0, "a"), (0, "inner.w")} and watch.same()
    chunk.inner._parameters["w"] = _param(2, 5.0)  # the first plan's parameter, replaced unseen by hooks
    assert not watch.same()
    watch.close()


def test_grad_watch_detects_each_change():
    p, q = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    p.main_grad = torch.zeros(2)
    q.grad = torch.zeros(2)
    watch = GradWatch([p, q])
    assert watch.same()
    q.main_grad = torch.zeros(2)
    assert not watch.same()
    del q.main_grad
    assert watch.same()
    q.grad = torch.zeros(2)
    assert not watch.same()
    watch = GradWatch([p, q])
    p.main_grad = torch.zeros(2)
    assert not watch.same()
    watch = GradWatch([p, q])
    del p.main_grad
    assert not watch.same()
    watch = GradWatch([p, q])
    q.requires_grad_(False)
    assert not watch.same()


def test_grad_watch_sees_equal_valued_replacements_and_in_place_changes():
    one, many = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(3))
    one.main_grad, many.main_grad = torch.ones(1), torch.ones(3)
    many.sequence_parallel = False
    watch = GradWatch([one, many])
    assert watch.same()
    one.main_grad = torch.ones(1)  # equal value, another tensor
    assert not watch.same()
    watch = GradWatch([one, many])
    many.main_grad = torch.ones(3)  # equal values, another tensor
    assert not watch.same()
    watch = GradWatch([one, many])
    many.sequence_parallel = True
    assert not watch.same()
    watch = GradWatch([one, many])
    many.main_grad.resize_(2)  # the same tensor object, another size
    assert not watch.same()
    watch = GradWatch([one, many])
    many.main_grad.data = torch.zeros(2)  # the same tensor object, other storage
    assert not watch.same()
    watch = GradWatch([one, many])
    many.note = "added"
    assert not watch.same()
    del many.note
    assert watch.same()


@pytest.mark.parametrize(
    "change",
    [
        lambda ts: ts[0].unsqueeze_(0),  # another dim, the same numel
        lambda ts: ts[1].resize_(2, 3),  # (3, 2) -> (2, 3): the same dim and numel
        lambda ts: ts[1].resize_(6),
        lambda ts: ts[2].resize_(0, 7),  # empty: (0, 5) -> (0, 7)
        lambda ts: ts[3].resize_(4, 1, 3),  # (4, 3, 1) -> (4, 1, 3)
        lambda ts: ts[0].resize_(5),
    ],
    ids=["unsqueeze", "2-D split", "flattened", "empty", "3-D middle", "numel"],
)
def test_grad_watch_sees_every_shape_change(change):
    tensors = [torch.zeros(4), torch.zeros(3, 2), torch.zeros(0, 5), torch.zeros(4, 3, 1), torch.zeros(())]
    params = [nn.Parameter(torch.zeros(t.shape)) for t in tensors]
    for param, tensor in zip(params, tensors):
        param.main_grad = tensor
    watch = GradWatch(params)
    assert watch.same()
    change(tensors)
    assert not watch.same()


@pytest.mark.parametrize(
    "param, change",
    [
        (lambda: nn.Parameter(torch.zeros(3, 2)), lambda p: setattr(p, "data", torch.zeros(3, 2))),  # same shape
        (lambda: nn.Parameter(torch.zeros(3, 2)), lambda p: setattr(p, "data", torch.zeros(3, 2, dtype=torch.float64))),
        (lambda: nn.Parameter(torch.zeros(3, 2)), lambda p: setattr(p, "data", torch.zeros(2, 3))),
        (lambda: nn.Parameter(torch.zeros(0, 2)), lambda p: setattr(p, "data", torch.zeros(0, 3))),  # empty: by shape
        (lambda: nn.Parameter(torch.zeros(3, 2, device="meta")), lambda p: setattr(p, "data", torch.zeros(2, 3, device="meta"))),
        # Its own storage under another shape: the same data pointer (as a storage freed by
        # an earlier replacement that comes back at the same address).
        (lambda: nn.Parameter(torch.zeros(3, 2)), lambda p: setattr(p, "data", p.data.view(-1))),
        (lambda: nn.Parameter(torch.zeros(3, 2)), lambda p: setattr(p, "data", p.data.view(2, 3))),
    ],
    ids=["same-shape", "dtype", "shape", "empty", "meta", "flattened in place", "reshaped in place"],
)
def test_grad_watch_sees_the_parameter_data_replaced(param, change):
    """``param.data = ...`` with the gradient left: a plain parameter is watched by its
    data pointer and shape (any other tensor: another dtype or device; its own storage
    under another shape), an empty or meta one by its shape."""
    p = param()
    p.main_grad = torch.zeros(p.shape)
    watch = GradWatch([p])
    assert watch.same()
    change(p)
    assert not watch.same()


class Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("qb_beta", torch.zeros(4))
        self.register_buffer("qb_beta_accum", torch.ones(4))
        self.register_buffer("qb_beta_count", torch.ones(()))


def test_helpers_plan_once_per_model_and_steps():
    model = [Chunk()]
    model[0].router = Router()
    for _ in range(3):
        model[0].router.qb_beta_accum.fill_(5.0)
        model[0].router.qb_beta_count.fill_(2.0)
        reset_model_temporary_tensors(CONFIG, model)
        assert float(model[0].router.qb_beta_accum.abs().sum()) == 0.0
        assert float(model[0].router.qb_beta_count) == 0.0
    stats = execution_stats(model)
    assert (stats.plans_built, stats.programs_bound) == (1, 1)


def test_router_only_helpers_do_not_recheck_parameters_but_finalize_does():
    model = [Chunk()]
    model[0].router = Router()
    reset_model_temporary_tensors(CONFIG, model)
    before = step(model)
    assert_scaled(model, before, 2)
    built = execution_stats(model).plans_built
    model[0].c.main_grad = torch.full((4,), 9.0)  # a parameter change: no router step reads it
    model[0].router.qb_beta_accum.fill_(5.0)
    reset_model_temporary_tensors(CONFIG, model)
    assert float(model[0].router.qb_beta_accum.abs().sum()) == 0.0
    assert execution_stats(model).plans_built == built  # the reset reused its plan
    before = step(model)  # finalize sees the new gradient tensor and scales it
    assert_scaled(model, before, 2)
    model[0].router.qb_beta_accum = torch.ones(4)  # a router buffer replaced: the reset sees it
    reset_model_temporary_tensors(CONFIG, model)
    assert float(model[0].router.qb_beta_accum.abs().sum()) == 0.0


def test_snapshot_sees_every_change_of_a_config_or_group_source():
    import dataclasses
    import types

    from torch_impl.call.memo import Snapshot

    plain = types.SimpleNamespace(sequence_parallel=True, tp=object())
    snap = Snapshot(plain, ("sequence_parallel", "tp"))
    assert snap.same()
    plain.sequence_parallel = 1  # an equal value reads the same
    assert snap.same()
    plain.sequence_parallel = False
    assert not snap.same()
    snap = Snapshot(plain, ())
    plain.extra = 3  # any attribute added, replaced or removed
    assert not snap.same()
    snap = Snapshot(plain, ())
    del plain.extra
    assert not snap.same()
    snap = Snapshot(plain, ())
    plain.tp = object()
    assert not snap.same()

    mapping = {"tp": object()}
    snap = Snapshot(mapping, ())
    assert snap.same()
    mapping["tp"] = object()
    assert not snap.same()

    class Dynamic:  # attributes computed on access: the named ones are read again
        def __init__(self) -> None:
            self.values = {"consistency_check": "once"}

        def __getattr__(self, name: str):
            try:
                return self.values[name]
            except KeyError:
                raise AttributeError(name) from None

    dynamic = Dynamic()
    snap = Snapshot(dynamic, ("consistency_check",))
    assert snap.same()
    dynamic.values["consistency_check"] = "off"
    assert not snap.same()

    @dataclasses.dataclass
    class ProcessGroupCollection:  # Megatron's: unset fields read None through __getattr__
        def __getattr__(self, name: str):
            return None

    collection = ProcessGroupCollection()
    snap = Snapshot(collection, ("tp",), by_vars=True)
    assert snap.same()
    collection.tp = object()
    assert not snap.same()


def test_a_config_changed_between_steps_is_read_again():
    import types

    from torch_impl.run.errors import NonFiniteGradError

    model = [Chunk()]
    model[0].config = types.SimpleNamespace(calculate_per_token_loss=True, check_for_nan_in_grad=False)
    before = step(model)
    assert_scaled(model, before, 2)
    model[0].a.main_grad[0] = float("nan")
    before = step(model)  # NaN passes (and propagates) with the check off
    assert torch.isnan(model[0].a.main_grad[0]) and torch.equal(model[0].b.main_grad, before[(0, "b")] / 2)
    model[0].config.check_for_nan_in_grad = True  # the same object, mutated
    kept = grads(model)
    with pytest.raises(NonFiniteGradError, match="'a'"):
        step(model)
    after = grads(model)
    for key, value in kept.items():  # nothing changed
        torch.testing.assert_close(after[key], value, rtol=0, atol=0, equal_nan=True)


def test_discovery_leaves_out_exactly_the_untouched_parameters_of_a_ddp_chunk():
    """On a chunk whose DDP does the DP sync, discovery keeps exactly the parameters that
    ``touched`` (the rule, not inlined) keeps: a q / k layernorm by its module's name or
    its own, a flagged one; the rest left out. Names as ``named_parameters()`` gives them."""
    from torch_impl.sources.discover import _class_flags, discover, touched

    root = nn.Module()
    root.self_attention = nn.Module()
    root.self_attention.q_layernorm = nn.LayerNorm(2)  # by its module's name
    root.self_attention.input_layernorm = nn.LayerNorm(2)  # a layernorm, not q / k
    root.self_attention.k_layernorm_bias = nn.Parameter(torch.zeros(2))  # by its own name
    root.mlp = nn.Linear(2, 2)
    root.mlp.weight.sequence_parallel = True  # flagged
    root.q_layer = nn.Module()
    root.q_layer.norm = nn.Parameter(torch.zeros(2))  # "q_layer.norm": no q_layernorm
    for p in root.parameters():
        p.main_grad = torch.zeros(p.shape)
    found = discover([root], FinalizeConfig(), [True])
    kept = [spec.name for spec in found.params]
    expected = [n for n, p in root.named_parameters() if touched(n, p, _class_flags(type(p)))]
    assert kept == expected == [
        "self_attention.k_layernorm_bias", "self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
        "mlp.weight",
    ]
    assert not found.complete


def test_named_parameters_walks_as_torch_does():
    """Discovery's one walk of the module tree names, orders and de-duplicates the
    parameters as ``nn.Module.named_parameters()`` does (a shared parameter once, under
    its first name; a None entry skipped)."""
    shared = nn.Linear(2, 2)
    root = nn.Sequential(nn.Linear(2, 3), nn.Sequential(shared, nn.LayerNorm(2)), shared)
    root.extra = nn.Parameter(torch.zeros(1))
    root[0].register_parameter("unset", None)
    root[1][1].tied = root[0].weight  # one tensor under two names
    expected = [(n, id(p)) for n, p in root.named_parameters()]
    found = discover_module.discover([root], FinalizeConfig())
    entries = [(spec.name, id(found.tensors[spec.key])) for spec in found.params]
    assert entries == expected
    assert len(expected) == 7


def test_a_watch_of_refreshed_specs_watches_the_modules_as_they_are_now():
    """The watch made for a discovery takes the module ids of discovery's own walk; a watch
    made for refreshed specs (the same parameters, their flags re-read) walks the modules
    again, so a submodule put into ``_modules`` directly since (no hook saw it) has its
    later registrations seen, as a fresh walk would."""
    chunk = Chunk()
    found = discover_module.discover([chunk], CONFIG)
    assert found.module_ids == tuple(map(id, chunk.modules()))
    sneaked = nn.Module()
    chunk._modules["sneaked"] = sneaked  # no registration hook sees this
    refreshed = found.refresh()
    assert refreshed.module_ids is None and refreshed.params == found.params
    watch = ModelWatch(refreshed, [chunk], lambda roles=True: (), [])
    assert id(sneaked) in watch.module_ids and watch.same()
    sneaked.w = nn.Parameter(torch.zeros(2))  # a registration under it
    assert not watch.same()
    watch.close()
