"""Calls under ``torch.inference_mode()``, a default-device context (``with
torch.device("meta")``, as ``torch.set_default_device`` sets one), a float64 default dtype,
``torch.autocast``, grad mode, a ``TorchDispatchMode`` (``FlopCounterMode``, a user's
pass-through mode) or a ``TorchFunctionMode``, deterministic algorithms, anomaly detection,
from another thread than the first call's, or given a ``num_tokens`` made under inference
mode, mixed with normal calls on one long-lived model, give the numbers (and global count)
of a model called in normal mode only, and the reference.

A tensor allocated in inference mode cannot be updated in place outside it and has no
version counter, so whatever meshgrad keeps between calls -- a bound program's staging
buffers, a status round's wire, the host token factor, ``attach_grad_buffers``' buffers --
is allocated outside inference mode (``torch_impl.run.modes``); and every tensor meshgrad
makes names its device (the gradients', or the host's for the status words, the host
token factor and its own probes), so an ambient default device changes nothing. Before, a
plan first bound under ``torch.inference_mode()`` failed every later call made outside it
(CollectiveError, on every rank); a per-token finalize whose count the status round carries
raised a bare RuntimeError under inference mode, and NotImplementedError under a meta
default device, after the gradients were reduced but before they were scaled; the strided
runs' probe failed under a meta default device. Megatron-core's finalize works in each.

One gloo world of 4 ranks runs the grid: four layouts (dp 2 x tp 2 with experts, routers and
sequence parallelism, a per-token count reduced by collectives; dp 2 x tp 2 of four layers;
pp 2 x tp 2 with the word and position embeddings synced across stages; pure dp 4, whose
count the status round carries and the host scales), gradients held in one
storage layer after layer (as a Megatron DDP's buffer: staged through a kept buffer, by
strided runs from the second call) or in meshgrad's own buffers (attached in either mode),
finalize or the non-TP helper then finalize, and eight sequences of modes over five steps
(three more, of modes that meshgrad's kept tensors do not depend on, without the buffers
attached in inference mode).
Every step: bit-identical to a twin called in normal mode only; finalize also equal to the
numpy reference.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import operator
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from parity_tests.compare import compare_ranks  # noqa: E402
from parity_tests.reference import reference_finalize  # noqa: E402
from parity_tests.scenarios import ParamLayout, Scenario, gpt_params, make_rank_inputs  # noqa: E402
from parity_tests.torch_world import build_model, load_inputs, read_outputs, scenario_config  # noqa: E402
from parity_tests.world_cases import case_values, local_cases, run_cases  # noqa: E402
from test_reliability_inputs import (  # noqa: E402
    DP_TP, PP_TP, attempt, ddp_buffer_layout, load_in_place, snapshot, timed_collection,
)
from test_reliability_steps import ROUTER  # noqa: E402
from torch_impl import _allreduce_non_tensor_model_parallel_grads, attach_grad_buffers, finalize_model_grads  # noqa: E402

WORLD = 4
STEPS = 5
#: Four layers of two sequence-parallel norms and two linear weights: in one storage, the
#: norms' staging runs as strided copies from the second call.
LAYERS = tuple(
    ParamLayout(f"decoder.layers.{i}.{name}", shape, sequence_parallel=shape == (4,))
    for i in range(4)
    for name, shape in (("input_layernorm.weight", (4,)), ("self_attention.linear_qkv.weight", (6, 4)),
                        ("pre_mlp_layernorm.weight", (4,)), ("mlp.linear_fc1.weight", (3, 4)))
) + (ParamLayout("decoder.final_layernorm.weight", (4,), sequence_parallel=True),)
LAYOUTS = {
    "dp2 tp2, experts": dataclasses.replace(
        DP_TP, name="modes-dp2tp2", num_tokens="random", config={**DP_TP.config, "calculate_per_token_loss": True}
    ),
    "dp2 tp2, 4 layers": Scenario(
        "modes-layers", dp=2, tp=2, params=LAYERS, num_tokens="random",
        config=dict(sequence_parallel=True, calculate_per_token_loss=True),
    ),
    "pp2 tp2, embeddings": dataclasses.replace(
        PP_TP, name="modes-pp2tp2", num_tokens="random", config={**PP_TP.config, "calculate_per_token_loss": True}
    ),
    "dp4, count on the host": Scenario(
        "modes-dp4", dp=4, params=gpt_params(), num_tokens="random", config=dict(calculate_per_token_loss=True)
    ),
}


class _PassThroughFunctions(TorchFunctionMode):
    """A user's ``TorchFunctionMode`` that sees every torch call and changes none."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


