"""Audit: record finalize steps in gloo worlds, replay them against the numpy reference.

One spawned world per size (4 and 8 ranks) records every case into its own directory:
torch_impl's finalize over several layouts (TP / PP / DP / CP / EP, tied and position
embeddings, expert bias, num_tokens, a distributed optimizer's reduce-scatter), megatron-
core 0.16.1's finalize on DDP-like chunks (skipped without it), and finalize functions
with planted bugs; one more world of 4 records megatron-core 0.19.2's finalize (from its
unpacked wheel, :mod:`parity_tests.megatron019`; skipped without it) with real
``TopKRouter`` modules. The parent replays each directory: correct runs pass, each planted
bug fails and is named by parameter and step.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import tempfile
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

from parity_tests import megatron019 as m19  # noqa: E402
from parity_tests.audit import AuditError, format_report, load, main as audit_main, replay  # noqa: E402
from parity_tests.megatron_state import fake_ddp, import_megatron_core  # noqa: E402
from parity_tests.scenarios import RouterLayout, Scenario, gpt_params  # noqa: E402
from parity_tests.process_world import spawn_world  # noqa: E402

ROUTERS = (RouterLayout("decoder.layers.0.mlp.router", 4), RouterLayout("decoder.layers.1.mlp.router", 4))
BIAS = dict(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.25)
LN = dict(sequence_parallel=True, qk_layernorm=True)
FC1 = "decoder.layers.0.mlp.linear_fc1.weight"
QKV = "decoder.layers.0.self_attention.linear_qkv.weight"
EXPERT = "decoder.layers.0.mlp.experts.linear_fc1.weight"


def _scen(name: str, **kw: Any) -> Scenario:
    base = dict(params=gpt_params(experts=True), routers=ROUTERS, mode="random", num_tokens="random",
                config=dict(LN, **BIAS))
    base.update(kw)
    return Scenario(name, **base)


#: torch_impl cases per world size: (scenario, planted bug or None, step index).
CASES: dict[int, list[tuple[Scenario, str | None, int]]] = {
    4: [
        (_scen("tp2pp2-vpp2", pp=2, tp=2, num_chunks=2), None, 0),
        (_scen("dp2tp2-ep2-distopt", dp=2, tp=2, ep=2, config=dict(LN, **BIAS, use_distributed_optimizer=True)), None, 3),
        (_scen("dp4-bf16-grad", dp=4, dtype="bfloat16", grad_attr="grad", config=dict(average_in_collective=True)), None, 0),
        (_scen("dp2cp2-pertoken", dp=2, cp=2, ep=2, config=dict(BIAS, calculate_per_token_loss=True)), None, 0),
        (_scen("bug-skip-tp2pp2", pp=2, tp=2, num_chunks=2), "skip", 0),
        (_scen("bug-double-dp2tp2", dp=2, tp=2, ep=2), "double", 5),
        (_scen("bug-replace-dp2tp2", dp=2, tp=2, ep=2), "replace", 0),
        (_scen("bug-group-dp2tp2", dp=2, tp=2, ep=2), "group", 0),
        (_scen("bug-router-dp2tp2", dp=2, tp=2, ep=2), "router", 0),
        # no experts; recorded twice (other values): the second run's files mixed into the first's
        (_scen("dense-dp2tp2", dp=2, tp=2, params=gpt_params(), routers=(), config=dict(LN)), None, 0),
        (_scen("dense-dp2tp2-b", dp=2, tp=2, params=gpt_params(), routers=(), config=dict(LN), seed=7), None, 0),
    ],
    8: [
        (_scen("pp2dp2tp2-ep2", pp=2, dp=2, tp=2, ep=2, num_chunks=2), None, 0),
        (_scen("pp2cp2tp2-pos01", pp=2, cp=2, tp=2, config=dict(LN, **BIAS, position_embedding_stages=(0, 1))), None, 0),
        (_scen("pp4tp2-embd023", pp=4, tp=2, config=dict(LN, embedding_stages=(0, 2, 3))), None, 0),
        (_scen("dp2cp2tp2-ep4-distopt", dp=2, cp=2, tp=2, ep=4,
               config=dict(LN, **BIAS, use_distributed_optimizer=True)), None, 0),
        (_scen("bug-skip-pp2dp2tp2", pp=2, dp=2, tp=2, ep=2), "skip", 2),
        (_scen("bug-router-pp2dp2tp2", pp=2, dp=2, tp=2, ep=2), "router", 0),
    ],
}
#: Cases recorded for two steps through one recorder (steps ``step`` and ``step + 1``).
REPEATED = {"tp2pp2-vpp2", "dp2tp2-ep2-distopt", "bug-double-dp2tp2"}
#: ... of which the second step gets new gradient tensors.
FRESH = {"dp2tp2-ep2-distopt"}
#: The parameter (or router) each planted bug must be named by.
PLANTED = {"skip": FC1, "double": QKV, "replace": QKV, "group": EXPERT, "router": "decoder.layers.1.mlp.router.expert_bias"}

#: megatron-core cases per world size: (name, Layout kwargs, config, wrapped in DDP-like chunks, lookup groups).
MEGATRON: dict[int, list[tuple[str, dict[str, Any], dict[str, Any], bool]]] = {
    4: [("mc-dp2tp2-ep2", dict(dp=2, tp=2, ep=2), dict(LN, **BIAS, num_moe_experts=4), False),
        ("mc-tp2pp2-lookup", dict(tp=2, pp=2), dict(LN, has_cond_embedder=True), True)],
    8: [("mc-pp2dp2tp2", dict(pp=2, dp=2, tp=2), dict(LN, **BIAS, num_moe_experts=4, calculate_per_token_loss=True), False)],
}


# =========================================================================== worker side


def _grad(p: Any) -> Any:
    return p.main_grad if hasattr(p, "main_grad") else p.grad


def _buggy(kind: str) -> Any:
    """torch_impl's finalize with one planted bug on one parameter (or router)."""
    import torch
    import torch.distributed as dist

    import torch_impl

    def finalize(model: Any, num_tokens: Any = None, pg_collection: Any = None, force_all_reduce: bool = False) -> None:
        chunk = model[0]
        params = dict(chunk.named_parameters())
        saved = {n: _grad(p).clone() for n, p in params.items() if _grad(p) is not None}
        router = chunk.get_submodule("decoder.layers.1.mlp.router")
        tokens = router.local_tokens_per_expert.clone()
        bias = router.expert_bias.clone()
        torch_impl.finalize_model_grads(model, num_tokens=num_tokens, pg_collection=pg_collection,
                                        force_all_reduce=force_all_reduce)
        if kind == "skip":  # its collectives skipped: only the token scale ran on it
            _grad(params[FC1]).copy_(saved[FC1])
        elif kind == "double":  # the DP pre-scale applied twice
            _grad(params[QKV]).mul_(0.5)
        elif kind == "replace":  # the same, into a new gradient tensor (the old one keeps the right values)
            param = params[QKV]
            setattr(param, "main_grad" if hasattr(param, "main_grad") else "grad", _grad(param) * 0.5)
        elif kind == "group":  # reduced over tp instead of expt_dp
            g = _grad(params[EXPERT])
            g.copy_(saved[EXPERT])
            dist.all_reduce(g, group=pg_collection.tp)
        elif kind == "router":  # the expert-bias update from this rank's own counts
            mean = tokens.mean()
            router.expert_bias.copy_(bias + 0.25 * torch.sign(mean - tokens))
        else:
            raise ValueError(kind)

    return finalize


