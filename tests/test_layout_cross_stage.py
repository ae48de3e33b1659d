"""The DP-sync planner's own buffers for cross-stage-summed parameters, the reference's
layout agreeing with the plan's, and the Megatron DDP bucket-alignment decision."""

from __future__ import annotations

import numpy as np
import pytest

from meshgrad import FinalizeConfig, ParallelDims, ParamSpec, Reduction, Role, Step, plan_finalize
from meshgrad.axes import Group
from meshgrad.ddp_layout import Bucket, BucketParam, misaligned_cross_stage_params, misalignment_message
from parity_tests import reference as ref
from parity_tests.invariants import owned_elements, scatter_pair
from parity_tests.scenarios import all_scenarios
from parity_tests.specs import scenario_dims, scenario_specs

WORD = "embedding.word_embeddings.weight"


def _gpt(chunks: int = 2) -> list[ParamSpec]:
    out = []
    for c in range(chunks):
        out += [
            ParamSpec(WORD, c, (8, 4), role=Role.WORD_EMBEDDING),
            ParamSpec("layer.weight", c, (3, 4)),
            ParamSpec("cond.weight", c, (3,), pipeline_parallel=True),
        ]
    return out


def _dp_actions(plan) -> list[Reduction]:
    return [a for a in plan.actions if isinstance(a, Reduction) and Step.DP_SYNC in a.steps]


def test_cross_stage_params_get_their_own_scatter_reduction():
    config = FinalizeConfig(use_distributed_optimizer=True, has_cond_embedder=True)
    plan = plan_finalize(_gpt(), config, ParallelDims(pp=2, dp=2))
    keys = [a.keys for a in _dp_actions(plan)]
    assert keys == [
        ((0, "layer.weight"), (1, "layer.weight")),
        ((0, WORD),), ((0, "cond.weight"),), ((1, WORD),), ((1, "cond.weight"),),
    ]
    assert all(a.scatter and a.group is Group.DP_CP for a in _dp_actions(plan))


def test_all_reduce_and_single_stage_keep_one_buffer():
    forced = plan_finalize(
        _gpt(), FinalizeConfig(use_distributed_optimizer=True), ParallelDims(pp=2, dp=2), force_all_reduce=True
    )
    assert [len(a.keys) for a in _dp_actions(forced)] == [6]  # all-reduces fuse back into one
    single = plan_finalize(_gpt(), FinalizeConfig(use_distributed_optimizer=True), ParallelDims(pp=1, dp=2))
    assert [len(a.keys) for a in _dp_actions(single)] == [6]  # no cross-stage sum at pp = 1
    untied = plan_finalize(
        _gpt(), FinalizeConfig(use_distributed_optimizer=True, share_embeddings_and_output_weights=False),
        ParallelDims(pp=2, dp=2),
    )
    assert [len(a.keys) for a in _dp_actions(untied)] == [6]  # no word-embedding sync: no split


def test_shards_line_up_across_stages_and_chunks():
    """The tied copies (chunk 0 on the first stage, chunk 1 on the last) own the same elements."""
    config = FinalizeConfig(use_distributed_optimizer=True)
    plan = plan_finalize(_gpt(), config, ParallelDims(pp=2, dp=2))
    from meshgrad.layout import scatter_shard

    spans = {a.keys[0]: [scatter_shard(32, 2, i) for i in range(2)] for a in _dp_actions(plan) if len(a.keys) == 1}
    assert spans[(0, WORD)] == spans[(1, WORD)] == [(0, 16), (16, 32)]


SCATTER = [scatter_pair(s)[0] for s in all_scenarios()]


@pytest.mark.parametrize("scenario", SCATTER, ids=[s.name for s in SCATTER])
def test_reference_buffers_equal_the_plan(scenario):
    """The reference's reduce-scatter buffers (written from the contract) are the plan's."""
    params, routers = scenario_specs(scenario)
    config = FinalizeConfig.from_mapping(scenario.config)
    plan = plan_finalize(params, config, scenario_dims(scenario), routers)
    ctx = ref.Context(scenario, ref.Config.from_scenario(scenario), ref.Mesh.from_scenario(scenario), [])
    for expert, group, size in ((False, Group.DP_CP, scenario.dp * scenario.cp), (True, Group.EDP, scenario.edp)):
        planned = [list(a.keys) for a in plan.actions if isinstance(a, Reduction) and a.scatter and a.group is group]
        if size > 1:
            assert planned == ref.scatter_buffers(ctx, expert)


