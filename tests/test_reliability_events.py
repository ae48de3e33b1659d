"""Training-loop events around finalize, on every rank of a gloo world of 4 (dp 2 x tp 2).

A small real model (two linear maps, a sequence-parallel norm weight, a channels_last
kernel, an optional numel-0 weight) is trained with real autograd on integer-valued data,
so every gradient is an integer and every expected value is exact: each rank computes
every rank's local gradients itself (a single process) and combines them as Megatron's
step does (tp sum of the sequence-parallel weight, dp mean of every weight); finalize
must match bit for bit. The events:

- activation checkpointing (``torch.utils.checkpoint``, reentrant and not), gradient
  hooks that scale ``.grad`` in place or replace it (``register_post_accumulate_grad_hook``,
  ``Tensor.register_hook``), accumulation over micro-batches with finalize once, a
  parameter frozen then unfrozen (its old gradient left or not), a parameter added then
  removed, numel-0 and non-contiguous (channels_last, transposed) gradients, two models on
  disjoint groups finalized from two threads at once, finalize under inference_mode /
  enable_grad / autocast / a float64 default dtype, the model cast to float64, a
  parametrized weight, ``sequence_parallel`` as a property of the parameter class: the
  right numbers every step;
- gradients finalize cannot reduce (complex, sparse, on the meta device), on every rank
  or on one rank only, a parameter frozen on one rank only, a bad
  ``moe_router_load_balancing_type`` on one rank (a warning when every rank has it), and
  ``SystemExit`` / ``GeneratorExit`` raised by a user property (``chunk.config``, a
  parameter's ``grad`` or flag) on one rank: a clear error on every rank (the rank at
  fault its own, naming the parameter or field), promptly, nothing changed, and the next
  clean step right.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from meshgrad import FinalizeConfig  # noqa: E402
from parity_tests.scenarios import Scenario  # noqa: E402
from parity_tests.torch_world import device_mesh  # noqa: E402
from parity_tests.world_cases import case_values, local_cases, run_cases  # noqa: E402
from test_reliability_inputs import DP_TP, TIMEOUT, kind_of, setup_model, snapshot, timed_collection  # noqa: E402
from torch_impl import finalize_model_grads  # noqa: E402

WORLD, DP, TP = 4, 2, 2
EVENTS = Scenario("rel-events-dp2tp2", dp=DP, tp=TP)
PROMPT = TIMEOUT / 2  # an error must come well before the groups' timeout


# =========================================================================== the model


def _ints(seed: int, *shape: int) -> Any:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-2, 3, shape, generator=gen).to(torch.float32)


class Net(nn.Module):
    """Two linear maps around a sequence-parallel norm weight, plus a channels_last
    kernel; ``block`` (the norm and the second map) may run under checkpointing."""

    def __init__(self, empty: bool = False, checkpointing: str | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 6, bias=False)
        self.norm = nn.Parameter(_ints(2, 6))
        self.fc2 = nn.Linear(6, 3)
        self.kernel = nn.Parameter(_ints(3, 2, 3, 2, 2).contiguous(memory_format=torch.channels_last))
        if empty:
            self.empty = nn.Parameter(torch.zeros(0, 4))
        with torch.no_grad():
            self.fc1.weight.copy_(_ints(0, 6, 4))
            self.fc2.weight.copy_(_ints(1, 3, 6))
            self.fc2.bias.copy_(_ints(4, 3))
        self.norm.sequence_parallel = True
        self.checkpointing = checkpointing
        self.config = FinalizeConfig(sequence_parallel=True)

    def block(self, h: Any) -> Any:
        return self.fc2(h * self.norm)

    def forward(self, x: Any, k: Any) -> Any:
        h = self.fc1(x)
        if self.checkpointing is None:
            out = self.block(h)
        else:
            out = checkpoint(self.block, h, use_reentrant=self.checkpointing == "reentrant")
        out = out + (self.kernel * k).sum()
        if "extra" in self._parameters:
            out = out * self.extra
        if "empty" in self._parameters:
            out = out + self.empty.sum()
        return out


def batch(rank: int, step: int, micro: int = 0) -> tuple[Any, Any, Any]:
    """This rank's integer inputs, kernel input and targets of one micro-batch."""
    seed = 10_000 + 1000 * rank + 10 * step + micro
    return _ints(seed, 5, 4), _ints(seed + 1, 2, 3, 2, 2), _ints(seed + 2, 5, 3)


