"""Run parity scenarios through torch_impl in ONE spawned gloo world (spawning is slow).

:func:`run_torch_world` starts ``world_size`` processes once (forked from a fork server
that imported torch once per session); every rank runs every
scenario: it builds real ``nn.Module`` chunks from the scenario layout, loads its inputs
from :func:`~parity_tests.scenarios.make_rank_inputs`, builds groups (alternating between
a torch ``DeviceMesh`` and a ProcessGroupCollection-like object, cached per mesh shape),
calls :func:`torch_impl.finalize_model_grads` and writes its outputs to a temp file. A
scenario that raises records its error; the other scenarios still run. The whole world is
killed when it outlives ``timeout``.

:func:`spawn_world` is the generic part (also used by the unit tests): run a picklable
function on every rank of a fresh gloo world and collect what it emits.
"""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing
import os
import pickle
import tempfile
import time
import traceback
import types
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from parity_tests.results import ScenarioResult
from parity_tests.scenarios import (
    RankData,
    RouterLayout,
    RouterState,
    Scenario,
    make_rank_inputs,
)

# --------------------------------------------------------------------------- generic world


class Sink:
    """Where a rank emits results: one pickle file per (rank, key), written atomically."""

    def __init__(self, directory: str, rank: int) -> None:
        self.directory = directory
        self.rank = rank

    def put(self, key: int | str, value: Any) -> None:
        path = os.path.join(self.directory, f"r{self.rank}-{key}.pkl")
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            pickle.dump(value, f)
        os.replace(tmp, path)


