"""Across steps, a cached plan never outlives the model it describes, and a change on
one rank only is found by every rank before anything moves.

One gloo world of 4 ranks (dp 2 x tp 2 with experts and routers; groups with a 10 s
timeout) runs every ``case_*`` below on every rank. Two kinds of case:

* ``live vs fresh``: a long-lived model runs step 1, then every rank changes the model
  the same way (a parameter added, replaced, removed; a flag set later; a Megatron-DDP
  chunk) and runs step 2; a model built fresh with the same change runs once. Both must
  give bit-identical gradients and router state (or both raise the same error type).
* ``one rank``: after step 1, one rank alone changes something per step (a gradient of
  another shape, an in-place resize, another dtype, a parameter added, an expanded
  gradient, a bad config value, a generator for a model, a gradient that is not a
  tensor, bad router buffers, other router names). Every rank must raise -- the one at
  fault its own error naming the parameter, the others a ConsistencyError naming that
  rank or the group -- well within the timeout, with every gradient and router buffer
  unchanged.

Each case of both kinds runs twice: after step 1 (the change meets the full steady
check), and after steady steps (``steady_*``: the calls before the change were answered by
the probes written from that check, and the change must make them miss on the rank that
made it).

Plus groups built by meshgrad from a DeviceMesh (timeouts inherited from the default
group, layouts agreed before any group is created), and, in one process, gradient
layouts (sparse, expanded, aliasing, one parameter in two chunks) and config kinds
(mappings, numpy scalars).
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from in_place import alias_rows, view_as_int32  # noqa: E402
from meshgrad import FinalizeConfig  # noqa: E402
from parity_tests.scenarios import make_rank_inputs  # noqa: E402
from parity_tests.torch_world import load_inputs  # noqa: E402
from parity_tests.world_cases import case_values, local_cases, run_cases  # noqa: E402
from test_reliability_inputs import (  # noqa: E402
    DP_TP,
    LINEAR,
    TIMEOUT,
    _seeded,
    attempt,
    kind_of,
    load_in_place,
    param,
    setup_model,
    snapshot,
    timed_collection,
)
from meshgrad.axes import Group  # noqa: E402
from meshgrad.plan import Step  # noqa: E402
from torch_impl import _allreduce_non_tensor_model_parallel_grads, finalize_model_grads, invalidate_plans  # noqa: E402
from torch_impl.call.read import Request  # noqa: E402
from torch_impl.call.replay import replayed  # noqa: E402
from test_steady_watched import probes_hold  # noqa: E402

WORLD = 4
#: Calls before the change in a ``steady_*`` case: the plan, the full check (which writes
#: the probes), then one answered by the probes.
STEADY = 3
SP_NORM = "decoder.final_layernorm.weight"
ROUTER = "decoder.layers.0.mlp.router"


class DDPChunk(nn.Module):
    """A Megatron-DDP-like wrapper: it owns the DP sync (here: a no-op) and scaling."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.config = module.config

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        return None

    def scale_gradients(self, scale: Any) -> None:
        for p in self.module.parameters():
            if getattr(p, "main_grad", None) is not None:
                p.main_grad.mul_(scale)


def _model(rank: int, ddp: bool = False, changes: dict[str, Any] | None = None) -> list[Any]:
    model = setup_model(DP_TP, rank, changes)
    return [DDPChunk(c) for c in model] if ddp else model


def _inner(model: Sequence[Any]) -> Any:
    return getattr(model[0], "module", model[0])


def _call(groups: Any, tokens: bool = True) -> Callable[[Sequence[Any]], None]:
    return lambda m: finalize_model_grads(m, num_tokens=torch.tensor(7) if tokens else None, pg_collection=groups)


def _step2(model: Sequence[Any], rank: int) -> None:
    load_inputs(model if not isinstance(model[0], DDPChunk) else [c.module for c in model], DP_TP,
                make_rank_inputs(_seeded(DP_TP, 1), rank))


