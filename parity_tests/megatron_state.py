"""What the megatron-core oracles (0.16.1 and 0.19.2) share: Megatron's ``parallel_state``
for a test layout, a Megatron-DDP-like chunk (for the oracles that compare single
helpers), and :func:`megatron_on_cpu`, which lets megatron-core's real DDP, models and
schedules run on CPU gloo.

Megatron is a black box here: only its public ``initialize_model_parallel`` is called.
"""

from __future__ import annotations

import warnings
from typing import Any


def import_megatron_core() -> None:
    """Import the installed megatron-core's modules the test worlds use, its warnings
    silenced: the ``prepare`` of :func:`parity_tests.process_world.spawn_world`, so that the
    ranks of a world are forked from one process that imported megatron-core once (each
    rank importing it costs seconds of CPU).

    Raises:
      ImportError: megatron-core is not installed.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.distributed  # noqa: F401
        import megatron.core.parallel_state  # noqa: F401
        import megatron.core.process_groups_config  # noqa: F401
        import megatron.core.transformer.transformer_config  # noqa: F401


def preload_megatron_core() -> None:
    """:func:`import_megatron_core` where it succeeds, else nothing: the ``prepare`` of a
    world whose ranks import megatron-core themselves and handle its absence or failure
    (then each rank's own import meets the same error as it would have)."""
    try:
        import_megatron_core()
    except Exception:  # noqa: BLE001 -- an optimization only: the ranks' own imports decide
        pass


def initialize_parallel_state(ps: Any, layout: Any, **extra: Any) -> None:
    """``ps.initialize_model_parallel`` for ``layout`` (its tp, pp, cp, ep, etp sizes and,
    where set, the pp stages of the embedding groups), Megatron's warnings silenced.

    Args:
      ps: megatron's ``parallel_state`` module (of whichever version the process imported).
      layout: an object with ``tp``, ``pp``, ``cp``, ``ep``, ``etp`` and optional ``embd`` /
        ``pos`` (tuples of pp stages, None = Megatron's default).
      extra: further keywords of that version's ``initialize_model_parallel``.
    """
    kwargs: dict[str, Any] = dict(extra)
    for key, stages in (("get_embedding_ranks", getattr(layout, "embd", None)), ("get_position_embedding_ranks", layout.pos)):
        if stages is not None:
            kwargs[key] = lambda pp_ranks, split=None, stages=stages: [pp_ranks[s] for s in stages]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ps.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            context_parallel_size=layout.cp,
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.etp,
            create_gloo_process_groups=False,
            **kwargs,
        )


def fake_ddp(module: Any, ddp_config: Any, dp_cp: Any, expt_dp: Any) -> Any:
    """A Megatron-DDP-like chunk around ``module``: ``finish_grad_sync`` does the `dp_sync`
    step of docs/semantics.md over ``dp_cp`` / ``expt_dp`` (with the DDP config's pre-scale
    and average), ``scale_gradients`` multiplies; both record their calls in ``.calls``.

    The sync is one all-reduce per (group, dtype) of the gradients laid end to end, as a
    DDP's buffer is, rather than one per gradient: elementwise the same products, sums and
    quotients, and far fewer collectives (each one waits for every rank of an
    oversubscribed test world).

    Args:
      module: the model chunk (with ``config``).
      ddp_config: a DistributedDataParallelConfig-like object (``average_in_collective``).
      dp_cp: the dense data-parallel group.
      expt_dp: the expert data-parallel group.
    """
    import torch
    import torch.distributed as dist
    from torch import nn

    class DDPLike(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = module
            self.ddp_config = ddp_config
            self.calls: list[Any] = []

        def _grads(self) -> list[tuple[bool, Any]]:
            out = []
            for p in self.module.parameters():
                g = getattr(p, "main_grad", None) if hasattr(p, "main_grad") else p.grad
                if hasattr(g, "to_local"):  # DTensor: its shards line up across DP ranks
                    g = g.to_local()
                if p.requires_grad and g is not None:
                    out.append((not getattr(p, "allreduce", True), g))
            return out

        def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
            self.calls.append(("finish", bool(force_all_reduce)))
            cfg = self.module.config
            dp_size, edp_size = dist.get_world_size(dp_cp), dist.get_world_size(expt_dp)
            buckets: dict[tuple[bool, Any], list[Any]] = {}
            for expert, g in self._grads():
                buckets.setdefault((expert, g.dtype), []).append(g)
            for (expert, _), grads in buckets.items():
                group = expt_dp if expert else dp_cp
                if cfg.calculate_per_token_loss:
                    scale, avg = 1.0, False
                elif getattr(self.ddp_config, "average_in_collective", False):
                    scale, avg = (edp_size / dp_size if expert else 1.0), True
                else:
                    scale, avg = 1.0 / dp_size, False
                flat = torch.cat([g.reshape(-1) for g in grads]).mul_(scale)
                dist.all_reduce(flat, group=group)
                if avg:
                    flat.div_(edp_size if expert else dp_size)
                for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                    g.copy_(part.view_as(g))

        def scale_gradients(self, scale: Any) -> None:
            self.calls.append(("scale", str(getattr(scale, "dtype", type(scale).__name__)), float(scale)))
            for _, g in self._grads():
                g.mul_(scale)

    return DDPLike()


class _CudaDevicesOnCpu:
    """A ``TorchFunctionMode`` (built lazily: torch is imported in workers) that creates
    tensors asked for on a CUDA device on the CPU and makes ``Tensor.cuda()`` a no-op."""

    @staticmethod
    def make() -> Any:
        import torch
        from torch.overrides import TorchFunctionMode

        class CudaDevicesOnCpu(TorchFunctionMode):
            def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                kwargs = dict(kwargs or {})
                device = kwargs.get("device")
                if device is not None and "cuda" in str(device):
                    kwargs["device"] = "cpu"
                if func is torch.Tensor.cuda:
                    return args[0]
                return func(*args, **kwargs)

        return CudaDevicesOnCpu()


def megatron_on_cpu() -> Any:
    """Point megatron-core's device lookups at the CPU, in this (test) process, for good.

    Megatron is not changed: ``torch.cuda.current_device`` returns ``"cpu"`` (the DDP's
    buffers, the schedules' p2p buffers and token counts then live on the CPU),
    ``torch.cuda.synchronize`` does nothing, a ``TorchFunctionMode`` creates tensors asked
    for with ``device="cuda"`` on the CPU (the pipelined schedules' token counter), and the
    model-parallel CUDA RNG tracker's ``fork()`` is a no-op context (its CUDA RNG states
    cannot be made without CUDA; the test models use no dropout).

    Returns:
      The entered TorchFunctionMode (exit it with ``mode.__exit__(None, None, None)``).
    """
    import contextlib

    import torch

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import tensor_parallel
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    mode = _CudaDevicesOnCpu.make()
    mode.__enter__()
    return mode
