"""The call pipeline's rules, held on every rank of a gloo world of 4:

- anything raised while a call reads the user's objects (a user method such as
  ``shared_embedding_or_output_weight()`` raising ``RuntimeError`` or
  ``KeyboardInterrupt``; a bad config value) on one rank is held for the status round:
  that rank raises its own exception, its peers a ``ConsistencyError`` naming it, promptly,
  and the next call works (the numbers of a fresh call);
- one kind of cross-rank round: a DeviceMesh expert layout changed on one rank after
  step 1 is found in the status round (no rank waits in another kind of round);
- a parameter replaced by one of another shape (``param.data = ...``) between steps is
  seen (the cached call behaves like a fresh one);
- finalize entered on some ranks only: the others raise the documented
  ``CollectiveError`` naming the round, within the process-group timeout;
- the embedding roles changed between steady steps (the tied weight moved to another
  parameter, or untied): the non-TP seed helper, whose plan reads no role, keeps its probes
  and does not call the model's getter (Megatron's helper never does); the finalize call
  after it reads the change; both give a fresh model's numbers.
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable, Sequence
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from parity_tests.scenarios import make_rank_inputs  # noqa: E402
from parity_tests.torch_world import device_mesh, load_inputs  # noqa: E402
from parity_tests.world_cases import case_values, local_cases, run_cases  # noqa: E402
from meshgrad.axes import Group  # noqa: E402
from meshgrad.plan import Step  # noqa: E402
from test_reliability_inputs import (  # noqa: E402
    DP_TP, LINEAR, PP_TP, TIMEOUT, kind_of, load_in_place, param, setup_model, snapshot, timed_collection,
)
from test_reliability_steps import STEADY, live_vs_fresh, replay_answers  # noqa: E402
from test_steady_watched import probes_hold  # noqa: E402
from torch_impl import _allreduce_non_tensor_model_parallel_grads, finalize_model_grads  # noqa: E402
from torch_impl.call.read import Request  # noqa: E402

WORLD = 4
SHORT = 4.0  # the process-group timeout of the groups of the last case
_MESHES: dict[Any, Any] = {}  # per worker process


def attempt_any(model: Sequence[Any], call: Callable[[Sequence[Any]], Any]) -> tuple[str, str, bool, float]:
    """(error type or "ok", message, everything bit-identical afterwards, seconds); catches
    every exception, KeyboardInterrupt included."""
    before = snapshot(model)
    start = time.monotonic()
    try:
        call(model)
        kind, message = "ok", ""
    except BaseException as err:  # noqa: BLE001 -- recorded; the parent checks type and text
        kind, message = kind_of(err), str(err)
    return kind, message, snapshot(model) == before, time.monotonic() - start


def _finalize(groups: Any, num_tokens: float | None = None) -> Callable[[Sequence[Any]], None]:
    """Finalize over ``groups``, with a fresh ``num_tokens`` tensor of that count per call
    (finalize writes the global count back into it), or none."""
    if num_tokens is None:
        return lambda m: finalize_model_grads(m, pg_collection=groups)
    return lambda m: finalize_model_grads(m, num_tokens=torch.tensor(num_tokens), pg_collection=groups)


def _recovers(rank: int, scenario: Any, groups: Any, model: list[Any], undo: Callable[[], None],
              call: Callable[[Sequence[Any]], None] | None = None) -> bool:
    """After the failed call and ``undo()``: the next ``call`` (finalize without num_tokens
    by default) gives a fresh model's numbers."""
    call = call or _finalize(groups)
    undo()
    call(model)
    fresh = setup_model(scenario, rank)
    call(fresh)
    return snapshot(model) == snapshot(fresh)


def _steady_steps(model: list[Any], scenario: Any, data: Any, call: Callable[[Sequence[Any]], None]) -> None:
    """STEADY calls of ``call``, each on ``data`` copied into the held gradient tensors,
    then ``data`` copied in once more for the call that follows."""
    for _ in range(STEADY):
        load_in_place(model, scenario, data)
        call(model)
    load_in_place(model, scenario, data)


