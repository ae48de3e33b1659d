"""torch_impl.sources.discover and the seed's accessor helpers, in-process (no process group)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from meshgrad import FinalizeConfig, Role  # noqa: E402
from torch_impl import (  # noqa: E402
    _get_main_grad_attr,
    _get_position_embedding_weight,
    _get_shared_word_embedding_weight,
    _reshard_if_dtensor,
    _unshard_if_dtensor,
    discover,
)
from torch_impl.sources.discover import get_grad  # noqa: E402
from torch_impl.sources.routers import router_spec  # noqa: E402
from torch_impl.sources.wrappers import find_attr, unwrap  # noqa: E402


class Embedding(nn.Module):
    def __init__(self, rows: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, 2))


class Router(nn.Module):
    def __init__(self, experts: int, qb: bool = True) -> None:
        super().__init__()
        self.register_buffer("expert_bias", torch.zeros(experts))
        self.register_buffer("local_tokens_per_expert", torch.zeros(experts))
        self.register_buffer("qb_beta", torch.zeros(experts) if qb else None)
        self.register_buffer("qb_beta_accum", torch.zeros(experts) if qb else None)

    def reset_global_aux_loss_tracker(self) -> None:
        pass


class Model(nn.Module):
    def __init__(self, share: bool = True) -> None:
        super().__init__()
        self.embedding = nn.Module()
        self.embedding.word_embeddings = Embedding(4)
        self.embedding.position_embeddings = Embedding(3)
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.zeros(2))
        self.norm.weight.sequence_parallel = True
        self.expert = nn.Module()
        self.expert.weight = nn.Parameter(torch.zeros(2))
        self.expert.weight.allreduce = False
        self.expert.weight.is_gtp_weight_remat = True
        self.frozen = nn.Parameter(torch.zeros(2), requires_grad=False)
        self.router = Router(3)
        self.pre_process = True
        self.share_embeddings_and_output_weights = share

    def shared_embedding_or_output_weight(self) -> nn.Parameter:
        return self.embedding.word_embeddings.weight

    @property
    def position_embeddings(self) -> nn.Module:
        return self.embedding.position_embeddings


class Wrapper(nn.Module):
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.config = FinalizeConfig()


def _give_grads(model: nn.Module) -> None:
    for i, p in enumerate(model.parameters()):
        if p.requires_grad:
            p.main_grad = torch.full(p.shape, float(i))


def test_unwrap_and_find_attr():
    inner = Model()
    outer = Wrapper(Wrapper(inner))
    assert unwrap(outer) is inner
    assert find_attr(outer, "config") is outer.config
    assert find_attr(outer, "missing") is None


def test_main_grad_attr_and_grad():
    p = nn.Parameter(torch.zeros(2))
    assert _get_main_grad_attr(p) == "grad"
    assert get_grad(p) is None
    p.grad = torch.ones(2)
    assert get_grad(p) is p.grad
    p.main_grad = torch.full((2,), 3.0)
    assert _get_main_grad_attr(p) == "main_grad"
    assert get_grad(p) is p.main_grad


def test_discover_flags_roles_and_routers():
    model = Model()
    _give_grads(model)
    found = discover([Wrapper(model)], FinalizeConfig())
    specs = {s.name: s for s in found.params}
    assert specs["embedding.word_embeddings.weight"].role is Role.WORD_EMBEDDING
    assert specs["embedding.position_embeddings.weight"].role is Role.POSITION_EMBEDDING
    assert specs["norm.weight"].sequence_parallel and not specs["norm.weight"].expert
    assert specs["expert.weight"].expert and specs["expert.weight"].is_gtp_weight_remat
    assert not specs["frozen"].has_grad
    assert all(s.chunk == 0 for s in found.params)
    (router,) = found.routers
    assert (router.name, router.num_experts, router.has_expert_bias, router.has_qb_beta) == ("router", 3, True, True)
    assert router.has_aux_loss_tracker and router.training and router.qb_accum_present
    assert found.router_modules[router.key] is model.router


@pytest.mark.parametrize("value,expert", [(False, True), (None, True), (0, True), (True, False), (1, False)])
def test_allreduce_flag_is_read_by_truth_value_as_megatron_does(value, expert):
    # Megatron DDP and finalize: `not getattr(param, "allreduce", True)` marks expert params.
    model = Model()
    _give_grads(model)
    model.norm.weight.allreduce = value
    specs = {s.name: s for s in discover([model], FinalizeConfig()).params}
    assert specs["norm.weight"].expert is expert


def test_ddp_chunks_leave_out_what_no_step_touches():
    model = Model()
    model.dense = nn.Parameter(torch.zeros(2))
    model.moe = nn.Parameter(torch.zeros(2))
    model.moe.allreduce = False
    model.q_layernorm = nn.Module()
    model.q_layernorm.weight = nn.Parameter(torch.zeros(2))
    _give_grads(model)
    full = discover([model], FinalizeConfig())
    left = discover([model], FinalizeConfig(), untouched=[True])
    kept = {s.name for s in left.params}
    # flags, embedding roles and q/k layernorm names keep a spec; plain and expert weights
    # (their DDP does the DP sync) do not, and their specs equal a full discovery's.
    assert kept == {"embedding.word_embeddings.weight", "embedding.position_embeddings.weight", "norm.weight",
                    "expert.weight", "q_layernorm.weight"}
    assert {s.name for s in full.params} - kept == {"dense", "moe", "frozen"}
    assert all(s == next(f for f in full.params if f.key == s.key) for s in left.params)
    assert (full.complete, left.complete, full.untouched_experts, left.untouched_experts) == (True, False, False, True)
    model.moe.requires_grad_(False)
    assert not discover([model], FinalizeConfig(), untouched=[True]).untouched_experts
    assert discover([model], FinalizeConfig(), untouched=[False]).complete


def test_word_embedding_role_needs_sharing_or_mtp():
    model = Model(share=False)
    _give_grads(model)
    found = discover([model], FinalizeConfig())
    assert {s.role for s in found.params} == {Role.NONE, Role.POSITION_EMBEDDING}
    found = discover([model], FinalizeConfig(mtp_num_layers=1))
    assert Role.WORD_EMBEDDING in {s.role for s in found.params}


def test_fingerprint_tracks_grad_presence_and_router_mode():
    model = Model()
    _give_grads(model)
    found = discover([model], FinalizeConfig())
    before = found.fingerprint()
    model.norm.weight.requires_grad_(False)
    assert found.fingerprint() != before
    refreshed = found.refresh()
    assert not {s.name: s for s in refreshed.params}["norm.weight"].has_grad
    model.norm.weight.requires_grad_(True)
    model.router.eval()
    assert found.fingerprint() != before


def test_non_float_gradient_is_a_type_error():
    model = Model()
    _give_grads(model)
    model.norm.weight.main_grad = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(TypeError, match="norm.weight"):
        discover([model], FinalizeConfig())


def test_router_buffers_must_agree():
    router = Router(3)
    router.qb_beta = torch.zeros(4)
    with pytest.raises(ValueError, match="differ in length"):
        router_spec("r", 0, router)
    assert router_spec("x", 0, nn.Linear(2, 2)) is None


def test_shared_word_embedding_weight():
    model = Model(share=False)
    cfg = FinalizeConfig()
    assert _get_shared_word_embedding_weight(model, cfg) is None
    assert _get_shared_word_embedding_weight(model, FinalizeConfig(mtp_num_layers=2)) is model.embedding.word_embeddings.weight
    model.share_embeddings_and_output_weights = True
    assert _get_shared_word_embedding_weight(model, cfg) is model.embedding.word_embeddings.weight


def test_position_embedding_weight():
    model = Model()
    assert _get_position_embedding_weight(model) is model.embedding.position_embeddings.weight
    with pytest.raises(AttributeError):
        _get_position_embedding_weight(nn.Linear(2, 2))


def test_dtensor_helpers_pass_plain_tensors_through():
    t, ref = torch.ones(2), torch.zeros(2)
    assert _unshard_if_dtensor(t) is t
    assert _reshard_if_dtensor(t, ref) is ref


def _torch_ddp(module: nn.Module) -> nn.Module:
    """A torch ``DistributedDataParallel`` object around ``module`` for discovery's walk
    alone (built without a process group: only its class and its submodule are read)."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel.__new__(DistributedDataParallel)
    nn.Module.__init__(ddp)
    ddp.module = module
    return ddp