def _load_in_place(model: Any, data: Any) -> None:
    """A rank's inputs copied into the gradient tensors and router buffers it already has."""
    import torch

    inner = [getattr(c, "module", c) for c in model]
    with torch.no_grad():
        for (chunk, name), values in data.grads.items():
            grad = _grad(inner[chunk].get_parameter(name))
            if values is not None and grad is not None:
                grad.copy_(torch.from_numpy(np.asarray(values, dtype=np.float32)))
        for (chunk, name), state in data.routers.items():
            router = inner[chunk].get_submodule(name)
            for field in ("local_tokens_per_expert", "expert_bias", "qb_beta", "qb_beta_accum", "qb_beta_count"):
                if getattr(router, field, None) is not None:
                    getattr(router, field).copy_(torch.from_numpy(np.asarray(getattr(state, field), dtype=np.float32)))


def _torch_case(scen: Scenario, bug: str | None, step: int, rank: int, directory: str, cache: dict[Any, Any]) -> None:
    import torch

    import torch_impl
    from torch_impl import audit
    from parity_tests.scenarios import make_rank_inputs
    from parity_tests.torch_world import build_model, collection, device_mesh, load_inputs, scenario_config

    use_mesh = bug is None and len(scen.name) % 2 == 0
    groups = device_mesh(scen, cache) if use_mesh else collection(scen, cache)
    model = build_model(scen, rank, scenario_config(scen, finalize_config=False))
    data = make_rank_inputs(scen, rank)
    load_inputs(model, scen, data)
    n = None if data.num_tokens is None else torch.tensor(data.num_tokens)
    fn = torch_impl.finalize_model_grads if bug is None else _buggy(bug)
    with audit.record(directory, sample=5, finalize=fn, start_step=step) as finalize:
        finalize(model, n, groups)
        if scen.name in REPEATED:  # a second step: new values, the same plan file
            data = make_rank_inputs(dataclasses.replace(scen, seed=scen.seed + 1), rank)
            if scen.name in FRESH:  # new gradient tensors (as after zero_grad(set_to_none=True))
                load_inputs(model, scen, data)
            else:  # the same gradient tensors: nothing is planned again
                _load_in_place(model, data)
            finalize(model, None if data.num_tokens is None else torch.tensor(data.num_tokens), groups)
            if finalize.plans_made != (2 if scen.name in FRESH else 1):
                raise RuntimeError(f"{finalize.plans_made} plans for two steps of one model")