def _user_method_raises(rank: int, error: BaseException) -> tuple:
    groups = timed_collection(PP_TP)
    model = setup_model(PP_TP, rank)
    inner = model[0]
    if rank == 1:
        def broken() -> Any:
            raise error

        inner.__dict__["shared_embedding_or_output_weight"] = broken
    outcome = attempt_any(model, _finalize(groups))
    recovered = _recovers(rank, PP_TP, groups, model, lambda: inner.__dict__.pop("shared_embedding_or_output_weight", None))
    return (*outcome, recovered)


def case_user_method_raises_runtime_error(rank: int, world: int) -> tuple:
    return _user_method_raises(rank, RuntimeError("the user's method failed"))


def case_user_method_raises_keyboard_interrupt(rank: int, world: int) -> tuple:
    return _user_method_raises(rank, KeyboardInterrupt("interrupted in the user's method"))


class _Config(types.SimpleNamespace):
    """A Megatron-like config of a class of its own (so that it can become
    :class:`_Interrupting` and back)."""


class _Interrupting(_Config):
    """A config whose ``calculate_per_token_loss`` raises KeyboardInterrupt when read."""

    @property
    def calculate_per_token_loss(self) -> bool:
        raise KeyboardInterrupt("interrupted while a replayed call read the config")


def case_replayed_call_interrupted_reading_the_config(rank: int, world: int) -> tuple:
    """After STEADY finalize calls without num_tokens (replayed from the third), rank 1's
    config raises KeyboardInterrupt when the replay reads it again: (attempt, the next call
    after the config is restored gives a fresh call's numbers, the call before was replayed
    on this rank)."""
    groups = timed_collection(PP_TP)
    model = setup_model(PP_TP, rank)
    # Many attributes, as a Megatron config has: the fields it is read for are read by name.
    config = _Config(**vars(model[0].config), **{f"unread_{i}": i for i in range(60)})
    for chunk in model:
        chunk.config = getattr(chunk, "module", chunk).config = config
    data = make_rank_inputs(PP_TP, rank)
    _steady_steps(model, PP_TP, data, _finalize(groups))
    replayed = replay_answers(model, groups)
    if rank == 1:
        config.__class__ = _Interrupting
    outcome = attempt_any(model, _finalize(groups))

    def undo() -> None:
        config.__class__ = _Config
        load_in_place(model, PP_TP, data)

    return (*outcome, _recovers(rank, PP_TP, groups, model, undo), replayed)


BAD_CONFIG = {
    # case: (field, value on rank 2, its error type)
    "case_bad_config_consistency_check": ("consistency_check", "sometimes", "ValueError"),
    "case_bad_config_nan_flag": ("check_for_nan_in_grad", "yes", "TypeError"),
    "case_bad_config_tp_size": ("tensor_model_parallel_size", 2.5, "ValueError"),
    "case_bad_config_bias_rate": ("moe_router_bias_update_rate", "fast", "TypeError"),
}


def _bad_config_case(name: str) -> Callable[[int, int], tuple]:
    field, value, _ = BAD_CONFIG[name]

    def case(rank: int, world: int) -> tuple:
        groups = timed_collection(DP_TP)
        model = setup_model(DP_TP, rank, {field: value} if rank == 2 else None)
        outcome = attempt_any(model, _finalize(groups))
        good = setup_model(DP_TP, rank)
        return (*outcome, _recovers(rank, DP_TP, groups, good, lambda: None))

    return case


for _name in BAD_CONFIG:
    globals()[_name] = _bad_config_case(_name)


def case_mesh_expert_layout_changed_on_one_rank(rank: int, world: int) -> tuple:
    mesh = device_mesh(DP_TP, _MESHES)
    model = setup_model(DP_TP, rank)
    _finalize(mesh)(model)  # step 1: every rank ep=2
    load_inputs(model, DP_TP, make_rank_inputs(DP_TP, rank))
    config = model[0].config
    if rank == 0:
        config.expert_model_parallel_size = 1
    outcome = attempt_any(model, _finalize(mesh))

    def undo() -> None:
        config.expert_model_parallel_size = 2

    return (*outcome, _recovers(rank, DP_TP, mesh, model, undo))