class HelperThenFinalize:
    """Step 2 as the non-TP seed helper (its own, narrower check of a kept discovery),
    then finalize; the gradients after the helper are kept for the comparison."""

    def __init__(self, groups: Any) -> None:
        self.groups = groups
        self.after_helper: Any = None

    def __call__(self, model: Sequence[Any]) -> None:
        _allreduce_non_tensor_model_parallel_grads(model, _inner(model).config, self.groups.tp)
        self.after_helper = snapshot(model)
        _call(self.groups)(model)


def _step2_in_place(model: Sequence[Any], rank: int) -> None:
    """:func:`_step2`, the new values copied into the gradient tensors the model holds (as
    training accumulates into the same buffers), so that only the case's change differs."""
    load_in_place(model, DP_TP, make_rank_inputs(_seeded(DP_TP, 1), rank))


def _steady_live_case(name: str) -> Callable[[int, int], tuple]:
    """The live-vs-fresh case ``name``, its change made after steady steps."""
    case = globals()[name]
    return lambda rank, world: case(rank, world, warm=STEADY)


def steady_name(name: str) -> str:
    """The name of the ``steady_*`` twin of case ``name``."""
    return name.replace("case_", "case_steady_", 1)


def replayed_name(name: str) -> str:
    """The name of the ``replayed_*`` twin of case ``name`` (finalize without num_tokens)."""
    return name.replace("case_", "case_replayed_", 1)


def replay_answers(model: Sequence[Any], groups: Any, num_tokens: Any = None) -> bool:
    """Whether the next finalize call (with ``num_tokens``) is a replay of the last one
    (:mod:`torch_impl.call.replay`: no read or check stage)."""
    return replayed(list(model), groups, Request(num_tokens=num_tokens)) is not None


def probes_answer(model: Sequence[Any], groups: Any, helper: bool) -> bool:
    """Whether the probes kept on ``model`` answer its next finalize call (and, with
    ``helper``, its next non-TP helper call) without the full steady check."""
    calls = [(groups, Request(num_tokens=torch.tensor(7)))]
    if helper:
        calls.append(({Group.TP: groups.tp}, Request(steps=(Step.NON_TP,), config=_inner(model).config, over=(Group.TP,))))
    return all(probes_hold(list(model), call) for call in calls)


def live_vs_fresh(
    rank: int,
    change: Callable[[list[Any], int], None],
    ddp: bool = False,
    step2: Callable[[Any], Callable[[Sequence[Any]], None]] = _call,
    warm: int = 1,
) -> tuple:
    """(live kind, fresh kind, live == fresh bit for bit, live message, whether the probes
    answered the live model's calls before the change): ``warm`` steps and step 2 are
    ``step2(groups)`` (finalize, or the non-TP helper then finalize, compared after each);
    with ``warm`` > 1 step 2's inputs are copied into the held gradient tensors."""
    groups = timed_collection(DP_TP)
    live = _model(rank, ddp)
    for _ in range(warm):
        step2(groups)(live)
    (_step2_in_place if warm > 1 else _step2)(live, rank)
    probed = probes_answer(live, groups, step2 is HelperThenFinalize)
    change(live, rank)
    fresh = _model(rank, ddp)
    _step2(fresh, rank)
    change(fresh, rank)
    live_call, fresh_call = step2(groups), step2(groups)
    kind_live, message, _, _ = attempt(live, live_call)
    kind_fresh, _, _, _ = attempt(fresh, fresh_call)
    between = getattr(live_call, "after_helper", None) == getattr(fresh_call, "after_helper", None)
    return kind_live, kind_fresh, between and snapshot(live) == snapshot(fresh), message, probed


def one_rank(rank: int, bad: int, change: Callable[[list[Any], int], Any], ddp: bool = False, warm: int = 1,
             tokens: bool = True) -> tuple:
    """After ``warm`` good steps, rank ``bad`` alone applies ``change``; (``attempt`` of
    step 2, whether the call before the change was replayed -- with ``tokens``, and
    answered by the probes). ``change`` may return a replacement for the model argument;
    with ``warm`` > 1 step 2's inputs are copied into the held gradient tensors."""
    groups = timed_collection(DP_TP)
    model = _model(rank, ddp)
    call = _call(groups, tokens)
    for _ in range(warm):
        call(model)
    (_step2_in_place if warm > 1 else _step2)(model, rank)
    tokens_given = torch.tensor(7) if tokens else None
    probed = replay_answers(model, groups, tokens_given) and (not tokens or probes_answer(model, groups, helper=False))
    target: Any = model
    if rank == bad:
        target = change(model, rank) or model
    before = snapshot(model)
    start = time.monotonic()
    try:
        call(target)
        kind, message = "ok", ""
    except Exception as err:  # recorded for the parent
        kind, message = kind_of(err), str(err)
    return kind, message, snapshot(model) == before, time.monotonic() - start, probed


