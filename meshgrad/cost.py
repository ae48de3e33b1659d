"""An alpha-beta cost model of finalize's collectives, per rank class of an explanation.

Each collective of :func:`meshgrad.explain.explain` costs (``p`` ranks in the group over
``n`` nodes, ``k = p / n`` per node, ``B`` bytes sent):

* ring all-reduce: ``launch + (2(p-1) - 2(n-1)) a_in + 2(n-1) a_out + 2 (p-1)/p B / b``
* tree all-reduce: ``launch + 2 ((k-1) a_in + ceil(log2 n) a_tree) + 2 B / b``
  (``auto`` takes the cheaper one, as NCCL's tuner does)
* ring reduce-scatter: ``launch + ((p-1) - (n-1)) a_in + (n-1) a_out + (p-1)/p B / b``
* broadcast (pipelined ring): ``launch + ((p-1) - (n-1)) a_in + (n-1) a_out + B / b``

where ``b`` is the bus bandwidth of the slowest link the group crosses (``inter`` when it
spans nodes, else ``intra``) and ``a`` a link's per-hop latency. This is NCCL's own model
(``src/graph/tuning.cc``: ``baseLat`` + per-step ``hwLat``, algorithm bandwidth from bus
bandwidth) without its protocol and channel refinements. Ranks are placed in meshgrad's
rank order (tp fastest) on nodes of ``gpus_per_node``. Collectives of one rank run one
after another (one stream), so a class's time is their sum; a DDP bucket launched during
backward (``overlap_grad_reduce``) is not counted. Every number is a field: override any.

The GPU defaults (:data:`H100_NVLINK`, :data:`NDR_INFINIBAND`, :data:`NCCL_LAUNCH_S`) are
predictions until a GPU run measures them; :func:`fit_link` fits a link class to measured
times (``bench/at_scale.py`` fits this machine's gloo).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from meshgrad.axes import Axis, Group
from meshgrad.explain import Explanation, RankClass
from meshgrad.launches import Launch
from meshgrad.plan import GroupSizes


@dataclasses.dataclass(frozen=True)
class LinkClass:
    """One kind of link.

    Args:
      name: a label.
      alpha_s: latency per ring step (seconds).
      beta_bytes_s: bus bandwidth per rank (bytes / second, one direction).
      alpha_tree_s: latency per tree level (default: ``alpha_s``).
      source: where the numbers come from.
    """

    name: str
    alpha_s: float
    beta_bytes_s: float
    alpha_tree_s: float | None = None
    source: str = ""

    @property
    def tree_alpha(self) -> float:
        return self.alpha_s if self.alpha_tree_s is None else self.alpha_tree_s


#: NVLink 4 (H100 / H200 SXM): 900 GB/s bidirectional per GPU = 450 GB/s each way, at 80 %
#: (NCCL all-reduce bus bandwidth measured on 8 x H100 is 360-480 GB/s); 0.5 us per step
#: (NCCL tuning.cc hwLat, NVLink ring LL: 0.47 us).
H100_NVLINK = LinkClass(
    "nvlink4", alpha_s=0.5e-6, beta_bytes_s=0.8 * 450e9,
    source="NVIDIA H100 SXM datasheet (NVLink 900 GB/s); NCCL src/graph/tuning.cc hwLat NVLink ring LL 0.47 us",
)
#: NDR InfiniBand, one 400 Gb/s ConnectX-7 per GPU (DGX H100) = 50 GB/s each way, at 80 %;
#: 2.7 us per ring step, 5.0 us per tree level (NCCL tuning.cc hwLat, NET, LL protocol).
NDR_INFINIBAND = LinkClass(
    "ndr-ib", alpha_s=2.7e-6, beta_bytes_s=0.8 * 50e9, alpha_tree_s=5.0e-6,
    source="NVIDIA DGX H100 (8 x ConnectX-7 NDR 400 Gb/s); NCCL src/graph/tuning.cc hwLat NET ring LL 2.7 us, tree LL 5.0 us",
)
#: Fixed cost of one NCCL collective (NCCL tuning.cc baseLat: 4.4 - 8.4 us).
NCCL_LAUNCH_S = 6e-6


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Link classes and placement.

    Args:
      intra: the link inside a node.
      inter: the link between nodes.
      launch_s: fixed cost of one collective.
      gpus_per_node: ranks per node (consecutive ranks share a node).
      algorithm: ``"auto"`` (cheaper of ring and tree for all-reduce), ``"ring"`` or ``"tree"``.
    """

    intra: LinkClass = H100_NVLINK
    inter: LinkClass = NDR_INFINIBAND
    launch_s: float = NCCL_LAUNCH_S
    gpus_per_node: int = 8
    algorithm: str = "auto"

    def seconds(self, kind: str, size: int, nodes: int, nbytes: int) -> float:
        """Predicted time of one collective.

        Args:
          kind: ``all_reduce``, ``reduce_scatter`` or ``broadcast``.
          size: ranks in the group; nodes: nodes it spans; nbytes: bytes sent per rank.
        """
        p, n = size, max(1, nodes)
        if p <= 1:
            return 0.0
        link = self.inter if n > 1 else self.intra
        steps = {"all_reduce": 2 * (p - 1), "reduce_scatter": p - 1, "broadcast": p - 1}[kind]
        inter_steps = {"all_reduce": 2 * (n - 1), "reduce_scatter": n - 1, "broadcast": n - 1}[kind]
        hops = (steps - inter_steps) * self.intra.alpha_s + inter_steps * self.inter.alpha_s
        volume = {"all_reduce": 2 * (p - 1) / p, "reduce_scatter": (p - 1) / p, "broadcast": 1.0}[kind]
        ring = self.launch_s + hops + volume * nbytes / link.beta_bytes_s
        if kind != "all_reduce" or self.algorithm == "ring":
            return ring
        k = max(1, p // n)
        levels = math.ceil(math.log2(n)) if n > 1 else 0
        tree = self.launch_s + 2 * ((k - 1) * self.intra.tree_alpha + levels * self.inter.tree_alpha) + 2 * nbytes / link.beta_bytes_s
        return tree if self.algorithm == "tree" else min(ring, tree)


def _nodes(launch: Launch, stage: int, explanation: Explanation, model: CostModel) -> int:
    """Nodes the group of ``launch`` spans, for the first rank of pp ``stage``."""
    dims = explanation.layout.dims
    if launch.group == "world":
        return -(-dims.world_size // model.gpus_per_node)
    group = Group(launch.group)
    sizes = GroupSizes.from_dims(dims, explanation.config)
    stages = {Group.EMBD: sizes.embd_stages, Group.POS_EMBD: sizes.pos_embd_stages}.get(group)
    rank = dims.rank_of({Axis.PP: stage})
    return len({r // model.gpus_per_node for r in dims.group_ranks(group, rank, stages)})


@dataclasses.dataclass(frozen=True)
class ClassCost:
    """Predicted communication time of one rank class's finalize call.

    Args:
      name: the class.
      seconds: meshgrad's total (status round included; overlapped buckets not).
      status_seconds: the status round's part of it.
      megatron_seconds: Megatron-Core's finalize on the same ranks.
      per_launch: meshgrad's collectives with their predicted seconds.
    """

    name: str
    seconds: float
    status_seconds: float
    megatron_seconds: float
    per_launch: tuple[tuple[Launch, float], ...]

    @property
    def status_share(self) -> float:
        return self.status_seconds / self.seconds if self.seconds else 0.0


def launch_seconds(launches: Sequence[Launch], stage: int, explanation: Explanation, model: CostModel) -> list[float]:
    """Each collective's predicted time (0 for one launched during backward)."""
    cache: dict[tuple[str, int], int] = {}
    out = []
    for item in launches:
        if item.overlapped:
            out.append(0.0)
            continue
        key = (item.group, item.size)
        if key not in cache:
            cache[key] = _nodes(item, stage, explanation, model)
        out.append(model.seconds(item.kind, item.size, cache[key], item.nbytes))
    return out


def class_cost(rank_class: RankClass, explanation: Explanation, model: CostModel) -> ClassCost:
    """The predicted finalize communication time of one rank class, meshgrad and Megatron."""
    stage = rank_class.stages[0]
    mine = launch_seconds(rank_class.meshgrad, stage, explanation, model)
    theirs = launch_seconds(rank_class.megatron, stage, explanation, model)
    status = sum(t for item, t in zip(rank_class.meshgrad, mine) if item.step == "status")
    return ClassCost(rank_class.name, sum(mine), status, sum(theirs), tuple(zip(rank_class.meshgrad, mine)))


def finalize_cost(explanation: Explanation, model: CostModel | None = None) -> list[ClassCost]:
    """:func:`class_cost` of every class (a step waits for the slowest)."""
    model = CostModel() if model is None else model
    return [class_cost(c, explanation, model) for c in explanation.classes]


def backward_seconds(active_params: int, tokens_per_replica: int, model_parallel: int,
                     peak_flops: float = 989e12, mfu: float = 0.4) -> float:
    """A rough backward time per step for scale: ``4 x active params x tokens`` FLOPs per
    model replica (twice the forward's ``2 N T``), split over its ``model_parallel`` ranks,
    at ``mfu`` of ``peak_flops`` (H100 SXM dense BF16: 989 TFLOP/s, datasheet)."""
    return 4.0 * active_params * tokens_per_replica / (model_parallel * peak_flops * mfu)


def fit_link(rows: Sequence[tuple[str, int, int, float]], name: str = "fitted") -> tuple[LinkClass, float]:
    """Least-squares fit (of relative errors) of one link class (all ranks on one node,
    ring algorithms) to measured ``(kind, ranks, bytes, seconds)`` rows.

    Returns:
      ``(link, launch_s)``: per-step latency and bandwidth, and the fixed cost per collective
      (each clipped to stay positive).
    """
    a, y = [], []
    for kind, p, nbytes, seconds in rows:
        steps = {"all_reduce": 2 * (p - 1), "reduce_scatter": p - 1, "broadcast": p - 1}[kind]
        volume = {"all_reduce": 2 * (p - 1) / p, "reduce_scatter": (p - 1) / p, "broadcast": 1.0}[kind]
        a.append([1.0, steps, volume * nbytes])
        y.append(seconds)
    # Relative errors: each row weighs alike, small messages as much as large ones.
    weights = 1.0 / np.asarray(y)
    coef, *_ = np.linalg.lstsq(np.asarray(a) * weights[:, None], np.ones(len(y)), rcond=None)
    launch, alpha, inv_beta = (max(float(c), 1e-12) for c in coef)
    return LinkClass(name, alpha_s=alpha, beta_bytes_s=1.0 / inv_beta, source="fitted to measured times"), launch


__all__ = [
    "ClassCost", "CostModel", "H100_NVLINK", "LinkClass", "NCCL_LAUNCH_S", "NDR_INFINIBAND",
    "backward_seconds", "class_cost", "finalize_cost", "fit_link", "launch_seconds",
]