def case_mesh_expert_layout_switched_back_on_one_rank(rank: int, world: int) -> tuple:
    """Every rank uses ep=2, then ep=1 (both layouts resolved); rank 0 alone goes back to
    ep=2, a layout it already has groups for: it must still meet its peers' round."""
    mesh = device_mesh(DP_TP, _MESHES)
    model = setup_model(DP_TP, rank)
    config = model[0].config
    _finalize(mesh)(model)  # ep=2
    config.expert_model_parallel_size = 1
    load_inputs(model, DP_TP, make_rank_inputs(DP_TP, rank))
    _finalize(mesh)(model)  # ep=1 everywhere
    load_inputs(model, DP_TP, make_rank_inputs(DP_TP, rank))
    if rank == 0:
        config.expert_model_parallel_size = 2
    outcome = attempt_any(model, _finalize(mesh))

    def undo() -> None:  # every rank back to ep=2, the scenario's (a fresh model's) layout
        config.expert_model_parallel_size = 2

    return (*outcome, _recovers(rank, DP_TP, mesh, model, undo))


def _param_data_of_another_shape(model: list[Any], rank: int) -> None:
    param(model, LINEAR).data = torch.zeros(5, 4)  # its gradient left as it was


def case_param_data_of_another_shape_after_step1(rank: int, world: int) -> tuple:
    return live_vs_fresh(rank, _param_data_of_another_shape)


def case_param_data_of_another_shape_after_steady_steps(rank: int, world: int) -> tuple:
    return live_vs_fresh(rank, _param_data_of_another_shape, warm=STEADY)


#: Changes of the embedding roles alone, on every chunk of every rank: which weight is tied.
ROLE_CHANGES: dict[str, Callable[[Any], None]] = {
    "tied to another weight": lambda chunk: setattr(chunk, "_word", "decoder.layers.0.mlp.linear_fc1.weight"),
    "untied": lambda chunk: setattr(chunk, "share_embeddings_and_output_weights", False),
}


def _counted_getter(model: list[Any]) -> list[int]:
    """Each chunk's ``shared_embedding_or_output_weight()`` logged (one entry per call)."""
    calls: list[int] = []
    for chunk in model:
        def counted(getter: Callable[[], Any] = chunk.shared_embedding_or_output_weight) -> Any:
            calls.append(1)
            return getter()

        chunk.__dict__["shared_embedding_or_output_weight"] = counted
    return calls


def _roles_changed(rank: int, change: str) -> tuple:
    """(helper's gradients == a fresh model's, finalize's == a fresh model's, != the
    unchanged model's, the helper's probes answered after the change, finalize's missed,
    getter calls during the helper call): the non-TP helper then finalize, STEADY times,
    then ``change`` on every rank and both calls once more, next to a fresh model given the
    same change and an unchanged one."""
    groups = timed_collection(PP_TP)
    models = [setup_model(PP_TP, rank) for _ in range(3)]  # live, fresh, unchanged
    logs = [_counted_getter(m) for m in models]
    live, fresh, unchanged = models
    data = make_rank_inputs(PP_TP, rank)
    helper = ({Group.TP: groups.tp}, Request(steps=(Step.NON_TP,), config=live[0].config, over=(Group.TP,)))

    def step(model: list[Any]) -> Any:
        load_in_place(model, PP_TP, data)
        _allreduce_non_tensor_model_parallel_grads(model, model[0].config, groups.tp)
        after_helper = snapshot(model)
        _finalize(groups)(model)
        return after_helper

    for _ in range(STEADY):
        step(live)
    for model in (live, fresh):
        for chunk in model:
            ROLE_CHANGES[change](chunk)
    probed = probes_hold(live, helper)
    missed = not probes_hold(live, (groups, Request()))
    before = len(logs[0])
    load_in_place(live, PP_TP, data)
    _allreduce_non_tensor_model_parallel_grads(live, live[0].config, groups.tp)
    in_helper = len(logs[0]) - before
    live_helper = snapshot(live)
    _finalize(groups)(live)
    fresh_helper = step(fresh)
    step(unchanged)
    return (live_helper == fresh_helper, snapshot(live) == snapshot(fresh), snapshot(live) != snapshot(unchanged),
            probed, missed, in_helper)