# --------------------------------------------------------------------------- changes


def add_param(model: list[Any], rank: int, **flags: Any) -> None:
    extra = nn.Parameter(torch.zeros(3))
    for name, value in flags.items():
        setattr(extra, name, value)
    extra.main_grad = torch.full((3,), float(rank + 1))
    _inner(model).get_submodule("decoder").register_parameter("extra", extra)


def replace_param(model: list[Any], rank: int) -> None:
    old = param([_inner(model)], LINEAR)
    new = nn.Parameter(torch.zeros_like(old))
    new.main_grad = old.main_grad.clone() + 1
    _inner(model).get_submodule(LINEAR.rsplit(".", 1)[0]).weight = new


def remove_sp_param(model: list[Any], rank: int) -> None:
    owner, leaf = SP_NORM.rsplit(".", 1)
    delattr(_inner(model).get_submodule(owner), leaf)


def set_sp_flag(model: list[Any], rank: int) -> None:
    param([_inner(model)], LINEAR).sequence_parallel = True


def case_param_added_after_step1(rank: int, world: int, warm: int = 1) -> tuple:
    return live_vs_fresh(rank, add_param, warm=warm)


def case_param_replaced_after_step1(rank: int, world: int, warm: int = 1) -> tuple:
    return live_vs_fresh(rank, replace_param, warm=warm)


def case_flag_set_after_step1(rank: int, world: int, warm: int = 1) -> tuple:
    return live_vs_fresh(rank, set_sp_flag, warm=warm)


def replace_untouched_grad(model: list[Any], rank: int) -> None:
    p = param([_inner(model)], LINEAR)
    p.main_grad = p.main_grad.clone() * 2 + rank


def case_helper_flag_set_after_step1(rank: int, world: int, warm: int = 1) -> tuple:
    return live_vs_fresh(rank, set_sp_flag, step2=HelperThenFinalize, warm=max(warm, 2))  # checked alone from call 2


def case_helper_untouched_grad_replaced_after_step1(rank: int, world: int, warm: int = 1) -> tuple:
    return live_vs_fresh(rank, replace_untouched_grad, step2=HelperThenFinalize, warm=max(warm, 2))  # checked alone from call 2


def case_helper_param_replaced_after_step1(rank: int, world: int, warm: int = 1) -> tuple:
    return live_vs_fresh(rank, replace_param, step2=HelperThenFinalize, warm=max(warm, 2))  # checked alone from call 2


def case_ddp_sp_param_added_after_step1(rank: int, world: int, warm: int = 1) -> tuple:
    return live_vs_fresh(rank, lambda m, r: add_param(m, r, sequence_parallel=True), ddp=True, warm=warm)


def case_ddp_sp_param_removed_after_step1(rank: int, world: int, warm: int = 1) -> tuple:
    return live_vs_fresh(rank, remove_sp_param, ddp=True, warm=warm)


def case_ddp_sp_param_replaced_after_step1(rank: int, world: int, warm: int = 1) -> tuple:
    def change(model: list[Any], r: int) -> None:
        owner, leaf = SP_NORM.rsplit(".", 1)
        old = param([_inner(model)], SP_NORM)
        new = nn.Parameter(torch.zeros_like(old))
        new.sequence_parallel = True
        new.main_grad = old.main_grad * 3
        setattr(_inner(model).get_submodule(owner), leaf, new)

    return live_vs_fresh(rank, change, ddp=True, warm=warm)


