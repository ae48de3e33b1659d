"""Probes over watched parameters and seed helpers (``torch_impl.call.steady``): a model
whose plan depends on some parameters' flags and gradient tensors (a Megatron-DDP chunk
with a sequence-parallel parameter), and a seed helper's calls (its groups a mapping
built per call), are answered by their probes -- each watch's own bulk check among
them -- and every change the full check sees makes those probes miss.

World of one rank (no process group): finalize's numbers are checked after each step's
num_tokens scale (``step``), the non-TP helper's (over a tensor-parallel group of one)
are its inputs unchanged; for every change the probes are held against the full check.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from in_place import alias_rows, resize, swap_storage, view_as_int32  # noqa: E402
from meshgrad.axes import Group  # noqa: E402
from meshgrad.plan import Step  # noqa: E402
from torch_impl import _allreduce_non_tensor_model_parallel_grads, finalize_model_grads  # noqa: E402
from torch_impl.call.model_state import ModelState  # noqa: E402
from torch_impl.call.read import Request  # noqa: E402
from test_steady_guard import DDP, Config, FILLER, Inner, full_checks, step  # noqa: E402, F401 -- full_checks: a fixture

steady = importlib.import_module("torch_impl.call.steady")


def model() -> list[DDP]:
    """A DDP chunk whose ``a`` is sequence-parallel: watched, with its gradient tensor."""
    inner = Inner()
    inner.a.sequence_parallel = True
    return [DDP(inner, Config(calculate_per_token_loss=True, qk_layernorm=False, **FILLER))]


def _finalize_call() -> tuple[Any, Request]:
    return None, Request(num_tokens=torch.tensor(1))


def _helper_call(chunks: list[DDP], tp: Any = None) -> tuple[Any, Request]:
    return {Group.TP: tp}, Request(steps=(Step.NON_TP,), config=chunks[0].config, over=(Group.TP,))


def probes_hold(chunks: list[DDP], call: tuple[Any, Request]) -> bool:
    """Whether the kept probes answer the next call of this kind with these arguments."""
    source, request = call
    state = ModelState.of(chunks)
    kind = steady.call_kind(request)
    last, guard = state.steady.get(kind), state.steady_guards.get(kind)
    return last is not None and guard is not None and guard.holds(last, source, request)


def full_check_passes(chunks: list[DDP], call: tuple[Any, Request]) -> bool:
    """The full steady check of the next call of this kind, without the probes."""
    source, request = call
    state = ModelState.of(chunks)
    kept = dict(state.steady_guards)
    state.steady_guards.clear()
    try:
        return steady.steady_read(chunks, source, request, {}) is not None
    finally:
        state.steady_guards.update(kept)


def helper_step(chunks: list[DDP]) -> None:
    """The non-TP helper over a tensor-parallel group of one: every gradient unchanged."""
    for c in chunks:
        c.fill()
    want = [p.main_grad.clone() for c in chunks for p in c.module.parameters()]
    _allreduce_non_tensor_model_parallel_grads(chunks, chunks[0].config, None)
    assert all(torch.equal(p.main_grad, w) for p, w in zip((p for c in chunks for p in c.module.parameters()), want))


def test_a_model_with_watched_parameters_is_answered_by_its_probes(full_checks: list[int]) -> None:
    chunks = model()
    for n in (2, 4, 8, 4, 2):
        step(chunks, n)
    assert len(full_checks) == 1  # call 2; calls 3 to 5 by the probes
    guard = next(iter(ModelState.of(chunks).steady_guards.values()))
    assert guard.probes is not None and guard.probes.checks  # the parameters' watch among them


def test_a_seed_helpers_calls_are_answered_by_its_probes(full_checks: list[int]) -> None:
    chunks = model()
    for _ in range(5):
        helper_step(chunks)
    assert len(full_checks) == 1
    assert probes_hold(chunks, _helper_call(chunks))  # a new mapping of the same groups
    assert not probes_hold(chunks, _helper_call(chunks, tp=object()))  # another group object
    source, request = _helper_call(chunks)
    other_config = Request(steps=request.steps, config=Config(**FILLER), over=request.over)
    assert not probes_hold(chunks, (source, other_config))


def _clear_flag(chunks: list[DDP]) -> None:
    del chunks[0].module.a.sequence_parallel


def _replace_grad(chunks: list[DDP]) -> None:
    chunks[0].module.a.main_grad = torch.empty(3)


def _swap_grad_storage(chunks: list[DDP]) -> None:
    grad = chunks[0].module.a.main_grad
    grad.data = torch.empty(3)


def _freeze(chunks: list[DDP]) -> None:
    chunks[0].module.a.requires_grad_(False)


def _swap_param_storage(chunks: list[DDP]) -> None:
    chunks[0].module.a.data = torch.zeros(3)


def _replace_in_dict(chunks: list[DDP]) -> None:
    new = nn.Parameter(torch.zeros(3))
    new.sequence_parallel = True
    chunks[0].module._parameters["a"] = new  # no registration hook sees it


def _flag_other(chunks: list[DDP]) -> None:
    chunks[0].module.b.sequence_parallel = True


#: (change, which calls' full check sees it): the flags of a DDP chunk's other parameters
#: are read once per discovery, by either call (``invalidate_plans`` re-reads them).
CHANGES: list[tuple[Callable[[list[DDP]], None], tuple[str, ...]]] = [
    (_clear_flag, ("finalize", "helper")),
    (_replace_grad, ("finalize", "helper")),
    (_swap_grad_storage, ("finalize", "helper")),
    (_freeze, ("finalize", "helper")),
    (_swap_param_storage, ("finalize", "helper")),
    (_replace_in_dict, ("finalize", "helper")),
    (_flag_other, ()),
]


@pytest.mark.parametrize("kind", ["finalize", "helper"])
@pytest.mark.parametrize("change,seen_by", CHANGES, ids=lambda c: getattr(c, "__name__", "").strip("_"))
def test_every_change_of_a_watched_parameter_makes_the_probes_miss(change, seen_by, kind: str) -> None:
    chunks = model()
    run = step if kind == "finalize" else helper_step
    calls = [(lambda n=n: run(chunks, n)) if kind == "finalize" else (lambda: run(chunks)) for n in (2, 4, 8)]
    for call in calls:
        call()
    call_args = _finalize_call() if kind == "finalize" else _helper_call(chunks)
    assert probes_hold(chunks, call_args) and full_check_passes(chunks, call_args)
    change(chunks)
    holds, passes = probes_hold(chunks, call_args), full_check_passes(chunks, call_args)
    assert holds == passes, "the probes and the full check disagree"
    assert holds != (kind in seen_by)
    for call in calls[:2]:  # the stages read the change; the numbers stay right
        call()
    assert probes_hold(chunks, call_args) and full_check_passes(chunks, call_args)


def _restride_grad_in_place(chunks: list[DDP]) -> None:
    alias_rows(chunks[0].module.a.main_grad)  # a's gradient is 1-D: every element aliased


def _view_grad_as_int(chunks: list[DDP]) -> None:
    view_as_int32(chunks[0].module.a.main_grad)


def _outcome(chunks: list[DDP], kind: str) -> tuple[str, list[Any], int]:
    """(the error type or "ok", every gradient after the call, DP syncs) of one call."""
    try:
        if kind == "finalize":
            finalize_model_grads(chunks, num_tokens=torch.tensor(2))
        else:
            _allreduce_non_tensor_model_parallel_grads(chunks, chunks[0].config, None)
        got = "ok"
    except Exception as err:  # compared with a fresh call's
        got = type(err).__name__
    return got, [p.main_grad.clone() for c in chunks for p in c.module.parameters()], chunks[0].syncs


@pytest.mark.parametrize("kind", ["finalize", "helper"])
@pytest.mark.parametrize("change,errors", [
    # the aliased gradient is not one meshgrad reduces in a world of one: finalize hands it
    # to the DDP chunk's own scale, which refuses it (a fresh call alike)
    (_restride_grad_in_place, {"finalize": "RuntimeError", "helper": "ok"}),
    (_view_grad_as_int, {"finalize": "FinalizeTypeError", "helper": "FinalizeTypeError"}),
], ids=["restrided", "viewed_as_int32"])
def test_an_in_place_change_that_keeps_the_data_pointer_makes_the_probes_miss(change, errors, kind: str) -> None:
    """A gradient changed in place with its data pointer and shape kept (other strides over
    the same storage, a view as another dtype): the probes and the full check miss, and
    the next call gives what a fresh model's first call gives (the same error, or the same
    gradients); meshgrad's own error before anything changes."""
    live = model()
    for n in (2, 4, 8):
        step(live, n) if kind == "finalize" else helper_step(live)
    call_args = _finalize_call() if kind == "finalize" else _helper_call(live)
    assert probes_hold(live, call_args) and full_check_passes(live, call_args)
    live[0].fill()
    change(live)
    assert not probes_hold(live, call_args) and not full_check_passes(live, call_args)
    before = [p.main_grad.clone() for c in live for p in c.module.parameters()]
    syncs = live[0].syncs
    fresh = model()
    change(fresh)
    got, grads, synced = _outcome(live, kind)
    want, fresh_grads, _ = _outcome(fresh, kind)
    assert got == want == errors[kind]
    assert all(torch.equal(g, w) for g, w in zip(grads, fresh_grads))
    if got.startswith("Finalize"):
        assert all(torch.equal(g, b) for g, b in zip(grads, before)) and synced == syncs


