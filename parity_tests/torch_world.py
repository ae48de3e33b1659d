"""Run parity scenarios through torch_impl in ONE spawned gloo world (spawning is slow).

:func:`run_torch_world` starts ``world_size`` processes once (forked from a fork server
that imported torch once per session); every rank runs every
scenario: it builds real ``nn.Module`` chunks from the scenario layout, loads its inputs
from :func:`~parity_tests.scenarios.make_rank_inputs`, builds groups (alternating between
a torch ``DeviceMesh`` and a ProcessGroupCollection-like object, cached per mesh shape),
calls :func:`torch_impl.finalize_model_grads` and writes its outputs to a temp file. A
scenario that raises records its error; the other scenarios still run. The whole world is
killed when it outlives ``timeout``.

The world itself is :func:`parity_tests.process_world.spawn_world`.
"""

from __future__ import annotations

import time
import types
from collections.abc import Sequence
from typing import Any

import numpy as np

from parity_tests.process_world import Sink, spawn_world
from parity_tests.results import ScenarioResult
from parity_tests.scenarios import (
    RankData,
    RouterLayout,
    RouterState,
    Scenario,
    make_rank_inputs,
)

# --------------------------------------------------------------------------- models


def _child(root: Any, path: str) -> Any:
    """The submodule at dotted ``path`` of ``root``, created (empty) where missing."""
    from torch import nn

    module = root
    for part in [p for p in path.split(".") if p]:
        sub = module._modules.get(part)
        if sub is None:
            sub = nn.Module()
            module.add_module(part, sub)
        module = sub
    return module


def _model_classes() -> dict[str, type]:
    """nn.Module classes of the toy model (defined lazily: torch is imported in workers)."""
    from torch import nn

    class Chunk(nn.Module):
        """A model chunk with Megatron's embedding conventions."""

        def __init__(self, word: str | None, pos: str | None) -> None:
            super().__init__()
            self._word = word
            self._pos = pos

        def shared_embedding_or_output_weight(self) -> Any:
            return self.get_parameter(self._word) if self._word else None

        @property
        def position_embeddings(self) -> Any:
            if self._pos is None:
                raise AttributeError("position_embeddings")
            return self.get_submodule(self._pos.rsplit(".", 1)[0])

    class Wrapper(nn.Module):
        """A ``.module`` wrapper (like Float16Module), without DDP methods."""

        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

    class Router(nn.Module):
        """Router state buffers (None where the layout has no such state)."""

        def __init__(self, layout: RouterLayout) -> None:
            super().__init__()
            import torch

            e = layout.num_experts
            self.register_buffer("local_tokens_per_expert", torch.zeros(e))
            self.register_buffer("expert_bias", torch.zeros(e) if layout.has_expert_bias else None)
            for name, shape in (("qb_beta", (e,)), ("qb_beta_accum", (e,)), ("qb_beta_count", ())):
                self.register_buffer(name, torch.zeros(shape) if layout.has_qb_beta else None)
            if layout.frozen_expert_bias:
                self.frozen_expert_bias = True
            self.aux_loss_resets = 0

    class AuxRouter(Router):
        def reset_global_aux_loss_tracker(self) -> None:
            self.aux_loss_resets += 1

    return {"Chunk": Chunk, "Wrapper": Wrapper, "Router": Router, "AuxRouter": AuxRouter}


def build_model(scenario: Scenario, rank: int, config: Any, wrap: bool = False) -> list[Any]:
    """This rank's model chunks for ``scenario`` (parameters without gradients yet)."""
    import torch
    from torch import nn

    classes = _model_classes()
    dtype = getattr(torch, scenario.dtype)
    stage = rank // (scenario.world_size // scenario.pp)
    share = bool(scenario.cfg("share_embeddings_and_output_weights", True))
    word = next((p.name for p in scenario.params if p.role == "word_embedding"), None)
    pos = next((p.name for p in scenario.params if p.role == "position_embedding"), None)
    chunks = []
    for index in range(scenario.num_chunks):
        chunk = classes["Chunk"](word, pos)
        for i, layout in enumerate(scenario.params):
            parent, _, leaf = layout.name.rpartition(".")
            param = nn.Parameter(torch.zeros(layout.shape, dtype=dtype), requires_grad=layout.requires_grad)
            if layout.expert:
                param.allreduce = False
            elif i % 2:
                param.allreduce = True  # explicit True behaves like a missing attribute
            for flag in (
                "sequence_parallel",
                "average_gradients_across_tp_domain",
                "pipeline_parallel",
                "flextron_router_pp_sync",
                "is_gtp_weight_remat",
            ):
                if getattr(layout, flag):
                    setattr(param, flag, True)
            _child(chunk, parent).register_parameter(leaf, param)
        for layout in scenario.routers:
            parent, _, leaf = layout.name.rpartition(".")
            router = classes["AuxRouter" if layout.has_aux_loss_tracker else "Router"](layout)
            router.train(layout.training)
            _child(chunk, parent).add_module(leaf, router)
        chunk.config = config
        chunk.pre_process = stage == 0 and index == 0
        chunk.post_process = stage == scenario.pp - 1 and index == scenario.num_chunks - 1
        chunk.share_embeddings_and_output_weights = share
        chunks.append(classes["Wrapper"](chunk) if wrap else chunk)
    return chunks


