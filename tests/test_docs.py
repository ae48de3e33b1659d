"""The documentation works as written: README and docs/ snippets run and print what they
say (every python block of README.md and docs/*.md: a program, or a fragment run with the
objects it names, or a block marked ```python no-run REASON), commands use the venv, links
resolve, the reliability table names the measured types, stated times are
bench/setup_times.py's tables; the parity report's html and progress output; the examples
added for newcomers (a verdict, a semantics variant)."""

from __future__ import annotations

import ast
import dataclasses
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from launch import checkout_env, launch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
TIMEOUT_S = 240


def blocks(path: Path, kind: str) -> list[str]:
    """Code blocks of ``path`` preceded by ``<!-- docs-test: KIND -->``."""
    text = path.read_text()
    return re.findall(rf"<!-- docs-test: {re.escape(kind)} -->\n```python\n(.*?)```", text, re.S)


def run(cmd: list[str], cwd: Path) -> str:
    """Run ``cmd`` with the checkout on PYTHONPATH; return stdout, fail on a non-zero exit."""
    proc = subprocess.run(cmd, cwd=cwd, env=checkout_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"exit {proc.returncode}: {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def floats(text: str) -> list[float]:
    return [float(v) for v in re.findall(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", text)]


# --------------------------------------------------------------------------- snippets


def test_readme_jax_shard_map_snippet_runs_as_written(tmp_path: Path) -> None:
    (snippet,) = blocks(README, "python")
    out = run([sys.executable, "-c", snippet], tmp_path).split()
    assert len(out) == 1 and float(out[0]) <= 1e-6


def test_docs_jax_snippets_run_as_written(tmp_path: Path) -> None:
    shard_map, stacked = blocks(DOCS / "jax.md", "python")
    diffs = [float(v) for v in run([sys.executable, "-c", shard_map], tmp_path).split()]
    assert len(diffs) == 2 and max(diffs) <= 1e-6
    lines = run([sys.executable, "-c", stacked], tmp_path).strip().splitlines()
    assert float(lines[0]) == 0.25  # 2 dp x 2 tp x 1.0 / 16 tokens
    assert floats(lines[1]) == [0.01, 0.01, -0.01, -0.01]
    assert floats(lines[2]) == [0.0, 0.0, 0.0, 0.0]


def test_readme_torch_snippet_runs_as_written(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    (snippet,) = blocks(README, "torchrun 2")
    script = tmp_path / "demo_torch.py"
    script.write_text(snippet)
    out = launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)],
                 tmp_path, TIMEOUT_S)
    # The two processes share stdout: their lines may interleave, so match each report.
    reports = dict(re.findall(r"rank (\d+): (per-token -?[\d.]+, mean -?[\d.]+)", out))
    assert sorted(reports) == ["0", "1"], out
    assert reports["0"] == reports["1"]  # finalized: equal on both ranks
    assert all(v != 0 for v in floats(reports["0"]))


# --------------------------------------------------------------------------- text


#: The pages whose commands must run from a clone as written (docs/install.md's pip
#: commands run in the user's own environment; tests/test_packaging.py runs them).
COMMAND_PAGES = (README, DOCS / "migrating.md", DOCS / "reliability.md", DOCS / "performance.md")


def test_readme_commands_use_the_venv_or_make() -> None:
    commands = [
        line.strip() for path in COMMAND_PAGES for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S)
        for line in block.splitlines() if line.strip() and not line.strip().startswith("#")
    ]
    assert len(commands) >= 8
    allowed = ("make ", ".venv/bin/", "bash ", "XLA_FLAGS=", "MESHGRAD_")
    bad = [c for c in commands if not c.startswith(allowed)]
    assert not bad, f"commands that do not use the venv or make: {bad}"
    for path in COMMAND_PAGES:
        # inline code only: not a fence's info string (```python no-run ...)
        for inline in re.findall(r"(?<!`)`((?:python|torchrun) [^`\n]*)`", path.read_text()):
            pytest.fail(f"bare command in {path.name}: {inline!r}")


def test_the_readme_is_a_short_front_page() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    for page in ("install", "migrating", "semantics", "reliability", "performance", "jax", "audit", "architecture"):
        assert f"](docs/{page}.md" in text, page
    assert "runs/" in (ROOT / ".gitignore").read_text().split()  # made by the documented audit command


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of ``path`` and its explicit ``<a id>``s."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    heads = re.findall(r"^#{1,6} (.+)$", text, re.M)
    slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}
    return slugs | set(re.findall(r'<a id="([^"]+)"></a>', text))


