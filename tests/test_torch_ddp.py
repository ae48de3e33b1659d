"""torch's own ``DistributedDataParallel`` chunks finalized by
``torch_impl.finalize_model_grads``, in ONE gloo world of 4 ranks.

torch DDP all-reduces each gradient over its process group during backward. Finalize
checks that this is Megatron's DP sync (DDP's ranks are the dp_cp group; an average for a
mean loss, a sum -- ``torch_impl.ddp_sum_hook`` -- for a per-token loss), leaves the DP
sync out for those parameters and does the rest (sequence-parallel sums over tp, the tied
embedding across pp stages, router expert bias, the per-token scale). Every finalized
gradient is compared with the same model run in one process on the whole batch (float64,
so a gradient reduced twice under a per-token sum -- x2 -- shows); the collectives
finalize launches are counted; what it cannot match is refused on every rank before
anything changes.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from parity_tests.world_cases import case_values, run_cases  # noqa: E402
from pp_stage import B, H, S, V, Stage, reference_pp, tokens  # noqa: E402  (batch, sequence, hidden, vocab)

WORLD = 4
RATE = 0.25


# =========================================================================== worker side


class _Router(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("expert_bias", torch.zeros(4))
        self.register_buffer("local_tokens_per_expert", torch.zeros(4))


class _Block(torch.nn.Module):
    """Replicated parameters applied to this rank's sequence shard (sequence parallel: their
    gradients are partial over tp, flagged ``sequence_parallel``) and a router."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = torch.nn.LayerNorm(H, dtype=torch.float64)
        self.up = torch.nn.Linear(H, 2 * H, dtype=torch.float64)
        self.down = torch.nn.Linear(2 * H, H, dtype=torch.float64)
        self.router = _Router()
        with torch.no_grad():
            for p in self.parameters():
                p.add_(torch.randn(p.shape, dtype=p.dtype) * 0.5)

    def forward(self, x: Any) -> Any:
        return self.down(torch.relu(self.up(self.norm(x))))


def _batch() -> Any:
    torch.manual_seed(1)
    return torch.randn(B, S, H, dtype=torch.float64)


def _reference_block() -> dict[str, np.ndarray]:
    """The single-process gradients of the mean over all B*S tokens of ``out**2``."""
    model = _Block()
    model(_batch()).pow(2).sum().div(B * S).backward()
    return {n: p.grad.numpy().copy() for n, p in model.named_parameters()}


def _grads(model: Any) -> dict[str, np.ndarray]:
    return {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()}


def _ddp_block(mesh: Any, per_token: bool, hook: bool, group: Any = None, bucket_view: bool = False) -> Any:
    """The block under torch DDP over ``group`` (default: the mesh's dp group), with
    ``ddp_sum_hook`` when ``hook``, its gradients views into DDP's buckets with
    ``bucket_view``."""
    from torch.nn.parallel import DistributedDataParallel

    from meshgrad import FinalizeConfig
    from torch_impl import ddp_sum_hook

    inner = _Block()
    for p in inner.parameters():
        p.sequence_parallel = True
    inner.config = FinalizeConfig(sequence_parallel=True, calculate_per_token_loss=per_token,
                                  moe_router_enable_expert_bias=True, moe_router_bias_update_rate=RATE)
    ddp = DistributedDataParallel(inner, process_group=group or mesh["dp"].get_group(),
                                  gradient_as_bucket_view=bucket_view)
    if hook:
        ddp.register_comm_hook(ddp.process_group, ddp_sum_hook)
    return ddp