class _PassThroughDispatch(TorchDispatchMode):
    """A user's ``TorchDispatchMode`` that sees every aten op and changes none."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _global_setting(get: Callable[[], Any], put: Callable[[Any], Any], value: Any) -> Iterator[None]:
    """``put(value)`` for the block, what ``get()`` gave put back after it."""
    before = get()
    put(value)
    try:
        yield
    finally:
        put(before)


#: A normal call whose ``num_tokens`` was made under ``torch.inference_mode()`` (an
#: inference tensor, which the global count is written back into).
COUNT_IN_INFERENCE = "num_tokens made under inference mode"
#: A normal call made from a new thread (grad mode, inference mode and dispatch state are
#: per thread).
ANOTHER_THREAD = "another thread"
#: The modes a call runs in ("normal": ``torch.no_grad()``, as a training loop's step).
MODES: dict[str, Callable[[], Any]] = {
    "normal": torch.no_grad,
    "inference": torch.inference_mode,
    "meta default device": lambda: torch.device("meta"),
    "float64 default dtype": lambda: _global_setting(torch.get_default_dtype, torch.set_default_dtype, torch.float64),
    "autocast bfloat16": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    "grad enabled": torch.enable_grad,
    "flop counter": lambda: FlopCounterMode(display=False),
    COUNT_IN_INFERENCE: torch.no_grad,
    ANOTHER_THREAD: torch.no_grad,
    # which also fills every new tensor with NaN
    "deterministic algorithms": lambda: _global_setting(
        torch.are_deterministic_algorithms_enabled, torch.use_deterministic_algorithms, True),
    "anomaly detection": lambda: torch.autograd.set_detect_anomaly(True, check_nan=True),
    "torch function mode": _PassThroughFunctions,
    "torch dispatch mode": _PassThroughDispatch,
}
#: Per step, the mode of the call.
SEQUENCES = {
    "inference first": ("inference", "inference", "normal", "normal", "normal"),
    "inference last": ("normal", "normal", "normal", "inference", "inference"),
    "inference every other call": ("inference", "normal", "inference", "normal", "inference"),
    "meta default device every other call": ("meta default device", "normal", "meta default device", "normal",
                                             "meta default device"),
    "meta default device, inference, normal": ("meta default device", "inference", "meta default device", "normal",
                                               "inference"),
    "float64 default dtype, autocast, grad enabled": ("float64 default dtype", "autocast bfloat16", "grad enabled",
                                                      "float64 default dtype", "normal"),
    "flop counter first, then every other call": ("flop counter", "flop counter", "normal", "flop counter", "normal"),
    "num_tokens made under inference mode": (COUNT_IN_INFERENCE, COUNT_IN_INFERENCE, "normal", COUNT_IN_INFERENCE,
                                             "inference"),
}
STORAGES = ("one storage", "own buffers", "own buffers attached in inference mode")
#: Sequences of modes no kept tensor is made differently under: on the first two storages.
OTHER_SEQUENCES = {
    "deterministic algorithms, anomaly detection": ("deterministic algorithms", "anomaly detection", "normal",
                                                    "deterministic algorithms", "anomaly detection"),
    "a user's function and dispatch modes": ("torch function mode", "torch dispatch mode", "normal",
                                             "torch function mode", "torch dispatch mode"),
    "another thread every other call": (ANOTHER_THREAD, "normal", ANOTHER_THREAD, "normal", ANOTHER_THREAD),
}
CELLS = [
    (layout, storage, helper, sequence)
    for sequences, storages in ((SEQUENCES, STORAGES), (OTHER_SEQUENCES, STORAGES[:2]))
    for layout, storage, helper, sequence in itertools.product(LAYOUTS, storages, (False, True), sequences)
    if not helper or (storage == "one storage" and layout.startswith("dp2 tp2"))
]
EVERY_SEQUENCE = {**SEQUENCES, **OTHER_SEQUENCES}


def _in_a_new_thread(body: Callable[[], None]) -> None:
    """``body()`` on a new thread, its exception raised here."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            body()
        except BaseException as err:  # noqa: BLE001 -- handed to the caller's thread
            raised.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if raised:
        raise raised[0]