def test_every_relative_link_resolves() -> None:
    pages = (README, *sorted(DOCS.glob("*.md")), ROOT / "examples" / "README.md", ROOT / "bench" / "README.md")
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            assert dest.exists(), f"{page.name}: {target}"
            if anchor and dest.suffix == ".md":
                assert anchor in _anchors(dest), f"{page.name}: {target} (no such heading in {dest.name})"


def test_the_config_table_lists_every_field_the_code_reads() -> None:
    """docs/migrating.md's "Config fields read": every FinalizeConfig field and Megatron
    size is there, and the config rows name nothing else."""
    import dataclasses

    from meshgrad import FinalizeConfig
    from meshgrad.config import MEGATRON_SIZE_FIELDS

    text = (DOCS / "migrating.md").read_text()
    section = text[text.index("## Config fields read"):]
    section = section[:section.index("\n## ", 4)]
    rows = {line.split("|")[1].strip(): set(re.findall(r"`(\w+)(?:\(\))?\*?`", line.split("|")[2]))
            for line in section.splitlines() if line.startswith("| ") and not line.startswith("| from")}
    named = set().union(*rows.values())
    fields = {f.name for f in dataclasses.fields(FinalizeConfig)}
    assert fields | set(MEGATRON_SIZE_FIELDS) <= named, sorted(fields | set(MEGATRON_SIZE_FIELDS) - named)
    config_rows = {k: v for k, v in rows.items() if not k.startswith("the chunk module")}
    extra = set().union(*config_rows.values()) - fields - set(MEGATRON_SIZE_FIELDS)
    assert not extra, f"config rows name fields the code does not read: {sorted(extra)}"


def test_the_reliability_table_check_compares_rows_with_numbers_normalized() -> None:
    from doc_table import DOC, documented_rows, undocumented

    text = "x\n| kind | case | outcome |\n|---|---|---|\n| fault | rank 1 stalls 8 s [4 ranks] | CollectiveError after <= 5.0 s |\n\n"
    assert documented_rows(text) == [("fault", "rank 1 stalls 8 s [4 ranks]", "CollectiveError after <= 5.0 s")]
    same = ("fault", "rank 1 stalls 9 s [4 ranks]", "CollectiveError after <= 4.9 s")  # another run's numbers
    other = ("fault", "rank 1 stalls 8 s [4 ranks]", "UserWarning after <= 5.0 s")  # another behaviour
    assert undocumented([same, other], text) == [other]
    # The page's own table: every outcome names what happens (an error type, a warning, or a result).
    page = DOC.read_text()
    rows = documented_rows(page)
    assert len(rows) >= 40
    for kind, case, outcome in rows:
        assert re.search(r"\w+(Error|Warning)\b|replanned|read like|agree|equals|collectives|numbers", outcome), (
            case, outcome)


def test_the_reliability_table_gives_the_measured_warning_or_error_type() -> None:
    """The group-size rows: a UserWarning by default, a ValueError with strict_groups=True;
    the likely mistakes: a LikelyMistakeWarning; the new classes: the types their tests check."""
    from doc_table import DOC, documented_rows

    rows = {case: outcome for _, case, outcome in documented_rows(DOC.read_text())}

    def outcome(start: str) -> str:
        (found,) = [o for c, o in rows.items() if c.startswith(start)]
        return found

    assert outcome("tp group size != config.tensor_model_parallel_size, default").startswith("UserWarning once per plan")
    assert outcome("tp group size != config.tensor_model_parallel_size, strict_groups=True").startswith("ValueError")
    assert outcome("num_tokens passed with calculate_per_token_loss=False").startswith("LikelyMistakeWarning")
    assert outcome("a user method finalize calls raises RuntimeError").startswith("RuntimeError there, ConsistencyError")
    assert outcome("a user method finalize calls raises KeyboardInterrupt").startswith("KeyboardInterrupt there")
    assert outcome("num_tokens float16 on rank").startswith("ConsistencyError on every rank")
    assert outcome("num_tokens NaN on rank").startswith("NonFiniteGradError on every rank")
    assert outcome("finalize entered on ranks").startswith("CollectiveError naming the status round")
    assert outcome("DeviceMesh: the expert layout changed").startswith("AgreedInputError")
    for when in ("after step 1", "after steady steps"):
        assert outcome(f"param.data replaced by another shape {when}").startswith("ValueError naming the shape")
    assert outcome("NaN on one rank in a Megatron DDP").startswith("NonFiniteGradError on every rank")
    assert outcome("finalize with a Megatron DDP under a distributed optimizer").startswith("LayoutWarning once per plan")
    for field, error in (("consistency_check", "ValueError"), ("check_for_nan_in_grad", "TypeError")):
        assert outcome(f"config.{field} = ").startswith(f"{error} naming the field there, ConsistencyError")


