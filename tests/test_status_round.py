"""The status round priced like a collective: its arithmetic, the token count it carries,
and the host syncs a step makes.

Local tests check the SUM-encoded status vector (counts, the layout digest's equality
test, also for routes that reach some ranks more than once). One gloo world of 4 ranks
(pure data parallelism, dp = 4: the status round's route is the token count's own group)
checks by value that the round carries an integer ``num_tokens`` (the token all-reduce is
gone from the step; gradients and the written-back count are those of a separate
reduction), that a floating count keeps its own collective, that an error on one rank
still makes every rank raise before anything changes, and that a healthy step reads the
device back once (:func:`torch_impl.run.status.read_back`) and a CUDA-graph capture not
at all.
"""

from __future__ import annotations

import datetime
import types
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from meshgrad import FinalizeConfig  # noqa: E402
from parity_tests.torch_world import run_cases  # noqa: E402
from torch_impl.run import status  # noqa: E402

WORLD = 4


# --------------------------------------------------------------------------- local


def _sum(vectors: list[list[int]], weights: list[int] | None = None) -> list[int]:
    weights = weights or [1] * len(vectors)
    return [sum(w * v[i] for w, v in zip(weights, vectors)) for i in range(status.STATUS_SIZE)]


def test_the_status_vector_counts_flags_and_tells_equal_digests():
    digest = status.layout_digest(("ep", 2))
    same = [status.status_vector(layout=digest, error=(r == 2)) for r in range(4)]
    reduced = _sum(same)
    assert reduced[status.REACHED] == 4 and reduced[status.ERROR] == 1 and reduced[status.COMPARE] == 0
    assert not status.layouts_differ(reduced)
    other = status.layout_digest(("ep", 4))
    assert status.layouts_differ(_sum(same[:3] + [status.status_vector(layout=other)]))
    # Three ranks whose mean digest equals the fourth's still differ (the squares tell).
    parts = [status.status_vector(layout=d) for d in (1, 3, 2, 2)]
    assert status.layouts_differ(_sum(parts))
    kinds = [status.status_vector(layout=digest, layout_round=r == 0) for r in range(4)]
    assert status.layouts_differ(_sum(kinds))


def test_a_route_reaching_ranks_several_times_weighs_every_slot_alike():
    digest = status.layout_digest("grid")
    vectors = [status.status_vector(layout=digest) for _ in range(3)]
    assert not status.layouts_differ(_sum(vectors, [1, 2, 3]))
    vectors[1] = status.status_vector(layout=digest + 1)
    assert status.layouts_differ(_sum(vectors, [1, 2, 3]))


def test_the_digest_parts_hold_without_overflow_at_16k_ranks():
    top = (1 << 62) - 1
    reduced = _sum([status.status_vector(layout=top)] * 4, [1 << 14] * 4)
    assert max(reduced) < (1 << 63) and not status.layouts_differ(reduced)


# --------------------------------------------------------------------------- world cases

H = 6  # rows of the one weight


def _model(rank: int, **config: Any) -> list[nn.Module]:
    model = nn.Linear(4, H, bias=False)
    model.config = FinalizeConfig(calculate_per_token_loss=True, **config)
    model.weight.grad = torch.arange(4 * H, dtype=torch.float32).reshape(H, 4) * (rank + 1)
    return [model]


def _groups() -> Any:
    import torch.distributed as dist

    dp = dist.new_group(list(range(WORLD)), timeout=datetime.timedelta(seconds=20))
    return types.SimpleNamespace(tp=None, pp=None, dp_cp=dp, dp=dp, cp=None, embd=None, pos_embd=None)


_GROUPS: dict[str, Any] = {}


def _dp4() -> Any:
    if "dp4" not in _GROUPS:
        _GROUPS["dp4"] = _groups()
    return _GROUPS["dp4"]


def _step(model: list[nn.Module], tokens: torch.Tensor) -> dict[str, Any]:
    """One finalize (after a first, planning call), with its collectives counted."""
    from bench.counting import CollectiveCounter
    from torch_impl import finalize_model_grads

    finalize_model_grads(model, num_tokens=tokens.clone(), pg_collection=_dp4())  # plans, compares
    model[0].weight.grad = torch.arange(4 * H, dtype=torch.float32).reshape(H, 4)
    with CollectiveCounter() as counter:
        finalize_model_grads(model, num_tokens=tokens, pg_collection=_dp4())
    return {"grad": model[0].weight.grad.tolist(), "tokens": tokens.tolist(), "data": counter.total,
            "counts": dict(counter.counts)}


def case_int_tokens_ride_the_status_round(rank: int, world: int) -> dict[str, Any]:
    return _step(_model(rank), torch.tensor([3 + rank], dtype=torch.int32))


def case_float_tokens_keep_their_collective(rank: int, world: int) -> dict[str, Any]:
    return _step(_model(rank), torch.tensor([3.0 + rank]))


