"""Audit replay of a distributed optimizer's reduce-scatter across pipeline stages.

Under a distributed optimizer (plain chunks) every gradient a later step sums across
stages (tied word embedding, position embedding on two stages, conditional embedder and
flextron router with pp > 1) is a reduce-scatter of its own, after the shared buffer
(docs/semantics.md, "Reduce-scatter layout"). One spawned gloo world of 4 ranks
(pp2 x dp2) records torch_impl's finalize in several cases; the parent replays them: the
correct runs pass on every parameter, a wrong value planted in an owned element of the
word embedding is named by parameter and step.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

from parity_tests.audit import format_report, replay  # noqa: E402
from parity_tests.scenarios import Scenario, gpt_params  # noqa: E402
from parity_tests.process_world import spawn_world  # noqa: E402

WORD = "embedding.word_embeddings.weight"
DISTOPT = dict(use_distributed_optimizer=True, position_embedding_stages=(0, 1))

#: (scenario, planted bug, step index), all recorded in one world of 4 ranks.
CASES: tuple[tuple[Scenario, bool, int], ...] = (
    (Scenario("pp2dp2-distopt-tied-pos01", pp=2, dp=2, params=gpt_params(), mode="random", config=DISTOPT), False, 0),
    (Scenario("pp2dp2-vpp2-distopt-cond", pp=2, dp=2, num_chunks=2, params=gpt_params(), mode="random",
              config=dict(DISTOPT, has_cond_embedder=True, flextron=True)), False, 0),
    (Scenario("bug-pp2dp2-distopt-owned", pp=2, dp=2, params=gpt_params(), mode="random", config=DISTOPT), True, 3),
)
#: The planted wrong value: on global rank 0 (stage 0, first dp member: it owns the first
#: half of the word embedding's own buffer), flat element 1 of the word embedding.
BUG_RANK, BUG_INDEX = 0, 1


def _planted(rank: int) -> Any:
    """torch_impl's finalize, then one owned element of the word embedding made wrong on ``BUG_RANK``."""
    import torch_impl

    def finalize(model: Any, num_tokens: Any = None, pg_collection: Any = None, force_all_reduce: bool = False) -> None:
        torch_impl.finalize_model_grads(model, num_tokens=num_tokens, pg_collection=pg_collection,
                                        force_all_reduce=force_all_reduce)
        if rank == BUG_RANK:
            param = model[0].get_parameter(WORD)
            grad = param.main_grad if hasattr(param, "main_grad") else param.grad
            grad.view(-1)[BUG_INDEX] += 1.0

    return finalize


def scatter_world(rank: int, world: int, directory: str, sink: Any) -> None:
    """Record every case into its own directory; report per case."""
    import torch_impl
    from torch_impl import audit
    from parity_tests.scenarios import make_rank_inputs
    from parity_tests.torch_world import build_model, collection, load_inputs, scenario_config

    cache: dict[Any, Any] = {}
    for scen, bug, step in CASES:
        try:
            groups = collection(scen, cache)
            model = build_model(scen, rank, scenario_config(scen, finalize_config=False))
            load_inputs(model, scen, make_rank_inputs(scen, rank))
            fn = _planted(rank) if bug else torch_impl.finalize_model_grads
            with audit.record(os.path.join(directory, scen.name), sample=64, finalize=fn, start_step=step) as finalize:
                finalize(model, None, groups)
            sink.put(scen.name, "ok")
        except Exception as err:
            sink.put(scen.name, f"{type(err).__name__}: {err}")


@pytest.fixture(scope="module")
def recorded() -> Any:
    """The directory the world recorded into (removed when the module is done)."""
    directory = tempfile.mkdtemp(prefix="meshgrad-audit-scatter-")
    try:
        outcome = spawn_world(scatter_world, 4, directory, timeout=300)
        problems = [f"rank {r}: {k}: {v}" for r, res in enumerate(outcome.results) for k, v in res.items() if v != "ok"]
        problems += [f"rank {r}: {f}" for r, f in enumerate(outcome.fatal) if f]
        assert not outcome.timed_out and len(outcome.results) == 4 and not problems, "\n".join(problems) or "timed out"
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_cross_stage_reduce_scatter_replays_ok(recorded: str) -> None:
    """Every parameter of the correct runs verified on every rank holding it, the
    cross-stage-summed ones by the steps that sum them."""
    for scen, bug, step in CASES:
        if bug:
            continue
        result = replay(os.path.join(recorded, scen.name))
        report = format_report(result)
        assert result["ok"], report
        (s,) = result["steps"]
        assert s["step"] == step and s["layout"]["pp"] == 2 and s["layout"]["dp"] == 2
        rows = [r for r in s["rows"] if r["kind"] == "param"]
        assert rows and all(r["status"] == "ok" for r in rows), report
        assert all((r["ranks"] == 0) == ("frozen" in r["name"]) for r in rows), report
        steps = {name: r["steps"] for r in rows for name in r["name"].split(" | ")}
        assert {"dp_sync", "word_embedding"} <= set(steps[WORD]) and "pos_embedding" in steps["embedding.position_embeddings.weight"]
        if scen.config.get("has_cond_embedder"):
            assert "cond_embedder" in steps["cond_embedder.timestep.weight"], report


def test_wrong_owned_embedding_element_is_named(recorded: str) -> None:
    """The planted value is reported (parameter, step, rank, flat index), nothing else is."""
    scen, _, step = CASES[-1]
    result = replay(os.path.join(recorded, scen.name))
    report = format_report(result)
    assert not result["ok"], report
    bad = [(s["step"], r) for s in result["steps"] for r in s["rows"] if r["status"] == "MISMATCH"]
    assert len(bad) == 1, report
    (got_step, row), = bad
    assert got_step == step and WORD in row["name"].split(" | "), report
    assert f"rank {BUG_RANK}, flat index {BUG_INDEX}:" in row["detail"], report
    assert f"MISMATCH step {step}" in report and WORD in report
    recorded_value = float(row["detail"].split("recorded ")[1].split(",")[0])
    expected = float(row["detail"].split("expected ")[1].split(" ")[0])
    assert np.isclose(recorded_value - expected, 1.0, atol=1e-4), report