def test_no_references_to_files_a_clone_lacks() -> None:
    for path in (README, *sorted(DOCS.glob("*.md")), ROOT / "examples" / "README.md"):
        text = path.read_text()
        assert "SPEC" not in text, path
        assert not re.search(r"\bthe seed\b|\bseed's\b", text), path


def test_semantics_links_resolve() -> None:
    anchors = set(re.findall(r'<a id="([^"]+)"></a>', (DOCS / "semantics.md").read_text()))
    steps = {"dp_sync", "cond_embedder", "router", "non_tp", "gtp", "word_embedding", "pos_embedding",
             "expert_bias", "qb_beta", "reset", "token_scale"}
    assert steps <= anchors
    for path in (README, DOCS / "jax.md", DOCS / "semantics.md"):
        for target, anchor in re.findall(r"\]\(((?:docs/)?semantics\.md)?#([\w-]+)\)", path.read_text()):
            if target:
                assert anchor in anchors, f"{path.name}: semantics.md#{anchor}"
    from parity_tests.report import STEPS

    assert set(STEPS) == steps  # the report's step names are the documented ones


# --------------------------------------------------------------------------- jax_impl


def test_bare_string_key_is_the_pytree_path_of_chunk_0() -> None:
    out = run([sys.executable, "-c", """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import numpy as np
from meshgrad import FinalizeConfig, ParallelDims, ParamSpec, plan_finalize
from jax_impl.finalize import finalize
dims = ParallelDims(dp=2, tp=2)
plan = plan_finalize([ParamSpec("w", shape=(2,))], FinalizeConfig(), dims)
g = np.arange(8, dtype=np.float32).reshape(4, 2)
by_name = finalize({"w": g}, plan=plan, dims=dims)[0]["w"]
by_key = finalize({(0, "w"): g}, plan=plan, dims=dims)[0][(0, "w")]
print(np.asarray(by_name).tolist() == np.asarray(by_key).tolist(), np.asarray(by_name)[0].tolist())
try:
    finalize({"v": g}, plan=plan, dims=dims)
except ValueError as err:
    print(err)
"""], ROOT).strip().splitlines()
    assert out[0] == "True [2.0, 3.0]"  # dp mean of rows 0 and 2
    assert "gradient 'v' (chunk 0) is not in the plan" in out[1]


def test_dir_lists_public_names_without_importing_jax() -> None:
    out = run([sys.executable, "-c", "import sys, jax_impl; print(dir(jax_impl)); print('jax' in sys.modules)"],
              ROOT).splitlines()
    names = eval(out[0])  # noqa: S307 - our own printed list
    assert {"finalize_stacked", "make_meshes", "ensure_host_devices", "specs_from_nnx", "router_specs",
            "finalize", "mesh"} <= set(names)
    assert not [n for n in names if n.startswith("_")]
    assert out[1] == "False"


# --------------------------------------------------------------------------- parity report


def _reports():
    from parity_tests.report import ScenarioReport
    from parity_tests.results import ScenarioResult
    from parity_tests.scenarios import Scenario

    ok = ScenarioReport(
        Scenario(name="s-exact", dp=2), {"torch": {"dp_sync": (True, 0.0)}, "jax": {"dp_sync": (True, 0.0)}},
        {"torch": [], "jax": []}, {"jax": ScenarioResult([], seconds=0.001, compile_seconds=0.1)},
    )
    random = ScenarioReport(
        Scenario(name="s-random", dp=2, mode="random"),
        {"torch": {"dp_sync": (True, 1e-9), "non_tp": (True, 1e-6)}, "jax": {"dp_sync": (True, 0.0)}},
        {"torch": [], "jax": []}, {},
    )
    bad = ScenarioReport(
        Scenario(name="s-<bad>", tp=2), {"torch": {"non_tp": (False, 3.0)}, "jax": {"non_tp": (True, 0.0)}},
        {"torch": ["rank 1 grad (0, 'w'): max |diff| 3"], "jax": []}, {},
    )
    return [ok, random, bad]


