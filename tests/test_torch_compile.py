"""finalize under ``torch.compile``, in one gloo world of 2 ranks (issue 22, item 7).

- a training step ``torch.compile``d (backends ``eager`` and ``aot_eager``) that calls
  :func:`torch_impl.finalize_model_grads` after ``backward()``: finalize is a graph break
  and runs eagerly; the gradients equal those of the same step run eagerly and the
  DP average computed here with numpy, on two steps (the second one cached), with a
  DeviceMesh and with a collection of process groups;
- a compiled chunk (``torch.compile(module)``: an ``OptimizedModule`` whose parameters are
  named ``_orig_mod.*``), alone, behind a ``.module`` wrapper, on one rank only, and
  inside a compiled step: discovery gives the uncompiled names (so the q / k layernorm
  rule and the cross-rank comparison see the same names) and the finalized numbers equal
  the uncompiled twin's and numpy's TP sum;
- a tied word embedding over two pipeline stages, compiled chunks in a compiled step: both
  stages hold the sum of the two stages' gradients.

All data is integer-valued, so every comparison is exact.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from meshgrad import FinalizeConfig  # noqa: E402
from parity_tests.world_cases import case_values, local_cases, run_cases  # noqa: E402
from torch_impl import discover, finalize_model_grads  # noqa: E402
from torch_impl.sources.wrappers import eager_under_compile, uncompiled, uncompiled_name  # noqa: E402
from torch_impl.sources.wrappers import find_attr, unwrap  # noqa: E402

WORLD = 2
BACKENDS = ("eager", "aot_eager")
STEPS = 2


def compile_unavailable() -> str | None:
    """Why ``torch.compile`` cannot run here (None: it can)."""
    if not hasattr(torch, "compile") or not hasattr(torch.compiler, "disable"):
        return f"torch {torch.__version__} has no torch.compile / torch.compiler.disable"
    try:
        torch.compile(lambda t: t + 1, backend="eager")(torch.zeros(1))
    except Exception as err:  # noqa: BLE001 -- any failure means: not available here
        return f"torch.compile does not run here: {type(err).__name__}: {err}"
    return None


# =========================================================================== models and data


class Scale(nn.Module):
    """A layernorm-like weight (the q-layernorm of the block)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([1.0, 2.0]))