def _megatron_case(spec: tuple[str, dict[str, Any], dict[str, Any], bool], rank: int, directory: str) -> None:
    import torch

    import test_megatron_oracle as oracle
    from torch_impl import audit
    from parity_tests.scenarios import make_rank_inputs
    from parity_tests.torch_world import build_model, load_inputs

    name, lay, config, lookup = spec
    env = oracle._Env(oracle.Layout(name, **lay), rank)
    try:
        scen = env.scenario(routers=ROUTERS, num_chunks=2, mode="random", num_tokens="random")
        cfg = oracle._transformer_config(env.layout, config)
        base = build_model(scen, rank, cfg)
        data = make_rank_inputs(scen, rank)
        load_inputs(base, scen, data)
        model = [fake_ddp(c, oracle._ddp_config({}), env.pgc.dp_cp, env.pgc.expt_dp) for c in base]
        n = torch.tensor(data.num_tokens)
        finalize = audit.audited(oracle._mf().finalize_model_grads, directory, sample=6)
        finalize(model, n, None if lookup else env.pgc)
        finalize.recorder.flush()
    finally:
        env.close()


def audit_world(rank: int, world: int, payload: dict[str, Any], sink: Any) -> None:
    """Every case of one world size, each into its own directory; reports per case."""
    cache: dict[Any, Any] = {}
    for scen, bug, step in CASES[world]:
        try:
            _torch_case(scen, bug, step, rank, os.path.join(payload["dir"], scen.name), cache)
            sink.put(scen.name, "ok")
        except Exception as err:
            sink.put(scen.name, f"{type(err).__name__}: {err}")
    if payload["megatron"]:
        for spec in MEGATRON[world]:
            try:
                _megatron_case(spec, rank, os.path.join(payload["dir"], spec[0]))
                sink.put(spec[0], "ok")
            except Exception as err:
                sink.put(spec[0], f"{type(err).__name__}: {err}")


# =========================================================================== parent side


def _has_megatron() -> bool:
    try:
        import megatron.core  # noqa: F401
    except Exception:
        return False
    return True


_WORLDS: dict[int, str] = {}


@pytest.fixture(scope="module", autouse=True)
def _remove_recordings() -> Any:
    """The recorded directories are removed when the module's tests are done."""
    yield
    import shutil

    for directory in list(_WORLDS.values()) + list(_WORLD019.values()):
        shutil.rmtree(directory, ignore_errors=True)
    _WORLDS.clear()
    _WORLD019.clear()