def test_html_report_colours_each_cell_by_difference_over_tolerance() -> None:
    from parity_tests.report import cell_class, format_html

    assert cell_class(None, 0.0) == "none"
    assert cell_class((True, 0.0), 0.0) == "exact"
    assert cell_class((True, 1e-9), 2e-6) == "small"
    assert cell_class((True, 1e-6), 2e-6) == "near"
    assert cell_class((False, 3.0), 0.0) == "fail"
    page = format_html(_reports(), ("torch", "jax"))
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "NO PARITY: 1 of 3 scenarios differ: s-&lt;bad&gt;" in page  # escaped
    rows = re.findall(r"<tr><td class=\"name\">(.*?)</tr>", page)
    assert len(rows) == 3
    cells = [re.findall(r'<td class="(\w+)" title="[^"]*">([^<]*)</td>', row) for row in rows]
    # columns: dp_sync, non_tp (only the steps some scenario touched)
    assert cells[0] == [("exact", "0 / 0"), ("none", "-")]
    assert cells[1] == [("small", "1e-09 / 0"), ("near", "1e-06 / -")]
    assert cells[2] == [("none", "-"), ("fail", "3 FAIL / 0")]
    assert "<th>dp_sync</th><th>non_tp</th><th>verdict</th>" in page
    assert "rank 1 grad (0, &#x27;w&#x27;): max |diff| 3" in page


