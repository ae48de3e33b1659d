"""``explain`` against the collectives torch_impl really launches, on one gloo world of 8.

Each case builds every rank's model chunks from the same preset or JSON description that
``explain`` plans (at toy sizes: real ``nn.Module`` trees with Megatron's names and flags),
runs torch_impl's ``finalize_model_grads`` twice (the second call is the steady-state step)
and records, per rank and in order, each torch.distributed collective (the bench's
:class:`bench.counting.CollectiveCounter`: collective, group members, dtype, elements) and
each status-round all-reduce. The test compares that sequence with
:meth:`meshgrad.explain.Explanation.rank_launches` for the rank, and checks the values of
the replicated gradients (equal over their group, as finalize must leave them). Nine
layouts: pp 1-4, vpp, dp, cp, tp, gtp, ep with etp 1 and 2, the distributed optimizer,
per-token loss, tied embeddings, bf16 gradients reduced in fp32, AVG in the collective, a
JSON model with mixed dtypes and a frozen parameter; groups from a DeviceMesh or from a
ProcessGroupCollection-like namespace.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from meshgrad.config import FinalizeConfig
from meshgrad.explain import Explanation, Layout, explain, model_stages
from meshgrad.params import Role
from meshgrad.presets import PRESETS
from parity_tests.megatron_state import preload_megatron_core
from parity_tests.world_cases import case_values, run_cases

WORLD = 8

_TINY = PRESETS["tiny"]
_DENSE = dataclasses.replace(_TINY, name="tiny-dense", experts=0, tied=False, max_positions=0, expert_bias=False)
_JSON = json.dumps([
    {"name": "embedding.word_embeddings.weight", "shape": [8, 4], "role": "word_embedding", "stages": "first"},
    {"name": "ln.weight", "shape": [4], "sequence_parallel": True},
    {"name": "ln2.weight", "shape": [4], "dtype": "bfloat16", "sequence_parallel": True},
    {"name": "fc.weight", "shape": [4, 6]},
    {"name": "fc2.weight", "shape": [6, 4], "dtype": "bfloat16"},
    {"name": "frozen.weight", "shape": [5], "has_grad": False, "sequence_parallel": True},
    {"name": "head.scale", "shape": [3], "average_gradients_across_tp_domain": True, "stages": "last"},
    {"name": "output_layer.weight", "shape": [8, 4], "role": "word_embedding", "stages": "last"},
])

#: name -> (model, layout, config fields): pp, dp, tp, cp, ep, vpp, distributed optimizer,
#: per-token loss, tied embeddings, learned positions, bf16 gradients reduced in fp32, AVG.
CASES_SPEC: dict[str, tuple[Any, Layout, dict[str, Any]]] = {
    "tied_pp2_tp2_ep2_distopt_tokens": (
        _TINY, Layout(pp=2, dp=2, tp=2, ep=2),
        dict(sequence_parallel=True, qk_layernorm=True, moe_router_enable_expert_bias=True,
             calculate_per_token_loss=True, use_distributed_optimizer=True),
    ),
    "dense_dp8_mean": (_DENSE, Layout(dp=8), dict(share_embeddings_and_output_weights=False)),
    # pure data parallelism with per-token loss: the status round carries the token count
    "dense_dp8_tokens": (_DENSE, Layout(dp=8), dict(share_embeddings_and_output_weights=False,
                                                    calculate_per_token_loss=True)),
    "vpp2_positions_tp2_tokens": (
        dataclasses.replace(_TINY, layers=8, experts=0, expert_bias=False), Layout(pp=2, vpp=2, tp=2, dp=2),
        dict(sequence_parallel=True, qk_layernorm=True, calculate_per_token_loss=True),
    ),
    "moe_dp4_ep4_etp1_bf16_fp32": (
        dataclasses.replace(_TINY, grad_dtype="bfloat16", tied=False, max_positions=0), Layout(dp=4, tp=2, ep=4, etp=1),
        dict(sequence_parallel=True, qk_layernorm=True, use_distributed_optimizer=True, grad_reduce_in_fp32=True,
             moe_router_enable_expert_bias=True, share_embeddings_and_output_weights=False),
    ),
    "cp2_avg_in_collective": (
        _DENSE, Layout(cp=2, tp=2, dp=2),
        dict(sequence_parallel=True, average_in_collective=True, share_embeddings_and_output_weights=False),
    ),
    "json_pp2_mixed_dtypes": (_JSON, Layout(pp=2, tp=2, dp=2), dict(sequence_parallel=True)),
    "pp4_tied_middle_stages_tokens": (
        dataclasses.replace(_DENSE, layers=8, tied=True), Layout(pp=4, dp=2),
        dict(calculate_per_token_loss=True, use_distributed_optimizer=True),
    ),
    "gtp2_tp2_dp2": (_DENSE, Layout(dp=2, gtp=2, tp=2), dict(sequence_parallel=True, share_embeddings_and_output_weights=False)),
    "moe_etp2_edp2_tokens_pp1": (
        dataclasses.replace(_TINY, tied=False, max_positions=0), Layout(dp=4, tp=2, ep=2, etp=2),
        dict(sequence_parallel=True, qk_layernorm=True, calculate_per_token_loss=True, use_distributed_optimizer=True,
             moe_router_enable_expert_bias=True, share_embeddings_and_output_weights=False),
    ),
}

#: Cases whose groups come from a torch DeviceMesh (dims pp, dp, cp, gtp, tp); the others
#: from a ProcessGroupCollection-like namespace of every named group.
MESH_CASES = frozenset({"dense_dp8_mean", "vpp2_positions_tp2_tokens", "gtp2_tp2_dp2"})


def _explained(name: str) -> Explanation:
    model, layout, fields = CASES_SPEC[name]
    label = model.name if hasattr(model, "name") else "json"
    return explain(model_stages(model, layout), layout, FinalizeConfig(**fields), model=label)


# --------------------------------------------------------------------------- on each rank


def _run(name: str, rank: int) -> dict[str, Any]:
    import torch

    import torch_impl.run.rounds as status  # the rounds' collectives
    from bench.counting import CollectiveCounter
    from bench.explain_world import build_chunks, device_mesh, named_groups
    from meshgrad.axes import Axis
    from torch_impl import finalize_model_grads

    import time

    model, layout, fields = CASES_SPEC[name]
    config = FinalizeConfig(**fields)
    dims = layout.dims
    t0 = time.perf_counter()
    groups = device_mesh(dims) if name in MESH_CASES else named_groups(dims, config)
    t1 = time.perf_counter()
    stage = dims.coords(rank)[Axis.PP]
    chunks = build_chunks(model_stages(model, layout)(stage), config, rank)
    rounds: list[tuple[str, tuple[int, ...], str, int]] = []
    original = status.all_reduce_status  # the status round's one reduction

    def recorded(value: Any, pg: Any, options: Any = None) -> None:
        import torch.distributed as dist

        rounds.append(("status", tuple(dist.get_process_group_ranks(pg)), str(value.dtype).removeprefix("torch."),
                       value.numel()))
        original(value, pg, options)

    status.all_reduce_status = recorded
    try:
        def step() -> None:
            # Tokens differ by data-parallel rank only (tp / pp peers see the same batch).
            tokens = torch.tensor([dims.coords(rank)[Axis.DP] + 3]) if config.calculate_per_token_loss else None
            finalize_model_grads(chunks, num_tokens=tokens, pg_collection=groups)

        step()  # the first call plans and compares (its all-gathers are the checks')
        t2 = time.perf_counter()
        rounds.clear()
        with CollectiveCounter(log=True) as counter:
            step()
    finally:
        status.all_reduce_status = original
    grads = {f"{c}:{n}": p.grad.float().tolist() for c, chunk in enumerate(chunks) for n, p in chunk.named_parameters()
             if p.grad is not None}
    times = (t1 - t0, t2 - t1, time.perf_counter() - t2)
    return {"rounds": rounds, "launched": counter.records, "grads": grads, "seconds": times}


def _case(name: str) -> Any:
    def case(rank: int, world_size: int) -> dict[str, Any]:
        return _run(name, rank)

    case.__name__ = f"case_{name}"
    return case


for _name in CASES_SPEC:
    globals()[f"case_{_name}"] = _case(_name)

#: Megatron-Core's real DistributedDataParallel (dp = 8): (name, distributed optimizer,
#: bucket_size, overlap_grad_reduce) -- its DP sync against :func:`meshgrad.explain.ddp_launches`.
MEGATRON_DDP = (("ddp_buckets", False, 400, True), ("ddp_buckets_distopt", True, 400, True),
                ("ddp_no_overlap_one_bucket", True, 400, False))
#: The DDP's parameters (elements), in module order.
DDP_NUMELS = (300, 350, 1000, 64, 130, 7)


def case_megatron_ddp(rank: int, world_size: int) -> dict[str, Any]:
    """Megatron-Core's real DDP (backward, then ``finish_grad_sync``) on every rank: the
    collectives of its DP sync, per setting."""
    import sys
    import warnings

    import torch
    from torch import nn

    from bench.counting import CollectiveCounter, launch_record
    from parity_tests.megatron_state import megatron_on_cpu

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        megatron_on_cpu().__exit__(None, None, None)
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.transformer.transformer_config import TransformerConfig

        ps.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    out = {}
    for name, distopt, bucket, overlap in MEGATRON_DDP:
        module = nn.Module()
        for index, numel in enumerate(DDP_NUMELS):
            module.register_parameter(f"p{index}", nn.Parameter(torch.ones(numel)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
            ddp_cfg = DistributedDataParallelConfig(overlap_grad_reduce=overlap, bucket_size=bucket,
                                                    use_distributed_optimizer=distopt)
            ddp = DistributedDataParallel(cfg, ddp_cfg, module)
        # Megatron binds its reduce-scatter once, at import (``dist_reduce_scatter_func``):
        # the counter's torch.distributed wrappers cannot see it, so it is recorded here.
        buffers = sys.modules["megatron.core.distributed.param_and_grad_buffer"]
        scatter = buffers.dist_reduce_scatter_func
        with CollectiveCounter(log=True) as counter:
            def recorded(output: Any, tensor: Any, *args: Any, **kwargs: Any) -> Any:
                counter.records.append(launch_record("reduce_scatter_tensor", (output, tensor), kwargs))
                return scatter(output, tensor, *args, **kwargs)

            buffers.dist_reduce_scatter_func = recorded
            try:
                ddp.zero_grad_buffer()
                sum((p * (rank + 1)).sum() for p in module.parameters()).backward()
                ddp.finish_grad_sync()
            finally:
                buffers.dist_reduce_scatter_func = scatter
        out[name] = counter.records
    return out


CASES = [f"case_{n}" for n in CASES_SPEC] + ["case_megatron_ddp"]

# --------------------------------------------------------------------------- the test

_KIND = {"all_reduce": "all_reduce", "broadcast": "broadcast", "reduce_scatter_single": "reduce_scatter",
         "reduce_scatter_tensor": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter"}
_WORLD: dict[str, Any] = {}


@pytest.fixture(scope="module")
def world() -> dict[str, Any]:
    if "v" not in _WORLD:
        _WORLD["v"] = run_cases(__name__, CASES, WORLD, timeout=240, prepare=preload_megatron_core)
    return _WORLD["v"]


@pytest.mark.parametrize("name", list(CASES_SPEC))
def test_explain_lists_what_torch_launches(world: dict[str, Any], name: str) -> None:
    from bench.counting import CHECK_COLLECTIVES

    per_rank = case_values(world, f"case_{name}")
    explained = _explained(name)
    launched_any = False
    for rank, got in enumerate(per_rank):
        expected = [(l.kind, members, l.dtype, l.numel) for l, members in explained.rank_launches(rank)]
        rounds = [("all_reduce", m, d, n) for _, m, d, n in got["rounds"]]
        data = [(_KIND[c], m, d, n) for c, m, d, n in got["launched"] if c not in CHECK_COLLECTIVES]
        assert rounds + data == expected, f"{name}: rank {rank} ({explained.class_of(rank).name})"
        launched_any = launched_any or bool(data)
    assert launched_any


@pytest.mark.parametrize(("name", "distopt", "bucket", "overlap"), MEGATRON_DDP)
def test_megatron_ddp_buckets_as_explain_lists_them(world: dict[str, Any], name: str, distopt: bool,
                                                    bucket: int | None, overlap: bool) -> None:
    """Megatron-Core's own DDP launches the buckets :func:`~meshgrad.explain.ddp_launches`
    lists for it (sizes with its padding, kind, group), in some order (backward decides);
    without ``overlap_grad_reduce`` one bucket whatever ``bucket_size`` says."""
    pytest.importorskip("megatron.core")
    from meshgrad.megatron_launches import ddp_launches
    from meshgrad.params import ParamSpec
    from meshgrad.plan import plan_finalize

    per_rank = case_values(world, "case_megatron_ddp")
    specs = [ParamSpec(f"p{i}", shape=(n,)) for i, n in enumerate(DDP_NUMELS)]
    config = FinalizeConfig(use_distributed_optimizer=distopt)
    plan = plan_finalize(specs, config, Layout(dp=WORLD).dims)
    listed = ddp_launches(plan, 0, overlap=overlap, bucket_size=bucket if overlap else None)
    expected = sorted((l.kind, tuple(range(WORLD)), l.dtype, l.numel) for l in listed)
    # reversed: 7 + 130 + 64 + 1000 >= 400 closes the first bucket, 350 + 300 the second
    assert [n for *_, n in expected] == ([650, 1201] if not overlap else [768, 1408] if distopt else [650, 1201]) \
        or not overlap and [n for *_, n in expected] == [2048]
    for rank, got in enumerate(per_rank):
        launched = sorted((_KIND[c], m, d, n) for c, m, d, n in got[name])
        assert launched == expected, f"{name}: rank {rank}"


@pytest.mark.parametrize("name", list(CASES_SPEC))
def test_replicated_gradients_agree_over_their_groups(world: dict[str, Any], name: str) -> None:
    """After finalize (integer data: bit-exact), a sequence-parallel gradient is equal on
    every member of its tp group (the non-TP all-reduce covers the whole tensor), and a tied
    embedding on both embedding stages; the data differ by rank before."""
    from meshgrad.axes import Group

    per_rank = case_values(world, f"case_{name}")
    explained = _explained(name)
    dims, config = explained.layout.dims, explained.config
    tied = ("word_embeddings.weight", "output_layer.weight")
    checked = 0
    for rank, got in enumerate(per_rank):
        for spec in explained.class_of(rank).plan.params:
            if not spec.has_grad:
                continue
            mine = got["grads"][f"{spec.chunk}:{spec.name}"]
            if spec.sequence_parallel and config.sequence_parallel and dims.tp > 1:
                for peer in dims.group_ranks(Group.TP, rank):
                    assert per_rank[peer]["grads"][f"{spec.chunk}:{spec.name}"] == mine, f"{spec.name}: {rank} vs {peer}"
                    checked += 1
            if spec.role is Role.WORD_EMBEDDING and dims.pp > 1 and config.share_embeddings_and_output_weights:
                for peer in dims.group_ranks(Group.EMBD, rank, (0, dims.pp - 1)):
                    theirs = [v for k, v in per_rank[peer]["grads"].items() if k.endswith(tied) and len(v) == len(mine)]
                    assert mine in theirs, f"{spec.name}: rank {rank} vs {peer}"
                    checked += 1
    assert checked or not (config.sequence_parallel and dims.tp > 1)

