"""Audit of megatron-core's REAL ``DistributedDataParallel`` with ``overlap_grad_reduce=True``.

Such a DDP starts reducing its bucket groups during backward, so the recorder reads the
sampled local gradients as each bucket group's ``start_grad_sync`` begins
(:mod:`torch_impl.audit.overlap`). One spawned gloo world of 2 ranks (Megatron's
``parallel_state`` with dp=2, device lookups on the CPU: :func:`parity_tests.megatron_state.megatron_on_cpu`)
trains one small model per case for a few steps under ``audit.record(..., model=[ddp])``:
overlap off (the control), overlap on (several bucket groups, fp32 and bf16 with
``grad_reduce_in_fp32``), overlap on with a planted bug, overlap on without ``model=``
(its first step cannot be recorded). The parent replays every recording with
``parity_tests.audit`` and checks the verdicts, that the "before" values recorded under
overlap are those recorded without it (the same inputs; 2 ranks: the sums are exact), and
that the wrappers are gone after the context. Skipped without megatron-core.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import tempfile
import types
import warnings
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

from parity_tests.audit import format_report, main as audit_main, replay  # noqa: E402
from parity_tests.megatron_state import import_megatron_core  # noqa: E402
from parity_tests.process_world import spawn_world  # noqa: E402

WORLD = 2
STEPS = 3
LR = 0.125
#: The parameter the planted bug changes (rank 1, step BUG_STEP: +1 after finalize).
BUG_PARAM, BUG_STEP = "2.weight", 1

#: name -> (DistributedDataParallelConfig fields, parameter dtype, finalize has a bug, how the
#: DDP is given before the first backward: audit.record(model=), audit.audited(model=), not)
CASES: dict[str, tuple[dict[str, Any], str, bool, str | None]] = {
    "off": (dict(), "float32", False, "record"),
    "on": (dict(overlap_grad_reduce=True, bucket_size=64), "float32", False, "record"),
    "on-bf16-fp32": (dict(overlap_grad_reduce=True, bucket_size=64, grad_reduce_in_fp32=True), "bfloat16", False, "record"),
    "on-audited": (dict(overlap_grad_reduce=True, bucket_size=64), "float32", False, "audited"),
    "on-bug": (dict(overlap_grad_reduce=True, bucket_size=64), "float32", True, "record"),
    "on-unwatched": (dict(overlap_grad_reduce=True, bucket_size=64), "float32", False, None),
}


def _has_megatron() -> bool:
    try:
        return importlib.import_module("megatron.core") is not None
    except Exception:
        return False


# =========================================================================== worker side


def _finalize(bug: bool, rank: int, step: list[int]) -> Any:
    """torch_impl's finalize; with ``bug``, rank 1 adds 1 to BUG_PARAM's gradient at BUG_STEP."""
    import torch_impl

    def finalize(model: Any, num_tokens: Any = None, pg_collection: Any = None, force_all_reduce: bool = False) -> None:
        torch_impl.finalize_model_grads(model, num_tokens, pg_collection, force_all_reduce)
        if bug and rank == 1 and step[0] == BUG_STEP:
            model[0].module.get_parameter(BUG_PARAM).main_grad.add_(1.0)

    return finalize


def _case(name: str, rank: int, directory: str) -> dict[str, Any]:
    """Train one case for STEPS steps under the recorder; what the parent checks."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.transformer_config import TransformerConfig
    from torch import nn

    from torch_impl import audit

    fields, dtype, bug, watch = CASES[name]
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))
    module = module.to(getattr(torch, dtype))
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(**fields), module)
    groups = list(ddp.bucket_groups) + list(ddp.expert_parallel_bucket_groups)
    step = [0]
    started: list[bool] = []
    fn = _finalize(bug, rank, step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if watch == "audited":  # a wrapper; its recorder closed at the end
            rec = audit.audited(fn, directory, sample=8, model=[ddp])
            context: Any = contextlib.nullcontext(rec)
            closing: Any = contextlib.closing(rec.recorder)
        else:
            context = audit.record(directory, sample=8, finalize=fn, model=[ddp] if watch else None)
            closing = contextlib.nullcontext()
        with closing, context as rec:
            wrapped = all("start_grad_sync" in vars(g) for g in groups)
            for step[0] in range(STEPS):
                ddp.zero_grad_buffer()
                g = torch.Generator().manual_seed(1000 * step[0] + rank)
                x = torch.randn(6, 8, generator=g).to(getattr(torch, dtype))
                ddp(x).float().pow(2).mean().backward()
                started.append(all(getattr(g, "grad_reduce_handle", None) is not None for g in groups))
                rec([ddp])
                with torch.no_grad():
                    for p in ddp.parameters():
                        p.add_(p.main_grad.to(p.dtype), alpha=-LR)
    return {
        "bucket_groups": len(groups),
        "wrapped": wrapped,
        "started": started,
        "left": [sorted(k for k in vars(g) if k == "start_grad_sync") for g in groups],
        "warnings": [str(w.message) for w in caught if "audit:" in str(w.message)],
    }


def overlap_world(rank: int, world: int, directory: str, sink: Any) -> None:
    """Every case on this rank, each into its own directory."""
    from megatron.core import parallel_state as ps

    from parity_tests.megatron_state import megatron_on_cpu

    megatron_on_cpu()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ps.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    try:
        for name in CASES:
            try:
                sink.put(name, _case(name, rank, os.path.join(directory, name)))
            except Exception as err:
                import traceback

                sink.put(name, f"{type(err).__name__}: {err}\n{traceback.format_exc()[-2000:]}")
    finally:
        ps.destroy_model_parallel()


# =========================================================================== parent side

_WORLD: dict[str, Any] = {}


@pytest.fixture(scope="module")
def world() -> Any:
    """(directory, per-rank results); the recordings are removed after the module."""
    if not _has_megatron():
        pytest.skip("megatron-core is not installed (the real DistributedDataParallel is needed)")
    directory = tempfile.mkdtemp(prefix="meshgrad-audit-overlap-")
    try:
        outcome = spawn_world(overlap_world, WORLD, directory, timeout=600, prepare=import_megatron_core)
        problems = [f"rank {r}: {n}: {res.get(n, 'no result')}" for r, res in enumerate(outcome.results)
                    for n in CASES if not isinstance(res.get(n), dict)]
        problems += [f"rank {r}: {f}" for r, f in enumerate(outcome.fatal) if f]
        assert not problems and not outcome.timed_out, "\n".join(problems) or "world timed out"
        yield directory, outcome.results
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _steps(directory: str, rank: int) -> dict[int, dict[str, Any]]:
    """Per step: this rank's meta and arrays, read from its step files."""
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith("step") and f"rank{rank:05d}" in name:
            with np.load(os.path.join(directory, name), allow_pickle=False) as data:
                arrays = {k: data[k] for k in data.files}
            meta = json.loads(arrays["meta"].tobytes().decode())
            out[meta["step"]] = dict(arrays, meta=meta)
    return out


def _params(directory: str, rank: int) -> list[dict[str, Any]]:
    (plan,) = [n for n in os.listdir(directory) if n.startswith(f"plan.rank{rank:05d}.")]
    with np.load(os.path.join(directory, plan), allow_pickle=False) as data:
        return json.loads(data["plan"].tobytes().decode())["params"]


def _bad(result: dict[str, Any]) -> set[tuple[int, str]]:
    return {(s["step"], r["name"]) for s in result["steps"] for r in s["rows"] if r["status"] != "ok"}


@pytest.mark.parametrize("name", ["off", "on", "on-bf16-fp32", "on-audited", "on-unwatched"])
def test_overlap_recordings_pass(world: Any, name: str) -> None:
    """Every step of every correct recording replays ok, every parameter compared on both
    ranks; under overlap the bucket groups really reduced during backward (after the
    first batch) and their values were read as they started."""
    directory, results = world
    result = replay(os.path.join(directory, name))
    report = format_report(result)
    assert result["ok"], report
    first = 1 if name == "on-unwatched" else 0
    assert [s["step"] for s in result["steps"]] == list(range(first, STEPS)), report
    for s in result["steps"]:
        rows = [r for r in s["rows"] if r["kind"] == "param"]
        assert len(rows) == 6 and all(r["status"] == "ok" and r["ranks"] == WORLD for r in rows), report
        assert all("dp_sync" in r["steps"] for r in rows), report
    assert audit_main([os.path.join(directory, name)]) == 0
    for rank, res in enumerate(results):
        info = res[name]
        steps = _steps(os.path.join(directory, name), rank)
        if name == "off":
            assert not any(info["started"]) and all("before_at_grad_sync" not in s["meta"] for s in steps.values())
            continue
        assert info["bucket_groups"] > 1
        # megatron's first batch reduces in finish_grad_sync; later ones during backward
        assert info["started"] == [False] + [True] * (STEPS - 1), info
        for step in range(max(first, 1), STEPS):
            assert steps[step]["meta"]["before_at_grad_sync"] == info["bucket_groups"]


def test_overlap_before_values_equal_those_without_overlap(world: Any) -> None:
    """The same model and inputs with overlap off and on: the recorded "before" (and
    "after") values are equal at every step on every rank."""
    directory, _ = world
    for rank in range(WORLD):
        off, on = _steps(os.path.join(directory, "off"), rank), _steps(os.path.join(directory, "on"), rank)
        assert _params(os.path.join(directory, "off"), rank) == _params(os.path.join(directory, "on"), rank)
        assert sorted(off) == sorted(on) == list(range(STEPS))
        for step in range(STEPS):
            assert np.array_equal(off[step]["grads_before"], on[step]["grads_before"]), (rank, step)
            assert np.array_equal(off[step]["grads_after"], on[step]["grads_after"]), (rank, step)
            assert not np.array_equal(on[step]["grads_before"], on[step]["grads_after"])
        assert not np.array_equal(on[0]["grads_before"], on[1]["grads_before"])


def test_overlap_planted_bug_is_named(world: Any) -> None:
    """A finalize that adds 1 to one gradient on rank 1 at one step: that parameter and
    that step, nothing else."""
    directory, _ = world
    result = replay(os.path.join(directory, "on-bug"))
    assert not result["ok"] and _bad(result) == {(BUG_STEP, BUG_PARAM)}, format_report(result)
    assert f"MISMATCH step {BUG_STEP} param 0/{BUG_PARAM}" in format_report(result)
    assert audit_main([os.path.join(directory, "on-bug")]) == 1


def test_overlap_corrupted_after_value_is_named(world: Any, tmp_path: Any) -> None:
    """One after-value of one parameter changed in rank 0's step-2 file of a correct
    overlap recording: the replay names that parameter and step."""
    directory, _ = world
    copy = tmp_path / "on"
    shutil.copytree(os.path.join(directory, "on"), copy)
    params = _params(str(copy), 0)
    index = next(i for i, p in enumerate(params) if p["name"] == "4.bias")
    slot = sum(p["samples"] for p in params[:index]) + 1
    path = os.path.join(copy, "step00000002.rank00000.npz")
    with np.load(path, allow_pickle=False) as data:
        arrays = {k: data[k] for k in data.files}
    arrays["grads_after"] = arrays["grads_after"].copy()
    arrays["grads_after"][slot] += 0.5
    os.remove(path)
    np.savez(path, **arrays)
    result = replay(str(copy))
    assert not result["ok"] and _bad(result) == {(2, "4.bias")}, format_report(result)


def test_overlap_wrappers_are_removed_and_unwatched_step_is_named(world: Any) -> None:
    """The bucket groups' start_grad_sync is wrapped inside the context only (no attribute
    left after it); without model=, the first step is left out with a warning that says why."""
    _, results = world
    for rank, res in enumerate(results):
        for name in CASES:
            info = res[name]
            assert info["left"] == [[]] * info["bucket_groups"], (rank, name)
            assert info["wrapped"] == (name != "off" and CASES[name][3] is not None), (rank, name, info)
        (msg,) = res["on-unwatched"]["warnings"]
        assert "step 0 not recorded" in msg and "overlap_grad_reduce=True" in msg and "model=" in msg, msg
        assert all(not res[n]["warnings"] for n in CASES if n != "on-unwatched"), res


# =========================================================================== unknown structure (no world)


class _Group:
    """A bucket group of the known structure (its ``start_grad_sync`` counts calls)."""

    def __init__(self, params: list[Any]) -> None:
        self.params = set(params)
        self.calls = 0

    def start_grad_sync(self, force_all_reduce: bool = False) -> None:
        self.calls += 1


def _ddp_like(**attrs: Any) -> Any:
    import torch

    class OddDDP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = torch.nn.Linear(2, 2)
            self.ddp_config = types.SimpleNamespace(overlap_grad_reduce=True)

        def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
            pass

    ddp = OddDDP()
    for key, value in attrs.items():
        setattr(ddp, key, value(ddp) if callable(value) else value)
    return ddp


def test_unknown_overlapping_ddp_fails_clearly(tmp_path: Any) -> None:
    """An overlapping DDP whose structure the recorder does not know: FinalizeTypeError
    naming the DDP and what is missing, and nothing is wrapped."""
    from meshgrad.errors import FinalizeTypeError
    from torch_impl import audit

    cases = [
        (_ddp_like(), "no list `bucket_groups`"),
        (_ddp_like(bucket_groups=lambda d: [types.SimpleNamespace(params={d.module.weight, d.module.bias})]),
         "bucket group 0 .* no callable `start_grad_sync`"),
        (_ddp_like(bucket_groups=lambda d: [_Group([]), types.SimpleNamespace(start_grad_sync=print)]),
         "bucket group 1 .* lists no parameters"),
        (_ddp_like(bucket_groups=lambda d: [_Group([d.module.weight])]), r"parameters \['module.bias'\] are in none"),
    ]
    for ddp, what in cases:
        with pytest.raises(FinalizeTypeError, match=f"chunk 0's .*OddDDP with overlap_grad_reduce=True: .*{what}"):
            with audit.record(str(tmp_path), model=[ddp]):
                pass
        assert all("start_grad_sync" not in vars(g) for g in getattr(ddp, "bucket_groups", []) if isinstance(g, _Group))


def test_wrapper_restores_what_it_shadowed(tmp_path: Any) -> None:
    """A bucket group that already had an instance ``start_grad_sync``: it is put back
    after the context, and calls go through the wrapper to it inside."""
    from torch_impl import audit

    ddp = _ddp_like(bucket_groups=lambda d: [_Group([d.module.weight, d.module.bias])])
    (group,) = ddp.bucket_groups
    seen: list[Any] = []

    def own(force_all_reduce: bool = False) -> None:
        seen.append(force_all_reduce)

    group.start_grad_sync = own
    with audit.record(str(tmp_path), model=[ddp]):
        assert group.start_grad_sync is not own
        group.start_grad_sync(force_all_reduce=True)
    assert group.start_grad_sync is own and seen == [True]
    plain = _ddp_like(bucket_groups=lambda d: [_Group([d.module.weight, d.module.bias])])
    with audit.record(str(tmp_path), model=[plain]):
        plain.bucket_groups[0].start_grad_sync()
    assert "start_grad_sync" not in vars(plain.bucket_groups[0]) and plain.bucket_groups[0].calls == 1