def test_html_option_renders_a_real_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from parity_tests.__main__ import main

    path = tmp_path / "report.html"
    assert main(["--scenario", "pp1dp1cp1tp1-pertoken", "--backend", "jax", "--html", str(path),
                 "--no-progress"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("PARITY: all 2 scenarios")
    page = path.read_text()
    assert "PARITY: all 2 scenarios match the reference on every backend" in page
    grid = page[page.index('<table id="grid">'):]
    assert grid.count('<td class="exact"') == 4  # per scenario: its token_scale cell and its verdict
    assert "<th>token_scale</th><th>verdict</th>" in grid
    assert "pp1dp1cp1tp1-pertoken-zero" in page


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_on_a_terminal_and_lines_in_a_log() -> None:
    from parity_tests.report import Progress

    log = io.StringIO()
    progress = Progress(100, log)
    for i in range(100):
        progress.advance(1, f"jax scenario-{i}")
    progress.close()
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert len(lines) == 10 and lines[-1].startswith("parity: 100/100 runs done")
    assert lines[0].startswith("parity: 10/100 runs done") and lines[0].endswith("jax scenario-9")

    tty = _Terminal()
    progress = Progress(3, tty)
    for i in range(3):
        progress.advance(1, f"jax s{i}")
    progress.close()
    drawn = tty.getvalue()
    assert drawn.startswith("\r") and "0/3" in drawn and "\n" not in drawn  # redrawn in place, then cleared

    silent = io.StringIO()
    Progress(3, None).advance(3, "x")
    assert silent.getvalue() == ""


# --------------------------------------------------------------------------- examples


def test_semantics_variant_example(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = run([sys.executable, str(ROOT / "examples" / "semantics_variant.py")], tmp_path)
    assert "planned: non_tp: sum over tp" in out and "variant: non_tp: avg over tp" in out
    table = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith(("planned ", "variant "))}
    assert table == {"planned": ["0", "0"], "variant": ["0", "0"]}
    assert out.strip().splitlines()[-1] == "VERDICT: both backends execute both plans exactly"


def test_with_op_changes_only_the_requested_step() -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import semantics_variant as sv
    finally:
        sys.path.remove(str(ROOT / "examples"))
    from meshgrad import ReduceOp, Reduction, Step, plan_finalize

    plan = plan_finalize(list(sv.SPECS), sv.CONFIG, sv.DIMS)
    variant = sv.with_op(plan, Step.NON_TP, ReduceOp.AVG)
    ops = [(a.step, a.op) for a in variant.actions if isinstance(a, Reduction)]
    assert ops == [(Step.DP_SYNC, ReduceOp.SUM), (Step.NON_TP, ReduceOp.AVG)]
    assert [(a.step, a.op) for a in plan.actions if isinstance(a, Reduction)][1] == (Step.NON_TP, ReduceOp.SUM)
    with pytest.raises(ValueError, match="no gtp reduction"):
        sv.with_op(plan, Step.GTP, ReduceOp.AVG)
    grads = sv.rank_grads()
    ln = sv.SPECS[0].key
    assert (sv.expected(grads, True)[ln] * 2 == sv.expected(grads, False)[ln]).all()  # mean = sum / tp


def test_verify_script_compares_and_gives_a_verdict() -> None:
    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import verify_torch_train as vt
    finally:
        sys.path.remove(str(ROOT / "examples"))

    single = {
        "losses": [2.0, 1.5],
        "grads": [{"a": torch.tensor([1.0, -2.0]), "b": torch.tensor([0.5])}] * 2,
        "expert_bias": [{"r.expert_bias": torch.tensor([0.01, -0.01])}] * 2,
        "replica_diff": [0.0, 0.0],
    }
    dist = {
        **single,
        "grads": [single["grads"][0], {"a": torch.tensor([1.0, -2.0]), "b": torch.tensor([0.5 + 4e-4])}],
        "replica_diff": [0.0, 1e-7],
    }
    rows = vt.compare(dist, single)
    assert [r.grad_rel_diff for r in rows] == pytest.approx([0.0, 2e-4], rel=1e-4)  # float32 0.5 + 4e-4
    assert rows[1].worst_param == "b" and rows[1].grad_scale == 2.0
    assert [r.ok(1e-5) for r in rows] == [True, False]
    table = vt.format_table(rows, 1e-5)
    assert table.splitlines()[-1] == "VERDICT: MISMATCH at step(s) [1] (tolerance 1e-05): finalized gradients differ"
    assert vt.format_table(rows[:1], 1e-5).splitlines()[-1].startswith("VERDICT: OK: all 1 steps")
    with pytest.raises(ValueError, match="parameter names differ"):
        vt.compare({**dist, "grads": [{"a": torch.zeros(2)}] * 2}, single)


def test_verify_script_end_to_end(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = run([sys.executable, str(ROOT / "examples" / "verify_torch_train.py"), "--pp=2", "--dp=1", "--tp=1",
               "--ep=1", "--steps=1"], tmp_path)
    lines = out.strip().splitlines()
    assert "replica spread" in out and "What the columns mean" in out
    row = next(line for line in lines if line.split() and line.split()[0] == "0")
    assert row.split()[-1] == "yes"
    assert lines[-1].startswith("VERDICT: OK: all 1 steps of the distributed run match")


def test_a_launch_is_retried_only_after_the_gloo_teardown_abort() -> None:
    """The one failure a torchrun launch is run again for: both ranks done, then torch's
    gloo teardown abort; a program error (a traceback before the launcher's) is not."""
    from launch import teardown_abort_only

    abort = (
        "rank 1: per-token 1.40, mean 1.04\nrank 0: per-token 1.40, mean 1.04\n"
        "terminate called without an active exception\n"
        "Traceback (most recent call last):\n  raise ChildFailedError(\n"
        "exitcode  : -6 (pid: 361)  (SIGABRT)\n"
    )
    assert teardown_abort_only(1, abort)
    assert not teardown_abort_only(0, abort)
    assert not teardown_abort_only(1, "ValueError: rank 0: bad config\n" + abort)
    assert not teardown_abort_only(1, abort.replace("terminate called without an active exception\n", ""))


# --------------------------------------------------------------------------- every python block of the docs

#: A python block: an optional ``<!-- docs-test: KIND -->`` line, then the fence, whose info
#: string may say ``no-run REASON`` (a block no test runs; the reason is required).
_PYTHON_BLOCK = re.compile(r"^(?:<!-- docs-test: ([^\n]*?) -->\n)?```python([^\n]*)\n(.*?)^```", re.S | re.M)


@dataclasses.dataclass(frozen=True)
class Block:
    page: str  # file name
    kind: str | None  # the docs-test marker's KIND
    info: str  # the fence's info string after "python"
    code: str


def python_blocks(path: Path) -> list[Block]:
    return [Block(path.name, m[1], m[2].strip(), m[3]) for m in _PYTHON_BLOCK.finditer(path.read_text())]


#: Marked blocks, per (page, KIND): how many, and the test that runs them as programs.
MARKED = {
    ("README.md", "torchrun 2"): (1, "test_readme_torch_snippet_runs_as_written"),
    ("README.md", "python"): (1, "test_readme_jax_shard_map_snippet_runs_as_written"),
    ("jax.md", "python"): (2, "test_docs_jax_snippets_run_as_written"),
    ("jax.md", "jax-optax"): (1, "tests/test_jax_docs.py"),
    ("explain.md", "python"): (1, "tests/test_explain.py"),
}
#: Fragments (code that needs the reader's objects: a model, groups, a plan), found by
#: (page, a text in the block), and the test that runs each with those objects made.
FRAGMENTS = {
    ("README.md", "finalize_model_grads(model_chunks, num_tokens=num_tokens"): "test_torch_fragments_run_in_a_world_of_one",
    ("migrating.md", "from torch_impl import finalize_model_grads"): "test_torch_fragments_run_in_a_world_of_one",
    ("performance.md", "attach_grad_buffers("): "test_torch_fragments_run_in_a_world_of_one",
    ("audit.md", "audit.record("): "test_torch_fragments_run_in_a_world_of_one",
    ("jax.md", "dataclasses.replace(plan"): "test_jax_md_plan_edit_fragment_changes_only_the_non_tp_ops",
}


def no_run_reason(block: Block) -> str | None:
    """The reason of a ``python no-run REASON`` block (None: the block is to be run)."""
    if not block.info.startswith("no-run"):
        return None
    reason = block.info[len("no-run"):].strip(" :-")
    assert reason, f"{block.page}: a no-run block without its reason: {block.code[:80]!r}"
    return reason


def classify(blocks: list[Block]) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str], Block], list[Block], list[Block]]:
    """(marked blocks counted per (page, KIND), fragments by their FRAGMENTS key, no-run
    blocks, blocks nothing runs)."""
    marked: dict[tuple[str, str], int] = {}
    fragments: dict[tuple[str, str], Block] = {}
    skipped, unrun = [], []
    for block in blocks:
        if no_run_reason(block) is not None:
            skipped.append(block)
        elif block.kind is not None:
            marked[(block.page, block.kind)] = marked.get((block.page, block.kind), 0) + 1
        else:
            keys = [k for k in FRAGMENTS if k[0] == block.page and k[1] in block.code]
            if len(keys) == 1 and keys[0] not in fragments:
                fragments[keys[0]] = block
            else:
                unrun.append(block)
    return marked, fragments, skipped, unrun


