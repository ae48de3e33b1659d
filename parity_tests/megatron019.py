"""megatron-core 0.19.2 (the current finalize_model_grads API) as a black-box oracle, in its own process worlds.

megatron-core 0.19.2 is published as a Python 3.12 wheel only; its Python sources run on
3.11. :func:`fetch` downloads the wheel once (``pip download``) into
``.cache/megatron-core-0.19.2/`` (git-ignored) and unpacks it there; nothing is installed
(megatron-core 0.16.1, the older oracle, stays in site-packages). ``python -m
parity_tests.megatron019 fetch`` is the CI step (``make setup``); it is idempotent and
quiet when offline. ``MESHGRAD_MEGATRON019_SRC`` may point at an unpacked copy instead.

Worker side (:func:`world_main`, run by :func:`parity_tests.process_world.spawn_world`):
every rank puts the unpacked folder first on ``sys.path``, stubs the one module that
imports triton (``megatron.core.transformer.moe.ops.paged_stash``; finalization never runs
its kernels), imports megatron-core 0.19.2 and, for each layout of its world size,
initializes ``parallel_state`` and runs every case of ``tests/test_megatron019_oracle.py``
(:func:`cases`): the same call through megatron-core and through :mod:`torch_impl` on
two identical builds of one Megatron-shaped model (real ``TopKRouter`` modules),
with megatron-core's own ``TransformerConfig``, ``DistributedDataParallelConfig`` and
``ProcessGroupCollection``. Each side leaves a :func:`snapshot` of every gradient
(value, dtype, tensor type), every buffer and ``num_tokens``; the parent compares them bit
for bit.

megatron-core is a black box: its functions are called, never copied. On CPU two of its
device calls are replaced for the duration of a call: ``torch.cuda.current_device`` while a
``TopKRouter`` is built (its buffers then live on the CPU), and the GTP stream fence
``wait_for_gtp_grad_reduction_on_current_stream`` (CUDA streams), by a counter that both
sides' calls are compared on.
"""

from __future__ import annotations

import compileall
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import types
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from parity_tests.megatron_state import fake_ddp, initialize_parallel_state

VERSION = "0.19.2"
REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache" / f"megatron-core-{VERSION}"
ENV_VAR = "MESHGRAD_MEGATRON019_SRC"
_MARKER = Path("megatron") / "core" / "distributed" / "finalize_model_grads.py"

# =========================================================================== fetch


def source_dir() -> Path | None:
    """The unpacked megatron-core 0.19.2 sources (``$MESHGRAD_MEGATRON019_SRC`` or the
    cache), or None when they are not there."""
    for candidate in (os.environ.get(ENV_VAR), CACHE / "src"):
        if candidate and (Path(candidate) / _MARKER).is_file():
            return Path(candidate)
    return None


def skip_reason() -> str:
    return (
        f"megatron-core {VERSION} sources not available: run `python -m parity_tests.megatron019 fetch` "
        f"(needs the package registry; `make setup` does it) or set {ENV_VAR} to an unpacked wheel"
    )


def fetch(timeout: float = 240.0, verbose: bool = False) -> Path | None:
    """Download and unpack the 0.19.2 wheel into the cache once; None when it cannot be had
    (offline, no pip): never raises."""
    found = source_dir()
    if found is not None:
        return found
    CACHE.mkdir(parents=True, exist_ok=True)
    wheels = CACHE / "wheel"
    try:
        if not list(wheels.glob("megatron_core-*.whl")):
            cmd = [
                sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                "--python-version", "3.12", f"megatron-core=={VERSION}", "-d", str(wheels),
                "--disable-pip-version-check", "--retries", "1", "--timeout", "20",
            ]
            if not verbose:
                cmd.append("-q")
            subprocess.run(cmd, check=True, timeout=timeout, capture_output=not verbose)
        wheel = sorted(wheels.glob("megatron_core-*.whl"))[-1]
        with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
            with zipfile.ZipFile(wheel) as zf:
                zf.extractall(tmp)
            target = CACHE / "src"
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
            os.makedirs(tmp)  # TemporaryDirectory removes its (now moved) folder on exit
        # bytecode written once: every world imports these sources, and with
        # PYTHONDONTWRITEBYTECODE set an import would compile them again each time
        with warnings.catch_warnings():  # their docstrings' invalid escapes, say
            warnings.simplefilter("ignore")
            compileall.compile_dir(str(target), quiet=1)
    except Exception as err:  # offline or no pip: the oracle tests skip
        if verbose:
            print(f"megatron-core {VERSION} not fetched: {type(err).__name__}: {err}", file=sys.stderr)
        return None
    return source_dir()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] != ["fetch"]:
        print("usage: python -m parity_tests.megatron019 fetch [-v]", file=sys.stderr)
        return 2
    got = fetch(verbose="-v" in args)
    print(f"megatron-core {VERSION}: {got if got else 'not available (tests will skip)'}")
    return 0


