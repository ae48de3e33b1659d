"""The steady path of the embedding helpers (``torch_impl.call.steady``): a repeat call
takes the kept plan without the read and plan stages, its weight read again through the
getter it is given; every change of what that read finds sends the call through the
stages, with the numbers (or the error) of a fresh model given the same change.

One gloo world of 4 ranks (pp2 x tp2) runs every ``case_*`` below on every rank. Each
case steps a live model: gradients refilled in place, :data:`STEADY` calls, a change, two
more calls; a fresh model given the same change before its first call is the oracle of
the changed step. Data are small integers: every comparison is bit-exact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from in_place import alias_rows, resize, view_as_int32  # noqa: E402
from parity_tests.scenarios import WORD_EMB, RankData  # noqa: E402
from parity_tests.torch_world import read_outputs  # noqa: E402
from parity_tests.world_cases import case_values, local_cases, run_cases  # noqa: E402
from test_torch_helpers import (  # noqa: E402
    POS_ALL, PP_TP, WORLD, _embedding_expected, _inputs, _peers, _prepare, _same_grads,
)

#: Calls before the change: the first through the stages, the rest on the steady path.
STEADY = 3
LAYERNORM = "decoder.final_layernorm.weight"
POSITION = "embedding.position_embeddings.weight"


def _refill(model: list[Any], data: RankData) -> None:
    """This step's gradients (the rank's inputs), written into the tensors the parameters
    hold now (as a DDP's buffer is)."""
    inner = [getattr(c, "module", c) for c in model]
    for (chunk, name), values in data.grads.items():
        if values is not None:
            grad = inner[chunk].get_parameter(name).main_grad
            grad.copy_(torch.from_numpy(np.asarray(values, dtype=np.float32)))


def _replace_weight(model: list[Any], name: str) -> None:
    """``name`` replaced in its module, on every chunk, by a new parameter with a copy of
    the old one's gradient (a stale plan would reduce the old one and leave it as read)."""
    for chunk in (getattr(c, "module", c) for c in model):
        owner, _, leaf = name.rpartition(".")
        old = chunk.get_parameter(name)
        new = nn.Parameter(old.detach().clone())
        new.main_grad = old.main_grad.clone()
        setattr(chunk.get_submodule(owner), leaf, new)


def _replace_grad(model: list[Any], name: str) -> None:
    """``name``'s gradient tensor replaced, on every chunk, by a copy of it."""
    for chunk in (getattr(c, "module", c) for c in model):
        param = chunk.get_parameter(name)
        param.main_grad = param.main_grad.clone()


def _replace_grad_on_rank_0(model: list[Any], name: str) -> None:
    """As :func:`_replace_grad` on rank 0 only: that rank takes the stages, the others the
    steady path, in the same collectives."""
    if torch.distributed.get_rank() == 0:
        _replace_grad(model, name)


def _on_rank_0(change: Callable[[Any], None]) -> Callable[[list[Any], str], None]:
    """``change`` of ``name``'s gradient tensor in place (the same object), on rank 0 only."""
    def apply(model: list[Any], name: str) -> None:
        if torch.distributed.get_rank() == 0:
            for chunk in (getattr(c, "module", c) for c in model):
                change(chunk.get_parameter(name).main_grad)
    return apply


def _freeze(model: list[Any], name: str) -> None:
    for chunk in (getattr(c, "module", c) for c in model):
        chunk.get_parameter(name).requires_grad_(False)


def _untie(model: list[Any], name: str) -> None:
    for chunk in model:
        getattr(chunk, "module", chunk).share_embeddings_and_output_weights = False


def _no_change(model: list[Any], name: str) -> None:
    return None


CHANGES: dict[str, Callable[[list[Any], str], None]] = {
    "none": _no_change, "weight replaced": _replace_weight, "gradient replaced": _replace_grad,
    "gradient replaced on rank 0": _replace_grad_on_rank_0, "frozen": _freeze, "untied": _untie,
    # the same gradient object changed in place: the kept discovery must not hold over it
    "gradient resized in place on rank 0": _on_rank_0(resize),
    "gradient restrided in place on rank 0": _on_rank_0(alias_rows),
    "gradient viewed as int32 in place on rank 0": _on_rank_0(view_as_int32),
}
IN_PLACE = ("gradient resized in place on rank 0", "gradient restrided in place on rank 0",
            "gradient viewed as int32 in place on rank 0")


def _outcome(call: Callable[[], None], model: list[Any], scenario: Any, data: RankData) -> tuple[str, Any]:
    """("ok", the gradients after the call) or ("error", its message, whether the
    gradients were left as they were)."""
    before = read_outputs(model, scenario, data)
    try:
        call()
    except Exception as err:  # noqa: BLE001 -- compared with the fresh model's outcome
        return "error", (f"{type(err).__name__}: {err}", _same_grads(before, read_outputs(model, scenario, data)))
    return "ok", read_outputs(model, scenario, data).grads


def _steps(rank: int, scenario: Any, helper: Callable[[list[Any], Any, int], None], name: str,
           change: str) -> dict[str, Any]:
    """A live model stepped through the change, and a fresh one given it before its first
    call. Returns the live outcomes per call, the read stage's calls before each, and the
    fresh model's outcome."""
    from stage_counts import counted_reads

    live, pgc, data = _prepare(scenario, rank)
    outcomes, read_counts = [], []
    with counted_reads() as reads:
        for index in range(STEADY + 2):
            _refill(live, data)
            if index == STEADY:
                CHANGES[change](live, name)
            read_counts.append(len(reads))
            outcomes.append(_outcome(lambda: helper(live, pgc, index), live, scenario, data))
            if outcomes[-1][0] == "error":
                break
    fresh, pgc, data = _prepare(scenario, rank)
    CHANGES[change](fresh, name)
    return {"live": outcomes, "reads": read_counts + [len(reads)],
            "fresh": _outcome(lambda: helper(fresh, pgc, STEADY), fresh, scenario, data)}


def _word(model: list[Any], pgc: Any, index: int) -> None:
    from torch_impl import _allreduce_word_embedding_grads

    _allreduce_word_embedding_grads(model, model[0].config, pgc.embd, pgc.pp)


def _position(model: list[Any], pgc: Any, index: int) -> None:
    from torch_impl import _allreduce_position_embedding_grads

    _allreduce_position_embedding_grads(model, model[0].config, pgc.pos_embd, pgc.pp)


def _moving_getter(model: list[Any], pgc: Any, index: int) -> None:
    """A getter made per call that returns the word embedding before the change, then the
    final layernorm's weight (the same getter code: only what it returns moves)."""
    from torch_impl import _allreduce_embedding_grad

    target = WORD_EMB if index < STEADY else LAYERNORM
    _allreduce_embedding_grad(model, pgc.embd, pgc.pp, lambda m: m.get_parameter(target), config=model[0].config)


def _failing_getter(model: list[Any], pgc: Any, index: int) -> None:
    """A getter that raises on rank 0 from the change on (the other ranks' calls would be
    steady): every rank must raise, before anything changes."""
    from torch_impl import _allreduce_embedding_grad

    def getter(module: nn.Module) -> nn.Parameter:
        if index >= STEADY and torch.distributed.get_rank() == 0:
            raise RuntimeError("the getter failed on rank 0")
        return module.get_parameter(WORD_EMB)

    _allreduce_embedding_grad(model, pgc.embd, pgc.pp, getter, config=model[0].config)


def case_word(rank: int, world: int) -> dict[str, Any]:
    return {change: _steps(rank, PP_TP, _word, WORD_EMB, change) for change in CHANGES}


def case_position(rank: int, world: int) -> dict[str, Any]:
    return {change: _steps(rank, POS_ALL, _position, POSITION, change)
            for change in ("none", "gradient replaced", "gradient replaced on rank 0", "frozen", *IN_PLACE)}


def case_moving_getter(rank: int, world: int) -> dict[str, Any]:
    return {"getter moved": _steps(rank, PP_TP, _moving_getter, LAYERNORM, "none"),
            "getter raised on rank 0": _steps(rank, PP_TP, _failing_getter, WORD_EMB, "none")}


#: Groups every rank makes, by their global ranks (a non-member gets torch's NON_GROUP_MEMBER).
MEMBERSHIP = ((0, 1), (2,), (0, 1, 2, 3), (1, 3))


def case_membership(rank: int, world: int) -> list[bool]:
    """Whether the embedding helpers reduce over each group of :data:`MEMBERSHIP` here."""
    from torch_impl.helpers import _reduces_over

    groups = [torch.distributed.new_group(list(ranks)) for ranks in MEMBERSHIP]
    return [_reduces_over(group) for group in groups] + [_reduces_over(None)]


CASES = local_cases(globals())


# =========================================================================== tests (parent)


@pytest.fixture(scope="module")
def world() -> dict[str, list[tuple[str, Any]]]:
    return run_cases(__name__, CASES, WORLD, timeout=300)


def _expected_grads(scenario: Any, name: str, rank: int) -> dict[Any, np.ndarray]:
    """This rank's gradients after one call of the helper that reduces ``name``."""
    inputs = _inputs(scenario)[rank].grads
    summed = _embedding_expected(scenario, name, (0, 1))
    return {key: summed.get((rank, key), value) for key, value in inputs.items()}


def _assert_grads(got: dict[Any, Any], want: dict[Any, Any], what: str) -> None:
    for key, value in want.items():
        if value is None:
            assert got[key] is None, (what, key)
        else:
            np.testing.assert_array_equal(got[key], value, err_msg=f"{what} {key}")


def _check_run(run: dict[str, Any], scenario: Any, name: str, rank: int, what: str) -> None:
    """The steady calls give the reduced gradients each time without the read stage; the
    changed call and the one after it give the fresh model's outcome, the one after
    without the read stage again."""
    want = _expected_grads(scenario, name, rank)
    live, reads = run["live"], run["reads"]
    for index in range(STEADY):
        assert live[index][0] == "ok", (what, index, live[index])
        _assert_grads(live[index][1], want, f"{what} call {index}")
    assert reads[:STEADY + 1] == [0, 1, 1, 1], (what, reads)  # only the first call read the model
    changed, fresh = live[STEADY], run["fresh"]
    assert changed[0] == fresh[0], (what, changed, fresh)
    if changed[0] == "error":
        assert changed[1] == fresh[1] and changed[1][1], (what, changed, fresh)  # and nothing half-applied
        return
    for index in (STEADY, STEADY + 1):
        assert live[index][0] == "ok", (what, index, live[index])
        _assert_grads(live[index][1], fresh[1], f"{what} call {index} against a fresh model")
    assert reads[-1] == reads[STEADY + 1], (what, reads)  # steady again after the change


@pytest.mark.parametrize("case,scenario,name", [
    ("case_word", PP_TP, WORD_EMB),
    ("case_position", POS_ALL, POSITION),
    ("case_moving_getter", PP_TP, WORD_EMB),
])
def test_repeat_calls_are_steady_and_each_change_matches_a_fresh_model(world, case, scenario, name) -> None:
    for rank, runs in enumerate(case_values(world, case)):
        for change, run in runs.items():
            _check_run(run, scenario, name, rank, f"rank {rank} {case} {change}")


def _differs_somewhere(runs: list[dict[str, Any]], key_name: str, change: str, index: int, inputs: Any) -> bool:
    """Whether call ``index`` left ``key_name``'s gradient other than its input on some rank
    (a stale plan that reduced another tensor would have left it as read)."""
    for rank, by_change in enumerate(runs):
        grads = by_change[change]["live"][index][1]
        for key, value in grads.items():
            if key[1] == key_name and value is not None and not np.array_equal(value, inputs[rank].grads[key]):
                return True
    return False


def test_each_change_moved_the_numbers_a_stale_plan_would_get_wrong(world) -> None:
    """The changed calls reduce the new tensor (a plan kept for the old one would leave
    it as read), and the moved getter's new weight: the comparisons above see a stale plan."""
    word, inputs = case_values(world, "case_word"), _inputs(PP_TP)
    for change in ("weight replaced", "gradient replaced"):
        assert _differs_somewhere(word, WORD_EMB, change, STEADY, inputs), change
    assert _differs_somewhere(case_values(world, "case_moving_getter"), LAYERNORM, "getter moved", STEADY, inputs)
    position = case_values(world, "case_position")
    assert _differs_somewhere(position, POSITION, "gradient replaced", STEADY, _inputs(POS_ALL))
    for rank, runs in enumerate(word):
        frozen = runs["frozen"]
        assert frozen["live"][STEADY][0] == frozen["fresh"][0], rank
    for rank, runs in enumerate(case_values(world, "case_moving_getter")):
        status, value = runs["getter raised on rank 0"]["live"][STEADY]
        if 0 in _peers(PP_TP, rank, ("pp",)):  # rank 0's embedding group: every rank raised
            message, untouched = value
            assert status == "error" and untouched and "the getter failed on rank 0" in message, (rank, value)
        else:  # the other group's ranks reduce as on every step
            assert status == "ok", (rank, value)


def test_the_helpers_reduce_where_this_rank_is_in_a_group_of_several(world) -> None:
    """A ProcessGroup answers by its own size (torch gives it only to its members); a
    non-member's placeholder and None by the global ranks: no rank enters a group it is
    not in, none reduces over a group of one."""
    for rank, got in enumerate(case_values(world, "case_membership")):
        assert got == [len(ranks) > 1 and rank in ranks for ranks in MEMBERSHIP] + [False], rank