def doc_python_blocks() -> list[Block]:
    return [b for path in (README, *sorted(DOCS.glob("*.md"))) for b in python_blocks(path)]


def fragment(page: str, needle: str) -> str:
    (code,) = [b.code for b in doc_python_blocks() if b.page == page and b.kind is None and needle in b.code]
    return code


def test_every_python_block_of_the_docs_is_run_or_marked_no_run() -> None:
    marked, fragments, skipped, unrun = classify(doc_python_blocks())
    assert not unrun, [f"{b.page}: {b.code[:80]!r}" for b in unrun]
    assert marked == {k: n for k, (n, _) in MARKED.items()}, marked
    assert set(fragments) == set(FRAGMENTS), sorted(set(FRAGMENTS) - set(fragments))
    names = {n for n in globals() if n.startswith("test_")}
    for runner in [t for _, t in MARKED.values()] + list(FRAGMENTS.values()):
        assert runner in names or (ROOT / runner).exists(), runner
    assert all(no_run_reason(b) for b in skipped)


def test_only_blocks_marked_no_run_are_skipped(tmp_path: Path) -> None:
    page = tmp_path / "audit.md"
    page.write_text(
        "```python no-run: needs 8 GPUs\nx = 1\n```\n\n"
        "<!-- docs-test: python -->\n```python\nprint(1)\n```\n\n"
        "```python\nwith audit.record('d') as f:\n    f()\n```\n\n"
        "```python\nunknown_fragment()\n```\n"
    )
    blocks = python_blocks(page)
    assert [(b.kind, b.info) for b in blocks] == [(None, "no-run: needs 8 GPUs"), ("python", ""), (None, ""), (None, "")]
    marked, fragments, skipped, unrun = classify(blocks)
    assert marked == {("audit.md", "python"): 1}
    assert list(fragments) == [("audit.md", "audit.record(")]
    assert [no_run_reason(b) for b in skipped] == ["needs 8 GPUs"]
    assert [b.code for b in unrun] == ["unknown_fragment()\n"]
    with pytest.raises(AssertionError, match="without its reason"):
        no_run_reason(Block("x.md", None, "no-run", "x = 1\n"))


def run_fragment(code: str, namespace: dict) -> object:
    """Execute ``code`` in ``namespace``; the value of its last line when that is an
    expression (as a REPL shows it), else None."""
    tree = ast.parse(code)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, "<docs fragment>", "exec"), namespace)  # noqa: S102 - the docs' own code
    return eval(compile(ast.Expression(last.value), "<docs fragment>", "eval"), namespace) if last else None  # noqa: S307


def test_run_fragment_gives_the_last_expression() -> None:
    ns: dict = {}
    assert run_fragment("x = 2\nx * 3  # 6\n", ns) == 6 and ns["x"] == 2
    assert run_fragment("y = 1\n", ns) is None and ns["y"] == 1


def test_jax_md_plan_edit_fragment_changes_only_the_non_tp_ops() -> None:
    from meshgrad import FinalizeConfig, ParallelDims, ParamSpec, ReduceOp, Reduction, Step, plan_finalize

    specs = [ParamSpec("ln.weight", shape=(4,), sequence_parallel=True), ParamSpec("fc.weight", shape=(2, 4))]
    plan = plan_finalize(specs, FinalizeConfig(sequence_parallel=True), ParallelDims(dp=2, tp=2))
    ns = {"dataclasses": dataclasses, "plan": plan, "ReduceOp": ReduceOp, "Step": Step}
    run_fragment(fragment("jax.md", "dataclasses.replace(plan"), ns)
    before = [(a.step, a.op) for a in plan.actions if isinstance(a, Reduction)]
    after = [(a.step, a.op) for a in ns["variant"].actions if isinstance(a, Reduction)]
    assert before == [(Step.DP_SYNC, ReduceOp.SUM), (Step.NON_TP, ReduceOp.SUM)]
    assert after == [(Step.DP_SYNC, ReduceOp.SUM), (Step.NON_TP, ReduceOp.AVG)]
    assert len(ns["variant"].actions) == len(plan.actions)


