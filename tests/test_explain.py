"""``python -m meshgrad explain``, the presets, the rank classes and the cost model (no
process groups; tests/test_explain_world.py holds explain against torch_impl's launches)."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import time
import tracemalloc

import numpy as np
import pytest

from meshgrad.__main__ import main
from meshgrad.at_scale import predict_row
from meshgrad.axes import Group
from meshgrad.config import FinalizeConfig
from meshgrad.cost import CostModel, LinkClass, fit_link
from meshgrad.errors import FinalizeInputError
from meshgrad.explain import ITEMSIZE, STATUS_INT64, Layout, explain, launches, model_stages
from meshgrad.plan import GroupSizes, plan_finalize
from meshgrad.presets import PRESETS, json_stage, padded_vocab, preset_stage
from tests.launch import ROOT, checkout_env

# --------------------------------------------------------------------------- presets


@pytest.mark.parametrize(("name", "total", "active"), [
    ("gpt-8b", 8.03e9, 8.03e9), ("gpt-70b", 70.55e9, 70.55e9), ("moe-8x7b", 46.70e9, 12.88e9),
])
def test_presets_have_the_published_parameter_counts(name: str, total: float, active: float) -> None:
    """Llama 3 8B / 70B and Mixtral 8x7B (46.7B total, 12.9B active with top-2)."""
    m = PRESETS[name]
    assert m.total_params() == pytest.approx(total, rel=1e-3)
    assert m.active_params() == pytest.approx(active, rel=1e-3)


@pytest.mark.parametrize("name", ["gpt-8b", "moe-8x7b", "tiny"])
def test_stage_shards_add_up_to_the_whole_model(name: str) -> None:
    """Over every stage and chunk (pp 4 x vpp 2 for the large ones), the per-rank shapes at
    tp = ep = 1 hold exactly the model's parameters (vocabulary padded as Megatron pads it;
    a tied output layer is a second copy of the embedding)."""
    m = PRESETS[name]
    pp, vpp = (4, 2) if m.layers % 8 == 0 else (2, 1)
    held = sum(p.numel for s in range(pp) for p in preset_stage(m, pp=pp, stage=s, vpp=vpp).params)
    extra = (padded_vocab(m.vocab, 1) - m.vocab) * m.hidden * (1 if m.tied else 2)
    copy = padded_vocab(m.vocab, 1) * m.hidden if m.tied and pp * vpp > 1 else 0  # the last stage's tied copy
    assert held == m.total_params() + extra + copy


def test_tp_and_ep_shard_the_right_parameters() -> None:
    m = PRESETS["moe-8x7b"]
    whole = {p.name: p for p in preset_stage(m, pp=1, stage=0).params}
    split = {p.name: p for p in preset_stage(m, pp=1, stage=0, tp=4, ep=4, etp=2).params}
    assert len([n for n in whole if ".experts." in n]) == 4 * len([n for n in split if ".experts." in n])
    for name, p in split.items():
        w = whole[name]
        if p.sequence_parallel:  # norms and the router: replicated over tp
            assert p.shape == w.shape
        elif p.expert:  # etp splits the expert MLP hidden size
            assert p.numel * 2 == w.numel and p.expert == w.expert
        else:
            assert p.numel * 4 == w.numel or name.endswith("word_embeddings.weight") or name == "output_layer.weight"
    assert split["embedding.word_embeddings.weight"].shape == (padded_vocab(m.vocab, 4) // 4, m.hidden)


def test_bad_sizes_raise_naming_both_numbers() -> None:
    with pytest.raises(FinalizeInputError, match=r"layers = 32 is not divisible by pp x vpp = 3"):
        preset_stage(PRESETS["gpt-8b"], pp=3, stage=0)
    with pytest.raises(FinalizeInputError, match=r"kv_heads = 8 is not divisible by tp = 16"):
        preset_stage(PRESETS["gpt-8b"], pp=1, stage=0, tp=16)


def test_json_models_select_stages_and_reject_unknown_keys() -> None:
    text = json.dumps({"params": [
        {"name": "emb", "shape": [4, 2], "role": "word_embedding", "stages": "first"},
        {"name": "w", "shape": [2, 2], "dtype": "bfloat16"},
        {"name": "out", "shape": [4, 2], "role": "word_embedding", "stages": [2]},
    ], "routers": [{"name": "r", "num_experts": 4, "has_expert_bias": True, "stages": "last"}]})
    first, last = json_stage(text, pp=3, stage=0), json_stage(text, pp=3, stage=2)
    assert [p.name for p in first.params] == ["emb", "w"] and first.routers == ()
    assert [p.name for p in last.params] == ["w", "out"] and [r.num_experts for r in last.routers] == [4]
    with pytest.raises(FinalizeInputError, match=r"params\[0\] \('x'\) has unknown keys \['shap'\]"):
        json_stage('[{"name": "x", "shap": [2]}]', pp=1, stage=0)
    with pytest.raises(FinalizeInputError, match=r"'x': stages must be"):
        json_stage('[{"name": "x", "stages": [5]}]', pp=2, stage=0)
    with pytest.raises(FinalizeInputError, match="not valid JSON"):
        json_stage("[", pp=1, stage=0)
    with pytest.raises(FinalizeInputError, match=r"params\[1\] \('y'\): shape must be a list of non-negative ints, got 4"):
        json_stage('[{"name": "x"}, {"name": "y", "shape": 4}]', pp=1, stage=0)
    with pytest.raises(FinalizeInputError, match=r"params\[0\] \('x'\): .*gradient dtype 'int8'"):
        json_stage('[{"name": "x", "dtype": "int8"}]', pp=1, stage=0)


@pytest.mark.parametrize(("fields", "text"), [
    (dict(pp=0), "Layout.pp must be a positive int, got 0"),
    (dict(vpp=2.0), "Layout.vpp must be a positive int, got 2.0"),
    (dict(etp=True), "Layout.etp must be a positive int, got True"),
])
def test_a_bad_layout_names_its_field(fields: dict, text: str) -> None:
    with pytest.raises(FinalizeInputError, match=text.replace(".", r"\.")):
        Layout(**fields)
    with pytest.raises(FinalizeInputError, match=r"layout DP2 x TP2 x EP3: ParallelDims: ep\*etp\*egtp = 6"):
        explain(PRESETS["tiny"], Layout(dp=2, tp=2, ep=3), FinalizeConfig())


# --------------------------------------------------------------------------- rank classes


def _config(**flags: object) -> FinalizeConfig:
    return FinalizeConfig(sequence_parallel=True, use_distributed_optimizer=True,
                          share_embeddings_and_output_weights=False, **flags)


def test_classes_are_first_middle_and_last_stages_each_planned_as_the_backend_plans() -> None:
    m, layout = PRESETS["gpt-70b"], Layout(pp=8, dp=4, tp=8)
    config = _config()
    explained = explain(m, layout, config)
    assert [c.stages for c in explained.classes] == [(0,), (1, 2, 3, 4, 5, 6), (7,)]
    assert sum(c.ranks for c in explained.classes) == layout.world
    sizes = GroupSizes.from_dims(layout.dims, config)
    for stage in range(8):
        stage_model = preset_stage(m, pp=8, stage=stage, tp=8)
        direct = plan_finalize(stage_model.params, config, sizes, stage_model.routers, stage=stage)
        rank = layout.dims.rank_of({"pp": stage, "dp": 3, "tp": 5})
        cls = explained.class_of(rank)
        assert cls.plan.actions == direct.actions or stage != cls.stages[0]
        assert [item for item, _ in explained.rank_launches(rank)][1:] == list(launches(direct, stage, False))


def test_tied_embeddings_make_the_outer_stages_their_own_classes() -> None:
    m = dataclasses.replace(PRESETS["tiny"], layers=8)
    layout = Layout(pp=4, dp=2, tp=2)
    explained = explain(m, layout, FinalizeConfig(sequence_parallel=True))
    assert [c.stages for c in explained.classes] == [(0,), (1, 2), (3,)]
    first, middle, last = (tuple(i.step for i in c.meshgrad) for c in explained.classes)
    assert "word_embedding" in first and "word_embedding" in last and "word_embedding" not in middle
    # the position embedding's group is the first stage alone by default: nothing to launch
    assert not any("pos_embedding" in steps for steps in (first, middle, last))
    # the word embedding's group: stages 0 and 3 of the same dp / tp coordinates
    rank = layout.dims.rank_of({"pp": 3, "dp": 1, "tp": 1})
    members = dict((item.step, m) for item, m in explained.rank_launches(rank))["word_embedding"]
    assert members == (layout.dims.rank_of({"pp": 0, "dp": 1, "tp": 1}), rank)


def test_each_collective_states_its_bytes_group_and_axes() -> None:
    explained = explain(PRESETS["tiny"], Layout(pp=2, dp=2, tp=2, ep=2), _config(calculate_per_token_loss=True))
    c = explained.classes[0]
    status, *rest = c.meshgrad
    assert (status.group, status.size, status.dtype, status.numel) == ("world", 8, "int64", 1)  # one word
    for item in c.meshgrad:
        assert item.nbytes == item.numel * ITEMSIZE[item.dtype]
    dp = [i for i in rest if i.step == "dp_sync"]
    grads = sum(p.numel for p in c.plan.params if not p.expert)
    assert all(i.kind == "reduce_scatter" and i.axes == ("dp", "cp") and i.size == 2 for i in dp)
    assert sum(i.numel for i in dp) == grads + grads % 2  # padded to the group, no more
    token = [i for i in rest if i.step == "token_scale"]
    assert [(i.kind, i.group, i.size) for i in token] == [("broadcast", "pp", 2), ("all_reduce", "dp_cp_gtp_remat", 2)]
    assert c.bytes_by_axes()["world"] == 8


def test_megatron_launches_split_cross_step_fusions_and_bucket_the_dp_sync() -> None:
    """meshgrad fuses the conditional-embedder and flextron-router pp syncs into one
    collective; Megatron-Core launches one each. With overlap_grad_reduce Megatron's DDP
    buckets stage 0's first chunk at max(40M, 1M x dp) elements."""
    params = json.dumps([
        {"name": "cond.w", "shape": [3], "pipeline_parallel": True},
        {"name": "router.w", "shape": [5], "flextron_router_pp_sync": True},
        {"name": "big", "shape": [50_000_000]},
        {"name": "big2", "shape": [30_000_000]},
    ])
    layout = Layout(pp=2, dp=4)
    config = FinalizeConfig(has_cond_embedder=True, flextron=True)
    explained = explain(model_stages(params, layout), layout, config, overlap=True)
    stage0 = explained.classes[0]
    pp_mine = [i for i in stage0.meshgrad if i.group == "pp"]
    pp_theirs = [i for i in stage0.megatron if i.group == "pp"]
    assert [(i.step, i.numel) for i in pp_mine] == [("cond_embedder+router", 8)]
    assert [(i.step, i.numel) for i in pp_theirs] == [("cond_embedder", 3), ("router", 5)]
    dp = [i for i in stage0.megatron if i.step == "dp_sync"]
    # reversed order: big2 (30M) + big (50M) >= 40M closes the first bucket (launched during
    # backward); the two small ones make the last, which finalize waits for
    assert [(i.numel, i.overlapped) for i in dp] == [(80_000_000, True), (8, False)]
    assert [i.numel for i in explained.classes[1].megatron if i.step == "dp_sync"] == [80_000_008]  # stage 1: one bucket
    assert not any(i.step == "status" for i in stage0.megatron)