class Block(nn.Module):
    """``(x @ W.T + b) * q_layernorm.weight``: one linear layer and a q layernorm scale."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)
        self.q_layernorm = Scale()
        with torch.no_grad():
            self.linear.weight.copy_(torch.arange(6.0).reshape(2, 3) - 2)
            self.linear.bias.copy_(torch.tensor([1.0, -1.0]))
        self.config = config
        self.pre_process = self.post_process = True
        self.share_embeddings_and_output_weights = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.q_layernorm.weight


class Stage(nn.Module):
    """One pipeline stage of a model with a tied word embedding: the embedding on the
    first stage, the output layer on the last."""

    def __init__(self, first: bool, config: Any) -> None:
        super().__init__()
        if first:
            self.embedding = nn.Module()
            self.embedding.word_embeddings = nn.Embedding(4, 2)
        else:
            self.output_layer = nn.Linear(2, 4, bias=False)
        self.config = config
        self.pre_process, self.post_process = first, not first
        self.share_embeddings_and_output_weights = True
        with torch.no_grad():
            self.shared_embedding_or_output_weight().copy_(torch.arange(8.0).reshape(4, 2) - 3)

    def shared_embedding_or_output_weight(self) -> nn.Parameter:
        return self.embedding.word_embeddings.weight if self.pre_process else self.output_layer.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding.word_embeddings(x) if self.pre_process else self.output_layer(x)


class Wrapper(nn.Module):
    """A ``.module`` wrapper (like Megatron's Float16Module)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def config(tp: int = 1, pp: int = 1) -> Any:
    """A Megatron-like config with the q / k layernorm rule on."""
    return types.SimpleNamespace(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=1, qk_layernorm=True
    )


def block_data(rank: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    """(input x (2, 3), loss weights (2, 2)) of a rank and step: small integers."""
    x = np.arange(6, dtype=np.float32).reshape(2, 3) + rank + 3 * step
    w = np.array([[1, -2], [3, 1]], dtype=np.float32) + rank - step
    return x, w


def stage_data(rank: int) -> tuple[np.ndarray, np.ndarray]:
    """(input, loss weights) of a pipeline stage: token ids on the first, activations on the last."""
    if rank == 0:
        return np.array([[0, 1], [2, 1]], dtype=np.int64), np.arange(8, dtype=np.float32).reshape(2, 2, 2) - 4
    return np.array([[1, -1], [2, 3], [0, 1]], dtype=np.float32), np.arange(12, dtype=np.float32).reshape(3, 4) % 5 - 2


def block_grads(rank: int, step: int) -> dict[str, np.ndarray]:
    """numpy: the local gradients of :class:`Block` for ``(out * w).sum()``."""
    x, w = block_data(rank, step)
    weight = np.arange(6, dtype=np.float32).reshape(2, 3) - 2
    bias, scale = np.array([1, -1], dtype=np.float32), np.array([1, 2], dtype=np.float32)
    h = x @ weight.T + bias
    dh = w * scale
    return {"linear.weight": dh.T @ x, "linear.bias": dh.sum(0), "q_layernorm.weight": (h * w).sum(0)}


def stage_grad(rank: int) -> np.ndarray:
    """numpy: the local gradient of a stage's tied weight."""
    x, w = stage_data(rank)
    if rank == 1:
        return w.T @ x
    grad = np.zeros((4, 2), dtype=np.float32)
    np.add.at(grad, x.reshape(-1), w.reshape(-1, 2))
    return grad


# =========================================================================== worker side


def step(model: Sequence[nn.Module], x: torch.Tensor, w: torch.Tensor, groups: Any) -> torch.Tensor:
    """A training step: forward, backward and finalize (what a user compiles)."""
    loss = (model[0](x) * w).sum()
    loss.backward()
    finalize_model_grads(list(model), pg_collection=groups)
    return loss


def counting(backend: str, graphs: list[int]) -> Callable[..., Any]:
    """The dynamo backend ``backend``, counting the graphs it compiles."""
    inner = torch._dynamo.lookup_backend(backend)

    def compile_graph(gm: Any, example_inputs: Any) -> Any:
        graphs.append(len(gm.graph.nodes))
        return inner(gm, example_inputs)

    return compile_graph


def compiled_step(backend: str | None, graphs: list[int]) -> Callable[..., torch.Tensor]:
    """:func:`step`, compiled with ``backend`` (None: eager)."""
    if backend is None:
        return step
    torch._dynamo.reset()
    return torch.compile(step, backend=counting(backend, graphs))


def grads_by_name(module: nn.Module) -> dict[str, np.ndarray]:
    """The gradients of the uncompiled module, by name."""
    return {n: p.grad.detach().numpy().copy() for n, p in uncompiled(module).named_parameters()}


def process_groups(tp: int, pp: int, dp: int) -> Any:
    """A ProcessGroupCollection-like namespace over the world (groups of size 1: None)."""
    import torch.distributed as dist

    world = dist.group.WORLD
    sizes = {"tp": tp, "pp": pp, "embd": pp, "pos_embd": 1, "gtp_remat": 1, "expt_gtp_remat": 1,
             "dp_cp": dp, "tp_dp_cp": tp * dp, "expt_dp": tp * dp, "dp_cp_gtp_remat": dp}
    return types.SimpleNamespace(**{name: world if size > 1 else None for name, size in sizes.items()})


def mesh(dim: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (WORLD,), mesh_dim_names=(dim,))


def case_compiled_step_dp(rank: int, world: int) -> dict[str, Any]:
    """dp = 2: per group source and backend (None: eager), per step, the finalized
    gradients, and the number of graphs the backend compiled."""
    out: dict[str, Any] = {}
    for source, groups in (("mesh", mesh("dp")), ("collection", process_groups(1, 1, WORLD))):
        for backend in (None, *BACKENDS):
            graphs: list[int] = []
            run = compiled_step(backend, graphs)
            model = Block(config())
            per_step = []
            for index in range(STEPS):
                model.zero_grad()
                x, w = block_data(rank, index)
                run([model], torch.from_numpy(x), torch.from_numpy(w), groups)
                per_step.append(grads_by_name(model))
            out[f"{source}/{backend}"] = (per_step, len(graphs))
    return out


def _tp_chunk(variant: str, rank: int) -> tuple[nn.Module, nn.Module]:
    """(the chunk passed to finalize, the Block inside it)."""
    block = Block(config(tp=WORLD))
    compiled = variant != "twin" and not (variant == "mixed" and rank == 1)
    chunk = torch.compile(block, backend="eager") if compiled else block
    return (Wrapper(chunk) if variant == "wrapped" else chunk), block


def _chunk_variants(variants: Sequence[str]) -> dict[str, Any]:
    """tp = 2, qk_layernorm: per variant, the names discovery gives, torch's names and
    the finalized gradients."""
    rank = torch.distributed.get_rank()
    groups = mesh("tp")
    out: dict[str, Any] = {}
    for variant in variants:
        chunk, block = _tp_chunk(variant, rank)
        names = [s.name for s in discover([chunk], FinalizeConfig(qk_layernorm=True)).params]
        run = compiled_step("eager" if variant == "compiled step" else None, [])
        x, w = block_data(rank, 0)
        run([chunk], torch.from_numpy(x), torch.from_numpy(w), groups)
        out[variant] = (names, [n for n, _ in chunk.named_parameters()], grads_by_name(block))
    return out


def case_compiled_chunk_tp(rank: int, world: int) -> dict[str, Any]:
    """The uncompiled twin; a compiled chunk; compiled on rank 0 only; behind a
    ``.module`` wrapper."""
    return _chunk_variants(("twin", "compiled", "mixed", "wrapped"))


def case_compiled_chunk_in_compiled_step_tp(rank: int, world: int) -> dict[str, Any]:
    """The uncompiled twin; a compiled chunk in a compiled step."""
    return _chunk_variants(("twin", "compiled step"))


def case_tied_embedding_pp(rank: int, world: int) -> dict[str, Any]:
    """pp = 2, a tied word embedding: the stage's finalized tied-weight gradient, eager
    and with compiled chunks in a compiled step (aot_eager)."""
    out: dict[str, Any] = {}
    for source, groups in (("mesh", mesh("pp")), ("collection", process_groups(1, WORLD, 1))):
        for backend in (None, "aot_eager"):
            stage = Stage(rank == 0, config(pp=WORLD))
            chunk = stage if backend is None else torch.compile(stage, backend=backend)
            graphs: list[int] = []
            x, w = stage_data(rank)
            compiled_step(backend, graphs)([chunk], torch.from_numpy(x), torch.from_numpy(w), groups)
            grad = stage.shared_embedding_or_output_weight().grad.numpy().copy()
            out[f"{source}/{backend}"] = (grad, len(graphs))
    return out


CASES = local_cases(globals())


# =========================================================================== parent


@pytest.fixture(scope="module")
def world() -> dict[str, list[tuple[str, Any]]]:
    reason = compile_unavailable()
    if reason:
        pytest.skip(reason)
    return run_cases(__name__, CASES, WORLD, timeout=600)


def equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> bool:
    return got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)


def test_a_compiled_step_gives_the_eager_numbers_and_the_dp_average(world):
    per_rank = case_values(world, "case_compiled_step_dp")
    for rank, runs in enumerate(per_rank):
        for key, (per_step, graphs) in runs.items():
            for index, got in enumerate(per_step):
                local = [block_grads(r, index) for r in range(WORLD)]
                want = {k: sum(g[k] for g in local) / WORLD for k in local[0]}
                assert equal(got, want), (rank, key, index, got, want)
                assert equal(got, runs[key.split("/")[0] + "/None"][0][index]), (rank, key, index)
            if not key.endswith("None"):
                assert graphs > 0, f"{key}: nothing compiled: the step ran eagerly"


@pytest.mark.parametrize("case", ["case_compiled_chunk_tp", "case_compiled_chunk_in_compiled_step_tp"])
def test_a_compiled_chunk_has_its_uncompiled_names_and_numbers(world, case):
    per_rank = case_values(world, case)
    local = [block_grads(r, 0) for r in range(WORLD)]
    summed = sum(g["q_layernorm.weight"] for g in local)  # qk_layernorm: SUM over tp
    for rank, variants in enumerate(per_rank):
        twin_names, _, twin_grads = variants["twin"]
        assert twin_names == ["linear.weight", "linear.bias", "q_layernorm.weight"]
        want = {**local[rank], "q_layernorm.weight": summed}
        for variant, (names, torch_names, grads) in variants.items():
            assert names == twin_names, (rank, variant, names)
            assert equal(grads, want) and equal(grads, twin_grads), (rank, variant, grads, want)
            if variant in ("compiled", "compiled step"):
                assert all(n.startswith("_orig_mod.") for n in torch_names), torch_names  # what was seen through


def test_a_tied_embedding_in_a_compiled_step_is_summed_over_the_stages(world):
    per_rank = case_values(world, "case_tied_embedding_pp")
    want = stage_grad(0) + stage_grad(1)
    for rank, runs in enumerate(per_rank):
        for key, (grad, graphs) in runs.items():
            assert np.array_equal(grad, want), (rank, key, grad, want)
            if not key.endswith("None"):
                assert graphs > 0, key


# =========================================================================== in-process


def _compile_or_skip() -> None:
    reason = compile_unavailable()
    if reason:
        pytest.skip(reason)


def test_discovery_reads_through_compiled_wrappers_wherever_they_sit():
    _compile_or_skip()
    cfg = FinalizeConfig(qk_layernorm=True)
    stage = Stage(False, config(pp=2))
    want = [(s.name, s.role) for s in discover([stage], cfg).params]
    assert want[0][0] == "output_layer.weight" and want[0][1].name == "WORD_EMBEDDING"
    for chunk in (
        torch.compile(stage),
        Wrapper(torch.compile(stage)),
        torch.compile(Wrapper(stage)),
    ):
        found = discover([chunk], cfg)
        assert [(s.name, s.role) for s in found.params] == want, chunk
        assert found.chunks == (stage,) and unwrap(chunk) is stage
        assert find_attr(chunk, "config") is stage.config


def test_uncompiled_leaves_other_modules_alone():
    block = Block(config())
    assert uncompiled(block) is block and uncompiled(Wrapper(block)).module is block and uncompiled(None) is None


def test_uncompiled_names_drop_every_orig_mod_component():
    assert uncompiled_name("module._orig_mod.linear.weight") == "module.linear.weight"
    assert uncompiled_name("_orig_mod.module._orig_mod.w") == "module.w"
    assert uncompiled_name("my_orig_mod.w") == "my_orig_mod.w"
    _compile_or_skip()
    block = Block(config())
    names = [n for n, _ in Wrapper(torch.compile(block)).named_parameters()]
    assert [uncompiled_name(n) for n in names] == [f"module.{n}" for n, _ in block.named_parameters()]


def test_an_entry_point_is_a_graph_break_and_runs_eagerly_under_compile():
    _compile_or_skip()
    seen: list[bool] = []

    def body(t: torch.Tensor) -> torch.Tensor:
        seen.append(torch.compiler.is_compiling())
        return t + 1

    entry = eager_under_compile(body)
    assert entry.__name__ == "body" and entry.__wrapped__ is body
    assert torch.equal(entry(torch.ones(1)), torch.full((1,), 2.0)) and seen == [False]
    torch._dynamo.reset()
    out = torch.compile(lambda t: entry(t * 2) * 3, backend="eager")(torch.ones(2))
    assert torch.equal(out, torch.full((2,), 9.0)) and seen == [False, False]  # ran, untraced
    torch._dynamo.reset()
    torch.compile(lambda t: body(t * 2) * 3, backend="eager")(torch.ones(2))
    assert seen[-1] is True  # without it, the body is traced