def backward(model: Net, rank: int, step: int, micro: int = 0) -> None:
    x, k, t = batch(rank, step, micro)
    (model(x, k) * t).sum().backward()


def local_grads(rank: int, step: int, micros: int = 1, setup: Callable[[Net], None] | None = None,
                empty: bool = False) -> dict[str, Any]:
    """The local gradients of ``rank`` (a fresh model, no checkpointing, no hooks)."""
    model = Net(empty=empty)
    if setup is not None:
        setup(model)
    for micro in range(micros):
        backward(model, rank, step, micro)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def expected(rank: int, step: int, scale: float = 1.0, **kwargs: Any) -> dict[str, Any]:
    """What finalize leaves on ``rank``: the dp mean of each gradient, the tp sum of the
    sequence-parallel one (rank = dp index * tp + tp index), times ``scale``."""
    every = [local_grads(r, step, **kwargs) for r in range(WORLD)]
    tp_index, out = rank % TP, {}
    for name in every[0]:
        if name == "norm":
            total = sum(every[d * TP + t][name] for d in range(DP) for t in range(TP))
        else:
            total = sum(every[d * TP + tp_index][name] for d in range(DP))
        out[name] = total / DP * scale
    return out


def grads(model: nn.Module) -> dict[str, Any]:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def same(got: dict[str, Any], want: dict[str, Any]) -> str:
    """"" when ``got`` equals ``want`` bit for bit (same names, shapes, values), else why."""
    if sorted(got) != sorted(want):
        return f"gradients of {sorted(got)}, expected {sorted(want)}"
    for name in want:
        if got[name].shape != want[name].shape or not torch.equal(got[name], want[name]):
            return f"{name!r}: {got[name].flatten()[:6].tolist()} != {want[name].flatten()[:6].tolist()}"
    return ""


def _finalize(model: nn.Module, groups: Any) -> None:
    finalize_model_grads([model], pg_collection=groups)


def train(model: Net, rank: int, steps: Sequence[int], groups: Any, scale: float = 1.0,
          before: Callable[[Net, int], None] | None = None, micros: int = 1,
          want: Callable[[int], dict[str, Any]] | None = None) -> str:
    """Run ``steps`` (zero_grad, ``before``, backward per micro-batch, finalize once) and
    compare every step with :func:`expected`; "" or the first difference."""
    for step in steps:
        model.zero_grad(set_to_none=True)
        if before is not None:
            before(model, step)
        for micro in range(micros):
            backward(model, rank, step, micro)
        _finalize(model, groups)
        wrong = same(grads(model), want(step) if want else expected(rank, step, scale, micros=micros))
        if wrong:
            return f"step {step}: {wrong}"
    return ""


def attempt(model: Any, call: Callable[[], Any]) -> tuple[str, str, bool, float]:
    """(error type or "ok", message, everything bit-identical afterwards, seconds); every
    exception caught, SystemExit and GeneratorExit included."""
    before = snapshot([model])
    start = time.monotonic()
    try:
        call()
        kind, message = "ok", ""
    except BaseException as err:  # noqa: BLE001 -- recorded; the parent checks type and text
        kind, message = kind_of(err), str(err)
    return kind, message, snapshot([model]) == before, time.monotonic() - start


# =========================================================================== right numbers


def case_checkpoint_reentrant(rank: int, world: int) -> str:
    return train(Net(checkpointing="reentrant"), rank, (0, 1), timed_collection(EVENTS))


def case_checkpoint_non_reentrant(rank: int, world: int) -> str:
    return train(Net(checkpointing="non_reentrant"), rank, (0, 1), timed_collection(EVENTS))