def test_status_round_model_matches_torch_impl() -> None:
    """The status round's size follows torch_impl's wire format at every scale (a drift check)."""
    from meshgrad.launches import status_elements
    from torch_impl.run import status

    assert STATUS_INT64 == status.STATUS_SIZE
    for world in (2, 8, 63, 64, 1024, 16384, 1 << 15):
        assert status_elements(world) == len(status.encode(status.status_vector(), world)), world


def test_planning_70b_at_16k_ranks_is_fast_and_small() -> None:
    """One plan per rank class: 16,384 ranks plan in well under a second, in bounded memory."""
    config = _config()
    tracemalloc.start()
    start = time.perf_counter()
    explained = explain(PRESETS["gpt-70b"], Layout(pp=8, dp=256, tp=8), config)
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(explained.classes) == 3 and explained.layout.world == 16384
    assert seconds < 1.0 and peak < 8 * 2**20, (seconds, peak)
    rank = 16383
    assert explained.rank_launches(rank)[-1][1] == tuple(range(16376, 16384))  # its tp group


# --------------------------------------------------------------------------- cost model

_NV = LinkClass("nv", alpha_s=1e-6, beta_bytes_s=1e9)
_IB = LinkClass("ib", alpha_s=5e-6, beta_bytes_s=1e8, alpha_tree_s=10e-6)
_MODEL = CostModel(_NV, _IB, launch_s=10e-6, gpus_per_node=8)