def case_roles_changed_tied_to_another_weight(rank: int, world: int) -> tuple:
    return _roles_changed(rank, "tied to another weight")


def case_roles_changed_untied(rank: int, world: int) -> tuple:
    return _roles_changed(rank, "untied")


def case_num_tokens_dtype_differs_on_rank0(rank: int, world: int) -> tuple:
    groups = timed_collection(DP_TP)
    model = setup_model(DP_TP, rank)
    tokens = torch.tensor(6.0, dtype=torch.float16 if rank == 0 else torch.float32)
    outcome = attempt_any(model, lambda m: finalize_model_grads(m, num_tokens=tokens, pg_collection=groups))
    unchanged = tokens.item() == 6.0
    fresh = setup_model(DP_TP, rank)
    finalize_model_grads(model, num_tokens=torch.tensor(6.0), pg_collection=groups)
    finalize_model_grads(fresh, num_tokens=torch.tensor(6.0), pg_collection=groups)
    return (*outcome, unchanged and snapshot(model) == snapshot(fresh))


def case_num_tokens_nan_on_rank1_checked(rank: int, world: int) -> tuple:
    groups = timed_collection(DP_TP)
    model = setup_model(DP_TP, rank, {"check_for_nan_in_grad": True})
    tokens = torch.tensor(float("nan") if rank == 1 else 6.0)
    outcome = attempt_any(model, lambda m: finalize_model_grads(m, num_tokens=tokens, pg_collection=groups))
    same = (tokens.isnan() if rank == 1 else tokens == 6.0).item()
    return (*outcome, bool(same))


#: A bad num_tokens on one rank after replayed steps: (the rank, its num_tokens).
REPLAYED_TOKENS = {
    "case_replayed_num_tokens_float16_on_rank0": (0, torch.tensor(6.0, dtype=torch.float16)),
    "case_replayed_num_tokens_of_two_elements_on_rank2": (2, torch.tensor([6.0, 6.0])),
}


def _replayed_bad_tokens(rank: int, bad: int, wrong: Any) -> tuple:
    """After STEADY finalize calls with a float32 num_tokens (replayed from the third), rank
    ``bad`` passes ``wrong``: (attempt, this rank's num_tokens unchanged, the next good call
    gives a fresh call's numbers, the call before was replayed on this rank)."""
    groups = timed_collection(DP_TP)
    model = setup_model(DP_TP, rank)
    data = make_rank_inputs(DP_TP, rank)

    call = _finalize(groups, 6.0)
    _steady_steps(model, DP_TP, data, call)
    replayed = replay_answers(model, groups, torch.tensor(6.0))
    given = wrong if rank == bad else torch.tensor(6.0)
    tokens = given.clone()
    outcome = attempt_any(model, lambda m: finalize_model_grads(m, num_tokens=tokens, pg_collection=groups))
    unchanged = torch.equal(tokens, given)
    recovered = _recovers(rank, DP_TP, groups, model, lambda: load_in_place(model, DP_TP, data), call)
    return (*outcome, unchanged and recovered, replayed)


def case_replayed_num_tokens_on_rank0_only(rank: int, world: int) -> tuple:
    """After STEADY finalize calls with num_tokens and STEADY without (each kind replayed
    from its third, each compared alone on its first), rank 0 passes num_tokens and the
    others none: (attempt, the next good call gives a fresh call's numbers, the call
    without num_tokens replayed before it on this rank)."""
    groups = timed_collection(DP_TP)
    model = setup_model(DP_TP, rank)
    data = make_rank_inputs(DP_TP, rank)
    for tokens in (6.0, None):
        _steady_steps(model, DP_TP, data, _finalize(groups, tokens))
    replayed = replay_answers(model, groups)
    outcome = attempt_any(model, _finalize(groups, 6.0 if rank == 0 else None))
    return (*outcome, _recovers(rank, DP_TP, groups, model, lambda: load_in_place(model, DP_TP, data)), replayed)


