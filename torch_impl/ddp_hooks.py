"""A torch ``DistributedDataParallel`` comm hook that finalize can verify: the gradient
summed over DDP's ranks, not averaged -- Megatron's DP sync with
``calculate_per_token_loss`` (finalize then scales by ``1 / num_tokens``).

Register it with ``ddp.register_comm_hook(ddp.process_group, ddp_sum_hook)``; finalize
recognizes it by identity (:mod:`torch_impl.sources.torch_ddp`).

(No ``from __future__ import annotations`` here: DDP checks the hook's annotations as
objects, ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]``.)
"""

from typing import Any, Optional

import torch
import torch.distributed as dist


def ddp_sum_hook(process_group: Optional[Any], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce a DDP gradient bucket with SUM, without dividing by the group size.

    Args:
      process_group: the group to reduce over (None: the default group, as torch's hooks).
      bucket: DDP's ``GradBucket``.

    Returns:
      A future holding the summed bucket.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


__all__ = ["ddp_sum_hook"]
