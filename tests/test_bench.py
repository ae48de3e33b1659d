"""The benchmark's CPU-runnable parts, checked by value (no timing is asserted).

``bench/gpu.sh --cpu-smoke`` runs every step of the GPU script on the CPU with tiny
layouts; the collective counter and the DDP-like chunk are checked directly.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]


def test_collective_counter_restores_torch_distributed():
    import torch.distributed as dist

    from bench.counting import CollectiveCounter

    original = dist.all_reduce
    with CollectiveCounter() as counter:
        assert dist.all_reduce is not original
    assert dist.all_reduce is original and counter.total == 0


def test_mini_ddp_buffers_hold_main_grads_in_reverse_order():
    from bench.ddp import MiniDDP
    from bench.models import Layout, build_chunk, count_non_tp

    lay = Layout("t", 2, 64, tp=2, pp=1, dp=1, vocab=128)
    chunk = build_chunk(lay, 0)
    assert count_non_tp(chunk) == 2 * 8 + 1  # 8 per layer + the final layernorm
    ddp = MiniDDP(chunk, None, lazy=False)
    (flat, group), = ddp.grad_buffers
    params = [p for p in chunk.parameters() if p.requires_grad]
    assert group is None and flat.numel() == sum(p.numel() for p in params)
    assert params[-1].main_grad.storage_offset() == 0
    flat.fill_(3.0)
    ddp.scale_gradients(torch.tensor(0.5))
    assert all(torch.equal(p.main_grad, torch.full(p.shape, 1.5)) for p in params)


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")
def test_gpu_script_cpu_smoke(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu.sh"), "--cpu-smoke"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    side = json.loads((tmp_path / "gpu_side_by_side.json").read_text())
    (layout,) = side["fake"]
    assert layout["bytes_copied"]["meshgrad buffers"] == 0
    # Same collectives as Megatron (DP, non-TP, embedding), never more.
    if "megatron" in layout["collectives"]:
        assert layout["collectives"]["meshgrad buffers"] <= layout["collectives"]["megatron"]
    world1 = json.loads((tmp_path / "gpu_world_of_one.json").read_text())
    assert world1["bytes_copied_meshgrad_buffers"] == 0 and world1["eager values_ok"] is True
    assert world1["graph meshgrad buffers"] == {"skipped": "no CUDA device"}
    fake = json.loads((tmp_path / "gpu_fake_graph.json").read_text())
    assert fake["graph meshgrad buffers"] == {"skipped": "no CUDA device"} and fake["eager values_ok"] is True
    # The one file: every step's JSON as written, and each step's outcome, time and log.
    report = json.loads((tmp_path / "gpu_report.json").read_text())
    assert report["steps"]["gpu_world_of_one.json"] == world1 and report["steps"]["gpu_fake_graph.json"] == fake
    assert report["failed steps"] == [] and [r["outcome"] for r in report["runs"]] == ["ok"] * 5
    assert report["budget_s"] == 450 and sum(r["seconds"] for r in report["runs"]) <= report["elapsed_s"] <= 450
    assert all(r["limit_s"] == 150 for r in report["runs"])
    hand = report["runs"][3]
    assert hand["step"].startswith("4/5") and any("replay == eager" in line and "PASS" in line for line in hand["log_tail"])


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")
@pytest.mark.parametrize("limits, outcome", [({"STEP_TIMEOUT": "1"}, "timeout"), ({"BUDGET": "30"}, "skipped")])
def test_gpu_script_keeps_to_its_budget(tmp_path, limits, outcome):
    """A step is stopped at STEP_TIMEOUT or at what is left of BUDGET (skipped under 20 s
    left); the script goes on, writes the report and exits 1."""
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, **limits)
    (tmp_path / "gpu_fake_graph.json").write_text('{"from": "an earlier run"}')
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh"), "--cpu-smoke"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_report.json").read_text())
    runs = report["runs"]
    assert [r["outcome"] for r in runs] == [outcome] * 5 and report["failed steps"] == [r["step"] for r in runs]
    assert report["steps"] == {}  # no step wrote its file, and the earlier run's is gone
    expected_limit = 1 if outcome == "timeout" else 0
    assert all(r["limit_s"] == expected_limit and r["seconds"] <= expected_limit + 10 for r in runs)
    assert report["elapsed_s"] <= int(limits.get("BUDGET", 450))


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_script_help_is_its_whole_header():
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh"), "--help"], capture_output=True, text=True, timeout=60)
    lines = (ROOT / "bench" / "gpu.sh").read_text().splitlines()[1:]  # after the shebang
    header = lines[:next(i for i, line in enumerate(lines) if not line.startswith("#"))]
    assert proc.returncode == 0 and proc.stdout.splitlines() == header
    assert "BUDGET (seconds for the whole script, default 450)" in proc.stdout and header[-1] == "# is usable."


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
@pytest.mark.parametrize("megatron", ["as installed", "not importable"])
def test_gpu_script_refuses_without_a_gpu(tmp_path, megatron):
    """Exit 2 after the environment step, whose megatron-core line says what steps 3 and 4
    will find: the version that imports, or the import's error (not merely "installed")."""
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=sys.executable)
    if megatron == "not importable":  # a megatron package whose import fails, first on the path
        core = tmp_path / "site" / "megatron" / "core"
        core.mkdir(parents=True)
        (core.parent / "__init__.py").write_text("")
        (core / "__init__.py").write_text('raise ImportError("No module named \'packaging\'")\n')
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), env.get("PYTHONPATH", "")])
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "no usable CUDA device" in proc.stderr
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("megatron-core:")]
    if megatron == "not importable":
        expected = "megatron-core: installed but not importable (ImportError: No module named 'packaging'); "
        assert line == expected + "meshgrad's stand-ins"
    elif importlib.util.find_spec("megatron") is None:
        assert line == "megatron-core: no (meshgrad only)"
    else:  # the version and place of the package the steps import
        from megatron.core import package_info

        where = str(Path(package_info.__file__).parents[2])
        assert line == f"megatron-core: {package_info.__version__} from {where}"


