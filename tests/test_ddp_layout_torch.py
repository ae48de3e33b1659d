"""torch_impl.sources.ddp_layout against a real megatron-core DistributedDataParallel (CPU gloo,
2 ranks): the bucket facts it reads and the misaligned cross-stage-summed parameters.

A Megatron DDP gives a parameter flagged ``shared_embedding`` a bucket of its own under a
distributed optimizer (aligned on every stage); a position embedding shares the bucket of
the other parameters (misaligned). Skips when megatron-core is missing.
"""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core.distributed")

from parity_tests.megatron_state import import_megatron_core  # noqa: E402
from parity_tests.world_cases import case_values, run_cases  # noqa: E402

CROSS_STAGE = ("emb.weight", "pos.weight")


def _model():
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 8)
            self.pos = torch.nn.Embedding(4, 8)
            self.norm = torch.nn.LayerNorm(8)
            self.out = torch.nn.Linear(8, 3)
            self.emb.weight.shared_embedding = True

    return Tiny()


def ddp_world(rank: int, world: int) -> dict:
    """This rank's bucket layouts and misaligned names, with and without a distributed optimizer."""
    torch.cuda.current_device = lambda: "cpu"  # megatron's DDP allocates its buffers there
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig

    from torch_impl.sources.ddp_layout import ddp_layouts, misaligned_in_ddp

    whole = torch.distributed.new_group(list(range(world)))
    single = [torch.distributed.new_group([r]) for r in range(world)][rank]
    groups = ProcessGroupCollection(dp=whole, dp_cp=whole, expt_dp=whole, tp=single, pp=single, ep=single)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    result = {}
    for distopt in (True, False):
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distopt, overlap_grad_reduce=False)
        ddp = DistributedDataParallel(config, ddp_config, _model(), pg_collection=groups)
        layouts = [
            [[[p.name, p.offset, p.numel] for p in b.params] + [b.numel] for b in buckets] + [dp]
            for buckets, dp in ddp_layouts(ddp)
        ]
        result[str(distopt)] = {
            "layouts": layouts,
            "misaligned": list(misaligned_in_ddp(ddp, CROSS_STAGE)),
            "forced": list(misaligned_in_ddp(ddp, CROSS_STAGE, force_all_reduce=True)),
        }
    return json.loads(json.dumps(result))  # plain lists and strings, as compared below


@pytest.fixture(scope="module")
def world():
    return case_values(run_cases(__name__, ["ddp_world"], 2, timeout=300, prepare=import_megatron_core), "ddp_world")


def test_shared_embedding_bucket_is_read_and_aligned(world):
    for rank in world:
        (buckets_and_dp,) = rank["True"]["layouts"]
        *buckets, dp = buckets_and_dp
        assert dp == 2
        alone = [b for b in buckets if b[0][0] == "emb.weight"]
        assert alone == [[["emb.weight", 0, 80], math.lcm(2, 128)]]  # its own bucket, padded
        others = [b for b in buckets if b[0][0] != "emb.weight"]
        names = sorted(p[0] for b in others for p in b[:-1])
        assert names == ["norm.bias", "norm.weight", "out.bias", "out.weight", "pos.weight"]
        sizes = {p[0]: p[2] for b in others for p in b[:-1]}
        assert sizes == {"norm.bias": 8, "norm.weight": 8, "out.bias": 3, "out.weight": 24, "pos.weight": 32}


def test_misaligned_names_the_position_embedding_only(world):
    for rank in world:
        assert rank["True"]["misaligned"] == ["pos.weight"]
        assert rank["True"]["forced"] == []
        assert rank["False"]["misaligned"] == []  # all-reduce: nothing is sharded