def case_helper_plan_switched_on_rank0_only(rank: int, world: int) -> tuple:
    """The non-TP seed helper, STEADY steps with ``sequence_parallel`` set on a linear
    weight (the helper reduces it over tp) and STEADY with it cleared (each plan compared
    alone on its first call), then the flag set on rank 0 only: (attempt, the next call with
    the flag cleared everywhere gives a fresh model's numbers)."""
    groups = timed_collection(DP_TP)
    model = setup_model(DP_TP, rank)
    data = make_rank_inputs(DP_TP, rank)
    weight = param(model, LINEAR)

    def helper(chunks: Sequence[Any]) -> None:
        _allreduce_non_tensor_model_parallel_grads(chunks, getattr(chunks[0], "module", chunks[0]).config, groups.tp)

    for flag in (True, False):
        weight.sequence_parallel = flag
        _steady_steps(model, DP_TP, data, helper)
    weight.sequence_parallel = rank == 0
    outcome = attempt_any(model, helper)

    def undo() -> None:
        weight.sequence_parallel = False
        load_in_place(model, DP_TP, data)

    return (*outcome, _recovers(rank, DP_TP, groups, model, undo, helper))


for _name, (_bad, _wrong) in REPLAYED_TOKENS.items():
    globals()[_name] = lambda rank, world, _b=_bad, _w=_wrong: _replayed_bad_tokens(rank, _b, _w)


def case_zz_finalize_entered_on_some_ranks_only(rank: int, world: int) -> tuple:
    groups = timed_collection(DP_TP, timeout=SHORT)
    model = setup_model(DP_TP, rank)
    if rank == 3:
        time.sleep(SHORT * 2.5)  # never enters finalize; its peers' round times out
        return ("skipped", "", True, 0.0)
    return attempt_any(model, _finalize(groups))


CASES = local_cases(globals())


# =========================================================================== parent


@pytest.fixture(scope="module")
def world() -> dict[str, list[tuple[str, Any]]]:
    return run_cases(__name__, CASES, WORLD, timeout=300)


@pytest.mark.parametrize(
    "name,kind", [("case_user_method_raises_runtime_error", "RuntimeError"),
                  ("case_user_method_raises_keyboard_interrupt", "KeyboardInterrupt")]
)
def test_an_exception_in_a_user_method_on_one_rank_raises_on_every_rank(world, reliability, name, kind):
    slowest = 0.0
    for rank, (got, message, untouched, seconds, recovered) in enumerate(case_values(world, name)):
        assert untouched, (name, rank, "gradients changed")
        assert recovered, (name, rank, "the next call did not give a fresh call's numbers")
        assert seconds < TIMEOUT / 2, (name, rank, seconds)
        slowest = max(slowest, seconds)
        if rank == 1:
            assert got == kind and "the user's method failed" in message or "interrupted" in message, (rank, got, message)
        else:
            assert got == "ConsistencyError" and "rank 1 failed its own checks" in message, (rank, got, message)
            assert kind in message, (rank, message)
    reliability("bad input", f"a user method finalize calls raises {kind} on rank 1 only [4 ranks]",
                f"{kind} there, ConsistencyError naming it elsewhere, after <= {slowest:.2f} s; "
                "nothing changed; the next call gives a fresh call's numbers")


