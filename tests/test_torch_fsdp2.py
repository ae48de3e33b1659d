"""torch's own parallelism: models under ``fully_shard`` (FSDP2) with tensor-parallel DTensor
parameters (``parallelize_module``) and pipeline stages, on DeviceMeshes with torchtitan's
dim names, finalized by ``torch_impl.finalize_model_grads``, in ONE gloo world of 4 ranks.

Every finalized gradient is compared with the same model run in one process on the whole
batch (float64, so a gradient reduced twice -- x2 under a per-token sum -- shows). FSDP2
has already reduced its gradients over the data-parallel ranks and DTensor's autograd
the tensor-parallel layernorms: finalize does what they do not (a sequence-parallel
layernorm kept out of TP, the tied embedding across pp stages, router expert bias, the
per-token scale) and refuses, on every rank and before anything changes, what it cannot
match (an FSDP2 divide factor that is not the DP sync's, an FSDP2 mesh that is not the
dp_cp group, a mesh whose dim names it cannot map).
"""

from __future__ import annotations

import os
import types
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from parity_tests.world_cases import case_values, run_cases  # noqa: E402
from pp_stage import B, H, S, V, Stage, reference_pp, tokens  # noqa: E402  (batch, sequence, hidden, vocab)

WORLD = 4
RATE = 0.25


# =========================================================================== worker side


class _Block(torch.nn.Module):
    """norm (DTensor sequence parallel) -> up (colwise) -> down (rowwise) -> norm2 (DTensor
    sequence parallel) -> a local layernorm and head on this rank's sequence shard (plain
    parameters: their gradients are partial over tp, flagged ``sequence_parallel``) and a
    router holding expert-bias state."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(H, dtype=torch.float64)
        self.up = torch.nn.Linear(H, 2 * H, bias=False, dtype=torch.float64)
        self.down = torch.nn.Linear(2 * H, H, bias=False, dtype=torch.float64)
        self.norm2 = torch.nn.LayerNorm(H, dtype=torch.float64)
        self.local_norm = torch.nn.LayerNorm(H, dtype=torch.float64)
        self.head = torch.nn.Linear(H, H, dtype=torch.float64)
        self.router = _Router()

    def body(self, x: Any) -> Any:
        return self.norm2(self.down(torch.relu(self.up(self.norm(x)))))

    def forward(self, x: Any) -> Any:
        h = self.body(x)
        h = h.to_local() if hasattr(h, "to_local") else h
        return self.head(self.local_norm(h))


class _Router(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("expert_bias", torch.zeros(4))
        self.register_buffer("local_tokens_per_expert", torch.zeros(4))


def _init(model: torch.nn.Module) -> None:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, dtype=p.dtype) * 0.5 + (1.0 if p.dim() == 1 else 0.0))


def _batch() -> Any:
    torch.manual_seed(1)
    return torch.randn(B, S, H, dtype=torch.float64)


def _reference_grads(per_token: bool) -> dict[str, np.ndarray]:
    """The single-process gradients of the mean over all B*S tokens of ``out**2``."""
    model = _Block()
    _init(model)
    out = model(_batch())
    out.pow(2).sum().div(B * S).backward()
    return {n: p.grad.numpy().copy() for n, p in model.named_parameters()}


def _tp_sp_model(mesh: Any, per_token: bool, divide: float | None) -> Any:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    from meshgrad import FinalizeConfig

    model = _Block()
    _init(model)
    parallelize_module(model, mesh["tp"], {
        "norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)), "norm2": SequenceParallel(),
    })
    fully_shard(model, mesh=mesh["dp_shard"])
    # Megatron's flag, set after fully_shard (which replaces the parameters); the DTensor
    # layernorms' gradients are already whole over tp, the plain ones are partial.
    for norm in (model.norm, model.norm2, model.local_norm, model.head):
        for p in norm.parameters():
            p.sequence_parallel = True
    if divide is not None:
        model.set_gradient_divide_factor(divide)
    model.config = FinalizeConfig(sequence_parallel=True, calculate_per_token_loss=per_token,
                                  moe_router_enable_expert_bias=True, moe_router_bias_update_rate=RATE)
    return model


def _full_grads(model: Any) -> dict[str, np.ndarray]:
    """Every parameter's gradient made whole (collective over the DTensor meshes)."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().numpy().copy()
    return out