def test_a_tensors_layout_changes_with_each_in_place_change_the_plans_depend_on() -> None:
    """``tensor_layout`` (what an embedding helper's kept discovery compares): equal for the
    same tensor read again and after a write of its values, different after each in-place
    change that keeps the object; a sparse one by shape and dtype, one on meta with pointer 0."""
    from torch_impl.call.watches import tensor_layout

    grad = torch.zeros(4, 3)
    kept = tensor_layout(grad)
    grad.add_(1.0)
    assert tensor_layout(grad) == kept == ((4, 3), torch.float32, (3, 1), grad.data_ptr())
    for change in (alias_rows, view_as_int32, swap_storage, resize):
        grad = torch.zeros(4, 3)
        kept = tensor_layout(grad)
        change(grad)
        assert tensor_layout(grad) != kept
    assert tensor_layout(torch.zeros(2, device="meta")) == ((2,), torch.float32, (1,), 0)
    assert tensor_layout(torch.zeros(3).to_sparse()) == ((3,), torch.float32)
    assert tensor_layout(None) == () and tensor_layout([1.0]) == ()


def test_a_gradient_less_parameter_viewed_as_another_dtype_makes_the_probes_miss() -> None:
    """A parameter without a gradient is described by its own dtype: its data viewed as
    another dtype of the same size (the same storage and shape) makes the probes and the
    full check miss, and the next call reads it (a fresh call would), with the numbers of
    the others right."""
    from test_steady_path import Chunk, megatron_like_config

    chunk = Chunk(megatron_like_config())
    chunk.c = nn.Parameter(torch.zeros(4, dtype=torch.float16))  # trained, no gradient this step
    chunks = [chunk]

    def refill() -> None:  # a and b only (Chunk.fill would give c a gradient too)
        chunk.a.main_grad.fill_(4.0)
        chunk.b.main_grad.fill_(8.0)

    for _ in range(3):
        refill()
        finalize_model_grads(chunks, num_tokens=torch.tensor(2))
    assert probes_hold(chunks, _finalize_call()) and full_check_passes(chunks, _finalize_call())
    chunk.c.data = chunk.c.data.view(torch.bfloat16)
    assert not probes_hold(chunks, _finalize_call()) and not full_check_passes(chunks, _finalize_call())
    refill()
    finalize_model_grads(chunks, num_tokens=torch.tensor(2))
    assert torch.equal(chunk.a.main_grad, torch.full((3,), 2.0))
    assert torch.equal(chunk.b.main_grad, torch.full((2, 2), 4.0))
    (_, found, _, _), = ModelState.of(chunks).found.values()
    assert [spec.dtype for spec in found.params if spec.name == "c"] == ["bfloat16"]
    refill()
    finalize_model_grads(chunks, num_tokens=torch.tensor(2))  # the full check, which writes the probes again
    assert probes_hold(chunks, _finalize_call())