def test_an_interrupt_while_a_replayed_call_reads_is_held_for_the_round(world, reliability):
    slowest = 0.0
    for rank, (got, message, untouched, seconds, recovered, replayed) in enumerate(
        case_values(world, "case_replayed_call_interrupted_reading_the_config")
    ):
        assert replayed, (rank, "the call before the interrupt was not replayed")
        assert untouched, (rank, got, message, "gradients changed")
        assert recovered, (rank, "the next call did not give a fresh call's numbers")
        assert seconds < TIMEOUT / 2, (rank, seconds)
        slowest = max(slowest, seconds)
        if rank == 1:
            assert got == "KeyboardInterrupt" and "replayed call read the config" in message, (rank, got, message)
        else:
            assert got == "ConsistencyError" and "rank 1 failed its own checks" in message, (rank, got, message)
    reliability("bad input", "a config property raises KeyboardInterrupt on rank 1 only, read by a replayed finalize "
                "call [4 ranks]", f"KeyboardInterrupt there, ConsistencyError naming it elsewhere, after <= {slowest:.2f} s; "
                "nothing changed; the next call gives a fresh call's numbers")


@pytest.mark.parametrize("name", list(BAD_CONFIG), ids=list(BAD_CONFIG))
def test_a_bad_config_value_on_one_rank_raises_its_own_error_there(world, reliability, name):
    field, value, kind = BAD_CONFIG[name]
    for rank, (got, message, untouched, seconds, recovered) in enumerate(case_values(world, name)):
        assert untouched and recovered, (name, rank)
        assert seconds < TIMEOUT / 2, (name, rank, seconds)
        assert message.startswith(f"rank {rank}: "), (name, rank, message)
        if rank == 2:
            assert got == kind and field in message, (name, rank, got, message)
        else:
            assert got == "ConsistencyError" and "rank 2 failed its own checks" in message and field in message, (
                name, rank, got, message)
    reliability("bad input", f"config.{field} = {value!r} on rank 2 only [4 ranks]",
                f"{kind} naming the field there, ConsistencyError naming it elsewhere; nothing changed")


def _layouts_refused(world: Any, case: str) -> list[tuple]:
    """Each rank's outcome of a DeviceMesh layout case, checked for what every such case
    shows: an AgreedInputError naming the layouts, and the next call right."""
    rows = case_values(world, case)
    for rank, (got, message, untouched, seconds, recovered) in enumerate(rows):
        assert recovered, (rank, "the next call did not give a fresh call's numbers")
        assert got == "AgreedInputError" and "ask for different DeviceMesh group layouts" in message, (rank, got, message)
    return rows


def test_a_device_mesh_layout_changed_on_one_rank_is_found_in_the_status_round(world, reliability):
    slowest = 0.0
    for rank, (got, message, untouched, seconds, recovered) in enumerate(
        _layouts_refused(world, "case_mesh_expert_layout_changed_on_one_rank")
    ):
        assert message.startswith(f"rank {rank}: "), (rank, message)
        assert seconds < 10.0, (rank, seconds)
        slowest = max(slowest, seconds)
    reliability("bad input", "DeviceMesh: the expert layout changed on rank 0 after step 1 [4 ranks]",
                f"AgreedInputError naming the layouts on every rank after <= {slowest:.2f} s (found in the status round); "
                "the next call gives a fresh call's numbers")


def test_a_layout_switched_back_on_one_rank_is_found_in_the_status_round(world, reliability):
    slowest = 0.0
    for rank, (got, message, untouched, seconds, recovered) in enumerate(
        _layouts_refused(world, "case_mesh_expert_layout_switched_back_on_one_rank")
    ):
        assert untouched, (rank, "a gradient or buffer changed")
        slowest = max(slowest, seconds)
    reliability("bad input", "DeviceMesh: rank 0 alone switched back to an expert layout used before [4 ranks]",
                f"AgreedInputError naming the layouts on every rank after <= {slowest:.2f} s (a layout switched to "
                "is agreed like a new one); nothing changed; the next call gives a fresh call's numbers")


