"""parity_tests.torch_world: errors are recorded per scenario, hangs and crashes are killed."""

from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("torch")

from parity_tests.scenarios import Scenario, gpt_params  # noqa: E402
from parity_tests.process_world import spawn_world  # noqa: E402
from parity_tests.torch_world import run_torch_world  # noqa: E402
from parity_tests.world_cases import run_cases  # noqa: E402


def _hang_after_emit(rank: int, world_size: int, payload: object, sink) -> None:
    sink.put("before", rank)
    if rank == 0:
        time.sleep(600)
    import torch.distributed as dist

    dist.barrier()  # ranks > 0 wait for rank 0 forever


def _crash(rank: int, world_size: int, payload: object, sink) -> None:
    import torch.distributed as dist

    dist.barrier()  # every rank is connected before one dies (else rank 0 fails in init)
    sink.put("before", rank)
    if rank == 1:
        os._exit(3)
    dist.barrier()


#: Set by _prepare in the process that forks the ranks (spawn_world's ``prepare``).
_PREPARED: list[int] = []


def _prepare() -> None:
    _PREPARED.append(os.getpid())


def _prepare_fails() -> None:
    raise RuntimeError("no megatron here")


def _report_prepared(rank: int, world_size: int, payload: object, sink) -> None:
    import torch
    import torch.distributed as dist

    total = torch.tensor([rank + 1])
    dist.all_reduce(total)
    sink.put("seen", (list(_PREPARED), os.getppid(), int(total)))
    if payload == "crash" and rank == 1:
        os._exit(3)
    if payload == "hang" and rank == 0:
        time.sleep(600)
    dist.barrier()


def case_ok(rank: int, world_size: int) -> int:
    return rank * 10


def case_raises(rank: int, world_size: int) -> int:
    raise ValueError(f"bad on rank {rank}")


def test_hung_world_is_killed_and_keeps_emitted_results():
    start = time.monotonic()
    outcome = spawn_world(_hang_after_emit, 2, timeout=5.0)
    assert time.monotonic() - start < 30
    assert outcome.timed_out
    assert [r["before"] for r in outcome.results] == [0, 1]


def test_crashed_rank_is_reported():
    outcome = spawn_world(_crash, 2, timeout=60.0)
    assert outcome.exitcodes[1] == 3
    assert [r["before"] for r in outcome.results] == [0, 1]


def test_cases_record_values_and_errors():
    got = run_cases(__name__, ["case_ok", "case_raises"], 2)
    assert got["case_ok"] == [("ok", 0), ("ok", 10)]
    assert got["case_raises"] == [("error", "ValueError: bad on rank 0"), ("error", "ValueError: bad on rank 1")]


def test_failing_scenario_does_not_stop_the_world():
    bad = Scenario("needs-two", dp=2, params=gpt_params())
    good = Scenario("one", params=gpt_params(), config={"calculate_per_token_loss": True}, num_tokens="random")
    results = run_torch_world([bad, good], 1, timeout=120)
    assert "needs 2 ranks" in results["needs-two"].error
    assert results["one"].error is None and len(results["one"].outputs) == 1


def test_prepared_ranks_are_forked_from_one_prepared_process():
    """``prepare`` runs once; every rank is its child, sees its result and joins the world."""
    outcome = spawn_world(_report_prepared, 3, timeout=120.0, prepare=_prepare)
    assert outcome.exitcodes == [0, 0, 0] and not outcome.timed_out
    seen = [r["seen"] for r in outcome.results]
    (zygote,), parent, total = seen[0]
    assert seen == [([zygote], zygote, 6)] * 3
    assert zygote != os.getpid()


def test_prepared_world_reports_crash_hang_and_failed_prepare():
    crashed = spawn_world(_report_prepared, 2, "crash", timeout=60.0, prepare=_prepare)
    assert crashed.exitcodes[1] == 3 and not crashed.timed_out
    assert [r["seen"][2] for r in crashed.results] == [3, 3]
    start = time.monotonic()
    hung = spawn_world(_report_prepared, 2, "hang", timeout=10.0, prepare=_prepare)
    assert hung.timed_out and time.monotonic() - start < 40
    assert [r["seen"][2] for r in hung.results] == [3, 3]
    failed = spawn_world(_report_prepared, 2, timeout=60.0, prepare=_prepare_fails)
    assert all("prepare failed" in f and "no megatron here" in f for f in failed.fatal)
    assert failed.results == [{}, {}] and failed.exitcodes == [None, None]
