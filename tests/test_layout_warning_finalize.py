"""The LayoutWarning through finalize, with megatron-core's REAL DistributedDataParallel.

A gloo world of 4 (pp=2 x dp=2, tp=1). Each stage holds a conditional embedder (flagged
``pipeline_parallel``: finalize sums its gradient across the two stages) that shares a
bucket with the stage's other parameters. Under a distributed optimizer the DDP
reduce-scatters that bucket, so the shard a rank owns of the embedder need not cover the
same elements on both stages (Megatron-LM issue 844): torch_impl's finalize keeps
megatron-core's numbers (twins, bit for bit) and warns once per plan, at the user's line,
naming the parameter; with an all-reduce it does not warn. Skips without megatron-core.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from parity_tests.megatron_state import import_megatron_core  # noqa: E402
from parity_tests.world_cases import case_values, run_cases  # noqa: E402

WORLD, PP, DP = 4, 2, 2
STEPS = 2


def _groups() -> dict[str, Any]:
    """This rank's groups (rank = pp * DP + dp), every group created on every rank."""
    import torch.distributed as dist

    rank = dist.get_rank()
    pp_groups = [dist.new_group([d, DP + d]) for d in range(DP)]
    dp_groups = [dist.new_group([p * DP, p * DP + 1]) for p in range(PP)]
    singles = [dist.new_group([r]) for r in range(WORLD)]
    pp, dp = pp_groups[rank % DP], dp_groups[rank // DP]
    one = singles[rank]
    return dict(tp=one, pp=pp, embd=pp, pos_embd=one, dp=dp, dp_cp=dp, expt_dp=dp, ep=one, tp_dp_cp=dp)


def _stage() -> Any:
    """One pp stage: a conditional embedder (summed across stages) and a body layer, with
    integer-valued weights (exact sums)."""
    import torch
    from torch import nn

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pre_process = True
            self.share_embeddings_and_output_weights = False
            self.cond = nn.Linear(4, 4)
            self.body = nn.Linear(4, 4)
            for p in self.cond.parameters():
                p.pipeline_parallel = True

        def forward(self, x: Any) -> Any:
            return self.body(self.cond(x))

    torch.manual_seed(0)
    stage = Stage()
    with torch.no_grad():
        for p in stage.parameters():
            p.copy_(torch.randint(-2, 3, p.shape, dtype=torch.float32))
    return stage


def _step(impl: str, distopt: bool, rank: int) -> dict[str, Any]:
    """Train one twin for STEPS steps; returns its gradient buffers after each finalize and
    the LayoutWarnings the calls gave."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads as megatron_finalize
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    import torch_impl
    from meshgrad.errors import LayoutWarning

    groups = ProcessGroupCollection(**_groups())
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    config.has_cond_embedder = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ddp = DistributedDataParallel(
            config, DistributedDataParallelConfig(use_distributed_optimizer=distopt), _stage(), pg_collection=groups
        )
    finalize = megatron_finalize if impl == "megatron" else torch_impl.finalize_model_grads
    out: dict[str, Any] = {"buffers": [], "warnings": []}
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        g = torch.Generator().manual_seed(100 * step + rank)
        ddp(torch.randint(-2, 3, (3, 4), generator=g).float()).sum().backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            finalize([ddp], pg_collection=groups)
        out["warnings"] += [(str(w.message), w.filename) for w in caught if issubclass(w.category, LayoutWarning)]
        out["buffers"].append([b.grad_data.numpy().copy() for b in ddp.buffers])
    return out


def layout_world(rank: int, world: int) -> dict[str, Any]:
    """Both twins, with and without a distributed optimizer."""
    from parity_tests.megatron_state import megatron_on_cpu

    megatron_on_cpu()
    return {
        f"{impl}-{'distopt' if distopt else 'allreduce'}": _step(impl, distopt, rank)
        for distopt in (True, False)
        for impl in ("megatron", "ours")
    }


_WORLD: dict[str, Any] = {}


def _results() -> list[dict[str, Any]]:
    if "values" not in _WORLD:
        _WORLD["values"] = case_values(run_cases(__name__, ["layout_world"], WORLD, timeout=300, prepare=import_megatron_core), "layout_world")
    return _WORLD["values"]


@pytest.mark.parametrize("mode", ["distopt", "allreduce"])
def test_megatrons_numbers_are_kept(mode: str) -> None:
    """torch_impl's finalize leaves every rank's gradient buffer bit-identical to
    megatron-core's finalize on the twin model, at every step."""
    for rank, result in enumerate(_results()):
        meg, ours = result[f"megatron-{mode}"]["buffers"], result[f"ours-{mode}"]["buffers"]
        for step, (m, o) in enumerate(zip(meg, ours)):
            for a, b in zip(m, o):
                np.testing.assert_array_equal(a, b, err_msg=f"rank {rank} step {step}")
        assert any(np.abs(a).sum() > 0 for a in ours[-1]), f"rank {rank}: vacuous (all-zero gradients)"


def test_a_misaligned_cross_stage_parameter_is_named_once_per_plan_at_the_users_line() -> None:
    for rank, result in enumerate(_results()):
        given = result["ours-distopt"]["warnings"]
        assert len(given) == 1, f"rank {rank}: {given}"  # two steps, one plan
        text, filename = given[0]
        assert "'cond.weight'" in text and "'cond.bias'" in text and "'body.weight'" not in text, text
        assert filename.endswith("test_layout_warning_finalize.py"), filename
        assert result["ours-allreduce"]["warnings"] == []  # nothing is sharded
        assert result["megatron-distopt"]["warnings"] == []
