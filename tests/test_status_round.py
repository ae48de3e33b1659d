"""The status round priced like a collective: its arithmetic, the token count it carries,
and the host syncs a step makes.

Local tests check the SUM-encoded status (four flag counts packed in one int64, never
carrying into each other, also for routes that reach some ranks more than once). One gloo world of 4 ranks
(pure data parallelism, dp = 4: the status round's route is the token count's own group)
checks by value that the round carries an integer ``num_tokens`` (the token all-reduce is
gone from the step; gradients and the written-back count are those of a separate
reduction), that a floating count keeps its own collective, that an error on one rank
still makes every rank raise before anything changes, and that a healthy step reads the
device back once (:func:`torch_impl.run.rounds.read_back`) and a CUDA-graph capture not
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
from parity_tests.world_cases import local_cases, run_cases  # noqa: E402
from torch_impl.run import rounds as status  # noqa: E402  (the round's wire format and collectives)

WORLD = 4


# --------------------------------------------------------------------------- local


def _round(statuses: list[list[int]], weights: list[int] | None = None) -> list[int]:
    """What every rank decodes after a SUM of the encoded statuses (each rank counted
    ``weight`` times, as a route whose hops do not form a grid would)."""
    weights = weights or [1] * len(statuses)
    n = sum(weights)
    wires = [status.encode(s, n) for s in statuses]
    summed = [sum(w * int(wire[i]) for w, wire in zip(weights, wires)) for i in range(len(wires[0]))]
    return status.decode(summed, n)[:-1]


def test_the_status_counts_flags_in_one_packed_int64():
    statuses = [status.status_vector(error=r == 2, compare=r in (1, 3), nonfinite=r == 0) for r in range(4)]
    reduced = _round(statuses)
    assert reduced[status.REACHED] == 4 and reduced[status.ERROR] == 1
    assert reduced[status.COMPARE] == 2 and reduced[status.NONFINITE] == 1 and reduced[status.KIND] == 0
    assert status.wire_format(4) == "short" and len(status.encode(statuses[0], 4)) == 1
    assert not status.layouts_differ(reduced)


def test_round_kinds_that_differ_are_found():
    kinds = [status.status_vector(layout_round=r == 0) for r in range(4)]
    assert status.layouts_differ(_round(kinds))
    every = [status.status_vector(layout_round=True) for _ in range(4)]
    assert not status.layouts_differ(_round(every)) and _round(every)[status.KIND] == 4


def test_counts_never_carry_into_the_next_field_up_to_each_format_limit():
    everything = status.status_vector(error=True, compare=True, nonfinite=True, layout_round=True)
    for n, fmt in ((status.SHORT_MAX, "short"), (status.SHORT_MAX + 1, "packed"),
                   ((1 << (status.FIELD_BITS - 1)) - 1, "packed"), (1 << (status.FIELD_BITS - 1), "wide")):
        assert status.wire_format(n) == fmt
        assert _round([everything], [n]) == [n] * 5, (n, fmt)
        assert len(status.encode(everything, n)) == {"short": 1, "packed": 2, "wide": 5}[fmt]


@pytest.mark.parametrize("reached", [1, 4, status.SHORT_MAX, status.SHORT_MAX + 1, 1 << (status.FIELD_BITS - 1)])
def test_a_host_token_count_encodes_as_the_device_placement_does(reached: int):
    """A host count on a host route is encoded without tensor work (:func:`encode` with
    ``tokens``); it must give the wire the device placement gives, at and around the short
    word's limit, negative, of every integer dtype the host path takes (uint64, whose
    values int64 may not hold, keeps the device placement)."""
    limit = status.token_limit(reached)
    counts = [(0, torch.int64), (1, torch.int32), (limit - 1, torch.int64), (limit, torch.int64),
              (-limit + 1, torch.int64), (-limit, torch.int64), (-3, torch.int8), (255, torch.uint8),
              ((1 << 62) + 7, torch.int64), (-(1 << 63), torch.int64), (-30000, torch.int16)]
    flagged = status.status_vector(error=True, nonfinite=True)
    for vector in (status.status_vector(), flagged):
        for count, dtype in counts:
            tokens = torch.tensor([count], dtype=dtype)
            device = status.encode(vector, reached)
            status.place_tokens(device, tokens, reached)
            host = status.encode(vector, reached, int(tokens))
            assert host.tolist() == device.tolist(), (reached, count, dtype, vector)
    # What the short word carries decodes back: the count, or the too-large count instead.
    word = status.encode(flagged, 4, 1234)
    assert int(word[0]) >> status.TOKEN_SHIFT == 1234 and status.decode(word.tolist(), 4)[-1] == 0
    big = status.encode(status.status_vector(), 4, status.token_limit(4))
    assert status.decode(big.tolist(), 4) == [4, 0, 0, 0, 0, 1]


def test_a_host_wire_made_under_inference_mode_is_a_normal_tensor_sharing_its_memory():
    """A route's wire is kept between calls: made during a call under
    ``torch.inference_mode()`` it is still a normal tensor (the round's collective writes
    into it in place, in either mode), and the tensor and the memoryview share their memory."""
    with torch.inference_mode():
        wire = status.HostWire(3)
    assert not wire.tensor.is_inference()
    tensor, host = wire.load([5, -1, 1 << 40])
    assert tensor.tolist() == [5, -1, 1 << 40]
    tensor.add_(1)  # in place outside inference mode, as the round's all-reduce writes
    assert host.tolist() == [6, 0, (1 << 40) + 1]


@pytest.mark.parametrize("reached", [1, 4, 63, 64, 2**15])
def test_a_quiet_round_sends_and_reads_what_the_full_round_does(monkeypatch: pytest.MonkeyPatch, reached: int):
    """A healthy rank's round through :class:`QuietRound` (its route's shape worked out once)
    against :func:`reduce_status`: the same words on the wire for every token count (none,
    zero, negative, at and past the short word's limit), and the same reading of the reduced
    words when the other ranks were healthy, flagged something or sent a count too large."""
    from torch_impl.run.quiet_round import QuietRound

    route = [("the world", None, torch.device("cpu"), reached)]
    limit = status.token_limit(reached)
    others = {"healthy": status.wire_words(status.status_vector(), reached, 3),
              "error": status.wire_words(status.status_vector(error=True), reached),
              "nonfinite": status.wire_words(status.status_vector(nonfinite=True), reached, 3),
              "too large": status.wire_words(status.status_vector(), reached, limit)}
    for count in (None, 0, 5, -7, limit - 1, limit, 1 - limit, -limit, 1 << 40):
        for kind, other in others.items():
            sent: list[list[int]] = []

            def summed(value: torch.Tensor, pg: Any, options: Any = None) -> None:
                # the quiet round hands over the SUM options it keeps; the full round none
                assert options is None or options.reduceOp == torch.distributed.ReduceOp.SUM, options
                sent.append(value.tolist())
                value.add_(torch.tensor(other, dtype=torch.int64))

            monkeypatch.setattr(status, "all_reduce_status", summed)
            tokens = None if count is None else torch.tensor(count)
            full = status.reduce_status(status.status_vector(), route, 0, "t", tokens)
            words, healthy, total = QuietRound(route).run(count, 0, "t")
            assert sent[1] == sent[0], (count, kind, sent)  # the same words on the wire
            if healthy:
                assert full == ([reached, 0, 0, 0, 0], total), (count, kind, full, total)
            else:
                assert status.received(words, reached, tokens) == full, (count, kind, words, full)
            short = status.wire_format(reached) == "short"  # only a short word has a count too large
            fits = count is None or not short or -limit < count < limit
            quiet = kind == "healthy" or (kind == "too large" and not short)
            assert healthy == (quiet and fits), (count, kind)  # the quiet reading where it applies


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


def case_a_count_too_large_for_the_word_keeps_its_collective(rank: int, world: int) -> dict[str, Any]:
    big = (1 << 31) // WORLD  # rank 1's count would not fit the one-int64 round's token field
    return _step(_model(rank), torch.tensor([big + 5 if rank == 1 else 3 + rank]))


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
    """Device read-backs of one healthy step, of a replayed one
    (:mod:`torch_impl.call.replay`), of a step under a (simulated) CUDA-graph capture, and
    the rounds each runs."""
    from torch_impl import finalize_model_grads

    model = _model(rank, check_for_nan_in_grad=False)
    tokens = torch.tensor([2])
    finalize_model_grads(model, num_tokens=tokens.clone(), pg_collection=_dp4())
    reads, rounds = [], []
    original_read, original_reduce, original_capturing = status.read_back, status.all_reduce_status, status.capturing

    def read(*args: Any) -> Any:
        reads.append(1)
        return original_read(*args)

    def reduce(*args: Any) -> None:
        rounds.append(1)
        original_reduce(*args)

    out: dict[str, int] = {}
    status.read_back, status.all_reduce_status = read, reduce
    try:
        finalize_model_grads(model, num_tokens=tokens.clone(), pg_collection=_dp4())
        out["healthy reads"], out["healthy rounds"] = len(reads), len(rounds)
        from torch_impl.call.read import Request
        from torch_impl.call.replay import replayed

        out["replayed"] = replayed(model, _dp4(), Request(num_tokens=tokens.clone())) is not None
        del reads[:], rounds[:]
        finalize_model_grads(model, num_tokens=tokens.clone(), pg_collection=_dp4())
        out["replayed reads"], out["replayed rounds"] = len(reads), len(rounds)
        import torch_impl.call.agree as agree_stage
        import torch_impl.call.check as check_stage
        import torch_impl.call.replay as replay

        stages = (check_stage, agree_stage, replay)  # each asks whether a capture is on
        saved = [stage.capturing for stage in stages]
        for stage in stages:
            stage.capturing = lambda: True
        try:
            del reads[:], rounds[:]
            finalize_model_grads(model, num_tokens=tokens.clone(), pg_collection=_dp4())
            out["capture reads"], out["capture rounds"] = len(reads), len(rounds)
        finally:
            for stage, kept in zip(stages, saved):
                stage.capturing = kept
    finally:
        status.read_back, status.all_reduce_status = original_read, original_reduce
    return out


def _wires(model: list[nn.Module]) -> dict[Any, Any]:
    """The quiet rounds (each with its host wire) of the groups the model's last steady call resolved."""
    from torch_impl.call.model_state import ModelState

    (last,) = ModelState.of(model).steady.values()
    return last.inputs.groups.quiet_rounds


def _steady_step(model: list[nn.Module], count: int) -> tuple[list[int], list[float]]:
    """One step on the same gradient tensor (refilled: the steady path), with ``count`` tokens."""
    from torch_impl import finalize_model_grads

    model[0].weight.grad.copy_(torch.arange(4 * H, dtype=torch.float32).reshape(H, 4))
    tokens = torch.tensor([count])
    finalize_model_grads(model, num_tokens=tokens, pg_collection=_dp4())
    return tokens.tolist(), sum(model[0].weight.grad.tolist(), [])


def case_the_reused_wire_carries_each_steps_count(rank: int, world: int) -> dict[str, Any]:
    """Steady steps with another count each: the route's one host wire carries every step's."""
    model = _model(rank)
    steps = [_steady_step(model, 10 * step + rank + 1) for step in range(4)]
    (wire,) = _wires(model).values()
    _steady_step(model, 1)
    (again,) = _wires(model).values()
    return {"steps": steps, "wires": len(_wires(model)), "same wire": again is wire}


def case_a_failed_round_drops_its_wire(rank: int, world: int) -> dict[str, Any]:
    """A round whose collective fails (simulated on every rank) raises a CollectiveError,
    changes nothing and drops its wire; the next step makes a new one and is right."""
    from torch_impl import finalize_model_grads

    model = _model(rank)
    _steady_step(model, 1)
    wires = _wires(model)
    (before,) = wires.values()
    original = status.all_reduce_status

    def failing(value: torch.Tensor, pg: Any, options: Any = None) -> None:
        raise RuntimeError("simulated: connection closed by peer")

    grad = model[0].weight.grad.clone()
    tokens = torch.tensor([rank + 1])
    status.all_reduce_status = failing
    try:
        finalize_model_grads(model, num_tokens=tokens, pg_collection=_dp4())
        kind = "ok"
    except Exception as err:  # recorded for the parent
        kind = type(err).__name__
    finally:
        status.all_reduce_status = original
    unchanged = torch.equal(model[0].weight.grad, grad) and tokens.tolist() == [rank + 1]
    dropped = not wires
    after = _steady_step(model, rank + 2)
    return {"kind": kind, "unchanged": unchanged, "dropped": dropped, "after": after,
            "new wire": next(iter(_wires(model).values())) is not before}


CASES = local_cases(globals())


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


def test_a_count_too_large_for_the_round_is_reduced_by_its_own_collective(world):
    got = _values(world, "case_a_count_too_large_for_the_word_keeps_its_collective")
    total = (1 << 31) // WORLD + 5 + sum(3 + r for r in range(WORLD) if r != 1)
    for out in got:
        assert out["tokens"] == [total]  # exact: int64 all the way
        assert out["counts"].get("all_reduce") == 2, out  # the DP sync and the count
        assert sum(out["grad"], []) == pytest.approx(_expected(total), rel=1e-6)


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
        assert out == {"healthy reads": 1, "healthy rounds": 1, "replayed reads": 1, "replayed rounds": 1,
                       "replayed": True, "capture reads": 0, "capture rounds": 0}


def test_a_steady_round_reuses_one_host_wire_and_carries_each_steps_count(world):
    got = _values(world, "case_the_reused_wire_carries_each_steps_count")
    for out in got:
        assert out["wires"] == 1 and out["same wire"], out
        for step, (tokens, grad) in enumerate(out["steps"]):
            total = sum(10 * step + r + 1 for r in range(WORLD))
            assert tokens == [total]
            assert grad == pytest.approx(_expected(total), rel=1e-6)


def test_a_failed_round_changes_nothing_and_its_wire_is_made_anew(world):
    for out in _values(world, "case_a_failed_round_drops_its_wire"):
        assert out["kind"] == "CollectiveError" and out["unchanged"] and out["dropped"] and out["new wire"], out
        total = sum(r + 2 for r in range(WORLD))
        assert out["after"][0] == [total] and out["after"][1] == pytest.approx(_expected(total), rel=1e-6)