def case_post_accumulate_hook_scales_in_place(rank: int, world: int) -> str:
    model = Net()

    def scale(q: Any) -> None:
        q.grad.mul_(2)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(scale)
    return train(model, rank, (0, 1, 2), timed_collection(EVENTS), scale=2.0)


def case_post_accumulate_hook_replaces_grad(rank: int, world: int) -> str:
    model = Net()

    def replace(q: Any) -> None:
        q.grad = q.grad * 3  # a new tensor every step

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(replace)
    return train(model, rank, (0, 1, 2), timed_collection(EVENTS), scale=3.0)


def case_tensor_hook_scales_grad(rank: int, world: int) -> str:
    model = Net()
    for p in model.parameters():
        p.register_hook(lambda g: g * 2)
    return train(model, rank, (0, 1), timed_collection(EVENTS), scale=2.0)


def case_micro_batches_accumulated_then_finalized_once(rank: int, world: int) -> str:
    return train(Net(), rank, (0, 1), timed_collection(EVENTS), micros=3)


def case_frozen_then_unfrozen(rank: int, world: int) -> str:
    def freeze(net: Net) -> None:
        net.fc2.weight.requires_grad_(False)

    def before(model: Net, step: int) -> None:
        model.fc2.weight.requires_grad_(step != 1)

    def want(step: int) -> dict[str, Any]:
        return expected(rank, step, setup=freeze if step == 1 else None)

    return train(Net(), rank, (0, 1, 2, 3), timed_collection(EVENTS), before=before, want=want)


def case_parameter_added_then_removed(rank: int, world: int) -> str:
    def add(net: Net) -> None:
        net.extra = nn.Parameter(_ints(5, 3))

    def before(model: Net, step: int) -> None:
        if step == 1:
            add(model)
        if step == 3:
            del model.extra

    def want(step: int) -> dict[str, Any]:
        return expected(rank, step, setup=add if step in (1, 2) else None)

    return train(Net(), rank, (0, 1, 2, 3), timed_collection(EVENTS), before=before, want=want)


def case_numel_zero_parameter(rank: int, world: int) -> str:
    return train(Net(empty=True), rank, (0, 1), timed_collection(EVENTS),
                 want=lambda step: expected(rank, step, empty=True))


def case_transposed_view_gradient(rank: int, world: int) -> str:
    def before(model: Net, step: int) -> None:
        # a gradient that is a transposed view (strides (1, 6)), accumulated into by autograd
        model.fc1.weight.grad = torch.zeros(4, 6).t()

    model = Net()
    wrong = train(model, rank, (0, 1), timed_collection(EVENTS), before=before)
    layouts = (model.fc1.weight.grad.stride(), model.kernel.grad.is_contiguous(memory_format=torch.channels_last))
    return wrong or ("" if layouts == ((1, 6), True) else f"layouts changed: {layouts}")


def case_two_models_from_two_threads(rank: int, world: int) -> str:
    # Two models on two disjoint sets of groups (as two torch.distributed jobs need).
    pairs = [(Net(), timed_collection(EVENTS)), (Net(checkpointing="non_reentrant"),
                                                   timed_collection(EVENTS, timeout=TIMEOUT + 1))]
    found: list[str] = ["not run", "not run"]
    together = threading.Barrier(2)

    def run(i: int) -> None:
        try:
            together.wait(timeout=30)
            found[i] = train(pairs[i][0], rank, range(4), pairs[i][1])
        except BaseException as err:  # noqa: BLE001 -- reported
            found[i] = f"{type(err).__name__}: {err}"

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return "; ".join(f"model {i}: {f}" for i, f in enumerate(found) if f)


def _default_float64() -> Any:
    """A context in which torch's default dtype is float64."""
    import contextlib

    @contextlib.contextmanager
    def scope() -> Any:
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            yield
        finally:
            torch.set_default_dtype(old)

    return scope()


CONTEXTS = {
    "inference_mode": torch.inference_mode,
    "enable_grad": torch.enable_grad,
    "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    "default_float64": _default_float64,
}