def _world(world: int) -> str:
    """The directory the world of ``world`` ranks recorded into (spawned once)."""
    if world not in _WORLDS:
        directory = tempfile.mkdtemp(prefix=f"meshgrad-audit-{world}-")
        megatron = _has_megatron()
        outcome = spawn_world(audit_world, world, {"dir": directory, "megatron": megatron}, timeout=300,
                              prepare=import_megatron_core if megatron else None, crash_retries=1)
        problems = [f"rank {r}: {k}: {v}" for r, res in enumerate(outcome.results) for k, v in res.items() if v != "ok"]
        if any(outcome.exitcodes) or outcome.timed_out:
            problems.append(outcome.why())
        assert not problems, "\n".join(problems)
        _WORLDS[world] = directory
    return _WORLDS[world]


def _bad_rows(result: dict[str, Any]) -> list[tuple[int, str]]:
    return [(s["step"], r["name"]) for s in result["steps"] for r in s["rows"] if r["status"] == "MISMATCH"]


@pytest.mark.parametrize("world", [4, 8])
def test_correct_finalize_passes(world: int) -> None:
    directory = _world(world)
    for scen, bug, step in CASES[world]:
        if bug is not None:
            continue
        result = replay(os.path.join(directory, scen.name))
        report = format_report(result)
        assert result["ok"], report
        assert [s["step"] for s in result["steps"]] == ([step, step + 1] if scen.name in REPEATED else [step])
        s = result["steps"][0]
        assert s["world_size"] == world
        assert s["layout"]["pp"] == scen.pp and s["layout"]["tp"] == scen.tp and s["layout"]["dp"] * s["layout"]["cp"] == scen.dp * scen.cp
        params = [r for r in s["rows"] if r["kind"] == "param"]
        # Every gradient was compared on every rank holding it, and something really happened.
        assert params and all(r["status"] == "ok" for r in params), report
        assert all((r["ranks"] == 0) == ("frozen" in r["name"]) for r in params), report
        assert any(r["steps"] for r in params)
        if scen.name in REPEATED:  # the second step: other values, the same plan file per rank
            steps = load(os.path.join(directory, scen.name))
            first, second = steps[step], steps[step + 1]
            assert all(a.meta["plan"] == b.meta["plan"] for a, b in zip(first, second))
            assert not np.array_equal(first[0].arrays["grad_before"], second[0].arrays["grad_before"])
            plans = [n for n in os.listdir(os.path.join(directory, scen.name)) if n.startswith("plan.")]
            assert len(plans) == world
        tokens = next(r for r in s["rows"] if r["kind"] == "num_tokens")
        assert tokens["ranks"] == world and tokens["status"] == "ok"
        if scen.config.get("moe_router_enable_expert_bias"):
            assert any(r["kind"] == "router" and r["name"].endswith("expert_bias") and r["ranks"] == world
                       for r in s["rows"]), report


@pytest.mark.parametrize("world", [4, 8])
def test_planted_bugs_are_named(world: int) -> None:
    directory = _world(world)
    planted = [(scen, bug, step) for scen, bug, step in CASES[world] if bug is not None]
    assert planted
    for scen, bug, step in planted:
        result = replay(os.path.join(directory, scen.name))
        report = format_report(result)
        assert not result["ok"], report
        bad = _bad_rows(result)
        assert {name for _, name in bad} == {PLANTED[bug]}, report
        assert {s for s, _ in bad} == ({step, step + 1} if scen.name in REPEATED else {step})
        assert f"MISMATCH step {step}" in report and PLANTED[bug] in report
        assert audit_main([os.path.join(directory, scen.name)]) == 1


@pytest.mark.parametrize("world", [4, 8])
def test_megatron_core_finalize_passes(world: int) -> None:
    if not _has_megatron():
        pytest.skip("megatron-core is not installed")
    directory = _world(world)
    for name, *_ in MEGATRON[world]:
        result = replay(os.path.join(directory, name))
        report = format_report(result)
        assert result["ok"], report
        (s,) = result["steps"]
        assert "megatron" in s["finalize"]
        rows = [r for r in s["rows"] if r["kind"] == "param"]
        assert rows and all(r["status"] == "ok" and (r["ranks"] > 0 or "frozen" in r["name"]) for r in rows), report
        assert any("dp_sync" in r["steps"] for r in rows) and any("non_tp" in r["steps"] for r in rows)


