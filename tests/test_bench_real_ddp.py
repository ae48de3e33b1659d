"""The benchmark's real-DDP rows (``bench.real_ddp``, run by ``python -m bench``), in a reduced
configuration: megatron-core's real ``DistributedDataParallel`` in a gloo world of 4, an MLP
of 2 x 64. Checked by value, never by timing: every row is printed with numbers, the goals
are printed, and in the benchmark's own run megatron-core's finalize and torch_impl's left
bit-identical, non-zero gradients on twin DDPs (``overlap_grad_reduce`` off and on, the
distributed optimizer, bf16 with fp32 reduce; before and after the timed calls). Without megatron-core the rows are skipped with a printed reason.

Also ``bench.full_graph`` (``bench/gpu.sh`` step 3) on a CPU: megatron's ``FullCudaGraphWrapper``
around its schedule with torch_impl's finalize (the capture path taken, the torch.cuda graph
calls stood in) against eager twins, and its hand-rolled fallback without megatron-core; both
again with megatron-core 0.19.2 (the version a GPU machine is given), where its sources are there.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from launch import checkout_env, launch

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
NUMBER = r"-?[0-9]+(?:\.[0-9]+)?(?:e[-+]?[0-9]+)?"
ONLY_REAL_DDP = ["--no-fake", "--no-scale", "--no-gloo", "--no-jax", "--no-at-scale", "--no-fsdp2"]
HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


@pytest.mark.parametrize("world", [2, 4, 8])
def test_each_call_has_another_global_count_and_the_scales_cancel(world: int) -> None:
    """``bench.real_ddp.step_counts``: the global count (the sum over ranks) changes from one
    call to the next, and the no-overlap calls' scales of the summed values (world / sum)
    multiply to exactly 1 over a cycle, so the repeated calls keep the values' magnitude."""
    from fractions import Fraction

    from bench.real_ddp import step_counts

    per_rank = [step_counts(rank, world) for rank in range(world)]
    assert len({len(c) for c in per_rank}) == 1
    sums = [sum(c[turn] for c in per_rank) for turn in range(len(per_rank[0]))]
    assert sums == [world // 2, 2 * world]
    scale = Fraction(1)
    for total in sums:
        scale *= Fraction(world, total)
    assert scale == 1


def test_an_odd_world_passes_one_token_every_call() -> None:
    from bench.real_ddp import step_counts

    assert [step_counts(rank, 3) for rank in range(3)] == [(1,), (1,), (1,)]


@pytest.mark.parametrize("torch_impl_diff, expected", [(0.0, True), (2.0**-20, False)])
def test_the_gradient_goal_reads_torch_impl_alone(torch_impl_diff: float, expected: bool) -> None:
    """The row's max abs diff is the largest of the compared twins'; its gradient goal reads
    torch_impl's own, whatever a floor or another twin gave."""
    from bench.real_ddp_report import real_ddp_goals

    diffs = {"torch_impl": torch_impl_diff, "floor": 0.5}
    row = {"torch_impl / megatron-core": 1.0, "values": {"max_abs_diff": 0.5, "max_abs_diff by candidate": diffs}}
    result = {"world": 4, "layers": 2, "hidden": 64, "modes": {"no overlap": row}}
    (_, gradients) = real_ddp_goals(result)
    assert gradients["goal"].endswith("gradients, max abs diff torch_impl vs megatron-core == 0")
    assert (gradients["value"], gradients["ok"]) == (torch_impl_diff, expected)


@pytest.mark.skipif(not HAVE_MEGATRON, reason="needs megatron-core (its real DistributedDataParallel)")
def test_real_ddp_rows_have_numbers_and_identical_gradients(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    text = launch([sys.executable, "-m", "bench", *ONLY_REAL_DDP, "--rounds", "2", "--real-ddp-size", "2x64",
                   "--json", str(out)], ROOT, 600)
    report = json.loads(out.read_text())
    result = report["real_ddp"]
    assert "error" not in result, result
    assert (result["world"], result["layers"], result["hidden"], result["parameters"]) == (4, 2, 64, 2 * (64 * 64 + 64))
    assert "== megatron-core's real DDP, gloo world of 4" in text
    from bench.real_ddp import GOALS, MODES

    assert list(result["modes"]) == list(MODES)
    for mode in MODES:
        row = result["modes"][mode]
        values = row["values"]
        assert values["identical"] is True and values["max_abs_diff"] == 0.0, (mode, values)
        assert values["max_abs_diff by candidate"] == {"torch_impl": 0.0, "floor": 0.0}, (mode, values)
        assert values["steps compared"] == 2 and values["grad_abs_max"] > 0, (mode, values)  # not vacuous
        assert all(row["seconds per call"][n] > 0 for n in ("megatron-core", "torch_impl", "torch_impl no round",
                                                            "floor", "megatron-core again")), row
        assert row["megatron-core again / megatron-core"] > 0, row  # the control: two identical finalizes
        line = next(x for x in text.splitlines() if x.strip().startswith(mode))
        assert len(re.findall(NUMBER, line.split("bit-identical")[0])) >= 10, line  # 5 times, 5 ratios
        assert "bit-identical (max abs diff 0," in line, line
        for g in (f"{mode}: torch_impl finalize / floor <= {GOALS['floor']:g}",
                  f"{mode}: torch_impl / megatron-core <= {GOALS['megatron-core']:g}",
                  f"{mode}: gradients, max abs diff torch_impl vs megatron-core == 0"):
            assert re.search(rf"\[\s*(met|MISSED|floor)\] real-ddp-2L-h64-dp4 {re.escape(g)}  \(measured {NUMBER}",
                             text), (g, text)
    goals = [g for g in report["goals"] if g["goal"].startswith("real-ddp-")]
    assert len(goals) == 3 * len(MODES) and all(g["value"] is not None for g in goals)
    assert all(g["ok"] for g in goals if "gradients" in g["goal"])


@pytest.mark.skipif(not HAVE_MEGATRON, reason="needs megatron-core (its real DistributedDataParallel)")
def test_real_ddp_two_candidates_one_setting(tmp_path: Path) -> None:
    """``python -m bench.real_ddp --candidates ... --modes ... --parts``: the two finalizes alone
    in one setting (the A/B the docs quote), with their paired ratio, CPU line and value
    check, and each one's CPU part by part, every part where it belongs: torch_impl's steady
    calls replayed and agreed in its status round, which carries the token count
    (no token collective of its own), megatron-core's token count broadcast and all-reduced
    by itself, the DDP's own sync and scale in both; and the torch operations of a steady call."""
    out = tmp_path / "pair.json"
    text = launch([sys.executable, "-m", "bench.real_ddp", "--layers", "2", "--hidden", "64", "--rounds", "3",
                   "--batch", "2", "--candidates", "megatron-core", "torch_impl", "--modes", "no overlap",
                   "--parts", "--json", str(out)], ROOT, 600)
    result = json.loads(out.read_text())
    assert result["names"] == ["megatron-core", "torch_impl"] and list(result["modes"]) == ["no overlap"]
    row = result["modes"]["no overlap"]
    assert set(row["seconds per call"]) == set(row["cpu seconds per call"]) == {"megatron-core", "torch_impl"}
    assert row["torch_impl / megatron-core"] > 0 and "torch_impl / floor" not in row
    assert row["values"]["identical"] is True and row["values"]["grad_abs_max"] > 0
    assert "CPU ms of the calling thread" in text and "ours/floor" not in text
    assert [g["goal"].split(": ", 1)[1] for g in result["goals"]] == [
        "torch_impl / megatron-core <= 1.05", "gradients, max abs diff torch_impl vs megatron-core == 0"]
    from bench.real_ddp import PART_NAMES

    parts = row["cpu parts per call"]
    assert set(parts) == {"megatron-core", "torch_impl"} and all(list(p) == list(PART_NAMES) for p in parts.values())
    ours, theirs = parts["torch_impl"], parts["megatron-core"]
    for own in (ours, theirs):
        assert own["call"] > 0 and own["DDP finish_grad_sync"] > 0 and own["DDP scale_gradients"] > 0, own
        assert abs(sum(v for k, v in own.items() if k != "call") - own["call"]) < 1e-9, own  # the parts and the rest
    assert ours["steady check (replay lookup)"] > 0 and ours["status round"] > 0, ours
    assert ours["broadcast"] == ours["all_reduce"] == 0.0, ours
    assert theirs["broadcast"] > 0 and theirs["all_reduce"] > 0, theirs
    assert theirs["steady check (replay lookup)"] == theirs["status round"] == 0.0, theirs
    assert "CPU us per call, part by part" in text and "steady check (replay lookup)" in text
    functions = row["python functions per call"]  # one more steady call of each, counted exactly
    assert set(functions) == {"megatron-core", "torch_impl"}, functions
    assert all(calls >= distinct > 10 for distinct, calls in functions.values()), functions
    printed = re.search(r"Python functions \(distinct/calls\)\s+(\d+) / (\d+)\s+(\d+) / (\d+)", text)
    assert printed is not None, text
    assert [int(n) for n in printed.groups()] == [*functions["megatron-core"], *functions["torch_impl"]], text
    # the torch operations of one more steady call: each DDP's sync and scale, the token count's
    # collectives (megatron-core's own broadcast and all-reduce; torch_impl's status round) and
    # torch_impl's one write of the global count into num_tokens (its factor made without one)
    ops = row["torch operations per call"]
    assert set(ops) == {"megatron-core", "torch_impl"}, ops
    for own in ops.values():
        assert "c10d.allreduce_coalesced_.default" in own and own[-1] == "aten.mul_.Tensor", own
    assert {"c10d.broadcast_.default", "c10d.allreduce_.default"} <= set(ops["megatron-core"]), ops
    assert ops["torch_impl"].count("c10d.allreduce_.default") == 1 and "c10d.broadcast_.default" not in ops["torch_impl"]
    assert ops["torch_impl"].count("aten.fill_.Scalar") == 1, ops
    printed = re.search(r"torch operations\s+(\d+)\s+(\d+)", text)
    assert printed is not None and [int(n) for n in printed.groups()] == [len(ops["megatron-core"]), len(ops["torch_impl"])]


@pytest.mark.skipif(not HAVE_MEGATRON, reason="needs megatron-core (its real DistributedDataParallel)")
def test_real_ddp_opt_in_candidates(tmp_path: Path) -> None:
    """The candidates timed only when asked for (``--candidates``): ``torch_impl unchecked``,
    torch_impl's finalize with its steady check answered from the first yes
    (``bench.unchecked``), and ``floor, count first``, the floor with the token count's
    all-reduce before the DDP's sync. The unchecked twin's steady calls skip the check
    (counted); the unchecked twin's and both floors' gradients are compared with
    megatron-core's like torch_impl's, with overlap too (new gradients on every call)."""
    out = tmp_path / "opt_in.json"
    text = launch([sys.executable, "-m", "bench.real_ddp", "--layers", "2", "--hidden", "64", "--rounds", "2",
                   "--batch", "2", "--candidates", "megatron-core", "torch_impl", "floor", "torch_impl unchecked",
                   "floor, count first", "--modes", "no overlap", "overlap_grad_reduce", "--json", str(out)], ROOT, 600)
    result = json.loads(out.read_text())
    assert result["names"] == ["megatron-core", "torch_impl", "floor", "torch_impl unchecked", "floor, count first"]
    for mode in ("no overlap", "overlap_grad_reduce"):
        row = result["modes"][mode]
        ratios = ("torch_impl / torch_impl unchecked", "torch_impl / megatron-core", "floor, count first / floor",
                  "torch_impl / floor, count first")
        assert all(row[key] > 0 for key in ratios), row
        skipped, calls = row["torch_impl unchecked: calls without the check"]
        # two checks, three warm-up calls and 2 x 2 timed: all but the first calls of the
        # model (before a replay was kept) skip the check
        assert calls == 2 + 3 + 2 * 2 and calls - 3 <= skipped < calls, (skipped, calls)
        values = row["values"]  # torch_impl's, the unchecked twin's and the floors', each against megatron-core
        assert values["identical"] is True and values["max_abs_diff"] == 0.0 and values["grad_abs_max"] > 0, values
        assert values["max_abs_diff by candidate"] == {n: 0.0 for n in result["names"][1:]}, values
        line = next(x for x in text.splitlines() if x.strip().startswith(mode))
        assert "bit-identical (max abs diff 0," in line and len(re.findall(NUMBER, line.split("bit-identical")[0])) >= 5
    assert "ours/unchecked" in text and "first/floor" in text and "ours/first" in text
    # torch_impl's three per setting (over the floor, over megatron-core, its gradients); the opt-in ones have none
    assert len(result["goals"]) == 6 and not any("unchecked" in g["goal"] or "first" in g["goal"] for g in result["goals"])


def test_real_ddp_rows_skipped_with_a_reason(tmp_path: Path) -> None:
    """Without megatron-core (hidden from the import system) the rows are skipped with the
    reason printed; ``--no-real-ddp`` leaves them out."""
    hide = ("import sys; sys.modules['megatron'] = None; from bench.run import main; "
            "raise SystemExit(main(sys.argv[1:]))")
    env = checkout_env()
    runs = {"missing": [sys.executable, "-c", hide, *ONLY_REAL_DDP, "--json", str(tmp_path / "missing.json")],
            "off": [sys.executable, "-m", "bench", *ONLY_REAL_DDP, "--no-real-ddp", "--json", str(tmp_path / "off.json")]}
    for name, cmd in runs.items():
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        report = json.loads((tmp_path / f"{name}.json").read_text())
        if name == "missing":
            assert "skipped: megatron-core is not installed" in proc.stdout, proc.stdout
            assert report["real_ddp"] == {"skipped": "megatron-core is not installed (pip install megatron-core)"}
        else:
            assert "real DDP" not in proc.stdout and report["real_ddp"] is None, proc.stdout


@pytest.mark.skipif(not HAVE_MEGATRON, reason="needs megatron-core (its FullCudaGraphWrapper, schedule and DDP)")
@pytest.mark.parametrize("model", ["gpt", "mlp"])
def test_full_graph_wrapper_cpu_path_matches_eager(tmp_path: Path, model: str) -> None:
    """``bench.full_graph`` on a CPU (``bench/gpu.sh`` step 3): megatron's
    ``FullCudaGraphWrapper`` around its schedule with torch_impl's finalize, the capture path
    taken for the capture and every replay, equals the eager twins bit for bit at every step;
    and megatron-core's finalize on the eager twin gives the same values."""
    from bench.full_graph import STEPS, WARMUP

    out = tmp_path / "graph.json"
    text = launch([sys.executable, "-m", "bench.full_graph", "--device", "cpu", "--model", model, "--json", str(out)],
                  ROOT, 600)
    result = json.loads(out.read_text())
    assert "PASS" in text.splitlines()[-1], text[-2000:]
    assert (result["impl"], result["model"], result["schedule"]) == (
        "megatron FullCudaGraphWrapper", model, "forward_backward_no_pipelining")
    assert result["runs flagged as captured"] == STEPS - WARMUP  # the capture, then each later replay
    phases = [row["phase"] for row in result["steps"]]
    assert phases == ["eager (warm-up)"] * WARMUP + ["capture + replay"] + ["replay"] * (STEPS - WARMUP - 1)
    assert result["bit_identical"] == {"graph vs eager": True, "eager megatron-core vs eager torch_impl": True}
    for row in result["steps"]:
        assert all(v == 0.0 for k, v in row.items() if k.endswith("max abs diff")), row
        assert row["eager: grads max abs"] > 0 and row["eager: loss max abs"] > 0, row  # not vacuous
    assert result["values_ok"] is True


def test_full_graph_falls_back_to_the_hand_rolled_capture(tmp_path: Path) -> None:
    """Without megatron-core (hidden from the import system) ``bench.full_graph`` runs its
    hand-rolled capture on ``bench.ddp.MiniDDP``, replays equal to eager steps."""
    out = tmp_path / "hand.json"
    code = ("import sys; sys.modules['megatron'] = None; from bench.full_graph import main; "
            "raise SystemExit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, "--device", "cpu", "--json", str(out)], cwd=ROOT,
                          env=checkout_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert "hand-rolled capture (fallback)" in proc.stdout
    assert result["impl"] == "hand-rolled torch.cuda.graph" and result["ddp"].startswith("bench.ddp.MiniDDP")
    assert result["values_ok"] is True and result["max_rel_diff_replay_vs_eager"] <= 1e-6
    assert result["grad_abs_max"] > 0  # not vacuous


#: Runs ``bench.full_graph`` with megatron-core 0.19.2's sources imported first (the
#: version a GPU machine is given: bench/README.md), arguments after the code.
_WITH_019 = ("import runpy, sys; from parity_tests.megatron019 import import_megatron, source_dir; "
             "import_megatron(str(source_dir())); import megatron.core; "
             "print('megatron-core', megatron.core.__version__); sys.argv[0] = 'bench.full_graph'; "
             "runpy.run_module('bench.full_graph', run_name='__main__', alter_sys=True)")


@pytest.mark.parametrize("impl", ["hand", "wrapper"])
def test_full_graph_cpu_path_with_megatron_core_019(tmp_path: Path, impl: str) -> None:
    """``bench/gpu.sh`` steps 3 and 4 on a CPU with megatron-core 0.19.2's real DDP (its
    ``start_grad_sync`` asks CUDA for the current stream, stood in on a CPU): the hand-rolled
    capture and megatron's ``FullCudaGraphWrapper`` with torch_impl's finalize replay
    exactly what the eager twin computes, gradients not zero."""
    from parity_tests import megatron019 as m19

    if m19.source_dir() is None:
        pytest.skip(m19.skip_reason())
    out = tmp_path / f"{impl}.json"
    text = launch([sys.executable, "-c", _WITH_019, "--device", "cpu", "--impl", impl, "--rounds", "2",
                   "--json", str(out)], ROOT, 600)
    result = json.loads(out.read_text())
    assert f"megatron-core {m19.VERSION}" in text and "PASS" in text.splitlines()[-1], text[-3000:]
    assert result["values_ok"] is True
    if impl == "hand":
        assert result["ddp"] == "megatron-core DDP" and result["max_rel_diff_replay_vs_eager"] == 0.0
        assert result["grad_abs_max"] > 0  # not vacuous
    else:
        assert result["megatron_core"] == m19.VERSION
        assert result["bit_identical"] == {"graph vs eager": True, "eager megatron-core vs eager torch_impl": True}
        assert all(row["eager: grads max abs"] > 0 for row in result["steps"])  # not vacuous
