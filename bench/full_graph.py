"""``python -m bench.full_graph``: a whole training step captured in one CUDA graph with
``torch_impl.finalize_model_grads`` inside, its replays compared with eager steps.

**With megatron-core** (``--impl wrapper``, the default when it is importable): Megatron's
own ``FullCudaGraphWrapper`` (``megatron/core/full_cuda_graph.py``, what
``--cuda-graph-impl full_iteration`` uses) around ``get_forward_backward_func()`` (pp = 1:
``forward_backward_no_pipelining``), with ``config.finalize_model_grads_func =
torch_impl.finalize_model_grads``. The model (``--model``): a tiny megatron-core ``GPTModel``
(local layer spec, tied embeddings) or an MLP, in megatron-core's real
``DistributedDataParallel``, per-token loss (the schedule hands its device token count to
the finalize), two micro-batches a step, world of one rank (NCCL). Per step: every model's
``zero_grad_buffer()``, the step, SGD on ``main_grad`` (outside the graph, as Megatron's
optimizer step). The wrapper runs ``WARMUP`` eager steps, captures the next one and replays
it from then on; its static input buffers get each step's new batch. Twins of the same seed
run every step eagerly with the plain schedule: one with torch_impl's finalize (the
reference of the replays), one with megatron-core's. Printed per step: the max abs diff of
losses, gradients and parameters, graph against eager; then PASS or FAIL. On CUDA, a
wrapper step (replay) and an eager step are also timed, interleaved.

**Without megatron-core** (``--impl hand``, the fallback): the hand-rolled capture of one
step (``zero_grad_buffer()``, forward on a static input, backward, torch_impl's finalize
with ``num_tokens`` a device tensor) of an MLP in ``bench.ddp.MiniDDP`` (megatron-core's
DDP when present), built, warmed up and captured with ``torch.cuda.graph`` on one side
stream (:func:`capture_stream`), replayed on new inputs written in place
(docs/cuda_graphs.md, "The rule") and compared with a twin's eager steps.

``--device cpu`` (no GPU, ``bash bench/gpu.sh --cpu-smoke``): nothing can be captured. The
torch.cuda stream and graph calls the wrapper makes are stood in for
(:class:`SimulatedGraphs`): the "capture" runs the step once with the capture path taken
(``torch.cuda.is_current_stream_capturing`` returning True), which is the step's result
(a CUDA capture runs nothing, the replay that follows it does), and each later "replay"
runs the recorded call again, flagged as captured, on the same static buffers. Megatron's
wrapper, schedule, DDP and torch_impl's capture path all run; the hand-rolled path takes
the capture path the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bench.hand_graph import TOLERANCE, CpuStream, capture_stream, run_hand_rolled

#: The wrapper path: tiny GPT / MLP, micro-batches per step, eager steps before the capture.
VOCAB, SEQ, MICRO_BATCH, MICRO_BATCHES, LR, WARMUP, STEPS = 64, 8, 2, 2, 0.25, 2, 6


# --------------------------------------------------------------------------- Megatron's wrapper


class SimulatedGraphs:
    """On a CPU, in this process while entered: stand-ins for the ``torch.cuda`` stream and
    graph calls ``FullCudaGraphWrapper`` makes (``Stream``, ``stream``, ``current_stream``,
    ``CUDAGraph``, ``graph``, ``graph_pool_handle``). A "capture" runs the call made inside
    it once, flagged as captured (``torch.cuda.is_current_stream_capturing()`` True), and
    records it (:meth:`record` wraps the captured function); the first "replay" after it is
    that run, every later one runs the recorded call again, flagged, and writes its returned
    tensors into those of the capture (as a replay refills the captured outputs)."""

    _NAMES = ("Stream", "stream", "current_stream", "CUDAGraph", "graph", "graph_pool_handle")

    def __init__(self) -> None:
        self.capturing: Any = None
        self.runs = 0  # calls run flagged as captured: the capture, then each later replay
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> "SimulatedGraphs":
        self._saved = {name: getattr(torch.cuda, name) for name in self._NAMES}
        sim = self

        class Graph:
            def __init__(self) -> None:
                self.call: Callable[[], Any] | None = None
                self.result: Any = None
                self.fresh = False

            def register_generator_state(self, state: Any) -> None:
                pass

            def replay(self) -> None:
                if self.fresh:  # the capture's own run
                    self.fresh = False
                    return
                assert self.call is not None, "nothing was captured"
                with sim.flagged():
                    _copy_into(self.result, self.call())

        torch.cuda.Stream = CpuStream
        torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
        torch.cuda.current_stream = lambda device=None: CpuStream()
        torch.cuda.CUDAGraph = Graph
        torch.cuda.graph = self._graph
        torch.cuda.graph_pool_handle = lambda: None
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, value in self._saved.items():
            setattr(torch.cuda, name, value)

    @contextlib.contextmanager
    def flagged(self) -> Iterator[None]:
        """``torch.cuda.is_current_stream_capturing()`` (and ``is_available()``) True."""
        saved = torch.cuda.is_available, torch.cuda.is_current_stream_capturing
        torch.cuda.is_available = torch.cuda.is_current_stream_capturing = lambda: True
        self.runs += 1
        try:
            yield
        finally:
            torch.cuda.is_available, torch.cuda.is_current_stream_capturing = saved

    @contextlib.contextmanager
    def _graph(self, graph: Any, **kwargs: Any) -> Iterator[None]:
        self.capturing = graph
        try:
            with self.flagged():
                yield
        finally:
            self.capturing = None

    def record(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (the wrapped ``forward_backward_func``), recorded when called in a capture."""

        def forward_backward(**kwargs: Any) -> Any:
            graph = self.capturing
            if graph is None:
                return fn(**kwargs)
            static = [None if it is None else list(it) for it in kwargs["data_iterator"]]  # the static buffers

            def call() -> Any:
                return fn(**{**kwargs, "data_iterator": [None if b is None else iter(b) for b in static]})

            graph.call, graph.fresh = call, True
            graph.result = call()
            return graph.result

        return forward_backward