def test_cli_json_and_jax(tmp_path: Any, capsys: Any) -> None:
    directory = os.path.join(_world(4), "tp2pp2-vpp2")
    out = tmp_path / "audit.json"
    assert audit_main([directory, "--jax", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["ok"] and data["steps"][0]["jax"]
    rows = [r for r in data["steps"][0]["rows"] if r["kind"] == "param" and r["ranks"]]
    assert rows and all(r["jax_status"] == "ok" for r in rows)
    assert "audit PASS" in capsys.readouterr().out


def _copy(src: str, dst: str, skip: set[str] = frozenset(), rename: dict[str, str] | None = None) -> None:
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name in skip:
            continue
        with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, (rename or {}).get(name, name)), "wb") as g:
            g.write(f.read())


def test_clear_errors(tmp_path: Any) -> None:
    src = os.path.join(_world(4), "tp2pp2-vpp2")
    names = sorted(n for n in os.listdir(src) if n.startswith("step"))
    plans = sorted(n for n in os.listdir(src) if n.startswith("plan."))
    assert names == [f"step{s:08d}.rank{r:05d}.npz" for s in (0, 1) for r in range(4)]
    assert len(plans) == 4 and all(re.fullmatch(r"plan\.rank0000[0-3]\.[0-9a-f]{16}\.npz", n) for n in plans)
    # np.load without pickle reads every file; a step file holds only the per-step values.
    for name in names:
        with np.load(os.path.join(src, name), allow_pickle=False) as data:
            assert {"meta", "grads_before", "grads_after", "has_grad"} <= set(data.files)
            assert set(data.files) <= {"meta", "grads_before", "grads_after", "has_grad", "routers_before", "routers_after"}
            assert data["grads_before"].dtype == np.float32 and data["grads_before"].shape == data["grads_after"].shape
    for name in plans:
        with np.load(os.path.join(src, name), allow_pickle=False) as data:
            assert set(data.files) == {"plan", "positions"}
    step0 = [n for n in names if n.startswith("step00000000")]
    missing = tmp_path / "missing"
    _copy(src, str(missing), skip={step0[2]})
    with pytest.raises(AuditError, match=r"step 0: missing ranks \[2\]"):
        load(str(missing))
    assert audit_main([str(missing)]) == 2
    mixed = tmp_path / "mixed"
    other = os.path.join(_world(4), "dp4-bf16-grad")  # step 0 only
    _copy(src, str(mixed), skip=set(names) - {step0[0], step0[1], step0[2]})
    _copy(other, str(mixed), skip={n for n in os.listdir(other) if n.startswith("step") and "rank00003" not in n})
    os.rename(mixed / "step00000000.rank00003.npz", mixed / "step00000007.rank00003.npz")
    with pytest.raises(AuditError, match="holds step 0 rank 3, its name says step 7"):
        load(str(mixed))
    os.remove(mixed / "step00000007.rank00003.npz")
    _copy(os.path.join(_world(4), "bug-double-dp2tp2"), str(mixed),
          skip={f"step0000000{s}.rank{r:05d}.npz" for s in (5, 6) for r in range(4)} - {"step00000005.rank00003.npz"})
    with pytest.raises(AuditError, match="different steps"):
        load(str(mixed))
    # A plan file missing: named, with what to do.
    noplan = tmp_path / "noplan"
    _copy(src, str(noplan), skip={plans[1]})
    with pytest.raises(AuditError, match=r"plan\.rank00001\..*missing"):
        load(str(noplan))
    # A layout that does not match the world: rank 1's files replaced by another layout's.
    wrong = tmp_path / "wrong"
    _copy(src, str(wrong), skip=set(names) - set(step0) | {step0[1]})
    layout = os.path.join(_world(4), "dp4-bf16-grad")
    _copy(layout, str(wrong), skip={n for n in os.listdir(layout) if "rank00001" not in n})
    with pytest.raises(AuditError, match="different recordings.*rank 1"):  # another run's files, refused first
        replay(str(wrong))
    with np.load(os.path.join(src, step0[0]), allow_pickle=False) as data:
        run = json.loads(data["meta"].tobytes().decode())["run"]
    path = os.path.join(wrong, step0[1])
    with np.load(path, allow_pickle=False) as data:
        meta = json.loads(data["meta"].tobytes().decode())
    _rewrite(path, meta=np.frombuffer(json.dumps(dict(meta, run=run)).encode(), dtype=np.uint8))
    with pytest.raises(AuditError, match="layout does not match the world|group has"):  # the same run id: the layout
        replay(str(wrong))
    with pytest.raises(AuditError, match="no audit files"):
        load(str(tmp_path))