def _in_context(name: str) -> Callable[[int, int], str]:
    def case(rank: int, world: int) -> str:
        groups, model = timed_collection(EVENTS), Net()
        for step in (0, 1):
            model.zero_grad(set_to_none=True)
            backward(model, rank, step)
            with CONTEXTS[name]():
                _finalize(model, groups)
            wrong = same(grads(model), expected(rank, step))
            if wrong:
                return f"step {step}: {wrong}"
        return ""

    return case


for _name in CONTEXTS:
    globals()[f"case_finalize_under_{_name}"] = _in_context(_name)


def case_frozen_with_a_stale_gradient(rank: int, world: int) -> str:
    groups, model = timed_collection(EVENTS), Net()
    train(model, rank, (0,), groups)
    stale = model.fc2.weight.grad.clone()
    for name, p in model.named_parameters():
        if name != "fc2.weight":
            p.grad = None
    model.fc2.weight.requires_grad_(False)  # its gradient of step 0 left in place
    backward(model, rank, 1)
    _finalize(model, groups)
    want = expected(rank, 1, setup=lambda net: net.fc2.weight.requires_grad_(False))
    wrong = same({n: g for n, g in grads(model).items() if n != "fc2.weight"}, want)
    return wrong or ("" if torch.equal(model.fc2.weight.grad, stale) else "the frozen parameter's gradient changed")


def case_model_cast_to_float64_midway(rank: int, world: int) -> str:
    groups, model = timed_collection(EVENTS), Net()
    wrong = train(model, rank, (0,), groups)
    model.double()  # every parameter's data replaced by float64 (same Parameter objects)
    for step in (1, 2):
        model.zero_grad(set_to_none=True)
        x, k, t = (v.double() for v in batch(rank, step))
        (model(x, k) * t).sum().backward()
        _finalize(model, groups)
        got = grads(model)
        wrong = wrong or same(got, {n: g.double() for n, g in expected(rank, step).items()})
        wrong = wrong or ("" if all(g.dtype == torch.float64 for g in got.values()) else "not float64")
    return wrong


class _Identity(nn.Module):
    def forward(self, x: Any) -> Any:
        return x * 1


def case_parametrized_weight(rank: int, world: int) -> str:
    from torch.nn.utils import parametrize

    groups, model = timed_collection(EVENTS), Net()
    parametrize.register_parametrization(model.fc1, "weight", _Identity())
    for step in (0, 1):
        model.zero_grad(set_to_none=True)
        backward(model, rank, step)
        _finalize(model, groups)
        got = {n.replace("parametrizations.weight.original", "weight"): g for n, g in grads(model).items()}
        wrong = same(got, expected(rank, step))
        if wrong:
            return f"step {step}: {wrong}"
    return ""


class FlagParameter(nn.Parameter):
    """A parameter class computing Megatron's flag: only the 6-element norm weight is
    sequence parallel (a property, read per parameter as Megatron reads it)."""

    @property
    def sequence_parallel(self) -> bool:
        return tuple(self.shape) == (6,)


def case_sequence_parallel_as_a_class_property(rank: int, world: int) -> str:
    model = Net()
    del model.norm.sequence_parallel
    for p in model.parameters():
        p.__class__ = FlagParameter
    return train(model, rank, (0, 1), timed_collection(EVENTS))


# =========================================================================== clear errors

BAD_GRADS = {
    # kind: (the model to finalize, made from this rank's model after backward; error type; text)
    "complex": (lambda m, r: _complex(m), "TypeError", "'fc2.bias'"),
    "sparse": (lambda m, r: _sparse(m), "TypeError", "'fc2.bias'"),
    "meta": (lambda m, r: _meta(r), "ValueError", "is on the meta device"),
}


def _complex(model: Net) -> Net:
    p = model.fc2.bias
    p.data = p.data.to(torch.complex64)
    p.grad = p.grad.to(torch.complex64)
    return model


def _sparse(model: Net) -> Net:
    model.fc2.bias.grad = model.fc2.bias.grad.to_sparse()
    return model