@pytest.mark.parametrize(("kind", "p", "n", "nbytes", "expected"), [
    # ring: 10 + 14 x 1 us + 2 x 7/8 x 8 MB / 1 GB/s
    ("all_reduce", 8, 1, 8_000_000, 10e-6 + 14e-6 + 0.014),
    # 64 B: ring 24 us + 112 ns beats tree 24 us + 128 ns
    ("all_reduce", 8, 1, 64, 24e-6 + 1.75 * 64 / 1e9),
    # 16 ranks over 2 nodes, 0 B: tree 10 + 2 (7 x 1 + 1 x 10) = 44 us beats ring 10 + 28 + 10 = 48 us
    ("all_reduce", 16, 2, 0, 44e-6),
    # reduce-scatter: 10 + 14 x 1 + 1 x 5 us + 15/16 x 1.6 MB / 0.1 GB/s
    ("reduce_scatter", 16, 2, 1_600_000, 29e-6 + 15 / 16 * 0.016),
    ("broadcast", 4, 1, 1000, 10e-6 + 3e-6 + 1e-6),
    ("all_reduce", 1, 1, 10**9, 0.0),
])
def test_cost_of_one_collective_by_hand(kind: str, p: int, n: int, nbytes: int, expected: float) -> None:
    assert _MODEL.seconds(kind, p, n, nbytes) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_ring_and_tree_can_be_forced() -> None:
    ring = dataclasses.replace(_MODEL, algorithm="ring").seconds("all_reduce", 16, 2, 0)
    tree = dataclasses.replace(_MODEL, algorithm="tree").seconds("all_reduce", 8, 1, 8_000_000)
    assert ring == pytest.approx(48e-6) and tree == pytest.approx(24e-6 + 0.016)