def test_recorder_rejects_bad_arguments(tmp_path: Any) -> None:
    from torch_impl import audit

    with pytest.raises(ValueError, match="sample"):
        audit.Recorder(str(tmp_path), sample=0)
    with pytest.raises(TypeError, match="callable"):
        audit.Recorder(str(tmp_path), finalize=3)  # type: ignore[arg-type]
    a = audit.sample_positions("x", 1000, 64)
    assert np.array_equal(a, audit.sample_positions("x", 1000, 64)) and a[0] == 0 and a[-1] == 999 and a.size == 64
    assert np.array_equal(audit.sample_positions("x", 10, 64), np.arange(10))


# =========================================================================== megatron-core 0.19.2

#: megatron-core 0.19.2 cases, recorded in one world of 4: (parallel_state layout, config,
#: DDP-like chunks, groups looked up from parallel_state (pg_collection=None)).
MEGATRON019: tuple[tuple[Any, dict[str, Any], bool, bool], ...] = (
    (m19.Layout("m19-tp2pp2-pos01", 4, tp=2, pp=2, pos=(0, 1)),
     dict(LN, **BIAS, num_moe_experts=4, has_cond_embedder=True), True, False),
    (m19.Layout("m19-dp2tp2-ep2", 4, tp=2, ep=2),
     dict(LN, **BIAS, num_moe_experts=4, calculate_per_token_loss=True), True, True),
)
#: The same 0.19.2 finalize with a planted bug after it: rank 1 halves one gradient of chunk 1.
BUG019 = (m19.Layout("m19-bug-dp2tp2-ep2", 4, tp=2, ep=2), dict(LN, **BIAS, num_moe_experts=4), True, False)


def audit019_world(rank: int, world: int, payload: tuple[str, str], sink: Any) -> None:
    """Record megatron-core 0.19.2's own finalize_model_grads (real TopKRouters) per case."""
    src, directory = payload
    mf = m19.import_megatron(src)
    import torch
    from megatron.core.distributed import DistributedDataParallelConfig

    from torch_impl import audit

    for layout, config, wrap, lookup in MEGATRON019 + (BUG019,):
        env = m19.Env(layout, rank)
        try:
            scen = env.scenario(num_chunks=2)
            cfg = m19.transformer_config(layout, config)
            ddp_cfg = DistributedDataParallelConfig()
            base = m19.build(env, scen, cfg, m19.ROUTERS)
            for chunk in base:
                chunk.config, chunk.ddp_config = cfg, ddp_cfg
            model = [fake_ddp(c, ddp_cfg, env.mpu.dp_cp, env.mpu.expt_dp) for c in base] if wrap else base
            fn = mf.finalize_model_grads
            if layout is BUG019[0]:
                def fn(model: Any, num_tokens: Any = None, pg_collection: Any = None, force_all_reduce: bool = False) -> None:
                    mf.finalize_model_grads(model, num_tokens, pg_collection, force_all_reduce)
                    if rank == 1:
                        base[1].get_parameter(QKV).main_grad.mul_(0.5)
            finalize = audit.audited(fn, os.path.join(directory, layout.name), sample=6)
            finalize(model, torch.tensor(4 if env.last_stage else 7), None if lookup else env.mpu)
            finalize.recorder.close()
            sink.put(layout.name, "ok")
        except Exception as err:
            import traceback

            sink.put(layout.name, f"{type(err).__name__}: {err}\n{traceback.format_exc()[-1500:]}")
        finally:
            env.close()


_WORLD019: dict[str, str] = {}