def _copy_into(dst: Any, src: Any) -> None:
    """Write the tensors of ``src`` into those of ``dst`` (same nested lists / dicts)."""
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, dict):
        for key in dst:
            _copy_into(dst[key], src[key])
    elif isinstance(dst, (list, tuple)):
        for a, b in zip(dst, src):
            _copy_into(a, b)


class _Mlp(nn.Module):
    """An MLP the schedule accepts: ``config``, ``model_type``, ``set_input_tensor``."""

    def __init__(self, config: Any, model_type: Any) -> None:
        super().__init__()
        self.config, self.model_type = config, model_type
        self.layers = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))

    def set_input_tensor(self, tensor: Any) -> None:
        """pp = 1: nothing comes from a previous stage."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.one_hot(tokens % 32, 32).float()
        return self.layers(x).pow(2).mean(-1)  # a loss per token


def _loss_func(mask: torch.Tensor) -> Callable[[torch.Tensor], tuple[Any, Any, dict[str, Any]]]:
    def loss_func(output: torch.Tensor) -> tuple[Any, Any, dict[str, Any]]:
        total, count = (output.float() * mask).sum(), mask.sum().to(torch.int)
        return total, count, {"lm loss": torch.stack([total.detach(), count.float()])}

    return loss_func


def _forward_step(data: Any, model: Any) -> tuple[Any, Any]:
    """Megatron's ``forward_step_func``: one micro-batch of ``{"tokens": [b, SEQ + 1]}``."""
    tokens = next(data)["tokens"]
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    mask = (labels % 5 != 0).float()  # some tokens do not count: the per-token divisor is real
    if isinstance(getattr(model, "module", model), _Mlp):
        return model(inputs), _loss_func(mask)
    positions = torch.arange(SEQ, device=tokens.device).expand(MICRO_BATCH, SEQ)
    return model(inputs, positions, None, labels=labels), _loss_func(mask)


def _build(kind: str, device: str, finalize: Callable[..., Any]) -> Any:
    """One model of the seed 0 in megatron-core's DDP, with ``finalize`` as its config's
    ``finalize_model_grads_func``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                               hidden_dropout=0.0, attention_dropout=0.0, calculate_per_token_loss=True)
    if kind == "gpt":
        module: nn.Module = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ,
                                     share_embeddings_and_output_weights=True)
    else:
        module = _Mlp(config, ModelType.encoder_or_decoder)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), module.to(device))
    config.finalize_model_grads_func = finalize
    return ddp


def _batches(step: int, device: str) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + step)
    return [{"tokens": torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g).to(device)}
            for _ in range(MICRO_BATCHES)]


def _diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[float, float]:
    """(max abs diff, max abs value of ``b``)."""
    return (max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b)),
            max(float(y.float().abs().max()) for y in b))


def _sgd(ddp: Any, result: list[dict[str, torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
    """The step's losses and gradients, then SGD on ``main_grad`` and the new parameters."""
    with torch.no_grad():
        state = {"loss": [torch.stack([r["lm loss"] for r in result]).clone()],
                 "grads": [p.main_grad.detach().clone() for p in ddp.parameters()]}
        for p in ddp.parameters():
            p.sub_(LR * p.main_grad)
        state["params"] = [p.detach().clone() for p in ddp.parameters()]
    return state