def test_owned_elements_partition_each_buffer():
    scenario = scatter_pair(next(s for s in all_scenarios() if s.name == "pp2dp2cp1tp2-flags-vpp2"))[0]
    # ranks 0 and 2: the dp_cp group of stage 0 at tp 0; their shards cover each key once
    a, b = owned_elements(scenario, 0), owned_elements(scenario, 2)
    for key in a:
        assert np.all(a[key] ^ b[key]), key
    # the tied copies, stage 0 chunk 0 (rank 0) and stage 1 chunk 1 (rank 4), own alike
    assert np.array_equal(a[(0, WORD)], owned_elements(scenario, 4)[(1, WORD)])


# --------------------------------------------------------------------------- Megatron DDP buckets


def _bucket(*params: tuple[str, int, int], numel: int = 256) -> Bucket:
    return Bucket(tuple(BucketParam(n, o, k) for n, o, k in params), numel)


def test_embedding_alone_in_its_bucket_is_aligned():
    buckets = [_bucket(("output_layer.weight", 0, 32), numel=128), _bucket(("a", 0, 12), ("b", 64, 12))]
    assert misaligned_cross_stage_params(buckets, {"output_layer.weight"}, 2) == ()


def test_shared_bucket_or_offset_is_misaligned_in_bucket_order():
    buckets = [
        _bucket(("a", 0, 12), ("embedding.position_embeddings.weight", 64, 16)),
        _bucket(("embedding.word_embeddings.weight", 64, 32)),  # alone but not at the start
        _bucket(("cond.weight", 0, 3)),
    ]
    cross = {"embedding.word_embeddings.weight", "embedding.position_embeddings.weight", "cond.weight"}
    assert misaligned_cross_stage_params(buckets, cross, 4) == (
        "embedding.position_embeddings.weight", "embedding.word_embeddings.weight",
    )


def test_no_reduce_scatter_nothing_misaligned():
    buckets = [_bucket(("a", 0, 12), ("w", 64, 16))]
    assert misaligned_cross_stage_params(buckets, {"w"}, 1) == ()
    assert misaligned_cross_stage_params(buckets, {"w"}, 8, reduce_scatter=False) == ()
    assert misaligned_cross_stage_params(buckets, {"w"}, 8) == ("w",)


def test_misalignment_message_names_params_and_dp_size():
    text = misalignment_message(("embedding.position_embeddings.weight",), 4)
    assert "'embedding.position_embeddings.weight'" in text and "4 DP ranks" in text and "844" in text


def test_stage_models_of_different_layouts_line_up_the_tied_copies():
    """A real pipeline: the word embedding first on stage 0, the output layer last on stage 1."""
    from meshgrad.layout import scatter_shard

    first = [ParamSpec(WORD, 0, (8, 4), role=Role.WORD_EMBEDDING), ParamSpec("layers.0.weight", 0, (5, 4))]
    last = [ParamSpec("layers.1.weight", 0, (7, 4)), ParamSpec("output_layer.weight", 0, (8, 4), role=Role.WORD_EMBEDDING)]
    config = FinalizeConfig(use_distributed_optimizer=True)
    shards = {}
    for stage, params in ((0, first), (1, last)):
        plan = plan_finalize(params, config, ParallelDims(pp=2, dp=4), stage=stage)
        (alone,) = [a for a in _dp_actions(plan) if any(k[1] in (WORD, "output_layer.weight") for k in a.keys)]
        total = sum(p.numel for p in params if p.key in alone.keys)
        shards[stage] = [scatter_shard(total, 4, i) for i in range(4)]
    assert shards[0] == shards[1] == [(0, 8), (8, 16), (16, 24), (24, 32)]
