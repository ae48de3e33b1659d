"""The steady call replayed (``torch_impl.call.replay``): from the third call of a kind
whose check stage found nothing per step but ``num_tokens``, the agree stage gets the last
call's plan, inputs and findings without the read and check stages; each input of those
findings is read again (``num_tokens`` checked as the check stage checks it), and a call
whose check stage has other work per step keeps the stages.

World of one rank (no process group): finalize's DP sync is counted and every gradient is
checked against its filled value after each call; the multi-rank twin (a change on one
rank while the others replay) is in ``tests/test_reliability_steps.py``.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from meshgrad import FinalizeConfig  # noqa: E402
from meshgrad.axes import Group  # noqa: E402
from meshgrad.plan import Step  # noqa: E402
from torch_impl import _allreduce_non_tensor_model_parallel_grads, finalize_model_grads, invalidate_plans  # noqa: E402
from torch_impl.call.model_state import ModelState  # noqa: E402
from torch_impl.call.read import Request  # noqa: E402
from test_steady_guard import DDP, Config, FILLER, Inner, step  # noqa: E402

pipeline = importlib.import_module("torch_impl.call.pipeline")
replay = importlib.import_module("torch_impl.call.replay")
steady = importlib.import_module("torch_impl.call.steady")


def model(**config: Any) -> list[DDP]:
    """A DDP chunk whose ``a`` is sequence-parallel (the non-TP helper's plan reduces it)."""
    inner = Inner()
    inner.a.sequence_parallel = True
    fields = {"calculate_per_token_loss": False, "qk_layernorm": False, **FILLER, **config}
    return [DDP(inner, Config(**fields))]


def finalize(chunks: list[DDP], **kwargs: Any) -> None:
    finalize_model_grads(chunks, **kwargs)


def helper(chunks: list[DDP], config: Any = None) -> None:
    _allreduce_non_tensor_model_parallel_grads(chunks, config if config is not None else chunks[0].config, None)


#: Each kind of call: (the call, its group source and request as the pipeline sees them).
KINDS: dict[str, tuple[Callable[[list[DDP]], None], Callable[[list[DDP]], tuple[Any, Request]]]] = {
    "finalize": (finalize, lambda chunks: (None, Request())),
    "non-TP helper": (helper, lambda chunks: (
        {Group.TP: None}, Request(steps=(Step.NON_TP,), config=chunks[0].config, over=(Group.TP,)))),
}


@pytest.fixture
def stages(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How many times the read stage's steady check and the check stage ran."""
    counts = {"steady_read": 0, "check_call": 0}
    for name in counts:
        real = getattr(pipeline, name)

        def counted(*args: Any, _real: Any = real, _name: str = name) -> Any:
            counts[_name] += 1
            return _real(*args)

        monkeypatch.setattr(pipeline, name, counted)
    return counts


def checked_call(chunks: list[DDP], call: Callable[[list[DDP]], None], finalize_call: bool) -> None:
    """``call`` on freshly filled gradients: each unchanged (a world of one), one DP sync
    per chunk for finalize."""
    syncs = [c.syncs for c in chunks]
    for c in chunks:
        c.fill()
    want = [p.main_grad.clone() for c in chunks for p in c.module.parameters()]
    call(chunks)
    assert all(torch.equal(p.main_grad, w) for p, w in zip((p for c in chunks for p in c.module.parameters()), want))
    assert [c.syncs for c in chunks] == [s + int(finalize_call) for s in syncs]


def is_replayed(chunks: list[DDP], kind: str) -> bool:
    source, request = KINDS[kind][1](chunks)
    return replay.replayed(chunks, source, request) is not None


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_third_call_of_a_kind_is_replayed(stages: dict[str, int], kind: str) -> None:
    chunks = model()
    call = KINDS[kind][0]
    for expected in ({"steady_read": 1, "check_call": 1}, {"steady_read": 2, "check_call": 2}):
        checked_call(chunks, call, kind == "finalize")
        assert stages == expected  # the first call reads, the second takes the steady path
    assert is_replayed(chunks, kind)
    for _ in range(3):
        checked_call(chunks, call, kind == "finalize")
    assert stages == {"steady_read": 2, "check_call": 2}  # replayed: neither stage ran again
    state = ModelState.of(chunks)
    (kept,) = state.replays.values()
    assert kept.last is next(iter(state.steady.values())) and kept.findings.error is None
    assert kept.findings.round_due and not kept.findings.compare  # the status round runs on every call


def _tokens_compared(chunks: list[DDP]) -> None:
    next(iter(ModelState.of(chunks).replays.values())).findings.record.tokens = (torch.int64, 1, torch.device("cpu"))


def _not_consistent(chunks: list[DDP]) -> None:
    next(iter(ModelState.of(chunks).replays.values())).findings.record.consistent = False


def _record_dropped(chunks: list[DDP]) -> None:
    ModelState.of(chunks).plan_memo.records.clear()


def _inference_tensor(chunks: list[DDP]) -> None:
    next(iter(ModelState.of(chunks).replays.values())).findings.record.inference_tensor = "module.a"


def _record_of_another_discovery(chunks: list[DDP]) -> None:
    next(iter(ModelState.of(chunks).replays.values())).findings.record.found = object()


def _record_of_another_plan(chunks: list[DDP]) -> None:
    records = ModelState.of(chunks).plan_memo.records
    for key, (_, record) in list(records.items()):
        records[key] = (object(), record)  # the same record, kept for another plan at that key


def _last_call_of_another_plan(chunks: list[DDP]) -> None:
    calls = ModelState.of(chunks).last_calls
    for entry, (_, tokens) in list(calls.items()):
        calls[entry] = (object(), tokens)


def _flag_cleared(chunks: list[DDP]) -> None:
    chunks[0].module.a.sequence_parallel = False  # the plan reduces a no more


def _grad_replaced(chunks: list[DDP]) -> None:
    chunks[0].module.a.main_grad = torch.zeros(3)


#: Changes after which the next call is not replayed, each with what the stages then
#: raise (None: the call goes on with a fresh model's plan).
CHANGES: dict[str, tuple[Callable[[list[DDP]], None], str | None]] = {
    "another kind of num_tokens compared on the plan": (_tokens_compared, None),
    "the plan's consistency not established": (_not_consistent, None),
    "the plan's record dropped": (_record_dropped, None),
    "the plan's record kept for another discovery": (_record_of_another_discovery, None),
    "the record's key holding another plan": (_record_of_another_plan, None),
    "the entry point's last call of another plan": (_last_call_of_another_plan, None),
    "an inference tensor found on the plan": (_inference_tensor, "module.a was made under torch.inference_mode()"),
    "a watched flag cleared": (_flag_cleared, None),
    "a watched gradient replaced": (_grad_replaced, None),
    "invalidate_plans": (invalidate_plans, None),
}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("change", list(CHANGES))
def test_each_input_of_the_replay_is_read_again(stages: dict[str, int], kind: str, change: str) -> None:
    chunks, fresh = model(), model()
    call = KINDS[kind][0]
    for _ in range(3):
        checked_call(chunks, call, kind == "finalize")
    assert is_replayed(chunks, kind)
    make, refused = CHANGES[change]
    make(chunks)
    if change in ("a watched flag cleared", "a watched gradient replaced"):
        make(fresh)
    assert not is_replayed(chunks, kind)
    before = dict(stages)
    if refused is not None:  # the check stage refuses, before anything changes
        grads = [p.main_grad.clone() for p in chunks[0].module.parameters()]
        with pytest.raises(ValueError, match=refused):
            call(chunks)
        assert all(torch.equal(p.main_grad, g) for p, g in zip(chunks[0].module.parameters(), grads))
        assert stages["check_call"] == before["check_call"] + 1 and not is_replayed(chunks, kind)
        return
    checked_call(chunks, call, kind == "finalize")
    assert stages["check_call"] == before["check_call"] + 1  # the stages ran
    checked_call(fresh, call, kind == "finalize")
    state, fresh_state = ModelState.of(chunks), ModelState.of(fresh)
    (last,), (fresh_last,) = state.steady.values(), fresh_state.steady.values()
    assert last.bound.plan.actions == fresh_last.bound.plan.actions  # the plan a fresh model gets
    record = state.plan_memo.record(last.bound)
    assert record.consistent and record.tokens is None and record.inference_tensor is None
    for _ in range(2):
        checked_call(chunks, call, kind == "finalize")
    assert is_replayed(chunks, kind)  # kept again once its call had nothing to check


def test_a_capture_takes_the_stages(stages: dict[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    chunks = model()
    for _ in range(3):
        checked_call(chunks, finalize, True)
    assert is_replayed(chunks, "finalize")
    monkeypatch.setattr(replay, "capturing", lambda: True)
    assert not is_replayed(chunks, "finalize")
    monkeypatch.setattr(replay, "capturing", lambda: False)
    assert is_replayed(chunks, "finalize")


def test_another_chunk_list_or_config_object_takes_the_stages(stages: dict[str, int]) -> None:
    chunks = model()
    for _ in range(3):
        checked_call(chunks, helper, False)
    assert is_replayed(chunks, "non-TP helper")
    other = Config(**vars(chunks[0].config))  # equal values, another object
    source, request = KINDS["non-TP helper"][1](chunks)
    assert replay.replayed(chunks, source, request._replace(config=other)) is None
    assert replay.replayed(chunks + model(), source, request) is None
    assert replay.replayed((c for c in chunks), source, request) is None  # a generator: the stages raise
    assert replay.replayed(tuple(chunks), source, request) is not None  # the same chunks as a tuple
    before = stages["check_call"]
    checked_call(chunks, lambda c: helper(c, other), False)
    assert stages["check_call"] == before + 1


#: Calls whose check stage has work on every call: no replay is kept for them.
EVERY_STEP = FinalizeConfig(consistency_check="every_step")
PER_STEP: dict[str, tuple[dict[str, Any], Callable[[list[DDP]], None]]] = {
    "check_for_nan_in_grad": ({"check_for_nan_in_grad": True}, finalize),
    "consistency_check='every_step'": ({}, lambda c: helper(c, EVERY_STEP)),
}


@pytest.mark.parametrize("case", list(PER_STEP))
def test_no_replay_is_kept_where_the_check_stage_has_work_per_step(stages: dict[str, int], case: str) -> None:
    config, call = PER_STEP[case]
    chunks = model(**config)
    for _ in range(4):
        for c in chunks:
            c.fill()
        call(chunks)
    assert not ModelState.of(chunks).replays
    assert stages == {"steady_read": 4, "check_call": 4}


def test_consistency_check_off_replays_without_a_round(stages: dict[str, int]) -> None:
    chunks = model()
    off = FinalizeConfig(consistency_check="off")
    for _ in range(4):
        checked_call(chunks, lambda c: helper(c, off), False)
    assert stages["check_call"] == 2
    (kept,) = ModelState.of(chunks).replays.values()
    assert not kept.findings.round_due


def tokens_replayed(chunks: list[DDP], num_tokens: Any) -> bool:
    return replay.replayed(chunks, None, Request(num_tokens=num_tokens)) is not None


def as_left_by_step(chunks: list[DDP], n: int) -> bool:
    """Whether the gradients hold what :func:`step` with ``n`` left them (each filled value / n)."""
    grads = [p.main_grad for p in chunks[0].module.parameters()]
    return all(torch.equal(g, torch.full_like(g, float(4 * (i + 1)) / n)) for i, g in enumerate(grads))


def test_a_call_with_num_tokens_is_replayed_and_scaled(stages: dict[str, int]) -> None:
    chunks = model(calculate_per_token_loss=True)
    for _ in range(2):
        step(chunks, 4)
    assert stages == {"steady_read": 2, "check_call": 2}
    assert tokens_replayed(chunks, torch.tensor(4)) and not tokens_replayed(chunks, None)
    for n in (4, 8, 2):  # another count of the same kind: replayed, scaled by it
        step(chunks, n)
    assert stages == {"steady_read": 2, "check_call": 2}
    (kept,) = ModelState.of(chunks).replays.values()
    assert kept.findings.tokens == (torch.int64, 1, torch.device("cpu")) and not kept.findings.compare
    given = torch.tensor(8)
    finalize(chunks, num_tokens=given)
    assert given.item() == 8  # holds the global count (a world of one: its own)


def test_num_tokens_of_another_kind_takes_the_stages_and_is_compared(stages: dict[str, int]) -> None:
    chunks = model(calculate_per_token_loss=True)
    for _ in range(3):
        step(chunks, 4)
    assert not tokens_replayed(chunks, torch.tensor(4.0))  # float32: another kind
    before = stages["check_call"]
    for c in chunks:
        c.fill()
    want = [p.main_grad / 4 for p in chunks[0].module.parameters()]
    finalize(chunks, num_tokens=torch.tensor(4.0))
    assert all(torch.equal(p.main_grad, w) for p, w in zip(chunks[0].module.parameters(), want))
    assert stages["check_call"] == before + 1
    state = ModelState.of(chunks)
    record = state.plan_memo.record(next(iter(state.steady.values())).bound)
    assert record.tokens == (torch.float32, 1, torch.device("cpu"))  # compared in the round, then kept
    assert not tokens_replayed(chunks, torch.tensor(4))  # the int64 kind is compared again
    finalize(chunks, num_tokens=torch.tensor(4.0))
    assert tokens_replayed(chunks, torch.tensor(4.0))


def test_num_tokens_is_judged_again_where_the_record_moved(stages: dict[str, int]) -> None:
    """The replay skips the num_tokens check's judgement only for the kind, device and route
    the kept call passed it with; the record's device read again decides."""
    chunks = model(calculate_per_token_loss=True)
    for _ in range(3):
        step(chunks, 4)
    (kept,) = ModelState.of(chunks).replays.values()
    record = kept.findings.record
    device = record.device  # None: the DDP syncs every gradient, the plan reads none
    assert kept.judged == ((torch.int64, 1, torch.device("cpu")), device, False)
    record.device = torch.device("meta")  # as if the gradients were elsewhere: a CPU num_tokens fails
    assert not tokens_replayed(chunks, torch.tensor(4))
    record.device, record.nccl = device, True  # the NCCL route needs a CUDA num_tokens
    assert not tokens_replayed(chunks, torch.tensor(4))
    record.nccl = False
    assert tokens_replayed(chunks, torch.tensor(4))
    step(chunks, 8)  # and the numbers of the replayed call
    assert stages["check_call"] == 2


#: num_tokens a replayable call refuses as the check stage does: (value, error, text).
BAD_TOKENS: dict[str, tuple[Any, type, str]] = {
    "two elements": (torch.tensor([4, 4]), TypeError, "one-element tensor"),
    "a Python int": (4, TypeError, "one-element tensor"),
    "bool": (torch.tensor(True), TypeError, "integer or floating tensor"),
    "complex": (torch.tensor(4 + 0j), TypeError, "integer or floating tensor"),
    "on the meta device": (torch.empty((), dtype=torch.int64, device="meta"), ValueError, "meta device"),
}


@pytest.mark.parametrize("mode", ["once", "off"])  # off: no round, its kind not compared
@pytest.mark.parametrize("case", list(BAD_TOKENS))
def test_a_bad_num_tokens_on_a_replayable_call_raises_as_the_stages_do(stages: dict[str, int], case: str,
                                                                      mode: str) -> None:
    value, error, text = BAD_TOKENS[case]
    config = {"calculate_per_token_loss": True, "consistency_check": mode}
    chunks, fresh = model(**config), model(**config)
    for _ in range(3):
        step(chunks, 4)
    assert tokens_replayed(chunks, torch.tensor(4)) and not tokens_replayed(chunks, value)
    with pytest.raises(error, match=text) as live:
        finalize(chunks, num_tokens=value)
    assert stages["check_call"] == 3  # the stages ran, and refused
    with pytest.raises(error) as first:
        finalize(fresh, num_tokens=value)
    assert str(live.value) == str(first.value)  # the first call's own refusal
    assert as_left_by_step(chunks, 4)  # untouched
    assert chunks[0].syncs == 3
    step(chunks, 2)  # the next good call: right numbers, and replayed again after it
    assert tokens_replayed(chunks, torch.tensor(4))


def test_a_ddp_chunk_that_loses_scale_gradients_is_refused_on_a_replayable_call(
        stages: dict[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    chunks = model(calculate_per_token_loss=True)
    for _ in range(3):
        step(chunks, 4)
    assert tokens_replayed(chunks, torch.tensor(4))
    monkeypatch.delattr(DDP, "scale_gradients")  # the class, which no probe reads: the replay's own check
    assert not tokens_replayed(chunks, torch.tensor(4))
    with pytest.raises(TypeError, match="has finish_grad_sync but no scale_gradients"):
        finalize(chunks, num_tokens=torch.tensor(4))
    assert stages["check_call"] == 3 and chunks[0].syncs == 3  # the stages refused; no sync ran
    assert as_left_by_step(chunks, 4)  # untouched


def test_a_finalize_call_that_switches_kind_compares_and_is_not_replayed(stages: dict[str, int],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[bool] = []
    real = pipeline.agree_call

    def agree(findings: Any, *args: Any) -> Any:
        compared.append(findings.compare)
        return real(findings, *args)

    monkeypatch.setattr(pipeline, "agree_call", agree)
    chunks = model(calculate_per_token_loss=True)
    for _ in range(3):
        step(chunks, 4)
    for _ in range(3):
        checked_call(chunks, finalize, True)
    assert compared == [True, False, False, True, False, False]  # each kind's first call, the switch
    assert tokens_replayed(chunks, None) and not tokens_replayed(chunks, torch.tensor(4))  # a switch compares
    step(chunks, 4)  # back to num_tokens: compared again, by the stages, with the right numbers
    assert compared[-1] is True and stages["check_call"] == 5
    step(chunks, 4)
    assert compared[-1] is False and tokens_replayed(chunks, torch.tensor(4))


#: The distinct functions of torch_impl and meshgrad a replayed finalize with num_tokens
#: enters in this world of one, its count another than the last call's (a new host factor;
#: ``sys.setprofile``; torch's and Python's own not counted).
#: Each is a few microseconds of cold memory per step inside a distributed world
#: (docs/performance.md, "Thirteen functions fewer per steady call"): a change that adds
#: one to the steady path raises this bound on purpose, or writes the call out.
STEADY_FUNCTIONS = 34


def test_a_replayed_call_enters_no_more_of_our_functions_than_counted(stages: dict[str, int]) -> None:
    import meshgrad
    import torch_impl

    chunks = model(calculate_per_token_loss=True)
    for _ in range(3):
        step(chunks, 4)
    roots = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch_impl, meshgrad))
    entered: dict[Any, int] = {}

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(roots):
            entered[frame.f_code] = entered.get(frame.f_code, 0) + 1

    for c in chunks:
        c.fill()
    want = [p.main_grad / 8 for p in chunks[0].module.parameters()]
    sys.setprofile(profile)
    try:
        finalize(chunks, num_tokens=torch.tensor(8))
    finally:
        sys.setprofile(None)
    assert stages["check_call"] == 2  # replayed
    assert all(torch.equal(p.main_grad, w) for p, w in zip(chunks[0].module.parameters(), want))
    names = sorted(f"{os.path.basename(code.co_filename)}:{code.co_name}" for code in entered)
    assert len(entered) <= STEADY_FUNCTIONS, names
    assert {"replay.py:replayed", "status.py:status_round", "scaling.py:scale"} <= set(names), names


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_written_out_chunk_and_kind_reads_refuse_what_their_functions_refuse(kind: str) -> None:
    """``replayed`` writes out ``read.chunks_of``, ``ModelState.existing`` and
    ``steady.call_kind``: the same chunks in another container replay, any other model
    (an empty list, a chunk more, a non-module, an iterator, nothing) does not, and the
    written-out kind is ``call_kind``'s for every field it reads, each field changed
    finding no replay."""
    chunks = model()
    for _ in range(3):
        checked_call(chunks, KINDS[kind][0], kind == "finalize")
    source, request = KINDS[kind][1](chunks)
    for same in (chunks, tuple(chunks), chunks[0]):
        assert replay.replayed(same, source, request) is not None
    for other in ([], [*chunks, chunks[0]], [*chunks, object()], [object()], iter(chunks), None, object()):
        assert replay.replayed(other, source, request) is None
    changed = {
        "steps": (Step.NON_TP, Step.DP_SYNC), "merge_ddp_config": False, "config_default": True,
        "per_token_loss": True, "num_tokens": torch.tensor(3), "force_all_reduce": True, "over": (Group.DP_CP,),
    }
    for field, value in changed.items():
        other = request._replace(**{field: value})
        assert (*steady.KIND_FIELDS(other), other.num_tokens is None, None) == steady.call_kind(other), field
        assert steady.call_kind(other) != steady.call_kind(request), field
        assert replay.replayed(chunks, source, other) is None, field
