"""Every kind of gradient tensor through torch_impl.finalize_model_grads, in gloo worlds of
4 and 8 ranks (one world each; every case runs on every rank).

* DTensor gradients (SPEC 2.12) on a real DeviceMesh (over tp or dp, as tensor-parallel
  and FSDP-style sharding do): each is made whole, finalized and put back into its own
  local shard; the finalized values are identical (bit for bit) to those of plain
  gradients holding the whole tensors, and the DTensor keeps its mesh, placements and the
  attributes set on it. (A DTensor spanning pipeline stages is not supported: stages
  reduce different chunks' gradients, so their unsharding collectives would not pair.)
* Megatron-FSDP (``use_megatron_fsdp``): the local shards are reduced, identical to plain
  gradients holding those shards.
* bfloat16 / float16 gradients (with and without ``grad_reduce_in_fp32``) are within a
  dtype tolerance of the same finalization run in float64, which itself matches the numpy
  reference (parity_tests.reference) to float32 rounding.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from parity_tests.specs import scenario_dims  # noqa: E402
from parity_tests.scenarios import RankData, Scenario, gpt_params, make_rank_inputs, moe_routers  # noqa: E402
from parity_tests.torch_world import build_model, read_outputs  # noqa: E402
from parity_tests.world_cases import run_cases  # noqa: E402

ALL_ON = dict(sequence_parallel=True, qk_layernorm=True, has_cond_embedder=True, flextron=True)


@dataclasses.dataclass(frozen=True)
class Case:
    """A DTensor case: the scenario, the mesh dim the DTensors live on, FSDP or not."""

    name: str
    scenario: Scenario
    dim: str
    fsdp: bool = False


def _dtensor_cases(world: int) -> list[Case]:
    if world == 4:
        base = dict(dp=2, tp=2, ep=2, etp=1, params=gpt_params(experts=True))
        return [
            Case("dp2tp2-over-tp", Scenario("w4-tp", **base, config=ALL_ON), "tp"),
            Case("dp2tp2-over-dp-pertoken", Scenario("w4-dp", **base, config=dict(ALL_ON, calculate_per_token_loss=True),
                                                     num_tokens="random", mode="random", seed=11), "dp"),
            Case("dp2tp2-fsdp-over-dp", Scenario("w4-fsdp", **base, config=dict(ALL_ON, use_megatron_fsdp=True)), "dp", True),
            Case("dp2tp2-over-tp-distopt", Scenario("w4-distopt", **base, config=dict(use_distributed_optimizer=True,
                                                    average_in_collective=True)), "tp"),
        ]
    pipe = dict(pp=2, dp=2, tp=2, num_chunks=2, params=gpt_params())
    return [
        Case("pp2dp2tp2-over-tp", Scenario("w8-tp", **pipe, config=ALL_ON), "tp"),
        Case("pp2dp2tp2-over-dp-bf16", Scenario("w8-dp", **pipe, config=ALL_ON, dtype="bfloat16", mode="random", seed=12), "dp"),
        Case("pp2dp2tp2-over-dp-distopt-fp16", Scenario("w8-distopt", **pipe, dtype="float16",
             config=dict(ALL_ON, use_distributed_optimizer=True, average_in_collective=True)), "dp"),
        Case("dp2cp2tp2-fsdp-over-tp", Scenario("w8-fsdp", dp=2, cp=2, tp=2, params=gpt_params(experts=True), ep=2, etp=1,
                                                 config=dict(ALL_ON, use_megatron_fsdp=True, grad_reduce_in_fp32=True)),
             "tp", True),
    ]


def _dtype_cases(world: int) -> list[Scenario]:
    """Random-data scenarios in bf16 / fp16 (router state included)."""
    out = []
    meshes = [dict(dp=4, ep=2, etp=1), dict(pp=2, tp=2)] if world == 4 else [dict(pp=2, dp=2, tp=2), dict(dp=2, cp=2, tp=2, ep=4, etp=1)]
    for i, mesh in enumerate(meshes):
        for dtype in ("bfloat16", "float16"):
            for fp32 in (False, True):
                config = dict(ALL_ON, grad_reduce_in_fp32=fp32, calculate_per_token_loss=bool(i),
                              moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.25)
                name = f"{'-'.join(f'{k}{v}' for k, v in mesh.items())}-{dtype}{'-fp32reduce' if fp32 else ''}"
                out.append(Scenario(name, **mesh, num_chunks=2, params=gpt_params(experts=True), routers=moe_routers(),
                                    config=config, dtype=dtype, mode="random", seed=20 + i,
                                    num_tokens="random" if i else None))
    return out


# =========================================================================== worker side

_MESHES: dict[Any, Any] = {}


def _mesh(s: Scenario) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    key = (s.pp, s.dp, s.cp, s.tp)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", key, mesh_dim_names=("pp", "dp", "cp", "tp"))
    return _MESHES[key]


def _placement(shape: tuple[int, ...], size: int) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    for dim, n in enumerate(shape):
        if n % size == 0:
            return Shard(dim)
    return Replicate()


def _config(s: Scenario) -> Any:
    return types.SimpleNamespace(**dict(s.config), expert_model_parallel_size=s.ep, expert_tensor_parallel_size=s.expert_tp)


def _set_grads(model: list[Any], grads: dict[Any, Any]) -> None:
    for (chunk, name), value in grads.items():
        if value is not None:
            model[chunk].get_parameter(name).main_grad = value


def _num_tokens(data: RankData) -> Any:
    return None if data.num_tokens is None else torch.tensor(data.num_tokens)


def _run_dtensor_case(case: Case, rank: int) -> dict[str, Any]:
    """Finalize DTensor gradients and their plain equivalent; return what to compare."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from torch_impl import finalize_model_grads

    s = case.scenario
    dtype = getattr(torch, s.dtype)
    mesh = _mesh(s)
    sub = mesh[case.dim]
    size = sub.size()
    dims = scenario_dims(s)
    # Whole tensors: the inputs of this rank's peer at coordinate 0 along the DTensor's dim,
    # so every rank of one DTensor holds the same whole tensor (its shards differ).
    root = dims.rank_of({**{str(k): v for k, v in dims.coords(rank).items() if k.value in ("pp", "dp", "cp", "tp")},
                         case.dim: 0})
    data = make_rank_inputs(s, root if not case.fsdp else rank)
    whole = {k: None if v is None else torch.from_numpy(np.array(v, dtype=np.float32)).to(dtype) for k, v in data.grads.items()}
    dtensors: dict[Any, Any] = {}
    for key, value in whole.items():
        if value is None:
            continue
        d = distribute_tensor(value.clone(), sub, [_placement(tuple(value.shape), size)], src_data_rank=None)
        d.tag = f"kept-{key[1]}"
        dtensors[key] = d
    # Plain gradients: the whole tensors, or (FSDP) the local shards.
    plain = {k: None if v is None else (dtensors[k].to_local().clone() if case.fsdp else v.clone()) for k, v in whole.items()}

    out: dict[str, Any] = {}
    for kind, grads in (("plain", plain), ("dtensor", dtensors)):
        model = build_model(s, rank, _config(s))
        _set_grads(model, grads)
        finalize_model_grads(model, num_tokens=_num_tokens(data), pg_collection=mesh)
        values, meta = {}, {}
        for key in whole:
            g = getattr(model[key[0]].get_parameter(key[1]), "main_grad", None)
            if g is None:
                values[key] = None
                continue
            if kind == "dtensor":
                meta[key] = (isinstance(g, DTensor) and g is dtensors[key], g.device_mesh is sub, tuple(g.placements),
                             getattr(g, "tag", None))
                g = g.to_local() if case.fsdp else g.full_tensor()
            values[key] = g.detach().float().numpy().copy()
        out[kind] = values
        out[f"{kind}-meta"] = meta
    out["placements"] = {k: tuple(d.placements) for k, d in dtensors.items()}
    return out


