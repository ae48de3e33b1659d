"""parity_tests.process_world: a rank that crashes in native code is reported with its
signal and its stack, and a world that crashed is run again only where asked."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

pytest.importorskip("torch")

from parity_tests.process_world import WorldOutcome, exit_text, spawn_world  # noqa: E402
from parity_tests.world_cases import run_cases  # noqa: E402


def _attempt(directory: str) -> int:
    """This world's run number (1, 2, ...), counted by rank 0 in a file of ``directory``."""
    path = Path(directory, "attempts")
    return len(path.read_text()) if path.exists() else 0


def _crash_in_native_code(rank: int, world_size: int, payload: dict, sink) -> None:
    """Rank 1 dies by ``payload["signal"]`` on the world's first ``payload["crashes"]``
    runs, after every rank emitted its value; the others then meet it in a barrier."""
    import torch
    import torch.distributed as dist

    if rank == 0:
        with open(Path(payload["dir"], "attempts"), "a") as f:
            f.write("x")
    dist.barrier()
    run = _attempt(payload["dir"])
    total = torch.tensor([rank + 1])
    dist.all_reduce(total)
    sink.put("total", (run, int(total)))
    dist.barrier()
    if rank == 1 and run <= payload["crashes"]:
        os.kill(os.getpid(), payload["signal"])
    dist.barrier()


def _payload(tmp_path: Path, crashes: int, sig: int = signal.SIGSEGV) -> dict:
    return {"dir": str(tmp_path), "crashes": crashes, "signal": int(sig)}


def test_a_segfault_is_reported_with_its_signal_and_python_stack(tmp_path: Path) -> None:
    outcome = spawn_world(_crash_in_native_code, 2, _payload(tmp_path, crashes=1), timeout=60.0)
    assert outcome.exitcodes[1] == -signal.SIGSEGV and 1 not in outcome.killed
    assert outcome.crashed_ranks() == [1] and outcome.crashed() and outcome.attempts == 1
    assert [r["total"] for r in outcome.results] == [(1, 3), (1, 3)]
    why = outcome.why()
    assert "rank 1: SIGSEGV" in why and "rank 1's stderr" in why
    assert "Fatal Python error: Segmentation fault" in why and "_crash_in_native_code" in why


def test_a_crashed_world_is_run_again_once_with_a_warning(tmp_path: Path) -> None:
    with pytest.warns(RuntimeWarning, match="crashed and is run again.*SIGABRT"):
        outcome = spawn_world(
            _crash_in_native_code, 2, _payload(tmp_path, crashes=1, sig=signal.SIGABRT), timeout=60.0,
            crash_retries=1,
        )
    assert outcome.attempts == 2 and outcome.exitcodes == [0, 0] and not outcome.crashed()
    assert [r["total"] for r in outcome.results] == [(2, 3), (2, 3)]


def test_a_world_that_keeps_crashing_reports_its_last_crash(tmp_path: Path) -> None:
    with pytest.warns(RuntimeWarning, match="crashed and is run again"):
        outcome = spawn_world(_crash_in_native_code, 2, _payload(tmp_path, crashes=5), timeout=60.0, crash_retries=1)
    assert outcome.attempts == 2 and outcome.exitcodes[1] == -signal.SIGSEGV
    assert [r["total"] for r in outcome.results] == [(2, 3), (2, 3)]


def _raise_on_rank_1(rank: int, world_size: int, payload: dict, sink) -> None:
    if rank == 0:
        with open(Path(payload["dir"], "attempts"), "a") as f:
            f.write("x")
    if rank == 1:
        raise ValueError("a bug, not a crash")
    sink.put("value", rank)


def test_a_python_error_is_never_run_again(tmp_path: Path) -> None:
    outcome = spawn_world(_raise_on_rank_1, 2, _payload(tmp_path, crashes=0), timeout=60.0, crash_retries=3)
    assert outcome.attempts == 1 and _attempt(str(tmp_path)) == 1 and not outcome.crashed()
    assert outcome.exitcodes == [0, 1] and "ValueError: a bug, not a crash" in outcome.why()
    assert outcome.results[0] == {"value": 0}


def _prepare_nothing() -> None:
    """A ``prepare``: the ranks are forked from one process that ran it."""


def _crash_while_rank_0_sleeps(rank: int, world_size: int, payload: object, sink) -> None:
    import time

    import torch.distributed as dist

    dist.barrier()
    sink.put("joined", rank)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGBUS)
    time.sleep(600)  # rank 0: killed by the world GRACE seconds after rank 1 died


def test_a_rank_the_world_killed_is_not_the_crash() -> None:
    """Rank 0, still running GRACE seconds after rank 1 crashed, is killed by its prepared
    world (SIGKILL): the outcome names rank 1 as the crash and quotes its stack."""
    outcome = spawn_world(_crash_while_rank_0_sleeps, 2, timeout=120.0, prepare=_prepare_nothing)
    assert not outcome.timed_out and outcome.killed == [0]
    assert outcome.exitcodes == [-signal.SIGKILL, -signal.SIGBUS] and outcome.crashed_ranks() == [1]
    assert [r["joined"] for r in outcome.results] == [0, 1]
    why = outcome.why()
    assert "rank 0: SIGKILL, rank 1: SIGBUS" in why and "Fatal Python error: Bus error" in why


def test_ranks_alive_at_the_deadline_are_killed_and_it_is_a_timeout() -> None:
    outcome = spawn_world(_crash_while_rank_0_sleeps, 2, timeout=8.0)
    assert outcome.timed_out and outcome.killed == [0] and outcome.why() == "timed out"
    assert outcome.exitcodes == [-signal.SIGKILL, -signal.SIGBUS] and not outcome.crashed()


def test_exit_codes_in_words() -> None:
    assert [exit_text(c) for c in (0, 3, -signal.SIGSEGV, -signal.SIGKILL, None)] == [
        "0", "3", "SIGSEGV", "SIGKILL", "none"
    ]
    killed_by_the_world = WorldOutcome([{}, {}], [None, None], False, [-signal.SIGABRT, -signal.SIGKILL], 0.0,
                                       ["", ""], killed=[1])
    assert killed_by_the_world.crashed_ranks() == [0]
    only_killed = WorldOutcome([{}, {}], [None, None], False, [1, -signal.SIGKILL], 0.0, ["", ""], killed=[1])
    assert only_killed.crashed_ranks() == [] and not only_killed.crashed()
    assert "rank 0: 1, rank 1: SIGKILL" in only_killed.why()
    with pytest.raises(ValueError, match="crash_retries must be >= 0, got -1"):
        spawn_world(_raise_on_rank_1, 1, crash_retries=-1)


def case_value(rank: int, world_size: int) -> int:
    return rank * 7


def case_segfault_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    return rank


def test_cases_after_a_crash_say_which_rank_died_of_what() -> None:
    """run_cases runs a crashed world once more (by default), then reports the crash for
    the cases the dead rank never finished; what finished keeps its values."""
    with pytest.warns(RuntimeWarning, match="crashed and is run again"):
        got = run_cases(__name__, ["case_value", "case_segfault_on_rank_1"], 2, timeout=60.0)
    assert got["case_value"] == [("ok", 0), ("ok", 7)]
    assert got["case_segfault_on_rank_1"][0] == ("ok", 0)
    status, why = got["case_segfault_on_rank_1"][1]
    assert status == "missing" and "rank 1: SIGSEGV" in why and "case_segfault_on_rank_1" in why