_COUNTS = r"""
import dataclasses, json
from bench.fake import launch_counts
from bench.models import Layout
lay = Layout("t", 4, 256, tp=8, pp=2, dp=2, vocab=1024)
cases = {
    "base": (lay, {}),
    "mixed-dtypes": (lay, dict(mixed=True)),
    "tp-avg": (lay, dict(tp_avg=True)),
    "tokens": (lay, dict(tokens=True)),
    "all": (lay, dict(mixed=True, tp_avg=True, tokens=True)),
    "moe": (dataclasses.replace(lay, moe_experts=4), dict(mixed=True, tokens=True)),
    "pp1": (dataclasses.replace(lay, pp=1), dict(mixed=True, tp_avg=True, tokens=True)),
}
print("COUNTS" + json.dumps({k: launch_counts(l, **kw) for k, (l, kw) in cases.items()}))
"""


def test_never_more_collectives_than_megatron_core():
    pytest.importorskip("megatron.core")
    proc = subprocess.run([sys.executable, "-c", _COUNTS], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("COUNTS"))
    counts = json.loads(line[len("COUNTS"):])
    for case, got in counts.items():
        for ours in ("meshgrad buffers", "meshgrad drop-in"):
            assert got[ours] <= got["megatron"], (case, got)
    # Mixed dtypes: Megatron flattens the non-TP grads into one collective; so does the
    # fused plan (DP sync: one per dtype on both sides).
    assert counts["mixed-dtypes"]["meshgrad buffers"] == counts["mixed-dtypes"]["megatron"] == 4


_NUMBER = r"[0-9]+(?:\.[0-9]+)?"


_DROPIN_PARTS = """
import json, re
from bench import dropin_parts
from bench.run import FAKE_LAYOUTS
result = dropin_parts.measure(FAKE_LAYOUTS["gpt-24L-h1024"], rounds=2, batch=2, copies=True)
text = dropin_parts.report(result)
print("RESULT" + json.dumps({"grads": result["non_tp_grads"], "watched": result["watched"],
      "answers": result["answers"], "times": sorted(result["time"]), "copies": sorted(result["copies"]),
      "text": text}))
"""


def test_dropin_parts_profile_times_the_steady_checks_parts():
    """``python -m bench.dropin_parts``: the parts it times are the steady check's own (each
    answers "unchanged" as the step's check does), over the layout's 96 non-TP gradients
    and the 97 parameters the helper watches in full (the 96 and the tied embedding); each
    other staging it times (``--copies``) moved exactly the gradients' values (checked in
    the run: it raises otherwise)."""
    proc = subprocess.run([sys.executable, "-c", _DROPIN_PARTS], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))[len("RESULT"):])
    assert (got["grads"], got["watched"]) == (96, 97)
    assert got["answers"] == dict.fromkeys(
        ["probes", "params: requires_grad, shapes", "main_grads: shapes, dtypes", "attribute dicts",
         "main_grad pointers", "module-tree edges"], True)
    assert got["times"] == sorted(["step", "floor", "staging floor", "program", "probes", "params: requires_grad, shapes",
                                   "main_grads: shapes, dtypes", "attribute dicts", "main_grad pointers",
                                   "module-tree edges", "probes, then program", "step without probes and program"])
    assert got["copies"] == sorted(f"{way}: {op}" for way, op in [
        ("in", "_foreach_copy_"), ("out", "_foreach_copy_"), ("in", "torch.cat"), ("out", "split_with_sizes_copy"),
        ("in", "index_select"), ("out", "index_copy_"), ("in", "strided runs"), ("out", "strided runs")])
    assert re.search(rf"step\s+{_NUMBER}\s+floor\s+{_NUMBER}\s+step / floor {_NUMBER}", got["text"]), got["text"]
    assert re.search(rf"staging floor\s+{_NUMBER} .*step / it {_NUMBER}\s+beyond it {_NUMBER}", got["text"]), got["text"]
    # step, staging floor, 9 parts, the rest
    assert len(re.findall(rf"^  \S.*\s-?{_NUMBER}\s", got["text"], flags=re.M)) == 12, got["text"]
    assert len(re.findall(rf"^    (?:in|out): .*\s{_NUMBER}$", got["text"], flags=re.M)) == 8, got["text"]