def case_ddp_sp_param_replaced_in_its_dict_after_step1(rank: int, world: int, warm: int = 1) -> tuple:
    def change(model: list[Any], r: int) -> None:  # no registration hook sees it
        owner, leaf = SP_NORM.rsplit(".", 1)
        old = param([_inner(model)], SP_NORM)
        new = nn.Parameter(torch.zeros_like(old))
        new.sequence_parallel = True
        new.main_grad = old.main_grad * 5
        _inner(model).get_submodule(owner)._parameters[leaf] = new

    return live_vs_fresh(rank, change, ddp=True, warm=warm)


def case_ddp_sp_grad_storage_swapped_after_step1(rank: int, world: int, warm: int = 1) -> tuple:
    def change(model: list[Any], r: int) -> None:  # the same tensor object, another storage
        grad = param([_inner(model)], SP_NORM).main_grad
        grad.data = grad.detach().clone() * 3 + r

    return live_vs_fresh(rank, change, ddp=True, warm=warm)


def case_ddp_sp_param_frozen_after_step1(rank: int, world: int, warm: int = 1) -> tuple:
    return live_vs_fresh(rank, lambda m, r: param([_inner(m)], SP_NORM).requires_grad_(False), ddp=True, warm=warm)


def case_ddp_flag_set_then_invalidate_plans(rank: int, world: int, warm: int = 1) -> tuple:
    def change(model: list[Any], r: int) -> None:
        set_sp_flag(model, r)  # a parameter no step touched: read once per discovery
        invalidate_plans(model)

    return live_vs_fresh(rank, change, ddp=True, warm=warm)


LIVE_CASES = [name for name, case in list(globals().items()) if name.startswith("case_") and case.__module__ == __name__]
for _name in LIVE_CASES:
    globals()[steady_name(_name)] = _steady_live_case(_name)


# one rank only ------------------------------------------------------------------


def _wrong_shape(model: list[Any], rank: int) -> None:
    param(model, LINEAR).main_grad = torch.zeros(5, 4)


def _resized_in_place(model: list[Any], rank: int) -> None:
    param(model, LINEAR).main_grad.data = torch.zeros(7)


def _other_dtype(model: list[Any], rank: int) -> None:
    p = param(model, LINEAR)
    p.main_grad = p.main_grad.double()


def _expanded(model: list[Any], rank: int) -> None:
    p = param(model, LINEAR)
    p.main_grad = p.main_grad[:1].expand_as(p.main_grad)


def _restrided_in_place(model: list[Any], rank: int) -> None:
    alias_rows(param(model, LINEAR).main_grad)


def _viewed_as_int32(model: list[Any], rank: int) -> None:
    view_as_int32(param(model, LINEAR).main_grad)


def _grad_not_tensor(model: list[Any], rank: int) -> None:
    param(model, SP_NORM).main_grad = [1.0, 2.0]


def _bad_router(model: list[Any], rank: int) -> None:
    router = _inner(model).get_submodule(ROUTER)
    router.local_tokens_per_expert = torch.zeros(5)


def _bad_config(model: list[Any], rank: int) -> None:
    cfg = types.SimpleNamespace(**vars(model[0].config))
    cfg.mtp_num_layers = -1
    model[0].config = cfg


def _generator(model: list[Any], rank: int) -> Any:
    return (c for c in model)


def _router_renamed(model: list[Any], rank: int) -> None:
    mlp = _inner(model).get_submodule(ROUTER.rsplit(".", 1)[0])
    router = mlp.router
    del mlp.router
    mlp.add_module("gate", router)


ONE_RANK = {
    # case: (rank at fault, change, its error type, text of its error)
    "case_one_rank_grad_of_another_shape": (1, _wrong_shape, "ValueError", "has shape (5, 4), the parameter"),
    "case_one_rank_grad_resized_in_place": (2, _resized_in_place, "ValueError", "has shape (7,), the parameter"),
    "case_one_rank_grad_of_another_dtype": (3, _other_dtype, "ConsistencyError", "group 'dp_cp'"),
    "case_one_rank_param_added": (0, add_param, "ConsistencyError", "extra[3]"),
    "case_one_rank_expanded_grad": (1, _expanded, "ValueError", "share memory (strides"),
    "case_one_rank_grad_restrided_in_place": (3, _restrided_in_place, "ValueError", "share memory (strides (0, 1)"),
    "case_one_rank_grad_viewed_as_int32_in_place": (0, _viewed_as_int32, "TypeError",
                                                   "gradient dtype 'int32' is not a floating"),
    "case_one_rank_grad_not_a_tensor": (2, _grad_not_tensor, "TypeError", "is a list, not a tensor"),
    "case_one_rank_bad_router_buffers": (3, _bad_router, "ValueError", "per-expert buffers differ in length"),
    "case_one_rank_bad_config_value": (1, _bad_config, "ValueError", "mtp_num_layers"),
    "case_one_rank_model_a_generator": (2, _generator, "TypeError", "model must be a non-empty list"),
    "case_one_rank_routers_renamed": (2, _router_renamed, "ConsistencyError", "mlp.gate"),
}