def load_inputs(model: Sequence[Any], scenario: Scenario, data: RankData) -> None:
    """Put one rank's inputs into ``main_grad`` / ``.grad`` and the router buffers."""
    import torch

    dtype = getattr(torch, scenario.dtype)
    inner = [getattr(c, "module", c) for c in model]
    for (chunk, name), values in data.grads.items():
        param = inner[chunk].get_parameter(name)
        if values is None:
            continue
        grad = torch.from_numpy(np.array(values, dtype=np.float32)).to(dtype)
        if scenario.grad_attr == "main_grad":
            param.main_grad = grad
        else:
            param.grad = grad
    for (chunk, name), state in data.routers.items():
        router = inner[chunk].get_submodule(name)
        for field in ("local_tokens_per_expert", "expert_bias", "qb_beta", "qb_beta_accum", "qb_beta_count"):
            buffer = getattr(router, field)
            if buffer is not None:
                buffer.copy_(torch.from_numpy(np.array(getattr(state, field), dtype=np.float32)))


def read_outputs(model: Sequence[Any], scenario: Scenario, data: RankData) -> RankData:
    """One rank's outputs: gradients as float32 numpy, router state, aux-loss resets."""
    inner = [getattr(c, "module", c) for c in model]
    grads: dict[Any, np.ndarray | None] = {}
    for (chunk, name) in data.grads:
        param = inner[chunk].get_parameter(name)
        grad = getattr(param, "main_grad", None) if scenario.grad_attr == "main_grad" else param.grad
        grads[(chunk, name)] = None if grad is None else grad.detach().float().cpu().numpy().copy()
    routers: dict[Any, RouterState] = {}
    for (chunk, name), before in data.routers.items():
        router = inner[chunk].get_submodule(name)
        values = {}
        for field in ("local_tokens_per_expert", "expert_bias", "qb_beta", "qb_beta_accum", "qb_beta_count"):
            buffer = getattr(router, field)
            values[field] = (
                np.array(getattr(before, field), dtype=np.float32)
                if buffer is None
                else buffer.detach().float().cpu().numpy().copy()
            )
        routers[(chunk, name)] = RouterState(**values, aux_loss_resets=router.aux_loss_resets)
    return RankData(grads=grads, routers=routers, num_tokens=data.num_tokens)


# --------------------------------------------------------------------------- groups


def scenario_config(scenario: Scenario, finalize_config: bool) -> Any:
    """The chunk config: a Megatron-like namespace (with expert / GTP sizes) or a
    meshgrad FinalizeConfig."""
    if finalize_config:
        from meshgrad.config import FinalizeConfig

        return FinalizeConfig.from_mapping(dict(scenario.config))
    return types.SimpleNamespace(
        **dict(scenario.config),
        tensor_model_parallel_size=scenario.tp,
        pipeline_model_parallel_size=scenario.pp,
        context_parallel_size=scenario.cp,
        expert_model_parallel_size=scenario.ep,
        expert_tensor_parallel_size=scenario.expert_tp,
        gtp_weight_remat_size=scenario.gtp,
        expert_gtp_weight_remat_size=scenario.egtp,
    )


def _stages(scenario: Scenario) -> tuple[tuple[int, ...], tuple[int, ...]]:
    from meshgrad.axes import stage_set

    embd = stage_set(scenario.cfg("embedding_stages", None), scenario.pp, "first_last")
    pos = stage_set(scenario.cfg("position_embedding_stages", None), scenario.pp, "first")
    return embd, pos


def device_mesh(scenario: Scenario, cache: dict[Any, Any]) -> Any:
    """A DeviceMesh over the dense axes of size > 1 (cached per shape)."""
    from torch.distributed.device_mesh import init_device_mesh

    sizes = (scenario.pp, scenario.dp, scenario.cp, scenario.gtp, scenario.tp)
    dims = [(n, s) for n, s in zip(("pp", "dp", "cp", "gtp", "tp"), sizes) if s > 1]
    dims = dims or [("dp", 1)]
    key = ("mesh", tuple(dims))
    if key not in cache:
        cache[key] = init_device_mesh("cpu", tuple(s for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims))
    return cache[key]