def _run_dtype_case(s: Scenario, rank: int) -> dict[str, Any]:
    """Finalize one rank's bf16/fp16 inputs in their dtype and in float64."""
    from torch_impl import finalize_model_grads

    from parity_tests.torch_world import collection, load_inputs

    data = make_rank_inputs(s, rank)
    out = {}
    for dtype in (s.dtype, "float64"):
        run = dataclasses.replace(s, dtype=dtype)
        model = build_model(run, rank, _config(run))
        load_inputs(model, run, data)
        finalize_model_grads(model, num_tokens=_num_tokens(data), pg_collection=collection(run, _MESHES))
        out[dtype] = read_outputs(model, run, data)
    return out


def case_world(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case in _dtensor_cases(world):
        try:
            out[f"dtensor/{case.name}"] = ("ok", _run_dtensor_case(case, rank))
        except Exception as err:  # reported by the test of that case
            out[f"dtensor/{case.name}"] = ("error", f"{type(err).__name__}: {err}")
    for s in _dtype_cases(world):
        try:
            out[f"dtype/{s.name}"] = ("ok", _run_dtype_case(s, rank))
        except Exception as err:
            out[f"dtype/{s.name}"] = ("error", f"{type(err).__name__}: {err}")
    return out


# =========================================================================== tests (parent)

_WORLDS: dict[int, Any] = {}


def _results(world: int, name: str) -> list[Any]:
    if world not in _WORLDS:
        _WORLDS[world] = run_cases(__name__, ["case_world"], world, timeout=300)["case_world"]
    got = _WORLDS[world]
    problems = [f"rank {r}: {s}: {v}" for r, (s, v) in enumerate(got) if s != "ok"]
    assert not problems, "\n".join(problems)
    per_rank = [v[name] for _, v in got]
    errors = [f"rank {r}: {v[1]}" for r, v in enumerate(per_rank) if v[0] != "ok"]
    assert not errors, "\n".join(errors)
    return [v[1] for v in per_rank]


DTENSOR_IDS = [(w, c.name) for w in (4, 8) for c in _dtensor_cases(w)]
DTYPE_IDS = [(w, s.name) for w in (4, 8) for s in _dtype_cases(w)]


@pytest.mark.parametrize("world,name", DTENSOR_IDS, ids=[f"w{w}-{n}" for w, n in DTENSOR_IDS])
def test_dtensor_and_plain_gradients_finalize_identically(world: int, name: str) -> None:
    case = next(c for c in _dtensor_cases(world) if c.name == name)
    per_rank = _results(world, f"dtensor/{name}")
    sharded = 0
    for rank, out in enumerate(per_rank):
        assert out["plain"].keys() == out["dtensor"].keys()
        for key, want in out["plain"].items():
            got = out["dtensor"][key]
            assert (got is None) == (want is None), (rank, key)
            if want is not None:
                np.testing.assert_array_equal(got, want, err_msg=f"rank {rank} {key}")
        for key, (same_object, same_mesh, placements, tag) in out["dtensor-meta"].items():
            assert same_object and same_mesh, (rank, key)
            assert placements == out["placements"][key] and tag == f"kept-{key[1]}", (rank, key)
            sharded += "Shard" in str(placements)
    assert sharded, "no gradient was actually sharded"
    # Something was finalized: the outputs differ from the inputs somewhere.
    changed = any(
        not np.array_equal(v, np.array(make_rank_inputs(case.scenario, r).grads[k], dtype=np.float32))
        for r, out in enumerate(per_rank)
        for k, v in out["plain"].items()
        if v is not None and v.shape == np.shape(make_rank_inputs(case.scenario, r).grads[k])
    )
    assert changed


def _eps(dtype: str) -> float:
    return {"bfloat16": 2.0**-8, "float16": 2.0**-11}[dtype]


@pytest.mark.parametrize("world,name", DTYPE_IDS, ids=[f"w{w}-{n}" for w, n in DTYPE_IDS])
def test_low_precision_within_dtype_tolerance_of_float64(world: int, name: str) -> None:
    from parity_tests import reference
    from parity_tests.compare import compare_ranks

    s = next(x for x in _dtype_cases(world) if x.name == name)
    per_rank = _results(world, f"dtype/{name}")
    inputs = [make_rank_inputs(s, r) for r in range(s.world_size)]
    # The float64 run is the SPEC's math: it matches the numpy reference (float64 sums,
    # float32 results) given the same inputs.
    f32 = dataclasses.replace(s, dtype="float32")
    want = reference.reference_finalize(f32, inputs).outputs
    anchor = compare_ranks(f32, [out["float64"] for out in per_rank], want)
    assert anchor.ok, "\n".join(anchor.failures[:10])
    # Each low-precision value: a handful of roundings (pre-scale, ring sum, TP / PP sums,
    # token scale), each within eps of the running magnitude.
    eps, worst = _eps(s.dtype), 0.0
    for rank, out in enumerate(per_rank):
        for key, ref in out["float64"].grads.items():
            got = out[s.dtype].grads[key]
            if ref is None:
                assert got is None
                continue
            scale = float(np.max(np.abs(ref))) + float(np.max(np.abs(inputs[rank].grads[key])))
            err = float(np.max(np.abs(got.astype(np.float64) - ref.astype(np.float64))))
            worst = max(worst, err / (eps * scale))
            assert err <= 4 * eps * scale, f"rank {rank} {key}: error {err} > 4 eps x {scale}"
        for key, state in out["float64"].routers.items():  # router state is float32 either way
            np.testing.assert_allclose(out[s.dtype].routers[key].expert_bias, state.expert_bias, rtol=0, atol=1e-6)
    assert worst > 0, "low precision changed nothing: the comparison is vacuous"