def _meta(rank: int) -> Net:
    """A model materialized on the meta device, after its backward (meta gradients)."""
    model = Net().to("meta")
    x, k, t = (v.to("meta") for v in batch(rank, 1))
    (model(x, k) * t).sum().backward()
    return model


def _after_step0(rank: int) -> tuple[Any, Net]:
    """This rank's groups and a model trained one step (step 0), its gradients then dropped."""
    groups = timed_collection(EVENTS)
    model = Net()
    train(model, rank, (0,), groups)
    model.zero_grad(set_to_none=True)
    return groups, model


def _bad_grad_case(kind: str, only: int | None) -> Callable[[int, int], tuple]:
    make, _, _ = BAD_GRADS[kind]

    def case(rank: int, world: int) -> tuple:
        groups, model = _after_step0(rank)
        backward(model, rank, 1)
        kept = model.fc2.bias.data
        target = make(model, rank) if only is None or rank == only else model
        outcome = attempt(target, lambda: _finalize(target, groups))
        model.fc2.bias.data, model.fc2.bias.grad = kept, None
        return (*outcome, train(model, rank, (2,), groups))

    return case


for _kind in BAD_GRADS:
    globals()[f"case_{_kind}_gradient_everywhere"] = _bad_grad_case(_kind, None)
    globals()[f"case_{_kind}_gradient_on_rank2"] = _bad_grad_case(_kind, 2)


def case_sparse_embedding_gradient_everywhere(rank: int, world: int) -> tuple:
    groups = timed_collection(EVENTS)
    model = Net()
    model.table = nn.Embedding(5, 3, sparse=True)
    model.zero_grad(set_to_none=True)
    backward(model, rank, 0)
    model.table(torch.tensor([0, 2, 2])).sum().backward()
    outcome = attempt(model, lambda: _finalize(model, groups))
    del model.table
    return (*outcome, train(model, rank, (1,), groups))


def _raising_property(error: BaseException) -> Callable[[int, int], tuple]:
    def case(rank: int, world: int) -> tuple:
        groups, model = _after_step0(rank)
        backward(model, rank, 1)
        config = model.config
        if rank == 1:
            class Broken(Net):
                @property
                def config(self) -> Any:  # a user property finalize reads
                    raise error

                @config.setter
                def config(self, value: Any) -> None:
                    pass

            model.__class__ = Broken
            model.__dict__.pop("config", None)
        outcome = attempt(model, lambda: _finalize(model, groups))
        model.__class__ = Net
        model.config = config
        return (*outcome, train(model, rank, (2,), groups))

    return case


case_system_exit_from_a_property_on_rank1 = _raising_property(SystemExit(3))
case_generator_exit_from_a_property_on_rank1 = _raising_property(GeneratorExit("closed by the user"))


def _raising_parameter_property(attr: str, error: BaseException) -> Callable[[int, int], tuple]:
    """On rank 1, ``fc2.weight``'s class defines ``attr`` as a property raising ``error``."""

    def case(rank: int, world: int) -> tuple:
        groups, model = _after_step0(rank)
        backward(model, rank, 1)
        p = model.fc2.weight
        before = snapshot([model])  # (read before the property exists: it would raise here too)
        if rank == 1:
            def get(self: Any) -> Any:
                raise error

            p.__class__ = type("Raising", (nn.Parameter,), {attr: property(get)})
        start = time.monotonic()
        try:
            _finalize(model, groups)
            kind, message = "ok", ""
        except BaseException as err:  # noqa: BLE001 -- recorded
            kind, message = kind_of(err), str(err)
        seconds = time.monotonic() - start
        p.__class__ = nn.Parameter
        return kind, message, snapshot([model]) == before, seconds, train(model, rank, (2,), groups)

    return case


case_system_exit_from_a_grad_property_on_rank1 = _raising_parameter_property("grad", SystemExit(3))
case_generator_exit_from_a_flag_property_on_rank1 = _raising_parameter_property(
    "sequence_parallel", GeneratorExit("closed by the user"))