def _worker(
    rank: int,
    world_size: int,
    store: str,
    directory: str,
    target: Callable[[int, int, Any, Sink], None],
    payload: Any,
    pg_timeout: float,
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    sink = Sink(directory, rank)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        target(rank, world_size, payload, sink)
    except BaseException:  # report, then exit non-zero
        sink.put("fatal", traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclasses.dataclass
class WorldOutcome:
    """What a spawned world left behind.

    Args:
      results: per rank, ``{key: value}`` of everything the rank emitted.
      fatal: per rank, the traceback of an uncaught error, if any.
      timed_out: the world was killed after ``timeout`` seconds.
      exitcodes: per rank, the process exit code (None when killed before exiting).
      seconds: wall time of the whole world.
    """

    results: list[dict[Any, Any]]
    fatal: list[str | None]
    timed_out: bool
    exitcodes: list[int | None]
    seconds: float


#: Modules the fork server imports once, so that every world's processes start warm.
PRELOAD = ["torch", "torch.distributed", "numpy", "meshgrad", "torch_impl", "parity_tests.torch_world"]


def _context() -> Any:
    """A fork-server context (torch imported once per test session), its server started,
    or, where that is not available, spawn."""
    try:
        ctx = multiprocessing.get_context("forkserver")
    except ValueError:  # pragma: no cover - platforms without fork
        return multiprocessing.get_context("spawn")
    ctx.set_forkserver_preload(PRELOAD)
    from multiprocessing import forkserver

    forkserver.ensure_running()  # its one-time start does not count against a world's timeout
    return ctx


def spawn_world(
    target: Callable[[int, int, Any, Sink], None],
    world_size: int,
    payload: Any = None,
    timeout: float = 600.0,
    prepare: Callable[[], Any] | None = None,
) -> WorldOutcome:
    """Run ``target(rank, world_size, payload, sink)`` on every rank of a new gloo world.

    Args:
      target: a module-level (picklable) function; it emits results with ``sink.put``.
      world_size: number of processes.
      payload: picklable argument passed to every rank.
      timeout: seconds before every process of the world is killed.
      prepare: a picklable set-up (e.g. importing megatron-core) run once, in one process
        that then forks every rank: the ranks start with its result in memory instead of
        each repeating it (see :func:`_zygote`).

    Returns:
      A :class:`WorldOutcome`; emitted results survive a timeout or a crash.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    _context()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="meshgrad-world-") as directory:
        store = os.path.join(directory, "store")
        pg_timeout = max(30.0, min(timeout, 300.0))
        args = (world_size, store, directory, target, payload, pg_timeout)
        if prepare is None:
            timed_out, exitcodes = _run_ranks(args, start + timeout)
        else:
            timed_out, exitcodes = _run_zygote(args, prepare, start + timeout)
        results: list[dict[Any, Any]] = [{} for _ in range(world_size)]
        fatal: list[str | None] = [None] * world_size
        for name in os.listdir(directory):
            if not (name.startswith("r") and name.endswith(".pkl")):
                continue
            rank_text, key_text = name[1:-4].split("-", 1)
            with open(os.path.join(directory, name), "rb") as f:
                value = pickle.load(f)
            rank = int(rank_text)
            if key_text == "fatal":
                fatal[rank] = value
            else:
                results[rank][int(key_text) if key_text.isdigit() else key_text] = value
    return WorldOutcome(results, fatal, timed_out, exitcodes, time.monotonic() - start)


#: Seconds the other ranks get once one rank died (they may wait for it forever).
GRACE = 5.0


def _run_ranks(args: tuple[Any, ...], deadline: float) -> tuple[bool, list[int | None]]:
    """Every rank a process of the fork server; (timed out, exit codes)."""
    ctx = _context()
    world_size = args[0]
    procs = [ctx.Process(target=_worker, args=(rank, *args), daemon=True) for rank in range(world_size)]
    for p in procs:
        p.start()
    timed_out = False
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            timed_out = True
            break
    if not timed_out and any(p.exitcode for p in procs):
        for p in procs:
            p.join(max(0.0, min(GRACE, deadline - time.monotonic())))
    for p in procs:
        if p.is_alive():
            timed_out = timed_out or time.monotonic() >= deadline
            p.kill()
            p.join(5.0)
    return timed_out, [p.exitcode for p in procs]


def _run_zygote(
    args: tuple[Any, ...], prepare: Callable[[], Any], deadline: float
) -> tuple[bool, list[int | None]]:
    """One fork-server process runs ``prepare`` and forks every rank (:func:`_zygote`);
    the whole process group is killed at ``deadline``. Returns (timed out, exit codes)."""
    import signal

    world_size, directory = args[0], args[2]
    zygote = _context().Process(target=_zygote, args=(prepare, *args), daemon=True)
    zygote.start()
    zygote.join(max(0.0, deadline - time.monotonic()))
    timed_out = zygote.is_alive()
    if timed_out:
        try:
            os.killpg(zygote.pid, signal.SIGKILL)  # the zygote leads its ranks' group
        except ProcessLookupError:  # pragma: no cover - killed before it made the group
            zygote.kill()
        zygote.join(5.0)
    path = os.path.join(directory, "exitcodes.pkl")
    if os.path.exists(path):
        with open(path, "rb") as f:
            return timed_out, pickle.load(f)
    return timed_out, [None] * world_size


def _zygote(prepare: Callable[[], Any], world_size: int, store: str, directory: str, *rest: Any) -> None:
    """Run ``prepare`` once, fork every rank (each runs :func:`_worker`), reap them and
    write their exit codes; ranks still running ``GRACE`` seconds after one died are killed.
    A failing ``prepare`` leaves its traceback as every rank's fatal error."""
    import signal

    os.setpgrp()
    # terminated (its parent exiting): take the ranks along
    signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        prepare()
    except BaseException:
        text = traceback.format_exc()
        for rank in range(world_size):
            Sink(directory, rank).put("fatal", f"prepare failed: {text}")
        raise
    pids: dict[int, int] = {}
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:  # the rank: never returns
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            code = 1
            try:
                _worker(rank, world_size, store, directory, *rest)
                code = 0
            except SystemExit as err:
                code = err.code if isinstance(err.code, int) else 1
            except BaseException:  # already reported by _worker
                pass
            finally:
                os._exit(code)
        pids[pid] = rank
    codes: list[int | None] = [None] * world_size
    give_up: float | None = None
    while pids:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if give_up is not None and time.monotonic() > give_up:
                for other in pids:
                    os.kill(other, signal.SIGKILL)
                give_up = None
            time.sleep(0.05)
            continue
        rank = pids.pop(pid)
        codes[rank] = os.waitstatus_to_exitcode(status)
        if codes[rank] and give_up is None:
            give_up = time.monotonic() + GRACE
    path = os.path.join(directory, "exitcodes.pkl")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(codes, f)
    os.replace(path + ".tmp", path)


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
    cache[key] = groups_of(dims, embd, pos)
    return cache[key]


def groups_of(dims: Any, embd: Any, pos: Any) -> types.SimpleNamespace:
    """Every named group of ``dims`` as a ProcessGroupCollection-like namespace: this rank's
    process group per field (None where the group has one rank), ``dist.new_group`` called
    for every instance on every rank, in the same order everywhere.

    Args:
      dims: the ParallelDims.
      embd: the embedding stage set; pos: the position-embedding stage set.
    """
    import torch.distributed as dist

    from meshgrad.axes import Group

    rank = dist.get_rank()
    fields: dict[str, Any] = {}
    for group in Group:
        stages = embd if group is Group.EMBD else pos if group is Group.POS_EMBD else None
        mine = None
        for ranks in dims.all_groups(group, stages):
            if len(ranks) > 1:
                pg = dist.new_group(ranks)
                mine = pg if rank in ranks else mine
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
    outcome = spawn_world(_run_scenarios, world_size, list(scenarios), timeout)
    out: dict[str, ScenarioResult] = {}
    for index, scenario in enumerate(scenarios):
        per_rank = [outcome.results[r].get(index) for r in range(world_size)]
        errors = [f"rank {r}: {v[1]}" for r, v in enumerate(per_rank) if v is not None and v[0] == "error"]
        missing = [r for r, v in enumerate(per_rank) if v is None]
        if errors:
            out[scenario.name] = ScenarioResult(None, error=errors[0])
        elif missing:
            why = "timed out" if outcome.timed_out else "died"
            fatal = next((f for f in outcome.fatal if f), "")
            out[scenario.name] = ScenarioResult(
                None, error=f"torch world {why} before ranks {missing} finished\n{fatal}".strip()
            )
        else:
            out[scenario.name] = ScenarioResult(
                [v[1] for v in per_rank], seconds=max(v[2] for v in per_rank)
            )
    return out


# --------------------------------------------------------------------------- unit-test cases


def _call_cases(rank: int, world_size: int, payload: tuple[str, list[str]], sink: Sink) -> None:
    import importlib

    module_name, names = payload
    module = importlib.import_module(module_name)
    for name in names:
        try:
            value: tuple[str, Any] = ("ok", getattr(module, name)(rank, world_size))
        except Exception as err:  # recorded per rank; the next case still runs
            value = ("error", f"{type(err).__name__}: {err}")
        sink.put(name, value)


def run_cases(
    module_name: str,
    names: Sequence[str],
    world_size: int,
    timeout: float = 300.0,
    prepare: Callable[[], Any] | None = None,
) -> dict[str, list[tuple[str, Any]]]:
    """Run functions ``module.name(rank, world_size)`` on every rank of one gloo world.

    Every rank runs every case in order (cases must make the same collective calls on
    every rank).

    Args:
      module_name: importable module holding the case functions.
      names: function names, run in this order.
      world_size: number of processes.
      timeout: seconds before the world is killed.
      prepare: set-up run once before the ranks are forked (:func:`spawn_world`).

    Returns:
      ``{name: [(status, value) per rank]}`` with status ``"ok"`` (value = the return
      value), ``"error"`` (value = the error text) or ``"missing"`` (the rank never
      reported: timeout or crash).
    """
    outcome = spawn_world(_call_cases, world_size, (module_name, list(names)), timeout, prepare)
    fatal = next((f for f in outcome.fatal if f), None)
    why = "timed out" if outcome.timed_out else f"world died: {fatal}"
    return {
        name: [outcome.results[r].get(name, ("missing", why)) for r in range(world_size)] for name in names
    }


def case_values(world: dict[str, list[tuple[str, Any]]], name: str) -> list[Any]:
    """Per-rank values of case ``name`` from :func:`run_cases`; fails (pytest) naming every
    rank whose case did not return "ok"."""
    results = world[name]
    problems = [f"rank {r}: {s}: {v}" for r, (s, v) in enumerate(results) if s != "ok"]
    if problems:
        raise AssertionError("\n".join(problems))
    return [v for _, v in results]