@pytest.mark.parametrize("when", ["after step 1", "after steady steps (answered by the probes)"])
def test_a_parameter_of_another_shape_is_seen_like_a_fresh_call(world, reliability, when):
    name = "case_param_data_of_another_shape_" + ("after_step1" if when == "after step 1" else "after_steady_steps")
    for rank, (live, fresh, same, message, probed) in enumerate(case_values(world, name)):
        assert live == fresh == "ValueError", (rank, live, fresh, message)
        assert "shape" in message, (rank, message)
        assert same, (rank, "the long-lived model differs from a fresh call")
        assert probed == (when != "after step 1"), (rank, "the probes did not answer the steady calls")
    reliability("bad input", f"param.data replaced by another shape {when}, gradient left [4 ranks]",
                "ValueError naming the shape on every rank, as a fresh call raises; nothing changed")


@pytest.mark.parametrize("change", list(ROLE_CHANGES))
def test_an_embedding_role_change_leaves_the_helper_and_reaches_finalize(world, reliability, change):
    name = "case_roles_changed_" + change.replace(" ", "_")
    for rank, (helper_same, final_same, changed, probed, missed, getter_calls) in enumerate(case_values(world, name)):
        assert helper_same and final_same, (rank, "the long-lived model differs from a fresh one")
        assert changed, (rank, "the change did not change finalize's numbers: the case tests nothing")
        assert probed and missed, (rank, "the helper's probes missed" if not probed else "finalize's probes held")
        assert getter_calls == 0, (rank, "the helper called the model's embedding getter")
    reliability("bad input", f"seed helper, then finalize: the word embedding {change} after steady steps [4 ranks]",
                "the helper's probes answer (its plan reads no role; the getter is not called); finalize replanned: "
                "both bit-identical to a fresh model on every rank")


def test_finalize_entered_on_some_ranks_only_raises_a_collective_error(world, reliability):
    slowest = 0.0
    for rank, (got, message, untouched, seconds) in enumerate(
        case_values(world, "case_zz_finalize_entered_on_some_ranks_only")
    ):
        if rank == 3:
            continue
        assert got == "CollectiveError", (rank, got, message)
        assert "finalize status check" in message and "not entered finalize" in message, (rank, message)
        assert untouched, rank
        assert seconds < SHORT * 2.5, (rank, seconds)
        slowest = max(slowest, seconds)
    reliability("bad input", f"finalize entered on ranks 0-2 only [4 ranks, {SHORT:g} s timeout]",
                f"CollectiveError naming the status round on ranks 0-2 after <= {slowest:.2f} s; nothing changed")


def test_num_tokens_of_different_floating_dtypes_raise_on_every_rank(world, reliability):
    for rank, (got, message, untouched, seconds, recovered) in enumerate(
        case_values(world, "case_num_tokens_dtype_differs_on_rank0")
    ):
        assert got == "ConsistencyError", (rank, got, message)
        assert untouched and recovered, rank
        assert seconds < TIMEOUT / 2, (rank, seconds)
        if rank in (0, 2):  # rank 0's dp_cp group names the dtypes
            assert "float16" in message and "float32" in message, (rank, message)
    reliability("bad input", "num_tokens float16 on rank 0, float32 elsewhere [4 ranks]",
                "ConsistencyError on every rank (rank 0's group names both dtypes); nothing changed")


def test_non_finite_num_tokens_under_the_nan_check_raise_on_every_rank(world, reliability):
    for rank, (got, message, untouched, seconds, same) in enumerate(
        case_values(world, "case_num_tokens_nan_on_rank1_checked")
    ):
        assert got == "NonFiniteGradError", (rank, got, message)
        assert untouched and same, rank
        assert seconds < TIMEOUT / 2, (rank, seconds)
        assert ("num_tokens is nan" in message) if rank == 1 else ("rank 1 has NaN or Inf" in message), (rank, message)
    reliability("bad input", "num_tokens NaN on rank 1, check_for_nan_in_grad [4 ranks]",
                "NonFiniteGradError on every rank naming num_tokens there; nothing changed")