def torch_fragments(directory: str) -> None:
    """The torch fragments of the docs, each with the objects it names made here, in one
    process (a gloo world of one rank, cwd ``directory``); writes ``results.json``."""
    import inspect
    import os
    import types
    import warnings

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import torch_impl
    from meshgrad import FinalizeConfig

    os.chdir(directory)
    codes = json.loads(Path("fragments.json").read_text())
    dist.init_process_group("gloo", init_method=f"file://{directory}/store", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))  # 5 tokens
    out: dict[str, object] = {}

    def linear(config: object) -> torch.nn.Module:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        model.config = config
        return model

    # README: the call after backward; per-token loss, so the gradient of the mean.
    model, twin = linear(FinalizeConfig(calculate_per_token_loss=True)), linear(FinalizeConfig())
    model(x).pow(2).sum().backward()  # the sum of the 5 token losses
    twin(x).pow(2).sum().div(5).backward()  # their mean
    ns = {"model_chunks": [model], "num_tokens": torch.tensor([5]), "groups": mesh}
    run_fragment(codes["README.md"], ns)
    out["readme"] = {"diff": (model.weight.grad - twin.weight.grad).abs().max().item(),
                     "num_tokens": ns["num_tokens"].tolist()}

    # migrating.md: the one changed import.
    ns = {}
    run_fragment(codes["migrating.md"], ns)
    out["migrating"] = {"same": ns["finalize_model_grads"] is torch_impl.finalize_model_grads,
                        "params": list(inspect.signature(ns["finalize_model_grads"]).parameters)}

    # performance.md: buffers attached before training; the user's backward where "..." stands.
    model, twin = linear(FinalizeConfig()), linear(FinalizeConfig())
    ns = {"model_chunks": [model], "mesh": mesh, "num_tokens": None,
          "finalize_model_grads": torch_impl.finalize_model_grads}
    code = codes["performance.md"]
    cut = re.search(r"^\.\.\.", code, re.M)
    run_fragment(code[:cut.start()], ns)
    model(x).pow(2).mean().backward()
    twin(x).pow(2).mean().backward()
    last = run_fragment(code[cut.start():], ns)
    storages = {b.untyped_storage().data_ptr() for b in ns["buffers"].buffers}
    out["performance"] = {
        "last": last,
        "diff": max((p.main_grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), twin.parameters())),
        "views": all(p.main_grad.untyped_storage().data_ptr() in storages for p in model.parameters()),
    }

    # audit.md: torch_impl's finalize recorded, then megatron-core's wrapped, on Megatron-DDP-like chunks.
    try:
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError as err:
        out["audit"] = {"skipped": f"megatron-core: {err}"}
    else:
        from parity_tests.megatron_state import fake_ddp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2)
        config.calculate_per_token_loss = True
        module = linear(config)
        module(x).pow(2).sum().backward()
        world = dist.group.WORLD
        groups = types.SimpleNamespace(tp=world, pp=world, embd=world, pos_embd=world, dp_cp=world, dp=world,
                                       expt_dp=world, tp_dp_cp=world, cp=world, ep=world)
        chunk = fake_ddp(module, DistributedDataParallelConfig(), world, world)
        before = module.weight.grad.clone()
        ns = {"model_chunks": [chunk], "n": torch.tensor(5), "groups": groups, "pg_collection": groups}
        run_fragment(codes["audit.md"], ns)
        out["audit"] = {"scaled": (module.weight.grad * 25 - before).abs().max().item(),  # 1/5 twice
                        "files": sorted(str(p) for p in Path("runs").rglob("*.npz"))}
    Path("results.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def test_torch_fragments_run_in_a_world_of_one(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    codes = {page: fragment(page, needle) for (page, needle), runner in FRAGMENTS.items()
             if runner == "test_torch_fragments_run_in_a_world_of_one"}
    (tmp_path / "fragments.json").write_text(json.dumps(codes))
    tests = str(Path(__file__).parent)
    run([sys.executable, "-c", f"import sys; sys.path.insert(0, {tests!r}); import test_docs; "
         f"test_docs.torch_fragments({str(tmp_path)!r})"], tmp_path)
    got = json.loads((tmp_path / "results.json").read_text())
    assert got["readme"]["diff"] <= 1e-6 and got["readme"]["num_tokens"] == [5]  # per-token sum / 5 = the mean's
    assert got["migrating"]["same"]  # Megatron's parameters first (0.19.2 adds gtp_fence)
    assert got["migrating"]["params"][:4] == ["model", "num_tokens", "pg_collection", "force_all_reduce"]
    assert got["performance"] == {"last": 0, "diff": 0.0, "views": True}  # bytes_copied 0, DP of one: unchanged
    if "skipped" in got["audit"]:
        pytest.skip(got["audit"]["skipped"])
    assert got["audit"]["scaled"] <= 1e-6
    files = got["audit"]["files"]
    assert any(f.startswith("runs/step100/step00000100.rank00000") for f in files), files
    assert any(f.startswith("runs/audit/step") for f in files), files
    for directory in ("runs/step100", "runs/audit"):  # the replay the page documents
        out = run([sys.executable, "-m", "parity_tests", "audit", directory], tmp_path)
        assert out.strip().splitlines()[-1] == "audit PASS: 1 step(s), 0 with mismatches", out