# =========================================================================== worker: import


def import_megatron(src: str) -> types.ModuleType:
    """Import megatron-core from ``src`` (first on sys.path, triton-importing module stubbed,
    GTP fence replaced by a counter); returns its finalize_model_grads module."""
    # ``megatron`` is a namespace package (no ``__file__``): where it came from is
    # ``megatron.core``'s file; a world's zygote imported it already for every rank
    core_file = getattr(sys.modules.get("megatron.core"), "__file__", None) or ""
    if "megatron" in sys.modules and not core_file.startswith(src):
        for name in [n for n in sys.modules if n == "megatron" or n.startswith("megatron.")]:
            del sys.modules[name]
    if src not in sys.path:
        sys.path.insert(0, src)
    stub = types.ModuleType("megatron.core.transformer.moe.ops.paged_stash")

    def _no_kernel(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("paged_stash kernels are stubbed in the oracle (no triton)")

    stub.GLOBAL_BLOCK_SIZE = 1024
    stub.paged_stash_copy_kernel = _no_kernel
    stub.paged_stash_pop_kernel = _no_kernel
    sys.modules[stub.__name__] = stub
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core
        import megatron.core.distributed  # noqa: F401
        import megatron.core.tensor_parallel.generalized_tensor_parallelism as gtp_impl
        import megatron.core.tensor_parallel.gtp_api as gtp_api
    if not megatron.core.__file__.startswith(src) or not megatron.core.__version__.startswith(VERSION):
        raise RuntimeError(f"imported megatron-core {megatron.core.__version__} from {megatron.core.__file__}")
    for module in (gtp_api, gtp_impl):
        module.wait_for_gtp_grad_reduction_on_current_stream = _fence
    return sys.modules["megatron.core.distributed.finalize_model_grads"]


FENCE = [0]


def _fence() -> None:
    FENCE[0] += 1


# =========================================================================== worker: layouts


@dataclasses.dataclass(frozen=True)
class Layout:
    """One ``parallel_state.initialize_model_parallel`` call (dp follows from the world)."""

    name: str
    world: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    gtp: int = 1
    egtp: int = 1
    order: str = "tp-cp-ep-dp-pp"
    pos: tuple[int, ...] | None = None  # pp stages of the position-embedding group

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.cp * self.gtp)