def collection(scenario: Scenario, cache: dict[Any, Any]) -> Any:
    """A ProcessGroupCollection-like namespace built with dist.new_group (cached)."""
    from parity_tests.specs import scenario_dims

    dims = scenario_dims(scenario)
    embd, pos = _stages(scenario)
    key = ("pgc", dims, embd, pos)
    if key in cache:
        return cache[key]
    cache[key] = groups_of(dims, embd, pos, cache)
    return cache[key]


def groups_of(dims: Any, embd: Any, pos: Any, made: dict[Any, Any] | None = None) -> types.SimpleNamespace:
    """Every named group of ``dims`` as a ProcessGroupCollection-like namespace: this rank's
    process group per field (None where the group has one rank), ``dist.new_group`` called
    for every instance on every rank, in the same order everywhere.

    Args:
      dims: the ParallelDims.
      embd: the embedding stage set; pos: the position-embedding stage set.
      made: process groups made before, by (field, ranks), reused (and added to): layouts
        of one world share most of their groups, and each ``new_group`` is a rendezvous of
        every rank. Two fields with the same ranks still get two groups, as in Megatron.
    """
    import torch.distributed as dist

    from meshgrad.axes import Group

    made = {} if made is None else made
    rank = dist.get_rank()
    fields: dict[str, Any] = {}
    for group in Group:
        stages = embd if group is Group.EMBD else pos if group is Group.POS_EMBD else None
        mine = None
        for ranks in dims.all_groups(group, stages):
            if len(ranks) > 1:
                key = ("group", group.value, tuple(ranks))
                if key not in made:
                    made[key] = dist.new_group(ranks)
                mine = made[key] if rank in ranks else mine
        fields[group.value] = mine
    return types.SimpleNamespace(**fields)


# --------------------------------------------------------------------------- scenarios


def _run_scenarios(rank: int, world_size: int, scenarios: Sequence[Scenario], sink: Sink) -> None:
    import torch
    import torch.distributed as dist

    from torch_impl import finalize_model_grads

    cache: dict[Any, Any] = {}
    for index, scenario in enumerate(scenarios):
        try:
            if scenario.world_size != world_size:
                raise ValueError(f"scenario needs {scenario.world_size} ranks, world has {world_size}")
            use_mesh = index % 2 == 0
            config = scenario_config(scenario, finalize_config=not use_mesh and index % 4 == 3)
            groups = device_mesh(scenario, cache) if use_mesh else collection(scenario, cache)
            model = build_model(scenario, rank, config, wrap=index % 3 == 1)
            data = make_rank_inputs(scenario, rank)
            load_inputs(model, scenario, data)
            num_tokens = None if data.num_tokens is None else torch.tensor(data.num_tokens, dtype=torch.int64)
            dist.barrier()
            start = time.perf_counter()
            force = bool(getattr(scenario, "force_all_reduce", False))
            finalize_model_grads(model, num_tokens=num_tokens, pg_collection=groups, force_all_reduce=force)
            seconds = time.perf_counter() - start
            sink.put(index, ("ok", read_outputs(model, scenario, data), seconds))
        except Exception as err:  # recorded; the next scenario still runs
            sink.put(index, ("error", f"{type(err).__name__}: {err}", 0.0))


def run_torch_world(
    scenarios: list[Scenario], world_size: int, timeout: float = 600.0
) -> dict[str, ScenarioResult]:
    """Run every scenario through torch_impl in one gloo world of ``world_size`` ranks.

    Args:
      scenarios: scenarios whose ``world_size`` equals ``world_size``.
      world_size: number of processes.
      timeout: seconds before the world is killed; unfinished scenarios report an error.

    Returns:
      ``{scenario name: ScenarioResult}``; ``seconds`` is the slowest rank's finalize time.
    """
    outcome = spawn_world(_run_scenarios, world_size, list(scenarios), timeout, crash_retries=1)
    out: dict[str, ScenarioResult] = {}
    for index, scenario in enumerate(scenarios):
        per_rank = [outcome.results[r].get(index) for r in range(world_size)]
        errors = [f"rank {r}: {v[1]}" for r, v in enumerate(per_rank) if v is not None and v[0] == "error"]
        missing = [r for r, v in enumerate(per_rank) if v is None]
        if errors:
            out[scenario.name] = ScenarioResult(None, error=errors[0])
        elif missing:
            out[scenario.name] = ScenarioResult(
                None, error=f"torch world stopped before ranks {missing} finished: {outcome.why()}"
            )
        else:
            out[scenario.name] = ScenarioResult(
                [v[1] for v in per_rank], seconds=max(v[2] for v in per_rank)
            )
    return out