def _with_expert_ddp(model: Model) -> Model:
    model.experts = _torch_ddp(nn.Linear(2, 2))
    return model


def _beside_the_chain(model: Model) -> nn.Module:
    wrapper = Wrapper(model)
    wrapper.side = _torch_ddp(nn.Linear(2, 2))  # a second submodule: not on the .module chain
    return wrapper


@pytest.mark.parametrize("build,names", [
    (lambda: Model(), []),
    (lambda: Wrapper(Wrapper(Model())), []),
    (lambda: _torch_ddp(Model()), [""]),
    (lambda: Wrapper(_torch_ddp(Model())), ["module"]),
    (lambda: _with_expert_ddp(Model()), ["experts"]),
    (lambda: _torch_ddp(_with_expert_ddp(Model())), ["", "module.experts"]),
    (lambda: _beside_the_chain(Model()), ["side"]),
], ids=["plain", "wrappers", "ddp", "ddp-in-wrapper", "inner-ddp", "outer-and-inner", "beside-the-chain"])
def test_discovery_finds_the_torch_ddp_wrappers_a_walk_of_each_chunk_finds(build, names):
    """Discovery reads the torch DDP wrappers from its own walk of the unwrapped chunks (the
    wrapper chain above them checked apart) and gives what a walk of the chunk as given
    gives: the same wrapper objects under the same names; its module ids are the unwrapped
    chunk's modules in ``modules()`` order (what the model watch's hooks filter by)."""
    from torch_impl.sources.torch_ddp import ddp_wrappers

    chunk = build()
    found = discover([chunk], FinalizeConfig())
    walked = dict(chunk.named_modules())
    assert [d.module for d in found.torch_ddp] == names
    assert [d.wrapper for d in found.torch_ddp] == [walked[name] for name in names]
    assert found.torch_ddp == ddp_wrappers([chunk])
    assert found.module_ids == tuple(map(id, unwrap(chunk).modules()))