def test_fit_link_recovers_the_parameters_it_was_given() -> None:
    truth = CostModel(LinkClass("t", 3e-6, 2e9), LinkClass("t", 3e-6, 2e9), launch_s=40e-6, gpus_per_node=8,
                      algorithm="ring")
    rows = [(k, p, b, truth.seconds(k, p, 1, b)) for k in ("all_reduce", "reduce_scatter")
            for p in (2, 4, 8) for b in (256, 65536, 2**21)]
    link, launch = fit_link(rows)
    assert launch == pytest.approx(40e-6, rel=1e-6)
    assert link.alpha_s == pytest.approx(3e-6, rel=1e-6) and link.beta_bytes_s == pytest.approx(2e9, rel=1e-6)


def test_class_cost_sums_its_collectives_and_nodes_follow_rank_order() -> None:
    """gpt-70b, PP4 x DP32 x TP8: tp groups stay in a node (NVLink), dp groups cross 32
    nodes; the status round is one world all-reduce; Megatron lacks only that round."""
    from meshgrad.cost import finalize_cost

    explained = explain(PRESETS["gpt-70b"], Layout(pp=4, dp=32, tp=8), _config())
    costs = finalize_cost(explained, _MODEL)
    for cls, cost in zip(explained.classes, costs):
        by_step = {item.step: t for item, t in cost.per_launch}
        tp = next(i for i in cls.meshgrad if i.group == "tp")
        dp = next(i for i in cls.meshgrad if i.group == "dp_cp")
        assert by_step["non_tp"] == pytest.approx(_MODEL.seconds("all_reduce", 8, 1, tp.nbytes))
        assert by_step["dp_sync"] == pytest.approx(_MODEL.seconds("reduce_scatter", 32, 32, dp.nbytes))
        assert cost.status_seconds == pytest.approx(_MODEL.seconds("all_reduce", 1024, 128, 8 * STATUS_INT64))  # 2 words
        assert cost.seconds == pytest.approx(sum(t for _, t in cost.per_launch))
        assert cost.megatron_seconds == pytest.approx(cost.seconds - cost.status_seconds, rel=1e-3)