def test_bench_prints_scale_rows_and_copy_floor(tmp_path):
    """The MoE scale rows and the drop-in copy floor are printed with numbers and goals
    (no timing threshold is asserted)."""
    import re

    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "bench", "--quick", "--no-gloo", "--no-real-ddp", "--no-fsdp2", "--no-jax", "--no-at-scale", "--layouts", "gpt-24L-h1024", "--rounds", "2",
           "--scale-rows", "8x8", "32x8", "16x32", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    assert re.search(rf"non_tp floor ms\s+{_NUMBER}\s.*drop-in / floor {_NUMBER}", text), text
    assert re.search(rf"staging floor ms\s+{_NUMBER}\s.*drop-in / it {_NUMBER}", text), text
    for row, params in (("8x8", 169), ("32x8", 673), ("16x32", 16 * (5 + 2 * 32) + 1)):
        lines = [x for x in text.splitlines() if re.match(rf"\s+{row}\s+{params}\s", x)]
        assert len(lines) == 3, (row, text)  # DDP chunks, meshgrad buffers, user grads
        for line in lines:
            assert len(re.findall(_NUMBER, line)) >= 7, line
    for goal in ("drop-in non_tp / copy floor (", "DDP chunks: step / megatron-core <= 0.1",
                 "DDP chunks: step / step at 32x8 <= 1.5", "DDP chunks: first call / megatron-core's first call <= 2",
                 "DDP chunks: first call / megatron-core's step <= 2"):
        assert re.search(rf"\[\s*(met|MISSED|n/a|floor)\] .*{re.escape(goal)}", text), (goal, text)
    from bench.goals import split_goals

    report = json.loads(out.read_text())
    kept, bound, stretch = split_goals(report["goals"])
    for g in bound:  # a goal its floor misses is printed apart, never as a goal
        assert g["floor"] > g["limit"] and f"[ floor] {g['goal']}" in text.split("== not goals")[1]
    for g in kept:
        assert g["floor"] is None or g["floor"] <= g["limit"]
        assert text.count(g["goal"]) == 1 and "[ floor] " + g["goal"] not in text
    # the stretch goals (the moonshot, the staging floor) are judged in their own section
    stretch_part = text.split("== stretch goals")[1].split("== not goals")[0]
    assert sorted(g["goal"].split(": ", 1)[1].split(" (")[0] for g in stretch) == [
        "drop-in non_tp / meshgrad's staging floor", "non_tp meshgrad/megatron <= 0.05"]
    for g in stretch:
        assert text.count(g["goal"]) == 1 and g["goal"] in stretch_part and g["value"] > 0
        assert g["ok"] == (g["value"] <= g["limit"])
    report = json.loads(out.read_text())
    rows = {r["row"]: r for r in report["scale"]["rows"]}
    assert rows["16x32"]["params"] == 1105 and rows["16x32"]["non_tp_tensors"] == 5 * 16 + 1
    for r in rows.values():
        assert r["bytes_copied"]["buffers"] == 0
        assert r["first_call"]["DDP chunks"] > 0 and r["step"]["DDP chunks"]["median"] > 0
        # the first-call goal pairs each round's two first calls (one fresh model of each per round)
        ours, theirs = r["first_call_samples"]["DDP chunks"], r["first_call_samples"]["megatron"]
        assert len(ours) == len(theirs) == 3 and r["first_call"]["DDP chunks"] == statistics.median(ours)
        assert r["first_call_vs_megatron"] == statistics.median(a / b for a, b in zip(ours, theirs))
        # the first call's Python functions, counted on one more fresh model: (distinct, calls)
        for kind in ("DDP chunks", "megatron"):
            distinct, calls = r["first_call_functions"][kind]
            assert 0 < distinct <= calls, (kind, r["first_call_functions"])
    big = rows["16x32"]
    (ours, mcore) = (big["first_call_functions"][k] for k in ("DDP chunks", "megatron"))
    assert (f"first call at 16x32: enters {ours[0]} Python functions ({ours[1]} calls) "
            f"(megatron-core's first call: {mcore[0]} ({mcore[1]} calls))") in text, text
    (first_goal,) = [g for g in report["goals"] if g["goal"].endswith("first call / megatron-core's first call <= 2")]
    assert first_goal["value"] == big["first_call_vs_megatron"]
    (layout,) = report["fake"]
    assert layout["time"]["floor"]["non_tp"]["median"] > 0 and layout["time"]["staging floor"]["non_tp"]["median"] > 0