def run_wrapper(device: str, rounds: int, kind: str) -> dict[str, Any]:
    """Megatron's ``FullCudaGraphWrapper`` around its schedule, torch_impl's finalize inside."""
    from importlib.metadata import version

    import torch_impl

    store = os.path.join(tempfile.mkdtemp(prefix="meshgrad-graph-"), "store")
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{store}", rank=0, world_size=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.distributed import finalize_model_grads as megatron_finalize
        from megatron.core.full_cuda_graph import FullCudaGraphWrapper
        from megatron.core.pipeline_parallel import get_forward_backward_func

        parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    assert FullCudaGraphWrapper.cuda_graph["training"] is None, "a training graph was captured before"
    sim = SimulatedGraphs() if device == "cpu" else None
    scope = contextlib.ExitStack()
    if sim is not None:
        from parity_tests.megatron_state import megatron_on_cpu

        scope.callback(megatron_on_cpu().__exit__, None, None, None)
        scope.enter_context(sim)
    else:  # graph-safe CUDA RNG states: the wrapper registers them with the graph
        tensor_parallel.model_parallel_cuda_manual_seed(0, use_cudagraphable_rng=True)
        if hasattr(torch.autograd.graph, "set_override_stale_capture_stream"):
            torch.autograd.graph.set_override_stale_capture_stream(True)
        scope.enter_context(torch.cuda.stream(capture_stream(device)))  # models and steps on it
    models = {name: _build(kind, device, fin) for name, fin in (
        ("graph", torch_impl.finalize_model_grads), ("eager", torch_impl.finalize_model_grads),
        ("eager megatron-core", megatron_finalize))}
    schedule = get_forward_backward_func()
    wrapper = FullCudaGraphWrapper(schedule if sim is None else sim.record(schedule), cuda_graph_warmup_steps=WARMUP)
    out: dict[str, Any] = {"impl": "megatron FullCudaGraphWrapper", "megatron_core": version("megatron-core"),
                           "model": kind, "device": device, "schedule": schedule.__name__, "steps": []}
    out["captured"] = True if sim is None else "simulated (no CUDA device: capture path taken, nothing captured)"

    def step(name: str, batches: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        fb = wrapper if name == "graph" else schedule
        return fb(forward_step_func=_forward_step, data_iterator=iter(batches), model=[models[name]],
                  num_microbatches=MICRO_BATCHES, seq_length=SEQ, micro_batch_size=MICRO_BATCH, forward_only=False)

    worst = {"graph vs eager": 0.0, "eager megatron-core vs eager torch_impl": 0.0}
    bit_identical = {key: True for key in worst}
    with scope:
        for s in range(STEPS):
            batches, states = _batches(s, device), {}
            for name, ddp in models.items():
                ddp.zero_grad_buffer()
                states[name] = _sgd(ddp, step(name, batches))
            phase = "eager (warm-up)" if s < WARMUP else ("capture + replay" if s == WARMUP else "replay")
            row: dict[str, Any] = {"step": s, "phase": phase}
            for key, (a, b) in {"graph vs eager": ("graph", "eager"),
                                "eager megatron-core vs eager torch_impl": ("eager megatron-core", "eager")}.items():
                for what in ("loss", "grads", "params"):
                    diff, scale = _diff(states[a][what], states[b][what])
                    row[f"{key}: {what} max abs diff"] = diff
                    row[f"{b}: {what} max abs"] = scale
                    worst[key] = max(worst[key], diff / max(scale, 1e-30))
                    bit_identical[key] = bit_identical[key] and diff == 0.0
            out["steps"].append(row)
        if device == "cuda":
            from bench.timing import interleaved

            fixed = _batches(STEPS, device)

            def timed(name: str) -> Callable[[], None]:
                def run() -> None:
                    models[name].zero_grad_buffer()
                    step(name, fixed)

                return run

            out["time"] = interleaved({"graph step": timed("graph"), "eager step": timed("eager")}, rounds=rounds,
                                      batch=10, sync=torch.cuda.synchronize)
            out["speedup"] = out["time"]["eager step"]["median"] / out["time"]["graph step"]["median"]
    if sim is not None:
        out["runs flagged as captured"] = sim.runs
    out["max_rel_diff"] = worst
    out["bit_identical"] = bit_identical
    out["values_ok"] = all(v <= TOLERANCE for v in worst.values())
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return out


def _megatron_present() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("megatron.core.full_cuda_graph") is not None
    except (ImportError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--impl", default="auto", choices=("auto", "wrapper", "hand"),
                        help="wrapper: megatron's FullCudaGraphWrapper; hand: the hand-rolled capture; "
                             "auto: wrapper when megatron-core is importable")
    parser.add_argument("--model", default="gpt", choices=("gpt", "mlp"), help="the wrapper path's model")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    impl = args.impl if args.impl != "auto" else ("wrapper" if _megatron_present() else "hand")
    if impl == "wrapper":
        result = run_wrapper(args.device, args.rounds, args.model)
        for row in result["steps"]:
            print(f"step {row['step']} ({row['phase']}): graph vs eager max abs diff "
                  + ", ".join(f"{w} {row[f'graph vs eager: {w} max abs diff']:.3g}" for w in ("loss", "grads", "params"))
                  + " | eager megatron-core vs torch_impl "
                  + ", ".join(f"{w} {row[f'eager megatron-core vs eager torch_impl: {w} max abs diff']:.3g}"
                              for w in ("loss", "grads", "params")), flush=True)
    else:
        if args.impl == "auto":
            print("megatron-core not importable: the hand-rolled capture (fallback)")
        result = run_hand_rolled(args.device, args.rounds)
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print(f"whole step replay == eager ({result['impl']}, max rel diff "
          f"{result.get('max_rel_diff', {}).get('graph vs eager', result.get('max_rel_diff_replay_vs_eager'))}):",
          "PASS" if result["values_ok"] else "FAIL")
    return 0 if result["values_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