def test_at_scale_row_has_a_small_status_share() -> None:
    row = predict_row("gpt-70b", 16384)
    assert row["layout"] == "PP4 x DP512 x TP8" and row["classes"] == 3
    assert 0 < row["status_share"] < 0.01 and row["megatron_s"] < row["meshgrad_s"]
    assert math.isclose(row["meshgrad_s"] - row["status_s"], row["megatron_s"], rel_tol=1e-3)


# --------------------------------------------------------------------------- the CLI


def test_cli_text_lists_every_class_and_predicted_times(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--model", "gpt-70b", "--pp", "8", "--tp", "8", "--world", "16384",
                 "--distributed-optimizer", "--sp", "--cost", "--rank", "5000"]) == 0
    out = capsys.readouterr().out
    assert "gpt-70b on PP8 x DP256 x TP8 (16384 ranks)" in out
    for name in ("pp stage 0: 2048 ranks", "pp stages 1-6: 12288 ranks", "pp stage 7: 2048 ranks"):
        assert f"== {name}" in out
    assert out.count("reduce_scatter sum  dp_cp") == 3 and "per axes: world: 16 B" in out
    assert "predicted, pp stage 0: meshgrad" in out and "rank 5000 (pp stages 1-6):" in out
    assert "[5000, 5001, 5002, 5003, 5004, 5005, 5006, 5007]" in out


def test_cli_json_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--model", "moe-8x7b", "--pp", "4", "--dp", "16", "--tp", "2", "--ep", "8", "--etp", "1",
                 "--per-token-loss", "--json", "--rank", "3"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"model", "layout", "config", "overlap_grad_reduce", "num_tokens", "classes", "rank"}
    assert data["layout"]["world"] == 128 and data["num_tokens"] is True
    keys = {"step", "kind", "op", "group", "axes", "size", "dtype", "numel", "overlapped", "bytes"}
    for c in data["classes"]:
        assert {"name", "stages", "ranks", "params", "grad_elements", "plan", "meshgrad", "megatron", "bytes_by_axes",
                "megatron_bytes_by_axes", "predicted_seconds"} <= set(c)
        for row in c["meshgrad"] + c["megatron"]:
            assert set(row) == keys and row["bytes"] == row["numel"] * ITEMSIZE[row["dtype"]]
        assert len(c["predicted_seconds"]["per_collective"]) == len(c["meshgrad"])
        assert sum(c["bytes_by_axes"].values()) == sum(r["bytes"] for r in c["meshgrad"])
    expert = [r for r in data["classes"][0]["meshgrad"] if r["group"] == "expt_dp"]
    assert expert and all(r["axes"] == ["edp"] and r["size"] == 4 for r in expert)  # edp = 16 x 2 / 8
    assert data["rank"]["launches"][0]["members"] == list(range(128))