def case_frozen_on_rank3_only(rank: int, world: int) -> tuple:
    groups, model = _after_step0(rank)
    model.fc2.weight.requires_grad_(rank != 3)
    backward(model, rank, 1)
    outcome = attempt(model, lambda: _finalize(model, groups))
    model.fc2.weight.requires_grad_(True)
    return (*outcome, train(model, rank, (2,), groups))


_MESHES: dict[Any, Any] = {}  # per worker process


def _typo_on_rank1(mesh: bool) -> Callable[[int, int], tuple]:
    def case(rank: int, world: int) -> tuple:
        return _load_balancing_typo_on_rank1(rank, device_mesh(DP_TP, _MESHES) if mesh else timed_collection(DP_TP))

    return case


def _load_balancing_typo_on_rank1(rank: int, groups: Any) -> tuple:
    changes = {"moe_router_load_balancing_type": "aux-loss"} if rank == 1 else None
    model = setup_model(DP_TP, rank, changes)
    before = snapshot(model)
    start = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            finalize_model_grads(model, pg_collection=groups)
            kind, message = "ok", ""
        except Exception as err:  # recorded
            kind, message = kind_of(err), str(err)
    outcome = (kind, message, snapshot(model) == before, time.monotonic() - start)
    good, fresh = setup_model(DP_TP, rank), setup_model(DP_TP, rank)
    finalize_model_grads(good, pg_collection=groups)
    finalize_model_grads(fresh, pg_collection=groups)
    return (*outcome, snapshot(good) == snapshot(fresh))


case_load_balancing_typo_on_rank1 = _typo_on_rank1(mesh=False)
case_load_balancing_typo_on_rank1_device_mesh = _typo_on_rank1(mesh=True)


