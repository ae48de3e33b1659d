"""Synthetic audit records: correct step files of a dense pp=1 run, made with the reference.

``write_step(directory, dp=..., tp=..., params=..., sample=...)`` writes, for every rank of
a ``dp x tp`` world, the plan file and the step file that ``torch_impl.audit`` would
write for a correct finalize (``sequence_parallel`` on, every other parameter a
layernorm weight flagged ``sequence_parallel``): random "before" values, "after" values
from the numpy reference (:mod:`parity_tests.reference`). Each gradient has ``sample``
elements, all of them sampled. Used to test and time the replay at scale without a
world of that size. Plain numpy: no torch.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from parity_tests import reference as ref
from parity_tests.audit_files import FLAGS, FORMAT_VERSION
from parity_tests.scenarios import ParamLayout, RankData, Scenario

GROUPS = ("tp", "pp", "dp_cp", "expt_dp", "tp_dp_cp", "embd", "pos_embd", "gtp_remat", "expt_gtp_remat",
          "dp_cp_gtp_remat")


def _layout(rank: int, dp: int, tp: int) -> dict[str, Any]:
    """The recorded layout of one rank of a pp=1 ``dp x tp`` world (expert groups absent)."""
    d, t = divmod(rank, tp)
    tp_group = [d * tp + x for x in range(tp)]
    dp_group = [x * tp + t for x in range(dp)]
    members = {"tp": tp_group, "pp": [rank], "dp_cp": dp_group, "expt_dp": [rank],
               "tp_dp_cp": list(range(dp * tp)), "embd": [], "pos_embd": [], "gtp_remat": [rank],
               "expt_gtp_remat": [rank], "dp_cp_gtp_remat": dp_group}
    coords = {g: (sorted(m).index(rank) if rank in m else -1) for g, m in members.items() if g != "pp"}
    coords["pp"] = 0
    return {"members": members, "coords": coords, "stages": {"embd": None, "pos_embd": None}, "missing": ["expt_dp"]}


def scenario(dp: int, tp: int, params: int, sample: int) -> Scenario:
    """The reference scenario of the synthetic run (every third parameter TP-summed)."""
    layouts = tuple(ParamLayout(f"layers.{i}.{'norm' if i % 3 == 0 else 'linear'}.weight", (sample,),
                                sequence_parallel=i % 3 == 0) for i in range(params))
    return Scenario("audit-synthetic", dp=dp, tp=tp, params=layouts, routers=(),
                    config=dict(sequence_parallel=True), mode="random", dtype="float32")


def write_step(directory: str, dp: int, tp: int, params: int, sample: int, step: int = 0, seed: int = 0,
               run: str = "synthetic") -> Scenario:
    """Write one correct step of a ``dp x tp`` world into ``directory``.

    Args:
      directory: where the files go (created).
      dp, tp: the world's data- and tensor-parallel sizes.
      params: parameters per rank.
      sample: elements per gradient (all sampled).
      step, seed, run: the step index, the data seed, the run id.

    Returns:
      The reference scenario the records were made from.
    """
    os.makedirs(directory, exist_ok=True)
    scen = scenario(dp, tp, params, sample)
    world = dp * tp
    rng = np.random.default_rng(seed)
    keys = [(0, p.name) for p in scen.params]
    inputs = [RankData({k: rng.standard_normal(sample).astype(np.float32) for k in keys}, {}, None)
              for _ in range(world)]
    outputs = ref.reference_finalize(scen, inputs).outputs
    config = dict(ref.CONFIG_DEFAULTS, sequence_parallel=True)
    infos = [{"name": p.name, "chunk": 0, "shape": [sample], "numel": sample, "dtype": "float32", "expert": False,
              "role": "none", "samples": sample, **{f: bool(getattr(p, f)) for f in FLAGS}} for p in scen.params]
    positions = np.tile(np.arange(sample, dtype=np.int32), params)
    for rank in range(world):
        static = {"format": FORMAT_VERSION, "rank": rank, "world_size": world, "sample": sample,
                  "finalize": "parity_tests.audit_synth.reference", "num_chunks": 1, "ddp_chunks": [False],
                  "config": {"finalize": config, "sizes": {"tensor_model_parallel_size": tp}},
                  "layout": _layout(rank, dp, tp), "routers": [], "router_fields": [], "params": infos}
        digest = f"{rank:016x}"
        np.savez(os.path.join(directory, f"plan.rank{rank:05d}.{digest}.npz"),
                 plan=np.frombuffer(json.dumps(static).encode(), np.uint8), positions=positions)
        meta = {"format": FORMAT_VERSION, "step": step, "rank": rank, "plan": digest, "run": run,
                "force_all_reduce": False, "num_tokens": {"before": None, "after": None, "dtype": None}}
        np.savez(os.path.join(directory, f"step{step:08d}.rank{rank:05d}.npz"),
                 meta=np.frombuffer(json.dumps(meta).encode(), np.uint8),
                 grads_before=np.concatenate([inputs[rank].grads[k] for k in keys]),
                 grads_after=np.concatenate([outputs[rank].grads[k] for k in keys]).astype(np.float32),
                 has_grad=np.ones((2, params), dtype=bool))
    return scen