def test_megatron019_finalize_passes() -> None:
    """megatron-core 0.19.2's finalize, recorded and replayed: every value as the semantics say."""
    src = m19.source_dir()
    if src is None:
        pytest.skip(m19.skip_reason())
    if "dir" not in _WORLD019:
        directory = tempfile.mkdtemp(prefix="meshgrad-audit-m19-")
        outcome = spawn_world(audit019_world, 4, (str(src), directory), timeout=300,
                              prepare=functools.partial(m19.import_megatron, str(src)), crash_retries=1)
        names = [layout.name for layout, *_ in MEGATRON019 + (BUG019,)]
        problems = [f"rank {r}: {n}: {res.get(n, 'no result')}" for r, res in enumerate(outcome.results)
                    for n in names if res.get(n) != "ok"]
        if any(outcome.exitcodes) or outcome.timed_out:
            problems.append(outcome.why())
        assert len(outcome.results) == 4 and not problems, "\n".join(problems)
        _WORLD019["dir"] = directory
    for layout, config, _, _ in MEGATRON019:
        result = replay(os.path.join(_WORLD019["dir"], layout.name))
        report = format_report(result)
        assert result["ok"], report
        (s,) = result["steps"]
        assert s["finalize"] == "megatron.core.distributed.finalize_model_grads.finalize_model_grads"
        assert s["layout"]["tp"] == layout.tp and s["layout"]["pp"] == layout.pp
        assert s["layout"]["dp"] * s["layout"]["cp"] == layout.dp
        rows = [r for r in s["rows"] if r["kind"] == "param"]
        assert rows and all(r["status"] == "ok" and r["ranks"] > 0 for r in rows if "frozen" not in r["name"]), report
        assert any("non_tp" in r["steps"] for r in rows) and any("token_scale" in r["steps"] for r in rows)
        if layout.dp > 1:
            assert any("dp_sync" in r["steps"] for r in rows)
        if layout.pp > 1:
            assert any("word_embedding" in r["steps"] for r in rows) and any("pos_embedding" in r["steps"] for r in rows)
        # real routers: their expert bias was updated and checked on every rank
        bias = [r for r in s["rows"] if r["kind"] == "router" and r["name"].endswith(".expert_bias")]
        assert bias and all(r["ranks"] == 4 and r["status"] == "ok" for r in bias), report
        tokens = next(r for r in s["rows"] if r["kind"] == "num_tokens")
        assert tokens["ranks"] == 4 and tokens["status"] == "ok"
        files = load(os.path.join(_WORLD019["dir"], layout.name))[0]
        moved = [f for f in files for k in f.arrays if k.endswith("expert_bias.after")
                 and not np.array_equal(f.arrays[k], f.arrays[k.replace(".after", ".before")])]
        assert moved, "no expert bias changed: the router update was not exercised"
    bug = replay(os.path.join(_WORLD019["dir"], BUG019[0].name))
    assert not bug["ok"] and _bad_rows(bug) == [(0, QKV)], format_report(bug)
    assert "rank 1" in next(r["detail"] for r in bug["steps"][0]["rows"] if r["status"] == "MISMATCH")


def test_embeddings_are_sampled_alike_on_every_stage(tmp_path: Any) -> None:
    """The tied word embedding is summed across stages under different names
    (``embedding.word_embeddings.weight`` first, ``output_layer.weight`` last): both
    stages sample the same positions, other parameters by their own names."""
    import types

    import torch

    from torch_impl import audit

    recorder = audit.Recorder(str(tmp_path), sample=16)
    param = torch.nn.Parameter(torch.zeros(64, 32))

    def spec(name: str, role: str) -> Any:
        return types.SimpleNamespace(chunk=0, name=name, role=role, expert=False,
                                     **{f: False for f in audit.PARAM_FLAGS})

    first = recorder._entry(spec("embedding.word_embeddings.weight", "word_embedding"), param).positions
    last = recorder._entry(spec("output_layer.weight", "word_embedding"), param).positions
    other = recorder._entry(spec("output_layer.weight", "none"), param).positions
    assert first.size == 16 and np.array_equal(first, last) and not np.array_equal(first, other)
    assert np.array_equal(first, audit.sample_positions("[word embedding]", 64 * 32, 16))


# =========================================================================== damaged and mixed records


def _rewrite(path: str, **changes: Any) -> None:
    """Rewrite one recorded .npz with some arrays changed (np.savez, uncompressed)."""
    with np.load(path, allow_pickle=False) as data:
        arrays = {k: data[k] for k in data.files}
    arrays.update(changes)
    os.remove(path)
    np.savez(path, **arrays)


def test_a_rank_deleted_from_every_step_is_named(tmp_path: Any) -> None:
    """One rank's files deleted from a two-step run: that rank is named as missing from
    both steps (not "files from different steps")."""
    src = os.path.join(_world(4), "tp2pp2-vpp2")
    gone = tmp_path / "gone"
    _copy(src, str(gone), skip={f"step{s:08d}.rank00002.npz" for s in (0, 1)})
    with pytest.raises(AuditError, match=r"rank 2 missing from steps \[0, 1\]") as err:
        load(str(gone))
    assert "different steps" not in str(err.value)
    assert audit_main([str(gone)]) == 2