def _at(layout: str, step: int) -> Scenario:
    return dataclasses.replace(LAYOUTS[layout], seed=step)


def _model(layout: str, storage: str, rank: int, groups: Any) -> list[Any]:
    scenario = _at(layout, 0)
    model = build_model(scenario, rank, scenario_config(scenario, False))
    load_inputs(model, scenario, make_rank_inputs(scenario, rank))
    if storage.startswith("own buffers"):
        with torch.inference_mode(storage.endswith("inference mode")):
            attach_grad_buffers(model, groups)
    else:
        ddp_buffer_layout(model)
    return model


def _step(model: list[Any], groups: Any, data: Any, helper: bool, mode: str) -> tuple[str, str, Any]:
    """One call (the non-TP helper first with ``helper``) in ``mode``: (outcome, message,
    the count ``num_tokens`` holds afterwards)."""
    with torch.inference_mode(mode == COUNT_IN_INFERENCE):
        tokens = torch.tensor(data.num_tokens, device="cpu")

    def call(m: list[Any]) -> None:
        def body() -> None:
            with MODES[mode]():
                if helper:
                    _allreduce_non_tensor_model_parallel_grads(m, m[0].config, groups.tp)
                finalize_model_grads(m, num_tokens=tokens, pg_collection=groups)

        (_in_a_new_thread if mode == ANOTHER_THREAD else operator.call)(body)

    kind, message, _, _ = attempt(model, call)
    return kind, message, tokens.item()


def _twin_steps(layout: str, storage: str, helper: bool, rank: int, groups: Any) -> list[tuple[Any, Any]]:
    """The normal-mode twin of a cell, step by step: (snapshot, count) after each of its
    :data:`STEPS` calls. It depends on the cell's layout, storage and helper only, not on
    the sequence of modes: one twin serves every sequence of its kind."""
    twin = _model(layout, storage, rank, groups)
    out = []
    for step in range(STEPS):
        scenario = _at(layout, step)
        data = make_rank_inputs(scenario, rank)
        load_in_place(twin, scenario, data)
        count = _step(twin, groups, data, helper, "normal")[2]
        out.append((snapshot(twin), count))
    return out


def case_modes(rank: int, world: int) -> list[list[tuple]]:
    """Per cell, per step: (outcome, message, bit-identical to the normal-mode twin, the
    outputs for the reference)."""
    out = []
    twins: dict[tuple[str, str, bool], list[tuple[Any, Any]]] = {}
    for layout, storage, helper, sequence in CELLS:
        groups = timed_collection(LAYOUTS[layout])
        twin_of = (layout, storage, helper)
        if twin_of not in twins:
            twins[twin_of] = _twin_steps(*twin_of, rank, groups)
        live = _model(layout, storage, rank, groups)
        steps = []
        for step, mode in enumerate(EVERY_SEQUENCE[sequence]):
            scenario = _at(layout, step)
            data = make_rank_inputs(scenario, rank)
            load_in_place(live, scenario, data)
            kind, message, count = _step(live, groups, data, helper, mode)
            twin_state, twin_count = twins[twin_of][step]
            same = snapshot(live) == twin_state and count == twin_count
            steps.append((kind, message, same, read_outputs(live, scenario, data)))
        out.append(steps)
    return out


#: Tensors finalize updates in place made under inference mode (the gradients, or a router
#: buffer the plan writes), on every rank or on rank 2 only; the steps' modes: a call
#: outside inference mode after steady calls inside it.
INFERENCE_TARGETS = ("gradients", "expert_bias", "local_tokens_per_expert")
INFERENCE_STEPS = ("inference", "inference", "inference", "normal", "inference")
INFERENCE_CELLS = [(target, bad) for target in INFERENCE_TARGETS for bad in (None, 2)]


def case_inference_tensors(rank: int, world: int) -> list[list[tuple]]:
    """Per cell (what is made under inference mode, on every rank or on rank 2 only), per
    step: (outcome, message, nothing changed, the outputs for the reference)."""
    layout = "dp2 tp2, experts"
    groups = timed_collection(LAYOUTS[layout])
    out = []
    for target, bad in INFERENCE_CELLS:
        model = _model(layout, "one storage", rank, groups)
        made_there = bad is None or rank == bad
        ddp_buffer_layout(model, inference=made_there and target == "gradients")
        if made_there and target != "gradients":
            router = model[0].get_submodule(ROUTER)
            with torch.inference_mode():
                setattr(router, target, getattr(router, target).clone())
        steps = []
        for step, mode in enumerate(INFERENCE_STEPS):
            scenario = _at(layout, step)
            data = make_rank_inputs(scenario, rank)
            with torch.inference_mode():  # the only mode that writes into an inference tensor
                load_in_place(model, scenario, data)
            before = snapshot(model)
            kind, message, _ = _step(model, groups, data, False, mode)
            steps.append((kind, message, snapshot(model) == before, read_outputs(model, scenario, data)))
        out.append(steps)
    return out