@pytest.mark.parametrize("name", list(REPLAYED_TOKENS))
def test_a_bad_num_tokens_on_one_rank_after_replayed_steps_raises_on_every_rank(world, reliability, name):
    bad, wrong = REPLAYED_TOKENS[name]
    slowest = 0.0
    for rank, (got, message, untouched, seconds, recovered, replayed) in enumerate(case_values(world, name)):
        assert replayed, (name, rank, "the call before was not replayed")
        assert untouched and recovered, (name, rank, got, message)
        assert seconds < TIMEOUT / 2, (name, rank, seconds)
        slowest = max(slowest, seconds)
        assert message.startswith(f"rank {rank}: "), (name, rank, message)
        if wrong.numel() != 1:  # the local check refuses it there; the round tells the others
            want = ("TypeError", "num_tokens must be a one-element tensor") if rank == bad else (
                "ConsistencyError", f"rank {bad} failed its own checks")
            assert got == want[0] and want[1] in message, (name, rank, got, message)
        else:  # another kind of num_tokens: compared in the round
            assert got == "ConsistencyError", (name, rank, got, message)
            if rank in (0, 2):  # rank 0's dp_cp group names the dtypes
                assert "float16" in message and "float32" in message, (name, rank, message)
    label = ("num_tokens float16 on rank 0, float32 elsewhere" if wrong.numel() == 1
             else "num_tokens of shape [2] on rank 2")
    kinds = ("ConsistencyError on every rank (rank 0's group names both dtypes)" if wrong.numel() == 1
             else "TypeError there, ConsistencyError naming it elsewhere")
    reliability("bad input", f"after replayed steady steps (finalize with num_tokens): {label} [4 ranks]",
                f"{kinds}, after <= {slowest:.2f} s; nothing changed; the next call gives a fresh call's numbers")


def test_num_tokens_on_one_rank_only_after_replayed_steps_raises_on_every_rank(world, reliability):
    slowest = 0.0
    for rank, (got, message, untouched, seconds, recovered, replayed) in enumerate(
        case_values(world, "case_replayed_num_tokens_on_rank0_only")
    ):
        assert replayed, (rank, "the call without num_tokens was not replayed")
        assert untouched and recovered, (rank, got, message)
        assert seconds < TIMEOUT / 2, (rank, seconds)
        slowest = max(slowest, seconds)
        assert got == "ConsistencyError" and message.startswith(f"rank {rank}: "), (rank, got, message)
        if rank in (0, 2):  # the dp group of rank 0 names the token collective it alone launches
            assert "'dp_cp_gtp_remat'" in message and "token_scale sum num_tokens" in message, (rank, message)
    reliability("bad input", "after replayed steady steps with num_tokens and without: num_tokens on rank 0 only "
                "[4 ranks]", f"ConsistencyError on every rank (rank 0's group names the token collective), after <= "
                f"{slowest:.2f} s; nothing changed; the next call gives a fresh call's numbers")


def test_a_seed_helper_whose_plan_switches_on_one_rank_raises_on_every_rank(world, reliability):
    slowest = 0.0
    for rank, (got, message, untouched, seconds, recovered) in enumerate(
        case_values(world, "case_helper_plan_switched_on_rank0_only")
    ):
        assert recovered and seconds < TIMEOUT / 2, (rank, got, message, seconds)
        if rank in (0, 1):  # rank 0's tp group: its error names the reduction rank 0 alone launches
            assert got == "ConsistencyError" and message.startswith(f"rank {rank}: "), (rank, got, message)
            assert "'tp'" in message and "would launch different collectives" in message, (rank, message)
            assert untouched, (rank, "gradients changed")
            slowest = max(slowest, seconds)
        else:  # the other tp group agrees: its helper call goes on (its round is over tp)
            assert got == "ok", (rank, got, message)
    reliability("bad input", "non-TP seed helper after steady steps with a weight's sequence_parallel set and "
                "cleared: set on rank 0 only [4 ranks]", f"ConsistencyError on rank 0 and its tp peer (the group "
                f"named), after <= {slowest:.2f} s, nothing changed there; the other tp group goes on; the next call "
                "gives a fresh call's numbers")