@pytest.mark.parametrize("member,value", [("grads_before", np.nan), ("grads_before", -np.inf), ("grads_after", np.nan),
                                          ("grads_after", np.inf)])
def test_a_nonfinite_recorded_value_is_a_damaged_record(tmp_path: Any, capsys: Any, member: str, value: float) -> None:
    """A NaN or inf edited into rank 1's recorded values of step 0 (before or after
    finalize): the replay refuses the record -- one line naming the step, the rank, the
    parameter and the flat index, exit status 2 -- in the streamed and the whole load
    alike, instead of a row that names no parameter."""
    src = os.path.join(_world(4), "dp4-bf16-grad")
    damaged = tmp_path / "damaged"
    _copy(src, str(damaged))
    path = os.path.join(damaged, "step00000000.rank00001.npz")
    with np.load(path, allow_pickle=False) as data:
        values = data[member].copy()
        positions = load(src)[0][1].arrays["positions"]
    first = load(src)[0][1].meta["params"][0]
    values[1] = value  # the first parameter's second sample
    _rewrite(path, **{member: values})
    when = "before" if member == "grads_before" else "after"
    text = (f"step 0: rank 1: the recorded {when} value of parameter {first['chunk']}/{first['name']} at flat index "
            f"{int(positions[1])} is {float(value)!r}: a damaged record")
    for stream in (True, False):
        with pytest.raises(AuditError) as err:
            replay(str(damaged), stream=stream)
        assert str(err.value).startswith(text) and "\n" not in str(err.value), str(err.value)
    assert audit_main([str(damaged)]) == 2
    assert capsys.readouterr().err.startswith(f"audit: {text}")
    assert replay(src)["ok"]  # the same files without the edit pass


def test_a_nonfinite_recorded_num_tokens_is_a_damaged_record(tmp_path: Any) -> None:
    """num_tokens recorded as NaN on rank 2 (before finalize): the same one-line refusal."""
    src = os.path.join(_world(4), "dp4-bf16-grad")
    damaged = tmp_path / "damaged"
    _copy(src, str(damaged))
    path = os.path.join(damaged, "step00000000.rank00002.npz")
    with np.load(path, allow_pickle=False) as data:
        meta = json.loads(data["meta"].tobytes().decode())
    assert meta["num_tokens"]["before"] is not None
    meta["num_tokens"]["before"] = float("nan")
    _rewrite(path, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8))
    with pytest.raises(AuditError, match=r"^step 0: rank 2: the recorded num_tokens before finalize is nan: a damaged record"):
        replay(str(damaged))
    assert audit_main([str(damaged)]) == 2


def test_files_of_another_run_are_refused(tmp_path: Any) -> None:
    """Rank 1's files replaced by another recording's of the same step and layout (other
    values): a clear error naming the rank and the file, not a MISMATCH of every parameter."""
    root = _world(4)
    mixed = tmp_path / "mixed"
    _copy(os.path.join(root, "dense-dp2tp2"), str(mixed))
    other = os.path.join(root, "dense-dp2tp2-b")
    _copy(other, str(mixed), skip={n for n in os.listdir(other) if "rank00001" not in n})
    with pytest.raises(AuditError, match=r"different recordings.*rank 1: .*step00000000\.rank00001\.npz"):
        load(str(mixed))
    assert audit_main([str(mixed)]) == 2
    runs = {f.meta["run"] for f in load(os.path.join(root, "dense-dp2tp2"))[0]}
    assert len(runs) == 1 and runs != {f.meta["run"] for f in load(other)[0]}


def test_header_lists_only_the_axes_the_run_has() -> None:
    """A model without experts: the header says ``dp2 tp2``, no expert axes."""
    result = replay(os.path.join(_world(4), "dense-dp2tp2"))
    assert result["ok"], format_report(result)
    header = format_report(result).splitlines()[0]
    assert "(dp2 tp2)" in header and "edp" not in header and "ep*etp" not in header, header
    header = format_report(replay(os.path.join(_world(4), "dp2tp2-ep2-distopt"))).splitlines()[0]
    assert "ep*etp" in header, header