def _one_rank_case(name: str, warm: int, tokens: bool = True) -> Callable[[int, int], tuple]:
    bad, change, _, _ = ONE_RANK[name]
    return lambda rank, world: one_rank(rank, bad, change, warm=warm, tokens=tokens)


for _name in ONE_RANK:
    globals()[_name] = _one_rank_case(_name, 1)
    globals()[steady_name(_name)] = _one_rank_case(_name, STEADY)
    globals()[replayed_name(_name)] = _one_rank_case(_name, STEADY, tokens=False)


# groups meshgrad creates ---------------------------------------------------------


def case_mesh_groups_inherit_timeout_and_agree(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from torch_impl.sources.mesh_groups import MeshGroups

    default = MeshGroups.default_timeout()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    resolved = MeshGroups(mesh).resolve(ep=2, etp=1)
    created = resolved.groups
    timeouts = {
        g.value: created[g]._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        for g in created
        if created[g] is not None
    }
    other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    start = time.monotonic()
    try:
        MeshGroups(other).resolve(ep=1 if rank == 1 else 2, etp=1)
        outcome = ("ok", "")
    except ValueError as err:
        outcome = ("ValueError", str(err))
    dist.barrier()
    return {"default": default.total_seconds(), "timeouts": timeouts, "mismatch": outcome,
            "seconds": time.monotonic() - start}


CASES = local_cases(globals())


# =========================================================================== parent


@pytest.fixture(scope="module")
def world() -> dict[str, list[tuple[str, Any]]]:
    return run_cases(__name__, CASES, WORLD, timeout=300)


LIVE = [
    ("a parameter added after step 1 (plain chunks)", "case_param_added_after_step1"),
    ("a parameter replaced by a new Parameter after step 1", "case_param_replaced_after_step1"),
    ("sequence_parallel set on a parameter after step 1", "case_flag_set_after_step1"),
    ("seed helper, then finalize: sequence_parallel set on a parameter after step 1",
     "case_helper_flag_set_after_step1"),
    ("seed helper, then finalize: a gradient replaced on a parameter the helper does not touch",
     "case_helper_untouched_grad_replaced_after_step1"),
    ("seed helper, then finalize: a parameter replaced by a new Parameter after step 1",
     "case_helper_param_replaced_after_step1"),
    ("DDP chunks: an SP parameter added after step 1", "case_ddp_sp_param_added_after_step1"),
    ("DDP chunks: an SP parameter removed after step 1", "case_ddp_sp_param_removed_after_step1"),
    ("DDP chunks: an SP parameter replaced after step 1", "case_ddp_sp_param_replaced_after_step1"),
    ("DDP chunks: an SP parameter replaced in its module's _parameters dict (no hook sees it) after step 1",
     "case_ddp_sp_param_replaced_in_its_dict_after_step1"),
    ("DDP chunks: an SP gradient given another storage (grad.data = ...) after step 1",
     "case_ddp_sp_grad_storage_swapped_after_step1"),
    ("DDP chunks: an SP parameter frozen (requires_grad_(False)) after step 1", "case_ddp_sp_param_frozen_after_step1"),
    ("DDP chunks: sequence_parallel set on an untouched parameter, then invalidate_plans(model)",
     "case_ddp_flag_set_then_invalidate_plans"),
]
assert sorted(name for _, name in LIVE) == sorted(LIVE_CASES)


def _steady_label(label: str) -> str:
    """A live case's label for its ``steady_*`` twin."""
    when = "after steady steps (answered by the probes)"
    return label.replace("after step 1", when) if "after step 1" in label else f"{label}, {when}"


@pytest.mark.parametrize("steady", [False, True], ids=["after_step1", "after_steady_steps"])
@pytest.mark.parametrize("label,name", LIVE, ids=[c[1] for c in LIVE])
def test_a_changed_model_gets_the_numbers_of_a_fresh_call(world, reliability, label, name, steady):
    for rank, (live, fresh, same, message, probed) in enumerate(case_values(world, steady_name(name) if steady else name)):
        assert live == fresh == "ok", (name, rank, live, fresh, message)
        assert same, (name, rank, "the long-lived model differs from a fresh call")
        assert probed or not steady, (name, rank, "the probes did not answer the steady calls")
    label = _steady_label(label) if steady else label
    reliability("bad input", f"{label} [4 ranks]", "replanned: bit-identical to a fresh call on every rank")


#: When the change is made: (the case's name from the ONE_RANK name, the rows' words).
ONE_RANK_WHEN = {
    "after_step1": (lambda name: name, "after step 1"),
    "after_steady_steps": (steady_name, "after replayed steady steps (finalize with num_tokens)"),
    "replayed": (replayed_name, "after replayed steady steps (finalize without num_tokens)"),
}


@pytest.mark.parametrize("when", list(ONE_RANK_WHEN))
@pytest.mark.parametrize("name", list(ONE_RANK), ids=list(ONE_RANK))
def test_a_change_on_one_rank_raises_on_every_rank_before_anything_moves(world, reliability, name, when):
    bad, _, kind, text = ONE_RANK[name]
    case_name, words = ONE_RANK_WHEN[when]
    steady = when != "after_step1"
    slowest = 0.0
    for rank, (got, message, untouched, seconds, probed) in enumerate(case_values(world, case_name(name))):
        assert probed == steady, (name, rank, "probes answered" if probed else "the probes did not answer")
        assert untouched, (name, rank, "gradients or router state changed")
        assert seconds < TIMEOUT / 2, (name, rank, seconds)
        slowest = max(slowest, seconds)
        assert message.startswith(f"rank {rank}: "), (name, rank, message)
        if rank == bad:
            assert got == kind and text in message, (name, rank, got, message)
        elif kind == "ConsistencyError":
            assert got == "ConsistencyError", (name, rank, got, message)
        else:
            assert got == "ConsistencyError" and f"rank {bad} failed its own checks" in message, (name, rank, message)
    label = name.removeprefix("case_one_rank_").replace("_", " ")
    reliability("bad input", f"{words}, on rank {bad} only: {label} [4 ranks]",
                f"{kind} there, ConsistencyError naming it or the group elsewhere, after <= {slowest:.2f} s; nothing changed")


def test_groups_meshgrad_creates_inherit_the_timeout_and_agree_on_the_layout(world, reliability):
    slowest = 0.0
    for rank, got in enumerate(case_values(world, "case_mesh_groups_inherit_timeout_and_agree")):
        assert got["timeouts"] and set(got["timeouts"].values()) == {got["default"]}, (rank, got)
        kind, message = got["mismatch"]
        assert kind == "ValueError" and "ask for different DeviceMesh group layouts" in message, (rank, got)
        assert message.startswith(f"rank {rank}: ") and "ranks [1]: ep=1" in message, message
        slowest = max(slowest, got["seconds"])
    reliability("bad input", "DeviceMesh: groups meshgrad creates; rank 1 asks for ep=1, the others ep=2 [4 ranks]",
                f"created groups get the default group's timeout; ValueError on every rank after <= {slowest:.2f} s, "
                "before any group is created")


# =========================================================================== one process


class Chunk(nn.Module):
    def __init__(self, config: Any = None) -> None:
        super().__init__()
        self.config = config if config is not None else FinalizeConfig(calculate_per_token_loss=True)
        self.a = nn.Parameter(torch.zeros(2, 3))
        self.b = nn.Parameter(torch.zeros(2, 3))
        for i, p in enumerate(self.parameters()):
            p.main_grad = torch.arange(6, dtype=torch.float32).reshape(2, 3) + i


def _grads(model: Sequence[Any]) -> list[Any]:
    return [p.main_grad.clone() for c in model for p in c.parameters()]


LAYOUTS = [
    ("sparse gradient", lambda m: setattr(m[0].a, "main_grad", m[0].a.main_grad.to_sparse()), TypeError,
     "has layout torch.sparse_coo"),
    ("stride-0 (expanded) gradient", lambda m: setattr(m[0].a, "main_grad", torch.ones(1, 3).expand(2, 3)),
     ValueError, "share memory (strides (0, 1)"),
    ("two gradients overlapping in one storage",
     lambda m: (setattr(m[0].a, "main_grad", (buf := torch.ones(9))[:6].view(2, 3)),
                setattr(m[0].b, "main_grad", buf[3:].view(2, 3))), ValueError, "share memory"),
    ("one gradient tensor on two parameters", lambda m: setattr(m[0].b, "main_grad", m[0].a.main_grad), ValueError,
     "share memory (the same tensor)"),
]


@pytest.mark.parametrize("label,prepare,error,text", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_gradient_layouts_that_would_reduce_an_element_twice_raise(reliability, label, prepare, error, text):
    model = [Chunk()]
    prepare(model)
    kind, message, untouched, _ = attempt(model, lambda m: finalize_model_grads(m, num_tokens=torch.tensor(2)))
    assert kind == error.__name__ and text in message and message.startswith("rank 0: "), (kind, message)
    assert untouched
    reliability("bad input", f"{label} [1 rank]", f"{error.__name__} naming the parameter(s); nothing changed")


def test_the_same_parameter_in_two_chunks_raises():
    first = Chunk()
    second = Chunk()
    second.a = first.a
    kind, message, untouched, _ = attempt([first, second], lambda m: finalize_model_grads(m, num_tokens=torch.tensor(2)))
    assert kind == "ValueError" and "'a' (chunk 0)" in message and "'a' (chunk 1)" in message, message
    assert untouched


def test_disjoint_strided_views_of_one_storage_are_scaled_once():
    model = [Chunk()]
    buf = torch.arange(12, dtype=torch.float32).reshape(2, 6)
    model[0].a.main_grad, model[0].b.main_grad = buf[:, 0::2], buf[:, 1::2]
    want = buf.clone() / 4
    finalize_model_grads(model, num_tokens=torch.tensor(4))
    assert torch.equal(buf, want)


CONFIG_KINDS = [
    ("a dict", lambda: {"calculate_per_token_loss": True, "sequence_parallel": True, "tensor_model_parallel_size": 1}),
    ("numpy scalars", lambda: types.SimpleNamespace(
        calculate_per_token_loss=np.bool_(True), sequence_parallel=np.bool_(True),
        tensor_model_parallel_size=np.int64(1), mtp_num_layers=np.int64(0))),
]


@pytest.mark.parametrize("label,make", CONFIG_KINDS, ids=[c[0] for c in CONFIG_KINDS])
def test_configs_of_every_reasonable_kind_are_read(reliability, label, make):
    want = [Chunk(types.SimpleNamespace(calculate_per_token_loss=True, sequence_parallel=True))]
    finalize_model_grads(want, num_tokens=torch.tensor(4))
    got = [Chunk(make())]
    finalize_model_grads(got, num_tokens=torch.tensor(4))
    assert all(torch.equal(a, b) for a, b in zip(_grads(got), _grads(want)))
    assert not torch.equal(_grads(got)[0], _grads([Chunk()])[0])  # scaled: the dict was read
    reliability("bad input", f"config as {label} [1 rank]", "read like the equivalent config object")


def test_configs_that_are_not_configs_are_rejected(reliability):
    model = [Chunk("sequence_parallel")]
    kind, message, untouched, _ = attempt(model, lambda m: finalize_model_grads(m))
    assert kind == "TypeError" and "config must be a config object or a mapping" in message and untouched, message
    model = [Chunk({"sequence_parallel": "yes"})]
    kind, message, untouched, _ = attempt(model, lambda m: finalize_model_grads(m))
    assert kind == "TypeError" and "sequence_parallel must be a bool" in message and untouched, message
    reliability("bad input", "config a str / a flag 'yes' in a dict [1 rank]", "TypeError naming the field; nothing changed")
