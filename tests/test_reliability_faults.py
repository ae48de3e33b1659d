"""Broken worlds never hang: a rank that dies or stalls mid-finalize makes the others
raise within the process-group timeout, naming the collective they were in.

Each test spawns a fresh gloo world of 4 ranks whose groups have a 5 s timeout, makes one
rank exit (``os._exit``), get SIGKILLed, stall or raise on its own at a chosen point, and
checks what every other rank raised, how long it took, and that every process is gone
within 30 s (the world is not killed for outliving its deadline).
"""

from __future__ import annotations

import os
import re
import signal
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from parity_tests.process_world import spawn_world  # noqa: E402
from test_reliability_inputs import DP_TP, PP_TP, kind_of, setup_model, timed_collection  # noqa: E402

WORLD = 4
PG_TIMEOUT = 5.0
STALL = 8.0  # a stalled rank sleeps this long (past the timeout), then exits
DEADLINE = 30.0
ACTION = re.compile(
    r"^rank (\d): finalize action #(\d+) \((\w+(?:\+\w+)*): (sum|avg) (all-reduce|reduce-scatter) over group '(\w+)'"
)


def _fault(kind: str) -> None:
    if kind == "exit":
        os._exit(3)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "stall":
        time.sleep(STALL)
        os._exit(0)


def _target(rank: int, world: int, payload: dict[str, Any], sink: Any) -> None:
    import torch.distributed as dist

    from torch_impl import finalize_model_grads

    scenario = {"dp_tp": DP_TP, "pp_tp": PP_TP}[payload["scenario"]]
    groups = timed_collection(scenario, timeout=PG_TIMEOUT, cache={})
    model = setup_model(scenario, rank)
    num_tokens = torch.tensor(5) if payload.get("num_tokens") else None
    faulty = rank == payload["rank"]
    if faulty and payload["where"] in ("all_reduce", "broadcast"):
        original = getattr(dist, payload["where"])
        calls = []

        def patched(*args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            if len(calls) == payload["call"]:
                _fault(payload["kind"])
            return original(*args, **kwargs)

        setattr(dist, payload["where"], patched)
    if faulty and payload["where"] == "bad_num_tokens":
        num_tokens = torch.tensor([5, 5])
    dist.barrier()
    if faulty and payload["where"] == "before":
        _fault(payload["kind"])
    start = time.monotonic()
    try:
        finalize_model_grads(model, pg_collection=groups, num_tokens=num_tokens)
        sink.put("result", ("ok", "", time.monotonic() - start))
    except Exception as err:  # recorded for the parent
        sink.put("result", (kind_of(err), str(err), time.monotonic() - start))


def _run(**payload: Any) -> tuple[list[Any], Any, float]:
    start = time.monotonic()
    outcome = spawn_world(_target, WORLD, payload, timeout=DEADLINE)
    seconds = time.monotonic() - start
    assert not outcome.timed_out, "a process outlived the deadline"
    assert seconds < DEADLINE
    return [r.get("result") for r in outcome.results], outcome, seconds


FAULTS = [
    # (label, payload, survivors' error, text every survivor's message holds, max seconds)
    ("rank 1 os._exit at its 1st all-reduce (dp_sync)",
     dict(scenario="dp_tp", rank=1, where="all_reduce", call=1, kind="exit"), "action", None, PG_TIMEOUT),
    ("rank 2 SIGKILL at its 3rd all-reduce",
     dict(scenario="dp_tp", rank=2, where="all_reduce", call=3, kind="kill"), "action", None, PG_TIMEOUT),
    ("rank 3 stalls 8 s at its 2nd all-reduce",
     dict(scenario="dp_tp", rank=3, where="all_reduce", call=2, kind="stall"), "action", "Timed out", 3 * PG_TIMEOUT),
    # Only rank 1's pp peer (rank 3) needs it afterwards; ranks 0 and 2 finish correctly.
    ("rank 1 SIGKILL in the num_tokens broadcast (pp 2)",
     dict(scenario="pp_tp", rank=1, where="broadcast", call=1, kind="kill", num_tokens=True, affected=[3]),
     "token", None, PG_TIMEOUT),
    ("rank 0 stalls 8 s before finalize",
     dict(scenario="dp_tp", rank=0, where="before", kind="stall"), "check", None, 3 * PG_TIMEOUT),
    # The failing rank joins the status round before raising: the others raise at once.
    ("rank 3 alone raises (num_tokens of shape [2]) before communicating",
     dict(scenario="dp_tp", rank=3, where="bad_num_tokens", num_tokens=True), "shared", None, 3.0),
]


@pytest.mark.parametrize("label,payload,expect,text,bound", FAULTS, ids=[f[0] for f in FAULTS])
def test_a_broken_rank_makes_the_others_raise_naming_the_collective(reliability, label, payload, expect, text, bound):
    results, outcome, seconds = _run(**payload)
    bad = payload["rank"]
    slowest = 0.0
    for rank, result in enumerate(results):
        if rank == bad:
            if payload["where"] == "bad_num_tokens":
                assert result[0] == "TypeError" and "num_tokens must be a one-element tensor" in result[1], result
            continue
        assert result is not None, f"rank {rank} recorded nothing"
        kind, message, elapsed = result
        assert outcome.exitcodes[rank] == 0, (rank, outcome.exitcodes)  # it exited on its own
        if rank not in payload.get("affected", range(WORLD)):
            assert kind == "ok", (rank, kind, message)
            continue
        if expect == "shared":
            assert kind == "ConsistencyError", (rank, kind, message)
            assert f"rank {bad} failed its own checks: FinalizeTypeError" in message, message
            assert elapsed < bound, (rank, elapsed)
            slowest = max(slowest, elapsed)
            continue
        assert kind == "CollectiveError", (rank, kind, message)
        assert message.startswith(f"rank {rank}: "), message
        if expect == "action":
            match = ACTION.match(message)
            assert match, message
            assert int(match.group(2)) >= 1
        elif expect == "token":
            assert "token_scale: num_tokens broadcast over 'pp' and sum over '" in message, message
        else:
            assert "status check over '" in message, message
        assert "a peer rank may have died, stalled past the process-group timeout" in message
        if text:
            assert text in message, message
        assert elapsed < bound + 3.0, (rank, elapsed)
        slowest = max(slowest, elapsed)
    where = {"action": "the action (step, op, group, tensors)", "token": "the num_tokens collective",
             "check": "the consistency-check collective", "shared": "the failing rank and its error"}[expect]
    who = "others" if "affected" not in payload else f"ranks {payload['affected']} (the rest finish)"
    reliability(
        "fault",
        f"{label} [4 ranks, {PG_TIMEOUT:g} s timeout]",
        f"{who}: {'ConsistencyError' if expect == 'shared' else 'CollectiveError'} naming {where} after <= {slowest:.1f} s; all exited in {seconds:.0f} s; no hang",
    )