def case_error_on_one_rank_with_tokens(rank: int, world: int) -> tuple[str, str, bool]:
    from torch_impl import finalize_model_grads

    model = _model(rank)
    tokens = torch.tensor([3 + rank])
    finalize_model_grads(model, num_tokens=tokens.clone(), pg_collection=_dp4())
    if rank == 2:
        model[0].config = {"calculate_per_token_loss": "yes"}  # a bad config value: a local error
    before = (model[0].weight.grad.clone(), tokens.clone())
    try:
        finalize_model_grads(model, num_tokens=tokens, pg_collection=_dp4())
        kind, message = "ok", ""
    except Exception as err:  # recorded for the parent
        kind, message = type(err).__name__, str(err)
    unchanged = torch.equal(model[0].weight.grad, before[0]) and torch.equal(tokens, before[1])
    return kind, message, unchanged


def case_host_syncs_per_step(rank: int, world: int) -> dict[str, int]:
    """Device read-backs of one healthy step, of a step under a (simulated) CUDA-graph
    capture, and the rounds each runs."""
    from torch_impl import finalize_model_grads

    model = _model(rank, check_for_nan_in_grad=False)
    tokens = torch.tensor([2])
    finalize_model_grads(model, num_tokens=tokens.clone(), pg_collection=_dp4())
    reads, rounds = [], []
    original_read, original_reduce, original_capturing = status.read_back, status.all_reduce_status, status.capturing

    def read(value: Any) -> Any:
        reads.append(1)
        return original_read(value)

    def reduce(*args: Any) -> None:
        rounds.append(1)
        original_reduce(*args)

    out: dict[str, int] = {}
    status.read_back, status.all_reduce_status = read, reduce
    try:
        finalize_model_grads(model, num_tokens=tokens.clone(), pg_collection=_dp4())
        out["healthy reads"], out["healthy rounds"] = len(reads), len(rounds)
        import torch_impl.call.check as check_stage
        import torch_impl.call.agree as agree_stage

        saved = check_stage.capturing, agree_stage.capturing
        check_stage.capturing = agree_stage.capturing = lambda: True
        try:
            del reads[:], rounds[:]
            finalize_model_grads(model, num_tokens=tokens.clone(), pg_collection=_dp4())
            out["capture reads"], out["capture rounds"] = len(reads), len(rounds)
        finally:
            check_stage.capturing, agree_stage.capturing = saved
    finally:
        status.read_back, status.all_reduce_status = original_read, original_reduce
    return out


CASES = [name for name in list(globals()) if name.startswith("case_")]


@pytest.fixture(scope="module")
def world() -> dict[str, list[tuple[str, Any]]]:
    return run_cases(__name__, CASES, WORLD, timeout=180)


def _values(world: dict[str, list[tuple[str, Any]]], name: str) -> list[Any]:
    got = world[name]
    assert all(s == "ok" for s, _ in got), got
    return [v for _, v in got]


def _expected(total: float) -> list[float]:
    # every rank's second-step gradient is arange; summed over 4 ranks, divided by the total
    return [WORLD * i / total for i in range(4 * H)]


def test_an_integer_token_count_rides_the_status_round(world):
    got = _values(world, "case_int_tokens_ride_the_status_round")
    total = sum(3 + r for r in range(WORLD))
    for rank, out in enumerate(got):
        assert out["tokens"] == [total]
        assert sum(out["grad"], []) == pytest.approx(_expected(total), rel=1e-6)
        assert out["counts"].get("all_reduce") == 1, out  # the DP sync alone: no token all-reduce
        assert out["counts"].get("broadcast", 0) == 0
    assert got[0]["grad"] == got[1]["grad"] == got[2]["grad"] == got[3]["grad"]  # replicas agree


def test_a_floating_token_count_keeps_its_own_collective(world):
    got = _values(world, "case_float_tokens_keep_their_collective")
    total = sum(3.0 + r for r in range(WORLD))
    for out in got:
        assert out["tokens"] == [total]
        assert sum(out["grad"], []) == pytest.approx(_expected(total), rel=1e-6)
        assert out["counts"].get("all_reduce") == 2, out  # the DP sync and the count


def test_an_error_on_one_rank_still_raises_everywhere_before_anything_changes(world):
    got = _values(world, "case_error_on_one_rank_with_tokens")
    kinds = [kind for kind, _, _ in got]
    assert kinds[2] == "TypeError" and "calculate_per_token_loss" in got[2][1], got[2]
    assert all(kind == "ConsistencyError" for r, kind in enumerate(kinds) if r != 2), kinds
    assert all("rank 2" in message for r, (_, message, _) in enumerate(got) if r != 2)
    assert all(unchanged for _, _, unchanged in got)  # gradients and num_tokens as they were


def test_a_healthy_step_reads_the_device_back_once_and_a_capture_never(world):
    for out in _values(world, "case_host_syncs_per_step"):
        assert out == {"healthy reads": 1, "healthy rounds": 1, "capture reads": 0, "capture rounds": 0}