# --------------------------------------------------------------------------- measured times


def _time_tables(text: str) -> list[tuple[re.Match, list[re.Match]]]:
    """Every table of bench/setup_times.py's format in ``text``: (its machine line, its rows)."""
    from bench.setup_times import HEADER, MACHINE_RE, ROW_RE, SEPARATOR

    lines = text.splitlines()
    tables = []
    for i, line in enumerate(lines):
        if line != HEADER:
            continue
        assert i >= 2 and lines[i - 1] == "" and lines[i + 1] == SEPARATOR, lines[i - 2:i + 2]
        machine = MACHINE_RE.match(lines[i - 2])
        assert machine, f"not the script's machine line: {lines[i - 2]!r}"
        rows = []
        for row in lines[i + 2:]:
            if not row.startswith("|"):
                break
            match = ROW_RE.match(row)
            assert match, f"not the script's row: {row!r}"
            rows.append(match)
        tables.append((machine, rows))
    return tables


def test_the_time_script_prints_its_table_format() -> None:
    from bench.setup_times import COMMANDS, Measured, format_table, machine

    line = machine(1.5, 30.0, 2.25, "--only parity_report")
    rows = [Measured(COMMANDS[1], 12.34, 0, "PARITY: all 2 scenarios | ok"), Measured(COMMANDS[2], 1.0, 3, "`boom`")]
    ((head, got),) = _time_tables(format_table(rows, line))
    assert head.group(1) == str(os.cpu_count()) and head.group(5, 6, 7) == ("1.50", "30.00", "2.25")
    assert [m.groups() for m in got] == [
        (COMMANDS[1].line, "12.3 s", COMMANDS[1].what.replace("`", "'"), "PARITY: all 2 scenarios / ok"),
        (COMMANDS[2].line, "failed (exit 3)", COMMANDS[2].what, "'boom'"),  # a cell holds no | or `
    ]


def test_the_docs_time_tables_are_the_scripts_output() -> None:
    """docs/install.md and examples/README.md state times only in the script's tables (format
    only: no timing is asserted), and `make test`'s time as pytest's own closing line."""
    from bench.setup_times import COMMANDS

    lines = {c.line for c in COMMANDS}
    for page in (DOCS / "install.md", ROOT / "examples" / "README.md"):
        text = page.read_text()
        tables = _time_tables(text)
        assert tables, page
        for _, rows in tables:
            assert rows and {m.group(1) for m in rows} <= lines, page
            assert all(m.group(2).endswith(" s") for m in rows), page  # every command succeeded
        estimate = re.search(r"(\babout|\bunder|~) ?(a|an|one|\d+(\.\d+)?) ?(minutes?|seconds?|min|s)\b", text)
        assert not estimate, (page, estimate)  # no prose estimates
    install = (DOCS / "install.md").read_text()
    # `make test`: the figure of pytest's own closing line ("... in 1485.32s"), with the machine.
    assert re.search(r"^\| `make test` \| \d+ s \| pytest's own closing line[^|]*\| [^|]*\d+ CPU cores", install, re.M), \
        "make test's time: pytest's closing line and the machine"


def test_the_readme_states_the_extras_version_ranges_of_pyproject() -> None:
    """The front page says which versions the extras take: the same ranges as pyproject.toml."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    text = README.read_text()
    for extra, package in (("torch", "torch"), ("jax", "jax"), ("megatron", "megatron-core")):
        (spec,) = [r for r in extras[extra] if re.match(rf"{re.escape(package)}[<>=]", r)]
        assert f"{package} {spec[len(package):]}" in text, (extra, spec)
