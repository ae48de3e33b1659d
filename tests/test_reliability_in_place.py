"""Gradient tensors changed between steps, in place or by replacement, against every way a
call can find them: the cached plan never outlives the tensors it was made for.

One gloo world of 4 ranks (dp 2 x tp 2 with experts and routers, as
``test_reliability_steps``) runs the whole grid of: a change of a gradient tensor (its
storage swapped, its rows aliased by ``set_``, a view as int32, a resize, padded strides,
a new tensor, the parameter frozen, its ``sequence_parallel`` flag cleared), on a
gradient meshgrad reduces over dp (plain chunks) or over tp (the sequence-parallel norm;
plain and Megatron-DDP chunks), made after step 1 or after steady steps answered by the
probes, before finalize or before the non-TP helper then finalize, on every rank or on
one rank only. Invariants checked on every cell:

* every rank: the long-lived model gives what a fresh model given the same change gives
  (the same error type, or bit-identical gradients and router state);
* one rank: every rank succeeds, or every rank raises -- the rank at fault its own error,
  the others a ConsistencyError -- with every gradient and router buffer unchanged.

And a view of meshgrad's own buffers (``attach_grad_buffers``) changed in place after
steady steps (unsupported), on every rank or one: every rank succeeds and its buffers
equal a twin model's (the program reads them through private aliases).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from in_place import alias_rows, pad_strides, resize, swap_storage, view_as_int32  # noqa: E402
from parity_tests.world_cases import case_values, local_cases, run_cases  # noqa: E402
from test_reliability_inputs import DP_TP, LINEAR, attempt, param, setup_model, timed_collection  # noqa: E402
from torch_impl import attach_grad_buffers, finalize_model_grads  # noqa: E402
from test_reliability_steps import (  # noqa: E402
    SP_NORM, STEADY, HelperThenFinalize, _call, _inner, live_vs_fresh, one_rank,
)

WORLD = 4


def _gradient_change(change: Callable[[Any], None]) -> Callable[[Any], None]:
    return lambda p: change(p.main_grad)


def _new_tensor(p: Any) -> None:
    p.main_grad = p.main_grad.clone() * 2 + 1


def _freeze(p: Any) -> None:
    p.requires_grad_(False)


def _clear_flag(p: Any) -> None:
    p.sequence_parallel = False


CHANGES: dict[str, Callable[[Any], None]] = {
    "storage swapped": _gradient_change(swap_storage),
    "rows aliased in place": _gradient_change(alias_rows),
    "viewed as int32 in place": _gradient_change(view_as_int32),
    "resized in place": _gradient_change(resize),
    "strides padded in place": _gradient_change(pad_strides),
    "a new tensor": _new_tensor,
    "parameter frozen": _freeze,
    "sequence_parallel cleared": _clear_flag,
}
#: (target parameter, chunks): the dp-synced linear weight of plain chunks (a Megatron DDP
#: syncs it itself, so meshgrad reads it only in plain chunks), the sequence-parallel norm.
TARGETS = [(LINEAR, False), (SP_NORM, False), (SP_NORM, True)]
CELLS = [
    (change, target, ddp, warm, helper)
    for change, (target, ddp), warm, helper in itertools.product(CHANGES, TARGETS, (1, STEADY), (False, True))
]


def _apply(change: str, target: str) -> Callable[[list[Any], int], None]:
    return lambda model, rank: CHANGES[change](param([_inner(model)], target))


def case_every_rank(rank: int, world: int) -> list[tuple]:
    """live vs fresh for every cell, every rank making the change."""
    out = []
    for change, target, ddp, warm, helper in CELLS:
        # the helper's own steady check starts at its second call
        step2, calls = (HelperThenFinalize, max(warm, 2)) if helper else (_call, warm)
        out.append(live_vs_fresh(rank, _apply(change, target), ddp=ddp, step2=step2, warm=calls))
    return out


def case_one_rank(rank: int, world: int) -> list[tuple]:
    """every cell made on one rank only (finalize), the rank at fault rotating."""
    return [
        one_rank(rank, index % WORLD, _apply(change, target), ddp=ddp, warm=warm)
        for index, (change, target, ddp, warm, _) in enumerate(c for c in CELLS if not c[4])
    ]


#: In-place changes of a view of meshgrad's own buffers (unsupported: the buffers' API
#: changes them), each on every rank or on one.
OWN_VIEW_CHANGES = {"rows aliased in place": alias_rows, "storage swapped": swap_storage,
                    "viewed as int32 in place": view_as_int32, "resized in place": resize}
OWN_CELLS = [(change, target, one) for change in OWN_VIEW_CHANGES for target in (LINEAR, SP_NORM) for one in (None, 2)]


def case_own_buffer_views(rank: int, world: int) -> list[tuple]:
    """Own buffers (``attach_grad_buffers``), steady steps, then a view changed in place:
    (outcome, the buffers bit-identical to a twin model's whose views were left alone)."""
    out = []
    groups = timed_collection(DP_TP)
    call = lambda m: finalize_model_grads(m, num_tokens=torch.tensor(7), pg_collection=groups)  # noqa: E731
    for change, target, one in OWN_CELLS:
        live, twin = setup_model(DP_TP, rank), setup_model(DP_TP, rank)
        buffers = [attach_grad_buffers(model, groups) for model in (live, twin)]
        for _ in range(STEADY):
            call(live)
            call(twin)
        if one is None or rank == one:
            OWN_VIEW_CHANGES[change](param(live, target).main_grad)
        kind, message, _, _ = attempt(live, call)
        call(twin)
        out.append((kind, message, all(map(torch.equal, buffers[0].buffers, buffers[1].buffers))))
    return out


CASES = local_cases(globals())


@pytest.fixture(scope="module")
def world() -> dict[str, list[tuple[str, Any]]]:
    return run_cases(__name__, CASES, WORLD, timeout=300)


def _cell(cell: tuple) -> str:
    change, target, ddp, warm, helper = cell
    chunks = "DDP" if ddp else "plain"
    return f"{change} of {target.rsplit('.', 2)[-2]} ({chunks}, {'steady' if warm > 1 else 'step 1'}" \
           f"{', helper' if helper else ''})"


def test_a_changed_gradient_gives_what_a_fresh_model_gives(world, reliability) -> None:
    ranks = case_values(world, "case_every_rank")
    for index, cell in enumerate(CELLS):
        for rank, results in enumerate(ranks):
            live, fresh, same, message, probed = results[index]
            assert live == fresh, (_cell(cell), rank, live, fresh, message)
            assert live != "ok" or same, (_cell(cell), rank, "the long-lived model differs from a fresh call")
            assert probed or cell[3] == 1, (_cell(cell), rank, "the probes did not answer the steady calls")
    reliability("property", f"{len(CELLS)} gradient changes in place or by replacement, every rank [4 ranks]",
                "each gives a fresh model's numbers (bit-identical gradients and router state) or its error "
                "(ValueError / TypeError / ConsistencyError)")


def test_a_gradient_changed_on_one_rank_moves_every_rank_or_none(world, reliability) -> None:
    ranks = case_values(world, "case_one_rank")
    cells = [c for c in CELLS if not c[4]]
    raised = 0
    for index, cell in enumerate(cells):
        kinds = [results[index][0] for results in ranks]
        bad = index % WORLD
        if all(kind == "ok" for kind in kinds):
            continue
        raised += 1
        for rank, results in enumerate(ranks):
            kind, message, untouched, _, _ = results[index]
            assert untouched, (_cell(cell), rank, kinds, "gradients or router state changed")
            assert kind != "ok" and message.startswith(f"rank {rank}: "), (_cell(cell), rank, kinds, message)
            assert rank == bad or kind == "ConsistencyError", (_cell(cell), rank, kinds, message)
    assert raised >= 10, raised  # the aliased, int32 and resized gradients and the flag, at least
    reliability("property", f"{len(cells)} gradient changes in place or by replacement, on one rank only [4 ranks]",
                f"every rank succeeds, or every rank raises ({raised} cells: the rank at fault its own error, "
                "ConsistencyError elsewhere) with nothing changed")


def test_a_view_of_meshgrads_own_buffers_changed_in_place_does_not_reach_the_program(world, reliability) -> None:
    """Unsupported, and still safe: the bound program reads meshgrad's buffers through
    private aliases of its views, so a view changed in place (on every rank or one) changes
    no copy or collective: every rank succeeds and its buffers equal a twin model's."""
    ranks = case_values(world, "case_own_buffer_views")
    for index, (change, target, one) in enumerate(OWN_CELLS):
        for rank, results in enumerate(ranks):
            kind, message, same = results[index]
            assert kind == "ok" and same, (change, target, one, rank, kind, message)
    reliability("property", f"{len(OWN_CELLS)} in-place changes of a view of meshgrad's own buffers (unsupported), "
                "every rank or one [4 ranks]", "every rank succeeds, buffers bit-identical to an unchanged twin's: "
                "the program reads the buffers through private aliases (numbers, no CollectiveError)")