def _tie(chunks: list[DDP], weight: str) -> list[str]:
    """Tie ``weight`` of the inner module as its word embedding (Megatron's
    ``share_embeddings_and_output_weights`` and getter); returns the getter's call log."""
    inner = chunks[0].module
    calls: list[str] = []

    def shared_embedding_or_output_weight() -> nn.Parameter:
        calls.append(inner.tied_name)
        return getattr(inner, inner.tied_name)

    inner.tied_name = weight
    inner.share_embeddings_and_output_weights = True
    inner.shared_embedding_or_output_weight = shared_embedding_or_output_weight
    return calls


#: Changes of the embedding roles alone (no parameter, flag or gradient changes): what only
#: finalize's plan reads (its embedding steps), never a seed helper's of the discovery.
ROLE_CHANGES: dict[str, Callable[[nn.Module], None]] = {
    "tied_to_another_weight": lambda inner: setattr(inner, "tied_name", "b"),
    "untied": lambda inner: setattr(inner, "share_embeddings_and_output_weights", False),
}


def _roles(chunks: list[DDP]) -> dict[str, Any]:
    """Each parameter's embedding role in the model state's last finalize plan's discovery."""
    (kind, last), = ((k, v) for k, v in ModelState.of(chunks).steady.items() if not k[0])
    return {spec.name: spec.role for spec in last.inputs.found.params}