def test_a_goal_its_floor_misses_is_not_printed_as_a_goal():
    """Goals are judged; a stretch goal is judged in its own section; a goal (stretch or
    not) that its floor alone misses is printed apart with no verdict."""
    from bench.goals import format_goals, goal, markdown_goals, split_goals

    growth = goal("moe-64x128: step / step at 32x8 <= 1.5", 2.09, 1.5, floor=2.269)  # the floor alone: 2.269
    ratio = goal("moe-64x128: step / megatron-core <= 0.1", 0.043, 0.1, floor=0.02)
    first = goal("moe-64x128: first call <= 100 ms", 120.0, 100.0)
    moonshot = goal("moe-64x128: step / megatron-core <= 0.03", 0.043, 0.03, floor=0.02, stretch=True)
    unreachable = goal("moe-64x128: step / megatron-core <= 0.01", 0.043, 0.01, floor=0.02, stretch=True)
    every = [growth, ratio, moonshot, first, unreachable]
    kept, bound, stretch = split_goals(every)
    assert kept == [ratio, first] and bound == [growth, unreachable] and stretch == [moonshot]
    assert (ratio["ok"], first["ok"], moonshot["ok"]) == (True, False, False)
    text = format_goals(every)
    goals_part, rest = text.split("== stretch goals")
    stretch_part, floor_part = rest.split("== not goals")
    assert "[   met] moe-64x128: step / megatron-core <= 0.1  (measured 0.0430; floor 0.0200)" in goals_part
    assert "[MISSED] moe-64x128: first call <= 100 ms  (measured 120.0000)" in goals_part
    assert "step at 32x8" not in goals_part and "0.03" not in goals_part
    assert "[MISSED] moe-64x128: step / megatron-core <= 0.03  (measured 0.0430; floor 0.0200)" in stretch_part
    assert "[ floor] moe-64x128: step / step at 32x8 <= 1.5  (measured 2.0900; floor 2.2690)" in floor_part
    assert "[ floor] moe-64x128: step / megatron-core <= 0.01  (measured 0.0430; floor 0.0200)" in floor_part
    assert "== stretch goals" not in format_goals([growth, ratio, first])
    table = markdown_goals(every, {"argv": ["--quick"], "cpus": 2, "machine": "x86_64",
                                   "python": "3.11.7", "torch": "2.13.0", "megatron_core": "0.16.1"})
    assert table.startswith("Measured by `.venv/bin/python -m bench --quick` on 2 CPU cores")
    assert "| moe-64x128: first call <= 100 ms | 120.0000 | - | **missed** |" in table
    assert "| moe-64x128: step / megatron-core <= 0.03 | 0.0430 | 0.0200 | stretch: **missed** |" in table
    assert "| moe-64x128: step / step at 32x8 <= 1.5 | 2.0900 | 2.2690 | no goal: its floor misses it |" in table


def test_dropin_parts_staging_check_refuses_a_wrong_staging():
    """Each staging ``bench.dropin_parts`` times is checked by value before it is timed: one
    that moves the gradients in another order, or puts back other values, is refused, and
    the gradients are left as they were."""
    from bench.dropin_parts import _check_variants, staging_variants

    base = torch.arange(12, dtype=torch.float32)
    grads = [base[0:4].view(2, 2), base[6:9], base[9:12]]
    variants = staging_variants(grads, base)  # the real ones pass
    staged = torch.empty(10)
    views = [staged[0:4].view(2, 2), staged[4:7], staged[7:10]]
    with pytest.raises(RuntimeError, match="in: reversed"):
        _check_variants({"in: reversed": lambda: staged.copy_(torch.cat([g.reshape(-1) for g in grads]).flip(0))}, grads, staged)
    with pytest.raises(RuntimeError, match="out: doubled"):
        _check_variants({"out: doubled": lambda: [g.copy_(2 * v) for g, v in zip(grads, views)]}, grads, staged)
    assert torch.equal(base, torch.arange(12, dtype=torch.float32))  # put back after each check
    assert sorted(variants) == sorted(["in: _foreach_copy_", "out: _foreach_copy_", "in: torch.cat",
                                       "out: split_with_sizes_copy", "in: index_select", "out: index_copy_"])