CASES = local_cases(globals())


@pytest.fixture(scope="module")
def world() -> dict[str, list[tuple[str, Any]]]:
    return run_cases(__name__, CASES, WORLD, timeout=300)


def test_calls_in_other_torch_modes_give_normal_mode_numbers_and_the_reference(world, reliability) -> None:
    ranks = case_values(world, "case_modes")
    reference = {
        (layout, step): reference_finalize(
            _at(layout, step), [make_rank_inputs(_at(layout, step), r) for r in range(WORLD)]
        ).outputs
        for layout in LAYOUTS for step in range(STEPS)
    }
    for index, (layout, storage, helper, sequence) in enumerate(CELLS):
        cell = (layout, storage, "helper, then finalize" if helper else "finalize", sequence)
        for rank, cells in enumerate(ranks):
            for step, (kind, message, same, outputs) in enumerate(cells[index]):
                assert kind == "ok", (cell, rank, step, message)
                assert same, (cell, rank, step, "differs from the twin called in normal mode only")
                if not helper:  # the helper then finalize reduces the non-TP gradients twice
                    result = compare_ranks(_at(layout, step), [outputs], [reference[layout, step][rank]])
                    assert result.ok, (cell, rank, step, result.failures[:5])
    reliability("property", f"{len(CELLS)} models called under torch.inference_mode(), a meta default device, a "
                f"float64 default dtype, autocast, grad enabled, a FlopCounterMode or num_tokens made under inference "
                f"mode, deterministic algorithms, anomaly detection, a user's function or dispatch mode, or from "
                f"another thread, mixed with normal calls, over "
                f"{STEPS} steps (kept buffers, strided runs, own buffers, host token factor) [4 ranks]",
                "numbers bit-identical to normal-mode calls and the reference (no CollectiveError, no RuntimeError)")


def test_a_tensor_made_under_inference_mode_is_refused_outside_it_before_anything_changes(world, reliability) -> None:
    """Gradients or a router buffer finalize writes that are inference tensors: calls under
    inference mode give the reference's numbers; a call outside it (after steady calls
    inside) raises on every rank before anything changes -- ValueError naming the tensor
    where it is one, a ConsistencyError elsewhere -- and the next call under inference
    mode is right."""
    layout = "dp2 tp2, experts"
    ranks = case_values(world, "case_inference_tensors")
    for index, (target, bad) in enumerate(INFERENCE_CELLS):
        named = "the gradient (main_grad) of " if target == "gradients" else f"the {target} buffer of router "
        for step, mode in enumerate(INFERENCE_STEPS):
            want = reference_finalize(_at(layout, step), [make_rank_inputs(_at(layout, step), r) for r in range(WORLD)])
            for rank, cells in enumerate(ranks):
                kind, message, untouched, outputs = cells[index][step]
                cell = (target, bad, step, mode, rank)
                if mode == "inference":
                    assert kind == "ok", (cell, message)
                    result = compare_ranks(_at(layout, step), [outputs], [want.outputs[rank]])
                    assert result.ok, (cell, result.failures[:5])
                    continue
                assert untouched, (cell, "gradients or router state changed")
                if bad is None or rank == bad:
                    assert kind == "ValueError" and "torch.inference_mode()" in message, (cell, kind, message)
                    assert message.startswith(f"rank {rank}: {named}"), (cell, message)
                else:
                    assert kind == "ConsistencyError" and f"rank {bad}" in message, (cell, kind, message)
    reliability("bad input", "gradients or a router buffer finalize writes (expert_bias, local_tokens_per_expert) "
                "made under torch.inference_mode(), a call outside it after steady calls inside it (every rank, or "
                "one rank) [4 ranks]",
                "ValueError naming the tensor where it is one, ConsistencyError elsewhere, before communication; "
                "nothing changed; the next call under inference mode gives the reference's numbers")