def _helper_actions(chunks: list[DDP]) -> tuple[Any, ...]:
    return tuple(ModelState.of(chunks).steady[steady.call_kind(_helper_call(chunks)[1])].bound.plan.actions)


@pytest.mark.parametrize("change", list(ROLE_CHANGES))
def test_an_embedding_role_change_leaves_a_helpers_probes_and_reaches_the_next_finalize(change: str) -> None:
    """A seed helper's plan reads no embedding role (``meshgrad.steps.ROLE_STEPS``): after
    the tied weight moves or is untied, its probes and full check still hold, it does not
    call the model's getter (as Megatron's helper never does) and its plan is a fresh
    model's; finalize's probes and full check miss, its next call reads the getter again
    and plans with the new roles, as a fresh model's first call does."""
    live, fresh = model(), model()
    calls = _tie(live, "a")
    for n in (2, 4, 8):
        step(live, n)
        helper_step(live)
    helper, final = _helper_call(live), _finalize_call()
    assert probes_hold(live, helper) and probes_hold(live, final)
    roles = _roles(live)
    ROLE_CHANGES[change](live[0].module)
    _tie(fresh, "a")
    ROLE_CHANGES[change](fresh[0].module)
    assert probes_hold(live, helper) and full_check_passes(live, helper)
    assert not probes_hold(live, final) and not full_check_passes(live, final)
    before = len(calls)
    helper_step(live)
    helper_step(fresh)
    assert len(calls) == before, "the helper called the model's embedding getter"
    assert _helper_actions(live) == _helper_actions(fresh)
    step(live, 16)
    step(fresh, 16)
    assert len(calls) > before or change == "untied"  # untied: the getter is not asked (Megatron's rule)
    assert _roles(live) == _roles(fresh) != roles
    assert all(map(torch.equal, (p.main_grad for p in live[0].module.parameters()),
                   (p.main_grad for p in fresh[0].module.parameters())))