def test_cli_reads_a_json_model_and_reports_bad_input(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "model.json"
    path.write_text(json.dumps([{"name": "w", "shape": [6]}, {"name": "ln", "shape": [2], "sequence_parallel": True}]))
    assert main(["explain", "--params-json", str(path), "--dp", "2", "--tp", "2", "--sp"]) == 0
    out = capsys.readouterr().out
    assert "dp_sync" in out and "non_tp" in out and "all_reduce     sum  tp" in out
    path.write_text('[{"name": "w", "shape": [6], "flag": 1}]')
    assert main(["explain", "--params-json", str(path)]) == 2
    assert "unknown keys ['flag']" in capsys.readouterr().err
    assert main(["explain", "--model", "gpt-8b", "--pp", "8", "--world", "12"]) == 2
    assert "--world 12 is not a multiple of pp x cp x gtp x tp = 8" in capsys.readouterr().err


def test_cli_runs_without_torch_or_jax() -> None:
    """The core alone: torch and jax made unimportable, the CLI still explains and predicts."""
    block = ("import sys\nfor name in ('torch', 'jax', 'jaxlib'): sys.modules[name] = None\n"
             "from meshgrad.__main__ import main\n"
             "assert main(['explain', '--model', 'tiny', '--pp', '2', '--dp', '2', '--cost']) == 0\n"
             "assert main(['at-scale']) == 0\n")
    proc = subprocess.run([sys.executable, "-c", block], cwd=ROOT, env=checkout_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| gpt-70b | 16,384 | PP4 x DP512 x TP8 |" in proc.stdout


def test_group_axes_of_each_listed_collective_match_the_named_group() -> None:
    from meshgrad.axes import GROUP_AXES

    explained = explain(PRESETS["tiny"], Layout(pp=2, dp=2, tp=2, ep=2), _config())
    for c in explained.classes:
        for item in c.meshgrad[1:]:
            assert item.axes == tuple(a.value for a in GROUP_AXES[Group(item.group)])
            assert np.prod([getattr(explained.layout.dims, a) for a in item.axes]) >= item.size


def test_docs_explain_snippet_runs_as_written() -> None:
    """docs/explain.md's python block: three classes of the 70B preset, their costs, rank
    5000's tp group."""
    import re

    text = (ROOT / "docs" / "explain.md").read_text()
    (code,) = re.findall(r"<!-- docs-test: python -->\n```python\n(.*?)^```", text, re.S | re.M)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=checkout_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert [line.split()[:4] for line in lines[:3]] == [
        ["pp", "stage", "0", "2048"], ["pp", "stages", "1-6", "12288"], ["pp", "stage", "7", "2048"]]
    assert "step='non_tp', kind='all_reduce', op='sum', group='tp', axes=('tp',), size=8" in lines[3]
    assert "(5000, 5001, 5002, 5003, 5004, 5005, 5006, 5007)" in lines[3]


def test_bench_rows_print_the_fit_and_the_planning_scale() -> None:
    """bench.at_scale's printed rows (a synthetic measurement: the world runs in python -m
    bench) and its goal: planning 70B at 16k ranks under a second."""
    from bench.at_scale import at_scale_goals, format_rows, planning_scale

    planning = planning_scale((1024, 16384))
    assert [(r["world"], r["classes"], r["params_per_rank"]) for r in planning] == [(1024, 3, 61), (16384, 3, 61)]
    assert planning[1]["peak_bytes"] < 8 * 2**20
    (goal,) = at_scale_goals({"planning": planning})
    assert goal["ok"] and goal["limit"] == 1.0
    row = {"kind": "all_reduce", "ranks": 2, "bytes": 256, "measured_s": 2e-4, "predicted_s": 1e-4,
           "predicted_own_world_s": 3e-4}
    text = format_rows({"link": {"alpha_s": 5e-5, "beta_bytes_s": 1e9}, "launch_s": 1e-5, "rows": [row],
                        "planning": planning})
    assert "launch 10.0 us, 50.0 us per step, 1.00 GB/s" in text
    assert "all_reduce           2       256         200.0         100.0       0.50" in text and text.count("3 rank classes") == 2