def _shard(mesh: Any) -> Any:
    dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    return _batch()[dp * B // 2:(dp + 1) * B // 2, tp * S // 2:(tp + 1) * S // 2]


def _backward(ddp: Any, mesh: Any, per_token: bool) -> Any:
    """Forward and backward of this rank's tokens; the call's ``num_tokens`` (or None)."""
    out = ddp(_shard(mesh))
    if per_token:  # the sum of this rank's token losses; num_tokens: its dp shard's tokens
        out.pow(2).sum().backward()
        return torch.tensor([B // 2 * S])
    out.pow(2).sum().div(B // 2 * S).backward()  # this rank's share of its dp shard's mean
    return None


def _run_dp_tp(rank: int, mesh: Any, per_token: bool) -> dict[str, Any]:
    """dp x tp = 2 x 2: DDP over dp (with the summing hook and gradients that are views
    into DDP's buckets for a per-token loss)."""
    from torch_impl import finalize_model_grads

    ddp = _ddp_block(mesh, per_token, per_token, bucket_view=per_token)
    num_tokens = _backward(ddp, mesh, per_token)
    ddp.module.router.local_tokens_per_expert.copy_(torch.tensor([rank, 2.0, 3.0 * rank, 1.0]))
    before = _grads(ddp.module)
    storage = [p.grad.data_ptr() for p in ddp.module.parameters()]
    finalize_model_grads([ddp], num_tokens=num_tokens, pg_collection=mesh)
    return {"before": before, "after": _grads(ddp.module), "bias": ddp.module.router.expert_bias.numpy().copy(),
            "num_tokens": None if num_tokens is None else int(num_tokens.item()),
            "in_place": storage == [p.grad.data_ptr() for p in ddp.module.parameters()]}


def _attempt(ddp: Any, mesh: Any, num_tokens: Any, chunks: Any = None) -> dict[str, Any]:
    """finalize on an input it must refuse (``chunks``, default ``[ddp]``; ``ddp.module``
    holds the gradients): the error and whether anything changed."""
    from torch_impl import finalize_model_grads

    before = _grads(ddp.module)
    tokens = None if num_tokens is None else num_tokens.clone()
    try:
        finalize_model_grads(chunks or [ddp], num_tokens=num_tokens, pg_collection=mesh)
        message = "no error"
    except (ValueError, RuntimeError) as err:
        message = f"{type(err).__name__}: {err}"
    after = _grads(ddp.module)
    same_tokens = tokens is None or torch.equal(tokens, num_tokens)
    return {"message": message, "unchanged": same_tokens and all(np.array_equal(before[k], after[k]) for k in before)}


def _refused(rank: int, mesh: Any) -> dict[str, Any]:
    """Inputs finalize cannot match, each refused on every rank with nothing changed."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    out = {}
    ddp = _ddp_block(mesh, True, False)  # per-token loss, DDP's default average
    out["average_per_token"] = _attempt(ddp, mesh, _backward(ddp, mesh, True))
    ddp = _ddp_block(mesh, True, rank != 2)  # the summing hook on every rank but 2
    out["average_on_rank2"] = _attempt(ddp, mesh, _backward(ddp, mesh, True))
    ddp = _ddp_block(mesh, False, False)
    with ddp.no_sync():  # the gradients are not reduced
        _backward(ddp, mesh, False)
    out["no_sync"] = _attempt(ddp, mesh, None)
    ddp = _ddp_block(mesh, False, False, group=mesh["tp"].get_group())  # DDP over the wrong ranks
    out["wrong_group"] = _attempt(ddp, mesh, _backward(ddp, mesh, False))
    ddp = _ddp_block(mesh, False, False)
    ddp.register_comm_hook(ddp.process_group, fp16_compress_hook)
    out["unknown_hook"] = _attempt(ddp, mesh, _backward(ddp, mesh, False))
    return out


def _dp4_step(model: Any, rank: int, mesh: Any) -> dict[str, Any]:
    """Two micro-batches (the first under ``no_sync()`` for a DDP), then finalize, counted."""
    from bench.counting import CollectiveCounter
    from torch_impl import finalize_model_grads

    model.zero_grad(set_to_none=True)
    tokens = _batch().reshape(B * S, H)[rank * S:(rank + 1) * S]
    ddp = hasattr(model, "no_sync")
    if ddp:
        with model.no_sync():
            model(tokens[:S // 2]).pow(2).sum().div(S).backward()
    else:
        model(tokens[:S // 2]).pow(2).sum().div(S).backward()
    model(tokens[S // 2:]).pow(2).sum().div(S).backward()  # the rank's mean, over 2 micro-batches
    inner = model.module if ddp else model
    before = _grads(inner)
    with CollectiveCounter() as counter:
        finalize_model_grads([model], pg_collection=mesh)
    return {"before": before, "after": _grads(inner), "data": counter.total}


def _run_dp4(rank: int) -> dict[str, Any]:
    """dp = 4, a mean loss: DDP's average is the DP sync; finalize launches one collective
    fewer than for the same model unwrapped and leaves DDP's gradients bit for bit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from meshgrad import FinalizeConfig

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    out = {}
    for name in ("plain", "ddp"):
        torch.manual_seed(4)
        model = torch.nn.Linear(H, 2, dtype=torch.float64)
        model.config = FinalizeConfig()
        if name == "ddp":
            model = DistributedDataParallel(model, process_group=mesh.get_group())
        _dp4_step(model, rank, mesh)  # the first call plans and compares the ranks
        out[name] = _dp4_step(model, rank, mesh)
    with model.no_sync():  # a third step whose every micro-batch ran under no_sync(): a new plan, refused
        model(_batch().reshape(B * S, H)[rank * S:(rank + 1) * S]).pow(2).sum().backward()
    out["no_sync_step"] = _attempt(model, mesh, None)
    return out


def _run_training_steps(rank: int) -> dict[str, Any]:
    """dp = 4, a per-token loss, five training steps each after ``zero_grad(set_to_none=True)``
    (torch's default): the plain model (finalize's DP sync) and torch DDP with its defaults
    (``ddp_sum_hook``; gradients not views of its buckets), so each step's gradients are new
    tensors. Per step: the finalized gradients, the model state's discovery and watch, the
    plans built, and how many of the last step's gradients ``zero_grad`` left alive."""
    import weakref

    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from meshgrad import FinalizeConfig
    from torch_impl import ddp_sum_hook, execution_stats, finalize_model_grads
    from torch_impl.call.model_state import ModelState

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    tokens = _batch().reshape(B * S, H)[rank * S:(rank + 1) * S]
    out = {}
    for name in ("plain", "ddp"):
        torch.manual_seed(4)
        inner = torch.nn.Linear(H, 2, dtype=torch.float64)
        inner.config = FinalizeConfig(calculate_per_token_loss=True)
        model = inner
        if name == "ddp":
            model = DistributedDataParallel(inner, process_group=mesh.get_group())
            model.register_comm_hook(model.process_group, ddp_sum_hook)
        steps, last = [], []
        for _ in range(5):
            model.zero_grad(set_to_none=True)
            alive = sum(ref() is not None for ref in last)
            model(tokens).pow(2).sum().backward()
            finalize_model_grads([model], num_tokens=torch.tensor([S]), pg_collection=mesh)
            (_, found, watch, _), = ModelState.existing([model]).found.values()
            steps.append({"grads": _grads(inner), "alive": alive, "watch": id(watch),
                          "specs": found.params, "plans": execution_stats([model]).plans_built})
            last = [weakref.ref(p.grad) for p in inner.parameters()]
        out[name] = steps
    return out


def _steady_steps(rank: int) -> dict[str, Any]:
    """dp = 4, a mean loss, torch DDP with gradients that stay the same tensors
    (``zero_grad(set_to_none=False)``) over a DeviceMesh: per step, whether the call went
    through the read stage, the gradients before and after and the error. Steps: three
    synced ones (the steady path from the second on); one whose forward ran under
    ``no_sync()`` (the wrapper's settings changed: refused on every rank, nothing changed);
    one synced (the settings as kept again); a call of another model over another layout of the same mesh (ep = 2);
    then two synced steps of the first model (the mesh's layout changed back: read again)."""
    import types

    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from meshgrad import FinalizeConfig
    from stage_counts import counted_reads
    from torch_impl import finalize_model_grads

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    tokens = _batch().reshape(B * S, H)[rank * S:(rank + 1) * S]
    torch.manual_seed(4)
    inner = torch.nn.Linear(H, 2, dtype=torch.float64)
    inner.config = FinalizeConfig()
    model = DistributedDataParallel(inner, process_group=mesh.get_group())
    other = torch.nn.Linear(H, 2, dtype=torch.float64)
    other.config = types.SimpleNamespace(expert_model_parallel_size=2, expert_tensor_parallel_size=1)
    steps: list[dict[str, Any]] = []

    def step(reads: list[int], synced: bool = True) -> None:
        model.zero_grad(set_to_none=False)
        if synced:
            model(tokens).pow(2).sum().div(S).backward()
        else:
            with model.no_sync():
                model(tokens).pow(2).sum().div(S).backward()
        grads = [p.grad for p in inner.parameters()]
        before, count = _grads(inner), len(reads)
        got = _attempt(model, mesh, None)
        steps.append({"read": len(reads) - count, "before": before, "after": _grads(inner), **got,
                      "same tensors": all(p.grad is g for p, g in zip(inner.parameters(), grads))})

    with counted_reads() as reads:
        for _ in range(3):
            step(reads)
        step(reads, synced=False)
        step(reads)
        other(tokens).sum().backward()
        finalize_model_grads([other], pg_collection=mesh)
        step(reads)
        step(reads)
    return {"steps": steps, "same tensors": steps[0]["same tensors"] and inner.weight.grad is not None}


def _reference_dp4() -> dict[str, np.ndarray]:
    torch.manual_seed(4)
    model = torch.nn.Linear(H, 2, dtype=torch.float64)
    model(_batch().reshape(B * S, H)).pow(2).mean(dim=0).sum().backward()
    return {n: p.grad.numpy().copy() for n, p in model.named_parameters()}


def _run_experts(rank: int) -> dict[str, Any]:
    """dp = 4, ep = 2, per-token loss: the dense layer plain (finalize syncs it over dp_cp),
    the expert layer (``allreduce=False``) under its own DDP over expt_dp with the summing
    hook; a mean loss's expert layer under DDP's average is refused (DDP divides by the
    expt_dp size, Megatron by dp_cp)."""
    import types

    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from meshgrad.axes import Group
    from torch_impl import ddp_sum_hook, finalize_model_grads, mesh_groups
    from torch_impl.run.groups import group_ranks

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    out: dict[str, Any] = {}
    for per_token in (True, False):
        torch.manual_seed(5)
        model = torch.nn.Sequential(torch.nn.Linear(H, H, dtype=torch.float64),
                                    torch.nn.Linear(H, H, dtype=torch.float64))
        plain = torch.nn.Sequential(torch.nn.Linear(H, H, dtype=torch.float64),
                                    torch.nn.Linear(H, H, dtype=torch.float64))
        plain.load_state_dict(model.state_dict())
        for p in model[1].parameters():
            p.allreduce = False  # Megatron's expert flag
        model.config = types.SimpleNamespace(expert_model_parallel_size=2, expert_tensor_parallel_size=1,
                                             calculate_per_token_loss=per_token)
        edp = mesh_groups(mesh).resolve(ep=2).group(Group.EDP)
        model[1] = DistributedDataParallel(model[1], process_group=edp)
        if per_token:
            model[1].register_comm_hook(edp, ddp_sum_hook)
        x = _batch().reshape(B * S, H)[rank * S:(rank + 1) * S]
        plain(x).pow(2).sum().backward()  # this rank's own gradients, unreduced
        model(x).pow(2).sum().backward()
        if per_token:
            finalize_model_grads([model], num_tokens=torch.tensor([S]), pg_collection=mesh)
            out["got"] = _grads(model)
            out["local"] = _grads(plain)
            out["edp"] = group_ranks(edp)
        else:
            out["refused"] = _attempt(types.SimpleNamespace(module=model), mesh, None, chunks=[model])
    return out


def _run_pp(rank: int) -> dict[str, Any]:
    """pp x dp = 2 x 2, per-token loss: DDP (summing hook) over dp on each stage; finalize
    sums the tied weight over the two stages and scales by the token count."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from meshgrad import FinalizeConfig
    from torch_impl import ddp_sum_hook, finalize_model_grads

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    inner = Stage(stage)
    inner.config = FinalizeConfig(calculate_per_token_loss=True)
    model = DistributedDataParallel(inner, process_group=mesh["dp"].get_group())
    model.register_comm_hook(model.process_group, ddp_sum_hook)
    peer = int(mesh.mesh[1 - stage, dp])
    x = tokens()[dp * B // 2:(dp + 1) * B // 2]
    if stage == 0:
        h = model(x)
        dist.send(h.detach().contiguous(), peer)
        grad = torch.empty_like(h)
        dist.recv(grad, peer)
        h.backward(grad)
    else:
        h = torch.empty(B // 2, S, H, dtype=torch.float64)
        dist.recv(h, peer)
        h.requires_grad_(True)
        model(h).pow(2).sum().backward()
        dist.send(h.grad.contiguous(), peer)
    finalize_model_grads([model], num_tokens=torch.tensor([B // 2 * S]), pg_collection=mesh)
    grads = _grads(inner)
    return {"stage": stage, "weight": grads["weight"], "proj": grads["proj.weight"]}


def case_world(rank: int, world: int) -> dict[str, Any]:
    """Every case on every rank, in one order (each catches its own expected errors)."""
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return {
        "dp_tp_per_token": _run_dp_tp(rank, mesh, True),
        "dp_tp_mean": _run_dp_tp(rank, mesh, False),
        "refused": _refused(rank, mesh),
        "dp4": _run_dp4(rank),
        "training_steps": _run_training_steps(rank),
        "steady_steps": _steady_steps(rank),
        "pp_tied": _run_pp(rank),
        "experts": _run_experts(rank),
    }


# =========================================================================== test side

_WORLD: list[Any] = []


def _results() -> list[dict[str, Any]]:
    if not _WORLD:
        _WORLD.append(case_values(run_cases(__name__, ["case_world"], WORLD, timeout=240), "case_world"))
    return _WORLD[0]


def _close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-13, err_msg=what)


@pytest.mark.parametrize("case", ["dp_tp_per_token", "dp_tp_mean"])
def test_ddp_dp_tp_matches_single_process(case: str) -> None:
    """torch DDP over dp x sequence parallel over tp: every gradient equals the
    single-process one: DDP's reduction is not repeated, the sequence-parallel parameters
    are summed over tp, num_tokens scales."""
    want = _reference_block()
    for rank, result in enumerate(_results()):
        got = result[case]
        for name, value in want.items():
            _close(got["after"][name], value, f"rank {rank} {case} {name}")
        assert got["in_place"], rank  # DDP's gradient storage (its buckets' views) kept
        if case == "dp_tp_per_token":
            assert got["num_tokens"] == B * S
            # Before finalize the DDP-reduced gradient summed over tp was the token SUM: reduced once.
            tp_peer = _results()[rank ^ 1][case]["before"]["up.weight"]
            _close((got["before"]["up.weight"] + tp_peer) / (B * S), want["up.weight"], "up.weight before")


def test_ddp_router_expert_bias_summed_over_tp_dp() -> None:
    counts = sum(np.array([r, 2.0, 3.0 * r, 1.0]) for r in range(WORLD))
    want = (RATE * np.sign(counts.mean() - counts)).astype(np.float32)
    for rank, result in enumerate(_results()):
        for case in ("dp_tp_per_token", "dp_tp_mean"):
            np.testing.assert_array_equal(result[case]["bias"], want, err_msg=f"rank {rank} {case}")


def test_ddp_mean_loss_no_second_dp_all_reduce() -> None:
    """dp = 4: with DDP finalize launches one collective fewer than for the plain model (its
    DP sync's all-reduce) and leaves DDP's gradients bit for bit; both equal the
    single-process gradient, also after a no_sync() micro-batch."""
    want = _reference_dp4()
    for rank, result in enumerate(_results()):
        plain, ddp = result["dp4"]["plain"], result["dp4"]["ddp"]
        assert ddp["data"] == plain["data"] - 1, (rank, ddp["data"], plain["data"])
        for name, value in want.items():
            np.testing.assert_array_equal(ddp["after"][name], ddp["before"][name], err_msg=f"rank {rank} {name}")
            _close(ddp["after"][name], value, f"rank {rank} ddp {name}")
            _close(plain["after"][name], value, f"rank {rank} plain {name}")


def test_training_steps_keep_the_plan_and_hold_no_gradient() -> None:
    """Five training steps whose gradients are new tensors each step (plain model and torch
    DDP, ``zero_grad(set_to_none=True)``): every step's gradients equal the single-process
    ones; one discovery watch and one plan serve every step (the new gradients are checked
    and bound anew, not re-discovered); from the third step on, the last step's gradients
    are freed by ``zero_grad`` (renewed twice running, they are no longer held)."""
    want = _reference_dp4()
    for rank, result in enumerate(_results()):
        for name, steps in result["training_steps"].items():
            for index, got in enumerate(steps):
                for param, value in want.items():
                    _close(got["grads"][param], value, f"rank {rank} {name} step {index} {param}")
            assert len({got["watch"] for got in steps}) == 1, (rank, name)
            assert all(got["specs"] == steps[0]["specs"] for got in steps), (rank, name)
            assert [got["plans"] for got in steps] == [1] * 5, (rank, name)
            assert [got["alive"] for got in steps] == [0, 2, 2, 0, 0], (rank, name)


def test_steady_calls_see_a_no_sync_step_and_a_layout_switch() -> None:
    """torch DDP over a DeviceMesh, gradients kept in place: from the second step on a call
    takes the steady path (no read stage) with DDP's gradients left bit for bit, equal to the
    single-process ones; a step whose forward ran under ``no_sync()`` is read again and
    refused on every rank with nothing changed (the step after it, synced again, is steady);
    after another model's call over another layout of the mesh, the next call reads again
    (its layout's round)."""
    want = _reference_dp4()
    for rank, result in enumerate(_results()):
        steps = result["steady_steps"]["steps"]
        assert [s["read"] for s in steps] == [1, 0, 0, 1, 0, 1, 0], rank
        assert all(s["same tensors"] for s in steps), rank
        refused = steps[3]
        assert "no_sync()" in refused["message"] and f"rank {rank}" in refused["message"], refused["message"]
        assert refused["unchanged"], rank
        for index in (0, 1, 2, 4, 5, 6):
            got = steps[index]
            assert got["message"] == "no error", (rank, index, got["message"])
            for name, value in want.items():
                np.testing.assert_array_equal(got["after"][name], got["before"][name], err_msg=f"rank {rank} {name}")
                _close(got["after"][name], value, f"rank {rank} step {index} {name}")


def test_ddp_pipeline_tied_embedding_summed_across_stages() -> None:
    want = reference_pp()
    for rank, result in enumerate(_results()):
        got = result["pp_tied"]
        _close(got["weight"], want["weight"], f"rank {rank} tied weight")
        _close(got["proj"], want[f"proj{got['stage']}"], f"rank {rank} proj")


def test_ddp_no_sync_step_after_synced_steps_refused() -> None:
    """A step under no_sync() after two synced ones: the cached plan is not reused."""
    for rank, result in enumerate(_results()):
        got = result["dp4"]["no_sync_step"]
        assert got["message"].startswith(f"FinalizeInputError: rank {rank}:"), got["message"]
        assert "did not reduce" in got["message"] and "'weight'" in got["message"], got["message"]
        assert got["unchanged"], rank


@pytest.mark.parametrize(
    "case, needles",
    [
        ("average_per_token", ("divided the summed gradient by 2", "over ranks", "dp_cp group",
                               "torch_impl.ddp_sum_hook", "register_comm_hook")),
        ("no_sync", ("did not reduce", "no_sync()")),
        ("wrong_group", ("DDP reduced the gradient over ranks", "dp_cp group is ranks", "process_group")),
        ("unknown_hook", ("comm hook fp16_compress_hook", "cannot verify", "torch_impl.ddp_sum_hook")),
    ],
)
def test_ddp_refusals_on_every_rank_unchanged(case: str, needles: tuple[str, ...]) -> None:
    for rank, result in enumerate(_results()):
        got = result["refused"][case]
        message = got["message"]
        assert message.startswith(f"FinalizeInputError: rank {rank}: chunk 0 torch DistributedDataParallel "
                                  "'<the chunk>'"), message
        for needle in needles:
            assert needle in message, (needle, message)
        if case != "unknown_hook":
            assert "parameter '" in message, message
        assert got["unchanged"], rank


def test_ddp_group_ranks_in_refusals() -> None:
    dp_cp = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}
    tp = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
    for rank, result in enumerate(_results()):
        assert f"over ranks {dp_cp[rank]}" in result["refused"]["average_per_token"]["message"]
        wrong = result["refused"]["wrong_group"]["message"]
        assert f"over ranks {tp[rank]}" in wrong and f"dp_cp group is ranks {dp_cp[rank]}" in wrong, wrong


def test_ddp_mismatch_on_one_rank_raises_on_every_rank() -> None:
    """Per-token loss with the summing hook on every rank but rank 2: rank 2 raises its
    own error, every other rank a ConsistencyError naming rank 2; nothing changed."""
    for rank, result in enumerate(_results()):
        got = result["refused"]["average_on_rank2"]
        if rank == 2:
            assert got["message"].startswith("FinalizeInputError: rank 2:"), got["message"]
            assert "torch_impl.ddp_sum_hook" in got["message"], got["message"]
        else:
            assert got["message"].startswith("ConsistencyError") and "rank 2" in got["message"], got["message"]
        assert got["unchanged"], rank


def test_ddp_experts_over_expt_dp_follow_megatrons_rule() -> None:
    """Per-token loss: the dense layer summed over dp_cp by finalize, the expert layer over
    expt_dp by its DDP (not again), both scaled by the global token count; a mean loss's
    expert DDP (an average over expt_dp) is refused with the fix."""
    results = _results()
    for rank, result in enumerate(results):
        got = result["experts"]
        assert got["edp"] == [rank % 2, rank % 2 + 2], got["edp"]
        for name, value in got["got"].items():
            expert = name.startswith("1.")
            members = got["edp"] if expert else range(WORLD)
            total = sum(results[r]["experts"]["local"][name.replace(".module.", ".")] for r in members)
            _close(value, total / (WORLD * S), f"rank {rank} {name}")
        message = got["refused"]["message"]
        assert message.startswith(f"FinalizeInputError: rank {rank}: chunk 0 torch DistributedDataParallel '1'"), message
        assert "divided the summed gradient by 2" in message and "divides it by 4" in message, message
        assert "expt_dp group" in message and "_set_params_and_buffers_to_ignore_for_model" in message, message
        assert got["refused"]["unchanged"], rank