def case_load_balancing_typo_everywhere(rank: int, world: int) -> tuple:
    groups = timed_collection(DP_TP)
    model = setup_model(DP_TP, rank, {"moe_router_load_balancing_type": "aux-loss"})
    known = setup_model(DP_TP, rank, {"moe_router_load_balancing_type": "aux_loss"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # two steps of one plan
            finalize_model_grads(model, pg_collection=groups)
    finalize_model_grads(known, pg_collection=groups)
    finalize_model_grads(known, pg_collection=groups)
    texts = [str(w.message) for w in caught if "moe_router_load_balancing_type" in str(w.message)]
    return texts, snapshot(model) == snapshot(known)


CASES = local_cases(globals())


# =========================================================================== parent


@pytest.fixture(scope="module")
def world() -> dict[str, list[tuple[str, Any]]]:
    return run_cases(__name__, CASES, WORLD, timeout=400)


RIGHT = [
    ("case_checkpoint_reentrant", "activation checkpointing (torch.utils.checkpoint, reentrant), 2 steps"),
    ("case_checkpoint_non_reentrant", "activation checkpointing (torch.utils.checkpoint, non-reentrant), 2 steps"),
    ("case_post_accumulate_hook_scales_in_place", "register_post_accumulate_grad_hook scaling .grad in place, 3 steps"),
    ("case_post_accumulate_hook_replaces_grad", "register_post_accumulate_grad_hook replacing .grad every step, 3 steps"),
    ("case_tensor_hook_scales_grad", "Tensor.register_hook scaling the gradient, 2 steps"),
    ("case_micro_batches_accumulated_then_finalized_once", "3 micro-batches accumulated (no_sync-style), finalize once, 2 steps"),
    ("case_frozen_then_unfrozen", "a parameter frozen at step 2, unfrozen at step 3"),
    ("case_parameter_added_then_removed", "a parameter added to the chunk at step 2, removed at step 4"),
    ("case_numel_zero_parameter", "a parameter and gradient of numel 0"),
    ("case_transposed_view_gradient", "non-contiguous gradients (a transposed view, channels_last)"),
    ("case_two_models_from_two_threads", "two models on disjoint groups finalized from two threads at once, 4 steps each"),
    ("case_sequence_parallel_as_a_class_property", "sequence_parallel a property of the parameter class, per parameter"),
    ("case_frozen_with_a_stale_gradient", "a parameter frozen with its old .grad left in place (left unchanged)"),
    ("case_finalize_under_inference_mode", "finalize under torch.inference_mode(), 2 steps"),
    ("case_finalize_under_enable_grad", "finalize under torch.enable_grad(), 2 steps"),
    ("case_finalize_under_autocast", "finalize under torch.autocast('cpu', bfloat16), 2 steps"),
    ("case_finalize_under_default_float64", "finalize with torch's default dtype float64, 2 steps"),
    ("case_model_cast_to_float64_midway", "model.double() after step 1 (float64 from step 2)"),
    ("case_parametrized_weight", "a weight under torch.nn.utils.parametrize, 2 steps"),
]


@pytest.mark.parametrize("name,label", RIGHT, ids=[r[0][5:] for r in RIGHT])
def test_training_loop_events_give_the_right_numbers(world, reliability, name, label):
    for rank, wrong in enumerate(case_values(world, name)):
        assert wrong == "", (name, rank, wrong)
    reliability("bad input", f"{label} [4 ranks]",
                "the right numbers: bit-identical to the single-process dp mean / tp sum of the same steps on every rank")


def names_error(message: str, error: str) -> bool:
    """Whether a peer's message names an error of type ``error`` (or meshgrad's subclass of
    it: FinalizeInputError for ValueError, FinalizeTypeError for TypeError)."""
    own = {"ValueError": "FinalizeInputError", "TypeError": "FinalizeTypeError"}.get(error, error)
    return f"failed its own checks: {error}: " in message or f"failed its own checks: {own}: " in message


def _left_unchanged(world: Any, name: str) -> tuple[list[tuple], float]:
    """Each rank's outcome of an error case, checked for what every such case shows: nothing
    changed, the next clean step right, the error found promptly; with the slowest rank's
    seconds."""
    rows = case_values(world, name)
    slowest = 0.0
    for rank, (got, message, untouched, seconds, after) in enumerate(rows):
        assert untouched, (name, rank, "changed")
        assert after == "", (name, rank, "the next clean step:", after)
        assert seconds < PROMPT, (name, rank, seconds)
        slowest = max(slowest, seconds)
    return rows, slowest


BAD = [(k, None) for k in BAD_GRADS] + [(k, 2) for k in BAD_GRADS]


@pytest.mark.parametrize("kind,only", BAD, ids=[f"{k}-{'rank2' if o is not None else 'all'}" for k, o in BAD])
def test_gradients_finalize_cannot_reduce_raise_on_every_rank(world, reliability, kind, only):
    _, error, text = BAD_GRADS[kind]
    name = f"case_{kind}_gradient_{'on_rank2' if only is not None else 'everywhere'}"
    rows, slowest = _left_unchanged(world, name)
    for rank, (got, message, *_) in enumerate(rows):
        assert message.startswith(f"rank {rank}: "), (name, rank, message)
        if only is None or rank == only:
            assert got == error and text in message, (name, rank, got, message)
        else:
            assert got == "ConsistencyError" and f"rank {only} failed its own checks: " in message, (
                name, rank, got, message)
            assert names_error(message, error), (name, rank, message)
            assert text in message, (name, rank, message)
    where = "on every rank" if only is None else "on rank 2 only"
    outcome = (f"{error} naming the parameter on every rank" if only is None
               else f"{error} naming the parameter there, ConsistencyError naming it elsewhere")
    reliability("bad input", f"{kind} gradient after a real backward, {where} [4 ranks]",
                f"{outcome}, after <= {slowest:.2f} s; nothing changed; the next clean step right")


def test_a_sparse_embedding_gradient_raises_on_every_rank(world, reliability):
    for rank, (got, message, untouched, seconds, after) in enumerate(
        case_values(world, "case_sparse_embedding_gradient_everywhere")
    ):
        assert got == "TypeError" and "'table.weight'" in message and "sparse" in message, (rank, got, message)
        assert untouched and after == "" and seconds < PROMPT, (rank, untouched, after, seconds)
    reliability("bad input", "nn.Embedding(sparse=True) in the chunk [4 ranks]",
                "TypeError naming the parameter on every rank; nothing changed; the next clean step right")


def test_a_parameter_frozen_on_one_rank_only_raises_on_every_rank(world, reliability):
    slowest = 0.0
    for rank, (got, message, untouched, seconds, after) in enumerate(case_values(world, "case_frozen_on_rank3_only")):
        assert got == "ConsistencyError" and message.startswith(f"rank {rank}: "), (rank, got, message)
        assert untouched and after == "" and seconds < PROMPT, (rank, untouched, after, seconds)
        if rank in (1, 3):  # rank 3's dp_cp group names the parameter set that differs
            assert "'dp_cp'" in message and "fc2.weight" in message, (rank, message)
        slowest = max(slowest, seconds)
    reliability("bad input", "a parameter frozen on rank 3 only between steps [4 ranks]",
                f"ConsistencyError on every rank after <= {slowest:.2f} s (rank 3's dp_cp group names the "
                "parameter); nothing changed; the next clean step right")


PROPERTIES = [("case_system_exit_from_a_property_on_rank1", "SystemExit", "chunk.config"),
              ("case_generator_exit_from_a_property_on_rank1", "GeneratorExit", "chunk.config"),
              ("case_system_exit_from_a_grad_property_on_rank1", "SystemExit", "param.grad"),
              ("case_generator_exit_from_a_flag_property_on_rank1", "GeneratorExit", "param.sequence_parallel")]


@pytest.mark.parametrize("name,kind,what", PROPERTIES, ids=[p[0][5:] for p in PROPERTIES])
def test_a_base_exception_from_a_user_property_raises_on_every_rank(world, reliability, name, kind, what):
    rows, slowest = _left_unchanged(world, name)
    for rank, (got, message, *_) in enumerate(rows):
        if rank == 1:
            assert got == kind, (name, rank, got, message)
        else:
            assert got == "ConsistencyError" and f"rank 1 failed its own checks: {kind}" in message, (
                name, rank, got, message)
    reliability("bad input", f"a user property ({what}) raises {kind} on rank 1 only [4 ranks]",
                f"{kind} there, ConsistencyError naming it elsewhere, after <= {slowest:.2f} s; nothing changed; "
                "the next clean step right")


@pytest.mark.parametrize("name,groups", [("case_load_balancing_typo_on_rank1", "collection"),
                                         ("case_load_balancing_typo_on_rank1_device_mesh", "DeviceMesh")])
def test_a_load_balancing_type_typo_on_one_rank_raises_its_own_error_there(world, reliability, name, groups):
    for rank, (got, message, untouched, seconds, recovered) in enumerate(case_values(world, name)):
        assert untouched and recovered, rank
        assert seconds < PROMPT, (rank, seconds)
        assert message.startswith(f"rank {rank}: "), (rank, message)
        assert "moe_router_load_balancing_type" in message and "'aux-loss'" in message, (rank, message)
        if rank == 1:
            assert got == "ValueError", (rank, got, message)
            assert "'aux_loss'" in message and "'global_aux_loss'" in message, (rank, message)  # the allowed values
        else:
            assert got == "ConsistencyError" and "rank 1 failed its own checks: " in message, (rank, got, message)
            assert names_error(message, "ValueError"), (rank, message)
    reliability("bad input", f"config.moe_router_load_balancing_type = 'aux-loss' on rank 1 only, {groups} [4 ranks]",
                "ValueError naming the field and the allowed values there, ConsistencyError naming it "
                "elsewhere; nothing changed")


def test_a_load_balancing_type_typo_on_every_rank_is_a_warning(world, reliability):
    for rank, (texts, same_numbers) in enumerate(case_values(world, "case_load_balancing_typo_everywhere")):
        assert len(texts) == 1 and "'aux-loss'" in texts[0], (rank, texts)
        assert same_numbers, rank
    reliability("bad input", "config.moe_router_load_balancing_type = 'aux-loss' on every rank [4 ranks]",
                "UserWarning naming the field once per plan; Megatron's numbers (it accepts the value)")