def _run_tp_sp(rank: int, mesh: Any, per_token: bool, divide: float | None) -> dict[str, Any]:
    """dp_shard x tp = 2 x 2: this rank's batch half and sequence half, finalized."""
    from torch_impl import finalize_model_grads

    model = _tp_sp_model(mesh, per_token, divide)
    dp, tp = mesh["dp_shard"].get_local_rank(), mesh["tp"].get_local_rank()
    x = _batch()[dp * B // 2:(dp + 1) * B // 2, tp * S // 2:(tp + 1) * S // 2]
    out = model(x)
    if per_token:  # sum of this rank's token losses; num_tokens: its dp shard's tokens (full sequence)
        out.pow(2).sum().backward()
        num_tokens = torch.tensor([B // 2 * S])
    else:  # this rank's share of its dp shard's mean (tp ranks hold disjoint tokens)
        out.pow(2).sum().div(B // 2 * S).backward()
        num_tokens = None
    router = model.router
    router.local_tokens_per_expert.copy_(torch.tensor([rank, 2.0, 3.0 * rank, 1.0]))
    before = _full_grads(model)
    finalize_model_grads([model], num_tokens=num_tokens, pg_collection=mesh)
    from torch_impl.call.model_state import ModelState

    return {"before": before, "after": _full_grads(model), "bias": router.expert_bias.numpy().copy(),
            "num_tokens": None if num_tokens is None else int(num_tokens.item()),
            "kept for the steady path": bool(ModelState.of([model]).steady)}


def _local_shards(rank: int, mesh: Any) -> dict[str, Any]:
    """The run stage's read of DTensor gradients' local shards (``local_shard_grads``)
    against each gradient's own ``to_local()``, and the inputs it leaves to GradAccess."""
    from torch_impl.run.grads import local_shard_grads

    model = _tp_sp_model(mesh, True, 1.0)
    dp, tp = mesh["dp_shard"].get_local_rank(), mesh["tp"].get_local_rank()
    model(_batch()[dp * B // 2:(dp + 1) * B // 2, tp * S // 2:(tp + 1) * S // 2]).pow(2).sum().backward()
    params = list(model.parameters())
    with torch.no_grad():
        shards = local_shard_grads(params)
        same = shards is not None and all(s is p.grad.to_local() for s, p in zip(shards, params))
        params[0].main_grad = params[0].grad
        with_main_grad = local_shard_grads(params)
        del params[0].main_grad
        grad, params[1].grad = params[1].grad, None
        without_a_grad = local_shard_grads(params)
        params[1].grad = grad
    return {"same objects": same, "shards": len(shards or ()), "params": len(params),
            "declined": [with_main_grad is None, without_a_grad is None, local_shard_grads(params) is None]}


def _training_steps(rank: int, mesh: Any) -> dict[str, Any]:
    """Steps as a training loop runs them: ``zero_grad(set_to_none=True)`` (torch's default),
    forward, backward (FSDP2 makes every gradient anew), finalize. Each step's gradients and
    the discovery and watch the model state keeps; whether the last step's gradients are
    gone after the next ``zero_grad``; then a step whose ``up.weight`` gradient is a new
    DTensor of an equal but new spec (a new gradient FSDP2 did not make), and two steps of
    FSDP2's own gradients again; the calls (by number) that went through the read stage. Then a
    step after ``set_gradient_divide_factor(2)`` (FSDP2 averages where the per-token loss
    needs a sum: refused) and one after the factor is set back."""
    import gc
    import weakref

    from torch.distributed.tensor import DTensor

    from stage_counts import counted_reads
    from torch_impl import finalize_model_grads
    from torch_impl.call.model_state import ModelState

    model = _tp_sp_model(mesh, True, 1.0)
    dp, tp = mesh["dp_shard"].get_local_rank(), mesh["tp"].get_local_rank()
    x = _batch()[dp * B // 2:(dp + 1) * B // 2, tp * S // 2:(tp + 1) * S // 2]
    steps, kept, reads = [], [], []
    calls = [0]  # finalize calls made

    def finalize() -> None:
        calls[0] += 1
        count = len(seen)
        try:
            finalize_model_grads([model], num_tokens=torch.tensor([B // 2 * S]), pg_collection=mesh)
        finally:
            if len(seen) > count:
                reads.append(calls[0])  # this call went through the read stage

    def step(respec: bool = False) -> None:
        model.zero_grad(set_to_none=True)
        model(x).pow(2).sum().backward()
        if respec:
            g = model.up.weight.grad
            model.up.weight.grad = DTensor.from_local(g.to_local().clone(), g.device_mesh, g.placements,
                                                      shape=g.shape, stride=g.stride())
        model.router.local_tokens_per_expert.copy_(torch.tensor([rank, 2.0, 3.0 * rank, 1.0]))
        finalize()
        steps.append(_full_grads(model))
        ((_, found, watch, _),) = ModelState.of([model]).found.values()
        kept.append((found, watch))

    with counted_reads() as seen:
        for _ in range(3):
            step()
        last = [weakref.ref(p.grad) for p in model.parameters()]
        step(respec=True)
        gc.collect()
        freed = [ref() is None for ref in last]
        step()  # FSDP2's own spec again: read again
        step()
        bias = model.router.expert_bias.numpy().copy()
        model.set_gradient_divide_factor(2.0)
        model.zero_grad(set_to_none=True)
        model(x).pow(2).sum().backward()
        before = _full_grads(model)
        try:
            finalize()
            refused = "no error"
        except ValueError as err:
            refused = str(err)
        after = _full_grads(model)
        unchanged = all(np.array_equal(before[k], after[k]) for k in before) and np.array_equal(
            bias, model.router.expert_bias.numpy())
        model.set_gradient_divide_factor(1.0)
        step()
        step()
    return {
        "steps": steps, "bias": bias, "reads": reads, "refused": refused, "refused unchanged": unchanged,
        "kept": [found is kept[0][0] and watch is kept[0][1] for found, watch in kept],
        "read again": [kept[i][0] is not kept[i - 1][0] for i in range(1, len(kept))],
        "last step's gradients freed": freed,
    }


def _sharded_watch(rank: int, mesh: Any) -> dict[str, bool]:
    """``GradWatch.same()`` over an FSDP2 model's parameters, after each change of one
    DTensor gradient (then put back): the answers, in order."""
    from torch.distributed.tensor import DTensor

    from torch_impl.call.watches import GradWatch

    model = _tp_sp_model(mesh, True, 1.0)
    dp, tp = mesh["dp_shard"].get_local_rank(), mesh["tp"].get_local_rank()
    x = _batch()[dp * B // 2:(dp + 1) * B // 2, tp * S // 2:(tp + 1) * S // 2]
    model(x).pow(2).sum().backward()
    watch = GradWatch(model.parameters())
    param = model.up.weight
    out = {"unchanged": watch.same()}
    model.zero_grad(set_to_none=True)
    model(x).pow(2).sum().backward()
    out["new gradients of FSDP2's backward"] = watch.same()
    grad = param.grad
    local = grad._local_tensor

    def changed(what: str, value: Any) -> None:
        param.grad = value
        out[what] = watch.same()
        param.grad = grad
        out[f"{what}, put back"] = watch.same()

    changed("gradient gone", None)
    changed("a plain tensor", torch.zeros(grad.shape, dtype=local.dtype))
    changed("a DTensor of a new spec", DTensor.from_local(local.clone(), grad.device_mesh, grad.placements,
                                                          shape=grad.shape, stride=grad.stride()))
    for what, shard in (("local shard of another shape", local[:1]),
                        ("local shard of another dtype", local.to(torch.float32)),
                        ("local shard on the meta device", local.to("meta"))):
        grad._local_tensor = shard
        out[what] = watch.same()
        grad._local_tensor = local
    with torch.inference_mode():
        frozen = local.clone()
    grad._local_tensor = frozen
    out["an inference shard"] = watch.same()
    grad._local_tensor = local
    out["all put back"] = watch.same()
    return out


def _refused_divide(rank: int, mesh: Any, only_rank: int | None = None) -> dict[str, Any]:
    """Per-token loss with FSDP2's default (averaging) reduction (on ``only_rank`` alone, or
    on every rank): refused on every rank, nothing changed."""
    from torch_impl import finalize_model_grads

    model = _tp_sp_model(mesh, True, None if only_rank in (None, rank) else 1.0)
    dp, tp = mesh["dp_shard"].get_local_rank(), mesh["tp"].get_local_rank()
    model(_batch()[dp * B // 2:(dp + 1) * B // 2, tp * S // 2:(tp + 1) * S // 2]).pow(2).sum().backward()
    before = _full_grads(model)
    try:
        finalize_model_grads([model], num_tokens=torch.tensor([B // 2 * S]), pg_collection=mesh)
        message = "no error"
    except (ValueError, RuntimeError) as err:
        message = f"{type(err).__name__}: {err}"
    after = _full_grads(model)
    return {"message": message, "unchanged": all(np.array_equal(before[k], after[k]) for k in before)}


def _run_pp(rank: int) -> dict[str, Any]:
    """pp x dp_shard = 2 x 2 (torchtitan names): stage 0 sends activations to stage 1 and
    receives their gradient back; finalize sums the tied weight over the two stages."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from meshgrad import FinalizeConfig
    from torch_impl import finalize_model_grads

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard"))
    stage, dp = mesh["pp"].get_local_rank(), mesh["dp_shard"].get_local_rank()
    model = Stage(stage)
    fully_shard(model, mesh=mesh["dp_shard"])
    model.set_gradient_divide_factor(1.0)
    model.config = FinalizeConfig(calculate_per_token_loss=True)
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
    num_tokens = torch.tensor([B // 2 * S])
    finalize_model_grads([model], num_tokens=num_tokens, pg_collection=mesh)
    grads = _full_grads(model)
    return {"stage": stage, "weight": grads["weight"], "proj": grads["proj.weight"]}


def _run_hsdp(rank: int) -> dict[str, Any]:
    """dp_replicate x dp_shard = 2 x 2 (HSDP): torchtitan's data-parallel dims are meshgrad's
    dp; FSDP2 reduced over all four ranks, so finalize only scales by the token count."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from meshgrad import FinalizeConfig
    from torch_impl import finalize_model_grads, mesh_groups

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    torch.manual_seed(4)
    model = torch.nn.Linear(H, 2, dtype=torch.float64)
    fully_shard(model, mesh=mesh)
    model.set_gradient_divide_factor(1.0)
    model.config = FinalizeConfig(calculate_per_token_loss=True)
    x = _batch().reshape(B * S, H)[rank * S:(rank + 1) * S]
    model(x).pow(2).sum().backward()
    finalize_model_grads([model], num_tokens=torch.tensor([S]), pg_collection=mesh)
    from meshgrad.axes import Group
    from torch_impl.run.groups import group_ranks

    groups = mesh_groups(mesh).resolve()
    flat = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard_cp", "tp"))  # cp folded into dp
    return {"grads": _full_grads(model), "dp_cp": group_ranks(groups.group(Group.DP_CP)),
            "dims": mesh_groups(mesh).grid.shape, "flat": mesh_groups(flat).grid.tolist()}


def _reference_hsdp() -> dict[str, np.ndarray]:
    torch.manual_seed(4)
    model = torch.nn.Linear(H, 2, dtype=torch.float64)
    model(_batch().reshape(B * S, H)).pow(2).sum().div(B * S).backward()
    return {n: p.grad.numpy().copy() for n, p in model.named_parameters()}


def _run_cp_flattened(rank: int) -> dict[str, Any]:
    """dp_shard x cp = 2 x 2, FSDP2 over torchtitan's flattened ``dp_shard_cp``: that is
    finalize's dp_cp group, so a mean loss's gradient is FSDP2's average as it is."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from meshgrad import FinalizeConfig
    from torch_impl import finalize_model_grads

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "cp"))
    shard_cp = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    torch.manual_seed(4)
    model = torch.nn.Linear(H, 2, dtype=torch.float64)
    fully_shard(model, mesh=shard_cp)
    model.config = FinalizeConfig()
    x = _batch().reshape(B * S, H)[rank * S:(rank + 1) * S]
    model(x).pow(2).mean().backward()
    finalize_model_grads([model], pg_collection=mesh)
    return _full_grads(model)


def _run_experts(rank: int) -> dict[str, Any]:
    """torchtitan's EP mesh (dp_shard_mod_ep x dp_shard_in_ep = 2 x 2, ep = 2): the dense
    layer sharded over both dims, the expert layer (``allreduce=False``) over
    dp_shard_mod_ep (finalize's expt_dp) with torchtitan's divide factor (the dp size):
    Megatron's rule, the sum over expt_dp divided by dp_cp."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from torch_impl import finalize_model_grads

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard_mod_ep", "dp_shard_in_ep"))
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(H, H, dtype=torch.float64), torch.nn.Linear(H, H, dtype=torch.float64))
    plain = torch.nn.Sequential(torch.nn.Linear(H, H, dtype=torch.float64), torch.nn.Linear(H, H, dtype=torch.float64))
    plain.load_state_dict(model.state_dict())
    x = _batch().reshape(B * S, H)[rank * S:(rank + 1) * S]
    plain(x).pow(2).mean().backward()  # this rank's own gradients, unreduced
    fully_shard(model[1], mesh=mesh["dp_shard_mod_ep"])
    model[1].set_gradient_divide_factor(WORLD)
    fully_shard(model, mesh=mesh["dp_shard_mod_ep", "dp_shard_in_ep"]._flatten("dp_shard_all"))
    for p in model[1].parameters():
        p.allreduce = False  # Megatron's expert flag, set after fully_shard replaced the parameters
    model(x).pow(2).mean().backward()
    model.config = types.SimpleNamespace(expert_model_parallel_size=2, expert_tensor_parallel_size=1)
    finalize_model_grads([model], pg_collection=mesh)
    return {"got": _full_grads(model), "local": {n: p.grad.numpy().copy() for n, p in plain.named_parameters()}}


def _refused_meshes(rank: int) -> list[str]:
    """Meshes whose dim names finalize cannot map, and an FSDP2 mesh that is not dp_cp."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from meshgrad import FinalizeConfig
    from torch_impl import finalize_model_grads

    out = []
    for names in (("dp_shard_cp", "cp"), ("dp_replicate", "ep"), ("dp", "dp_shard")):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
        model = torch.nn.Linear(2, 2)
        model.config = FinalizeConfig()
        model(torch.ones(1, 2)).sum().backward()
        try:
            finalize_model_grads([model], pg_collection=mesh)
            out.append("no error")
        except ValueError as err:
            out.append(str(err))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    model = torch.nn.Linear(2, 2, dtype=torch.float64)
    fully_shard(model, mesh=mesh["tp"])  # sharded over the wrong dim
    model.config = FinalizeConfig()
    model(torch.ones(1, 2, dtype=torch.float64)).sum().backward()
    try:
        finalize_model_grads([model], pg_collection=mesh)
        out.append("no error")
    except ValueError as err:
        out.append(str(err))
    return out


def case_world(rank: int, world: int) -> dict[str, Any]:
    """Every case on every rank, in one order (each catches its own expected errors)."""
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    return {
        "tp_sp_per_token": _run_tp_sp(rank, mesh, True, 1.0),
        "tp_sp_mean": _run_tp_sp(rank, mesh, False, None),
        "local_shards": _local_shards(rank, mesh),
        "training_steps": _training_steps(rank, mesh),
        "sharded_watch": _sharded_watch(rank, mesh),
        "refused_divide": _refused_divide(rank, mesh),
        "refused_divide_rank2": _refused_divide(rank, mesh, only_rank=2),
        "pp_tied": _run_pp(rank),
        "hsdp": _run_hsdp(rank),
        "cp_flattened": _run_cp_flattened(rank),
        "experts": _run_experts(rank),
        "refused_meshes": _refused_meshes(rank),
    }


# =========================================================================== test side

_WORLD: list[Any] = []


def _results() -> list[dict[str, Any]]:
    if not _WORLD:
        _WORLD.append(case_values(run_cases(__name__, ["case_world"], WORLD, timeout=240), "case_world"))
    return _WORLD[0]


def _close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-13, err_msg=what)


@pytest.mark.parametrize("case", ["tp_sp_per_token", "tp_sp_mean"])
def test_fsdp2_tp_sp_matches_single_process(case: str) -> None:
    """FSDP2 (dp_shard) x TP (DTensor, sequence parallel): every gradient equals the
    single-process one: FSDP2's reduction and DTensor's layernorm sums are not repeated, the
    plain sequence-parallel layernorm and head are summed over tp, num_tokens scales."""
    want = _reference_grads(case == "tp_sp_per_token")
    for rank, result in enumerate(_results()):
        got = result[case]
        for name, value in want.items():
            _close(got["after"][name], value, f"rank {rank} {case} {name}")
        assert got["kept for the steady path"]  # an FSDP2 model over a mesh: its next call may take it
        if case == "tp_sp_per_token":
            assert got["num_tokens"] == B * S
            # Before finalize the FSDP-reduced gradient was the token SUM: reduced once only.
            _close(got["before"]["up.weight"] / (B * S), want["up.weight"], "up.weight before")


def test_fsdp2_router_expert_bias_summed_over_tp_dp() -> None:
    counts = sum(np.array([r, 2.0, 3.0 * r, 1.0]) for r in range(WORLD))
    want = (RATE * np.sign(counts.mean() - counts)).astype(np.float32)
    for rank, result in enumerate(_results()):
        for case in ("tp_sp_per_token", "tp_sp_mean"):
            np.testing.assert_array_equal(result[case]["bias"], want, err_msg=f"rank {rank} {case}")


def test_local_shard_grads_are_each_gradients_own_shard() -> None:
    """Every gradient's local shard itself, in order; declined (GradAccess reads them) for a
    parameter with ``main_grad``, a missing gradient, and with grad mode on."""
    for rank, result in enumerate(_results()):
        assert result["local_shards"] == {"same objects": True, "shards": result["local_shards"]["params"],
                                          "params": result["local_shards"]["params"],
                                          "declined": [True, True, True]}, rank
        assert result["local_shards"]["params"] > 4


def test_fsdp2_training_steps_keep_the_plan_and_hold_no_gradient() -> None:
    """Steps after ``zero_grad(set_to_none=True)``: FSDP2's new gradients (the same spec
    object, dtype, device, local shapes) keep the discovery and its watch, and every step's
    gradients equal the single-process ones; the watch holds none of them (the last step's
    are freed by the next ``zero_grad``); a new DTensor of a new spec object is seen (the
    discovery is read again, and again when FSDP2's own spec is back) and scaled as the
    others. Steps whose model is unchanged take the steady path (no read stage); a step
    after ``set_gradient_divide_factor(2)`` is read again and refused on every rank with
    nothing changed, and the steps after the factor is set back are steady again."""
    want = _reference_grads(True)
    counts = sum(np.array([r, 2.0, 3.0 * r, 1.0]) for r in range(WORLD))
    for rank, result in enumerate(_results()):
        got = result["training_steps"]
        for index, grads in enumerate(got["steps"]):
            for name, value in want.items():
                _close(grads[name], value, f"rank {rank} step {index} {name}")
        assert got["kept"] == [True, True, True, False, False, False, False, False], rank
        assert got["read again"] == [False, False, True, True, False, False, False], rank
        # Calls 2-3 and 6 took the steady path; 7 (the factor changed) read again, 8 (the
        # factor back) was steady again.
        assert got["reads"] == [1, 4, 5, 7], rank
        assert f"rank {rank}" in got["refused"] and "set_gradient_divide_factor(1)" in got["refused"], got["refused"]
        assert got["refused unchanged"], rank
        assert all(got["last step's gradients freed"]), rank
        np.testing.assert_array_equal(got["bias"], (6 * RATE * np.sign(counts.mean() - counts)).astype(np.float32))


def test_a_dtensor_gradient_is_watched_by_its_facts() -> None:
    """FSDP2's new gradients read as unchanged; a gradient gone, a plain one, a DTensor of
    another spec object, a local shard of another shape, dtype or device, or an inference
    shard, read as changed (and unchanged once put back). The first answer arms the
    shards' compiled guard, so the later ones go through it first."""
    want = {"unchanged": True, "new gradients of FSDP2's backward": True}
    for what in ("gradient gone", "a plain tensor", "a DTensor of a new spec"):
        want |= {what: False, f"{what}, put back": True}
    want |= {"local shard of another shape": False, "local shard of another dtype": False,
             "local shard on the meta device": False, "an inference shard": False, "all put back": True}
    for rank, result in enumerate(_results()):
        assert result["sharded_watch"] == want, rank


def test_fsdp2_divide_factor_mismatch_refused_on_every_rank_unchanged() -> None:
    for rank, result in enumerate(_results()):
        got = result["refused_divide"]
        assert f"rank {rank}" in got["message"] and "set_gradient_divide_factor(1)" in got["message"], got["message"]
        assert "divided the summed gradient by 2" in got["message"]
        assert got["unchanged"]


def test_fsdp2_divide_factor_mismatch_on_one_rank_raises_on_every_rank() -> None:
    for rank, result in enumerate(_results()):
        got = result["refused_divide_rank2"]
        if rank == 2:
            assert got["message"].startswith("FinalizeInputError: rank 2:"), got["message"]
            assert "set_gradient_divide_factor(1)" in got["message"], got["message"]
        else:
            assert got["message"].startswith("ConsistencyError") and "rank 2" in got["message"], got["message"]
        assert got["unchanged"], rank


def test_fsdp2_pipeline_tied_embedding_summed_across_stages() -> None:
    want = reference_pp()
    for rank, result in enumerate(_results()):
        got = result["pp_tied"]
        _close(got["weight"], want["weight"], f"rank {rank} tied weight")
        _close(got["proj"], want[f"proj{got['stage']}"], f"rank {rank} proj")


def test_torchtitan_hsdp_mesh_read_without_renaming() -> None:
    want = _reference_hsdp()
    for rank, result in enumerate(_results()):
        got = result["hsdp"]
        assert got["dp_cp"] == [0, 1, 2, 3] and tuple(got["dims"]) == (1, 4, 1, 1, 1)
        assert got["flat"] == [[[[[0, 1]]], [[[2, 3]]]]]  # (pp, dp, cp, gtp, tp) = (1, 2, 1, 1, 2)
        for name, value in want.items():
            _close(got["grads"][name], value, f"rank {rank} {name}")


def test_fsdp2_over_flattened_dp_shard_cp_is_the_dp_cp_group() -> None:
    torch.manual_seed(4)
    model = torch.nn.Linear(H, 2, dtype=torch.float64)
    model(_batch().reshape(B * S, H)).pow(2).mean().backward()  # the mean over every rank's tokens
    for rank, result in enumerate(_results()):
        for name, param in model.named_parameters():
            _close(result["cp_flattened"][name], param.grad.numpy(), f"rank {rank} {name}")


def test_fsdp2_experts_on_torchtitan_ep_mesh_follow_megatrons_rule() -> None:
    results = _results()
    edp = {0: (0, 2), 1: (1, 3), 2: (0, 2), 3: (1, 3)}
    for rank, result in enumerate(results):
        for name, got in result["experts"]["got"].items():
            members = range(WORLD) if name.startswith("0.") else edp[rank]
            total = sum(results[r]["experts"]["local"][name] for r in members)
            want = total / len(members) if name.startswith("0.") else total / WORLD
            _close(got, want, f"rank {rank} {name}")


def test_unmappable_meshes_refused_with_the_mapping() -> None:
    for rank, result in enumerate(_results()):
        shard_cp, ep, mixed, wrong_fsdp = result["refused_meshes"]
        for message, bad in ((shard_cp, "'dp_shard_cp' and 'cp' overlap"), (ep, "'ep' is an expert dim"),
                             (mixed, "'dp' and 'dp_shard' overlap")):
            assert f"rank {rank}" in message and bad in message, message
            assert "dp_replicate x dp_shard" in message and "-> dp" in message, message
        assert f"rank {rank}" in wrong_fsdp and "FSDP2 reduced the gradient over ranks" in wrong_fsdp, wrong_fsdp
        assert "mesh dims ['tp']" in wrong_fsdp and "dp_cp group" in wrong_fsdp, wrong_fsdp
