"""The last two differences from current Megatron-Core, held in one gloo world of 4 ranks
run by the 0.19.2 oracle's harness (:mod:`parity_tests.megatron019`).

1. **Megatron-FSDP embedding gradients.** With ``ddp_config.use_megatron_fsdp`` every
   gradient is a DTensor; megatron-core's word / position embedding step all-reduces the
   local shard over the embedding group and leaves it as the parameter's gradient: a plain
   tensor, no longer the DTensor. torch_impl must leave the same tensor type and values
   (compared bit for bit with 0.19.2, tensor type included, for both helpers and for
   ``finalize_model_grads``); the other DTensor gradients stay DTensors on both sides.
2. **GTP without ``gtp_remat``.** With ``config.gtp_weight_remat_size > 1`` and a
   ``ProcessGroupCollection`` that does not carry ``gtp_remat``, current Megatron-Core
   asserts ("Pass a pg_collection carrying ``gtp_remat``"); 0.19.2 did not (it runs, as
   ``fin-missing-gtp`` of tests/test_megatron019_oracle.py shows). torch_impl follows
   current Megatron: a ``MegatronAssertionError`` (an ``AssertionError``) naming
   ``gtp_remat``, on every rank, before any collective on gradient data (the calls of
   ``torch.distributed`` functions are recorded: only torch_impl's status round of int64 / object values, which
   lets every rank raise together) and with every gradient and buffer unchanged. With the
   field set, or with ``gtp_weight_remat_size`` 1, it runs (and equals 0.19.2).

Skipped when the 0.19.2 sources cannot be had.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

from parity_tests import megatron019 as m19  # noqa: E402
from parity_tests.megatron019 import MISSING, Case, Layout  # noqa: E402

LAYOUTS: dict[int, tuple[Layout, ...]] = {
    4: (Layout("tp2pp2-pos01", 4, tp=2, pp=2, pos=(0, 1)), Layout("gtp2dp2", 4, gtp=2)),
}
FSDP = dict(use_megatron_fsdp=True)
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
               "reduce_scatter_tensor", "barrier", "all_to_all_single")


def _dtensor_grads(model: list[Any], env: Any) -> None:
    """Every ``main_grad`` becomes a DTensor (Shard(0)) over a mesh of this rank's dp_cp
    group whose local tensor is the gradient itself (as Megatron-FSDP's are)."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = DeviceMesh.from_group(env.mpu.dp_cp, "cpu")
    with torch.no_grad():
        for chunk in model:
            while hasattr(chunk, "module"):
                chunk = chunk.module
            for _, p in chunk.named_parameters():
                if getattr(p, "main_grad", None) is not None:
                    p.main_grad = DTensor.from_local(p.main_grad, mesh, [Shard(0)], run_check=False)


def _fsdp(call: Callable[..., Any]) -> Callable[..., Any]:
    def run(impl: Any, m: list[Any], cfg: Any, env: Any, n: Any) -> Any:
        _dtensor_grads(m, env)
        return call(impl, m, cfg, env, n)

    return run


def _counting(call: Callable[[], Any]) -> tuple[Any, ...]:
    """Run ``call`` with every torch.distributed collective counted; (outcome, count)."""
    import torch.distributed as dist

    count: list[tuple[str, str]] = []
    saved = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def counted(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            tensor = args[0] if args and hasattr(args[0], "dtype") else None
            count.append((fn.__name__, str(tensor.dtype) if tensor is not None else "object"))
            return fn(*args, **kwargs)

        return wrapper

    for name, fn in saved.items():
        setattr(dist, name, counted(fn))
    try:
        call()
        outcome: tuple[Any, ...] = ("ok",)
    except Exception as err:  # the parent checks the type and text
        outcome = ("error", type(err).__name__, isinstance(err, AssertionError), str(err))
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    return outcome + (count,)


def _gtp_missing(impl: Any, m: list[Any], cfg: Any, env: Any, n: Any) -> Any:
    """Ours only (0.19.2 does not assert): the outcome and the collectives launched."""
    if impl.__name__ != "torch_impl":
        return None
    pgc = env.collection("mpu", gtp_remat=MISSING, expt_gtp_remat=MISSING)
    return _counting(lambda: impl.finalize_model_grads(m, pg_collection=pgc))


def cases(layout: Layout) -> dict[str, Case]:
    fin = lambda impl, m, cfg, env, n: impl.finalize_model_grads(m, pg_collection=env.mpu)  # noqa: E731
    if layout.gtp > 1:
        return {
            "gtp-missing": Case(call=_gtp_missing, config=dict(sequence_parallel=True)),
            "gtp-set": Case(call=fin, config=dict(sequence_parallel=True)),
        }
    word = lambda impl, m, cfg, env, n: impl._allreduce_word_embedding_grads(m, cfg, env.mpu.embd, env.mpu.pp)  # noqa: E731
    pos = lambda impl, m, cfg, env, n: impl._allreduce_position_embedding_grads(  # noqa: E731
        m, cfg, env.mpu.pos_embd, env.mpu.pp)
    return {
        "fsdp-word": Case(call=_fsdp(word), ddp=FSDP, wrap=False, scenario=dict(num_chunks=2)),
        "fsdp-pos": Case(call=_fsdp(pos), ddp=FSDP, wrap=False),
        "fsdp-finalize": Case(call=_fsdp(fin), ddp=FSDP, config=dict(sequence_parallel=True, qk_layernorm=True)),
    }


# =========================================================================== parent side

_WORLD: dict[str, Any] = {}


def _results() -> dict[str, list[Any]]:
    src = m19.source_dir()
    if src is None:
        pytest.skip(m19.skip_reason())
    if "r" not in _WORLD:
        from parity_tests.process_world import spawn_world

        wanted = {layout.name: list(cases(layout)) for layout in LAYOUTS[4]}
        outcome = spawn_world(m19.world_main, 4, (str(src), __name__, wanted), timeout=300,
                              prepare=functools.partial(m19.import_megatron, str(src)))
        fatal = next((f for f in outcome.fatal if f), None)
        _WORLD["r"] = {f"{lay}:{name}": [outcome.results[r].get(f"{lay}:{name}", ("missing", fatal))
                                          for r in range(4)] for lay, names in wanted.items() for name in names}
    return _WORLD["r"]


def _per_rank(name: str) -> list[dict[str, Any]]:
    got = _results()[name]
    bad = [f"rank {r}: {s}: {v}" for r, (s, v) in enumerate(got) if s != "ok"]
    assert not bad, "\n".join(bad)
    return [v for _, v in got]


def _same(x: Any, y: Any) -> bool:
    if x is None or y is None or not isinstance(x, tuple):
        return x == y
    return x[:3] == y[:3] and np.array_equal(x[3], y[3], equal_nan=True)


@pytest.mark.parametrize("name", ["fsdp-word", "fsdp-pos", "fsdp-finalize"])
def test_fsdp_embedding_grad_left_as_megatron_leaves_it(name: str) -> None:
    """Every gradient: tensor type (DTensor or plain), dtype, shape and values as 0.19.2."""
    plain = 0
    for rank, pair in enumerate(_per_rank(f"tp2pp2-pos01:{name}")):
        meg, ours = pair["megatron"], pair["ours"]
        assert meg[0] == "ok" and ours[0] == "ok", (meg[:3], ours[:3])
        diffs = [f"{k}: megatron {meg[1][k][:3]} ours {ours[1].get(k, ('<absent>',))[:3]}"
                 for k in meg[1] if not _same(meg[1][k], ours[1].get(k))]
        assert not diffs, f"rank {rank}:\n" + "\n".join(diffs[:10])
        plain += sum(1 for k, v in meg[1].items() if k.endswith(".main_grad") and v is not None and v[0] != "DTensor")
    assert plain > 0, "megatron-core left no plain gradient: the case is vacuous"


def test_gtp_without_gtp_remat_raises_before_any_collective() -> None:
    for rank, pair in enumerate(_per_rank("gtp2dp2:gtp-missing")):
        ours = pair["ours"]
        assert ours[0] == "ok", ours
        outcome = ours[2]["value"]
        assert outcome[0] == "error", f"rank {rank}: ours ran: {outcome}"
        kind, is_assertion, message, collectives = outcome[1:]
        assert kind == "MegatronAssertionError" and is_assertion, outcome
        assert "gtp_remat" in message and "Pass a pg_collection carrying" in message, message
        # Only torch_impl's status round (every rank joins it before its first collective, so
        # that an error on some ranks reaches all: int64 / object agreement values), no gradient collective.
        data = [c for c in collectives if c[1] not in ("torch.int64", "object")]
        assert not data, f"rank {rank}: collectives before the error: {collectives}"
        changed = [k for k in pair["inputs"] if not _same(pair["inputs"][k], ours[1][k])]
        assert not changed, f"rank {rank}: changed {changed[:5]}"


def test_gtp_with_gtp_remat_runs_as_megatron() -> None:
    moved = False
    for rank, pair in enumerate(_per_rank("gtp2dp2:gtp-set")):
        meg, ours = pair["megatron"], pair["ours"]
        assert meg[0] == "ok" and ours[0] == "ok", (meg[:3], ours[:3])
        diffs = [k for k in meg[1] if not _same(meg[1][k], ours[1][k])]
        assert not diffs, f"rank {rank}: {diffs[:5]}"
        moved = moved or any(not _same(pair["inputs"][k], meg[1][k]) for k in meg[1])
    assert moved