class Env:
    """One rank's groups for one layout: parallel_state, its collection, and an explicit
    collection of ``dist.new_group`` copies of the same groups."""

    FIELDS = (
        "tp", "pp", "embd", "pos_embd", "cp", "tp_cp", "dp", "dp_cp", "dp_cp_gtp_remat", "tp_dp_cp",
        "ep", "expt_tp", "expt_dp", "gtp_remat", "expt_gtp_remat",
    )

    def __init__(self, layout: Layout, rank: int) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core.process_groups_config import ProcessGroupCollection

        self.layout, self.rank, self.ps = layout, rank, ps
        initialize_parallel_state(
            ps, layout, gtp_remat_size=layout.gtp, expert_gtp_remat_size=layout.egtp, order=layout.order
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.mpu = ProcessGroupCollection.use_mpu_process_groups()
        self.stage = ps.get_pipeline_model_parallel_rank()
        self.last_stage = self.stage == layout.pp - 1
        # Explicit collection: a dist.new_group copy of each of the collection's groups.
        made: dict[tuple[int, ...], Any] = {}
        fields: dict[str, Any] = {}
        for name in self.FIELDS:
            group = getattr(self.mpu, name, None)
            mine = tuple(dist.get_process_group_ranks(group)) if group is not None else None
            every: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
            for ranks in sorted({r for r in every if r is not None}):
                if ranks not in made:
                    made[ranks] = dist.new_group(list(ranks))
            fields[name] = None if mine is None else made[mine]
        self.explicit = ProcessGroupCollection(**fields)
        self.groups = [g for g in list(vars(self.mpu).values()) + list(made.values()) if g is not None]
        #: The config every case's routers are built from (one object, as in Megatron).
        self.router_config = _router_config()
        self._inputs: dict[str, Any] = {}

    def rank_inputs(self, scen: Any) -> Any:
        """``make_rank_inputs(scen, rank)``, made once per scenario of this layout (most
        cases, and both builds of a case, share theirs; :func:`load_inputs` copies them).
        Kept by the scenario's ``repr``: its ``config`` is a dict, so it has no hash."""
        from parity_tests.scenarios import make_rank_inputs

        key = repr(scen)
        if key not in self._inputs:
            self._inputs[key] = make_rank_inputs(scen, self.rank)
        return self._inputs[key]

    def close(self) -> None:
        self.ps.destroy_model_parallel()

    def collection(self, kind: str, **override: Any) -> Any:
        """``mpu`` / ``explicit`` collection, or ``none``; ``override``: fields replaced
        (a value ``MISSING`` leaves the field unset)."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        if kind == "none":
            return None
        base = self.mpu if kind == "mpu" else self.explicit
        fields = {k: v for k, v in vars(base).items()}
        for key, value in override.items():
            if value is MISSING:
                fields.pop(key, None)
            else:
                fields[key] = getattr(self.mpu, value) if isinstance(value, str) else value
        return ProcessGroupCollection(**fields)

    def scenario(self, **kw: Any) -> Any:
        from parity_tests.scenarios import Scenario, gpt_params

        lay = self.layout
        base = dict(
            pp=lay.pp, dp=lay.dp, cp=lay.cp, tp=lay.tp, gtp=lay.gtp, ep=lay.ep, etp=lay.etp, egtp=lay.egtp,
            params=gpt_params(experts=True, gtp_remat=True), routers=ROUTERS,
        )
        base.update(kw)
        return Scenario(lay.name, **base)


MISSING = object()

# =========================================================================== worker: models


@dataclasses.dataclass(frozen=True)
class RouterSpec:
    name: str
    training: bool = True
    frozen: bool = False


ROUTERS = (RouterSpec("decoder.layers.0.mlp.router"), RouterSpec("decoder.layers.1.mlp.router"))
EVAL_FROZEN = ROUTERS + (RouterSpec("decoder.layers.2.mlp.router", training=False),
                         RouterSpec("decoder.layers.3.mlp.router", frozen=True))
NUM_EXPERTS = 4


def transformer_config(layout: Layout, fields: dict[str, Any], sizes: bool = True) -> Any:
    """megatron-core's TransformerConfig; ``fields`` set after construction (some are not
    fields of 0.19.2's dataclass: ``flextron``, ``has_cond_embedder``)."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2)
    values = dict(pipeline_dtype=torch.float32)
    if sizes:
        lay = layout
        values.update(
            tensor_model_parallel_size=lay.tp, pipeline_model_parallel_size=lay.pp,
            context_parallel_size=lay.cp, expert_model_parallel_size=lay.ep,
            expert_tensor_parallel_size=lay.tp if lay.etp is None else lay.etp,
            gtp_weight_remat_size=lay.gtp, expert_gtp_weight_remat_size=lay.egtp,
        )
    for name, value in {**values, **fields}.items():
        setattr(config, name, value)
    return config


def _router_config() -> Any:
    """The config real routers are built from: expert bias and quantile-balancing buffers."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TransformerConfig(
            num_layers=2, hidden_size=8, num_attention_heads=2, num_moe_experts=NUM_EXPERTS,
            moe_router_topk=2, moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
            moe_router_load_balancing_type="quantile_balancing", moe_aux_loss_coeff=0.0,
        )


_CLASSES: dict[str, type] = {}


def top_k_router(config: Any, pgc: Any) -> Any:
    """A real megatron-core TopKRouter (a subclass that only counts the calls of
    ``reset_global_aux_loss_tracker``) with its buffers on the CPU."""
    import torch

    if "router" not in _CLASSES:
        from megatron.core.transformer.moe.router import TopKRouter

        class CountingTopKRouter(TopKRouter):
            aux_loss_resets = 0

            def reset_global_aux_loss_tracker(self) -> None:
                self.aux_loss_resets += 1
                super().reset_global_aux_loss_tracker()

        _CLASSES["router"] = CountingTopKRouter
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        router = _CLASSES["router"](config, pg_collection=pgc)
    finally:
        torch.cuda.current_device = original
    router.aux_loss_resets = 0
    return router


def _rng(*parts: Any) -> np.random.Generator:
    import hashlib

    digest = hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=8).digest()
    return np.random.default_rng(int.from_bytes(digest, "little"))


def build(env: Env, scen: Any, cfg: Any, routers: tuple[RouterSpec, ...]) -> list[Any]:
    """This rank's chunks with integer inputs: scenario parameters (torch_world.build_model)
    plus real TopKRouters (gate weight/bias gradients, buffers)."""
    import torch

    from parity_tests.torch_world import _child, build_model, load_inputs

    plain = dataclasses.replace(scen, routers=())
    base = build_model(plain, env.rank, cfg)
    load_inputs(base, scen, env.rank_inputs(plain))
    rcfg = env.router_config
    dtype = getattr(torch, scen.dtype)
    for index, chunk in enumerate(base):
        for spec in routers:
            parent, _, leaf = spec.name.rpartition(".")
            router = top_k_router(rcfg, env.mpu)
            router.train(spec.training)
            router.frozen_expert_bias = spec.frozen
            _child(chunk, parent).add_module(leaf, router)
            rng = _rng(env.layout.name, env.rank, index, spec.name)
            shared = _rng(env.layout.name, "stage", env.stage, index, spec.name)  # replicated state
            with torch.no_grad():
                router.local_tokens_per_expert.copy_(torch.tensor(rng.integers(0, 6, NUM_EXPERTS), dtype=torch.float32))
                router.expert_bias.copy_(torch.tensor(shared.integers(-4, 5, NUM_EXPERTS) / 4, dtype=torch.float32))
                router.qb_beta.copy_(torch.tensor(shared.integers(-4, 5, NUM_EXPERTS) / 4, dtype=torch.float32))
                router.qb_beta_accum.copy_(torch.tensor(rng.integers(0, 9, NUM_EXPERTS), dtype=torch.float32))
                router.qb_beta_count.fill_(int(rng.choice([0, 1, 2, 4])))
            for pname, p in router.named_parameters():
                p.main_grad = torch.tensor(rng.integers(-3, 4, tuple(p.shape)), dtype=torch.float32).to(dtype)
    return base


def _rebuild(env: Env, scen: Any, cfg: Any, routers: tuple[RouterSpec, ...], inputs: dict[str, Any]) -> list[Any]:
    """A second :func:`build` of the same chunks (the one config, groups and routers' config
    shared, as in Megatron).

    Raises:
      RuntimeError: its gradients or buffers differ from ``inputs`` (the first build's
        snapshot).
    """
    twin = build(env, scen, cfg, routers)
    again = snapshot(twin)
    differ = sorted(k for k in set(inputs) | set(again) if k != "num_tokens" and not _same(inputs.get(k), again.get(k)))
    if differ:
        raise RuntimeError(f"two builds of one case differ at {differ[:4]}")
    return twin


def _same(x: Any, y: Any) -> bool:
    if not (isinstance(x, tuple) and isinstance(y, tuple)):
        return x == y
    return x[:3] == y[:3] and np.array_equal(x[3], y[3], equal_nan=True)


def _value(t: Any) -> tuple[str, str, tuple[int, ...], np.ndarray]:
    import torch

    local = t.to_local() if hasattr(t, "to_local") else t
    local = local.detach()
    data = local.to(torch.float64) if local.is_floating_point() else local.to(torch.int64)
    return (type(t).__name__, str(t.dtype), tuple(t.shape), data.cpu().numpy().copy())


def snapshot(model: list[Any], num_tokens: Any = None) -> dict[str, Any]:
    """Every gradient (``main_grad`` and ``.grad``), every buffer, the aux-loss reset
    counts and ``num_tokens`` of this rank, as (type, dtype, shape, values)."""
    out: dict[str, Any] = {}
    for index, chunk in enumerate(model):
        while hasattr(chunk, "module"):
            chunk = chunk.module
        for name, p in chunk.named_parameters():
            for attr in ("main_grad", "grad"):
                if attr == "main_grad" and not hasattr(p, "main_grad"):
                    continue
                g = getattr(p, attr)
                out[f"{index}/{name}.{attr}"] = None if g is None else _value(g)
        for name, b in chunk.named_buffers():
            out[f"{index}/{name}"] = _value(b)
        for name, m in chunk.named_modules():
            if hasattr(m, "aux_loss_resets"):
                out[f"{index}/{name}:aux_loss_resets"] = m.aux_loss_resets
    if num_tokens is not None:
        out["num_tokens"] = _value(num_tokens)
    return out


# =========================================================================== worker: one comparison


@dataclasses.dataclass(frozen=True)
class Case:
    """One comparison: ``call(impl, model, cfg, env, num_tokens)`` on both sides.

    Args:
      call: the call; ``impl`` is megatron's finalize module or ``torch_impl`` (check
        ``impl.__name__``), ``num_tokens`` a fresh tensor or None.
      config: TransformerConfig fields; ``sizes``: set the layout's sizes in it.
      ddp: DistributedDataParallelConfig fields.
      scenario: Scenario overrides (num_chunks, dtype, params, config for the model).
      routers: the real routers of every chunk.
      tokens: dtype name of num_tokens (4 on the last stage, 7 elsewhere) or None.
      ours_config: the config object torch_impl's side gets instead (from megatron's).
    """

    call: Callable[..., Any]
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    sizes: bool = True
    ddp: dict[str, Any] = dataclasses.field(default_factory=dict)
    scenario: dict[str, Any] = dataclasses.field(default_factory=dict)
    routers: tuple[RouterSpec, ...] = ROUTERS
    wrap: bool = True
    tokens: str | None = None
    ours_config: Callable[[Any], Any] | None = None


def _side(call: Callable[[], Any]) -> tuple[Any, ...]:
    try:
        return ("ok", call())
    except Exception as err:  # compared in the parent
        return ("error", type(err).__name__, str(err)[:300], isinstance(err, AssertionError))


def run_case(env: Env, case: Case, mf: Any) -> dict[str, Any]:
    """Both sides of ``case`` on this rank: {"inputs": snapshot, "megatron": side,
    "ours": side}; a side is ("ok", snapshot, extra) or ("error", type, message,
    is_assertion, snapshot)."""
    import torch
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallelConfig

    import torch_impl

    scen = env.scenario(**case.scenario)
    cfg = transformer_config(env.layout, dict(case.config), sizes=case.sizes)
    ddp_cfg = DistributedDataParallelConfig()
    for key, value in case.ddp.items():
        setattr(ddp_cfg, key, value)
    base = build(env, scen, cfg, case.routers)

    def tokens() -> Any:
        if case.tokens is None:
            return None
        return torch.tensor(4 if env.last_stage else 7, dtype=getattr(torch, case.tokens))

    out: dict[str, Any] = {"inputs": snapshot(base, tokens())}
    for side, impl in (("megatron", mf), ("ours", torch_impl)):
        side_cfg = cfg if side == "megatron" or case.ours_config is None else case.ours_config(cfg)
        # megatron-core gets a second build of the same inputs (cheaper than a deep copy;
        # checked identical); torch_impl, last, the first
        inner = _rebuild(env, scen, cfg, case.routers, out["inputs"]) if side == "megatron" else base
        for chunk in inner:
            chunk.config = side_cfg
            chunk.ddp_config = ddp_cfg
        model = [fake_ddp(c, ddp_cfg, env.mpu.dp_cp, env.mpu.expt_dp) for c in inner] if case.wrap else inner
        n = tokens()
        FENCE[0] = 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = _side(lambda: case.call(impl, model, side_cfg, env, n))
        fences = FENCE[0]
        dist.barrier()
        state = snapshot(inner, n)
        if result[0] == "ok":
            extra = {"calls": [list(getattr(m, "calls", [])) for m in model], "fence": fences, "value": result[1]}
            out[side] = ("ok", state, extra)
        else:
            out[side] = result + (state,)
    return out


def world_main(rank: int, world_size: int, payload: tuple[str, str, dict[str, list[str]]], sink: Any) -> None:
    """spawn_world target: payload (megatron source folder, module defining ``LAYOUTS``
    and ``cases(layout)``, {layout: case names}); runs them in order and emits one result
    per (layout, case) as ``layout:case``."""
    import importlib

    src, module_name, wanted = payload
    mf = import_megatron(src)
    module = importlib.import_module(module_name)
    LAYOUTS, cases = module.LAYOUTS, module.cases

    for layout in LAYOUTS[world_size]:
        env = Env(layout, rank)
        try:
            for name, case in cases(layout).items():
                if name not in wanted.get(layout.name, ()):
                    continue
                try:
                    value: tuple[str, Any] = ("ok", run_case(env, case, mf))
                except Exception as err:  # a harness failure of this case only
                    import traceback

                    value = ("harness-error", f"{type(err).__name__}: {err}\n{traceback.format_exc()[-2000:]}")
                sink.put(f"{layout.name}:{name}", value)
        finally:
            env.close()


if __name__ == "__main__":
    raise SystemExit(main())
