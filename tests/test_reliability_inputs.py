"""Bad inputs never corrupt gradients: every one raises before communication, with a
message naming the rank and the group or parameter, and leaves every gradient and
router buffer bit-identical.

In-process cases (a world of one: no process group) cover num_tokens, gradients and
config values; one gloo world of 4 ranks runs every ``case_*`` below on every rank for
what needs peers: group sizes and members, the cross-rank consistency check (different
parameter sets, shapes, dtypes, configs, stage-local freezes, num_tokens on some ranks)
and the all-rank NaN / Inf check. The helpers here (timed collections, snapshots) are
shared with the other reliability tests.
"""

from __future__ import annotations

import datetime
import re
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from meshgrad import FinalizeConfig, Group, ParallelDims, stage_set  # noqa: E402
from parity_tests.specs import scenario_dims  # noqa: E402
from parity_tests.scenarios import (  # noqa: E402
    POS_EMB,
    WORD_EMB,
    ParamLayout,
    RouterLayout,
    Scenario,
    gpt_params,
    make_rank_inputs,
    moe_routers,
)
from parity_tests.torch_world import build_model, load_inputs, scenario_config  # noqa: E402
from parity_tests.world_cases import local_cases, run_cases  # noqa: E402
from torch_impl import finalize_model_grads  # noqa: E402
from torch_impl.run.errors import CollectiveError, ConsistencyError, NonFiniteGradError  # noqa: E402

WORLD = 4
TIMEOUT = 10.0  # process-group timeout of the groups below: an unexpected hang fails fast
_CACHE: dict[Any, Any] = {}  # per worker process

LINEAR = "decoder.layers.0.mlp.linear_fc1.weight"
DP_TP = Scenario(
    "rel-dp2tp2",
    dp=2,
    tp=2,
    ep=2,
    etp=1,
    params=gpt_params(experts=True),
    routers=moe_routers(),
    config=dict(sequence_parallel=True, moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.25),
)
PP_TP = Scenario(
    "rel-pp2tp2", pp=2, tp=2, params=gpt_params(), config=dict(sequence_parallel=True, position_embedding_stages=(0, 1))
)


# =========================================================================== shared helpers


def timed_collection(
    scenario: Scenario,
    *,
    timeout: float = TIMEOUT,
    override: dict[Group, list[list[int]]] | None = None,
    drop: Sequence[str] = (),
    dims: ParallelDims | None = None,
    cache: dict[Any, Any] | None = None,
) -> types.SimpleNamespace:
    """A ProcessGroupCollection-like namespace of gloo groups with a short timeout.

    Args:
      scenario: mesh and embedding stage sets.
      timeout: the groups' timeout in seconds.
      override: per group, the instances (rank lists) to build instead of the mesh's.
      drop: fields to leave out (a "missing" group).
      dims: the mesh to build groups for (default: the scenario's).
      cache: where to keep built collections (every rank builds the same ones in order).
    """
    import torch.distributed as dist

    cache = _CACHE if cache is None else cache
    dims = dims or scenario_dims(scenario)
    embd = stage_set(scenario.cfg("embedding_stages", None), dims.pp, "first_last")
    pos = stage_set(scenario.cfg("position_embedding_stages", None), dims.pp, "first")
    key = ("timed", dims, embd, pos, timeout, repr(sorted((override or {}).items())), tuple(drop))
    if key in cache:
        return cache[key]
    rank = dist.get_rank()
    fields: dict[str, Any] = {}
    for group in Group:
        stages = embd if group is Group.EMBD else pos if group is Group.POS_EMBD else None
        instances = (override or {}).get(group) or dims.all_groups(group, stages)
        mine = None
        for ranks in instances:
            if len(ranks) > 1:
                pg = dist.new_group(sorted(ranks), timeout=datetime.timedelta(seconds=timeout))
                mine = pg if rank in ranks else mine
        if group.value not in drop:
            fields[group.value] = mine
    cache[key] = types.SimpleNamespace(**fields)
    return cache[key]


def kind_of(err: BaseException) -> str:
    """The error's type name, meshgrad's two plain input types named by the builtin they
    subclass (``FinalizeInputError`` -> ValueError, ``FinalizeTypeError`` -> TypeError:
    what code written against Megatron catches); every other type by its own name.
    :func:`test_torch_raises_meshgrad_error_types` holds the meshgrad types themselves."""
    from meshgrad.errors import FinalizeInputError, FinalizeTypeError

    return {FinalizeInputError: "ValueError", FinalizeTypeError: "TypeError"}.get(type(err), type(err).__name__)


def _bytes(tensor: Any) -> Any:
    if not isinstance(tensor, torch.Tensor):
        return repr(tensor)
    if tensor.device.type == "meta":
        return ("meta", str(tensor.dtype), tuple(tensor.shape))
    if tensor.layout is not torch.strided:
        return (str(tensor.layout), _bytes(tensor.detach().to_dense()))
    t = tensor.detach().cpu().contiguous().reshape(-1)
    return (str(t.dtype), tuple(tensor.shape), t.view(torch.uint8).numpy().tobytes())


def snapshot(model: Sequence[Any]) -> dict[Any, Any]:
    """Every gradient and buffer of every chunk, as raw bytes (bit-identity, NaN included)."""
    out: dict[Any, Any] = {}
    for i, chunk in enumerate(model):
        inner = getattr(chunk, "module", chunk)
        for name, p in inner.named_parameters():
            grad = p.main_grad if hasattr(p, "main_grad") else p.grad
            out[("grad", i, name)] = _bytes(grad)
        for name, b in inner.named_buffers():
            out[("buffer", i, name)] = _bytes(b)
        for name, m in inner.named_modules():
            if hasattr(m, "aux_loss_resets"):
                out[("aux", i, name)] = m.aux_loss_resets
    return out


def setup_model(
    scenario: Scenario, rank: int, config_changes: dict[str, Any] | None = None, step: int = 0
) -> list[Any]:
    """This rank's model of ``scenario`` with its inputs loaded (a Megatron-like config)."""
    config = scenario_config(scenario, finalize_config=False)
    for name, value in (config_changes or {}).items():
        setattr(config, name, value)
    model = build_model(scenario, rank, config)
    load_inputs(model, scenario, make_rank_inputs(scenario if not step else _seeded(scenario, step), rank))
    return model


def load_in_place(model: Sequence[Any], scenario: Scenario, data: Any) -> None:
    """``data`` loaded (:func:`load_inputs`), its gradients copied into the tensors the
    model holds (as backward accumulates into the same buffers), so that a long-lived
    model's next step changes only what a case changes."""
    inner = [getattr(c, "module", c) for c in model]
    held = {(i, n): p.main_grad for i, c in enumerate(inner) for n, p in c.named_parameters()
            if getattr(p, "main_grad", None) is not None}
    load_inputs(model, scenario, data)
    for (i, name), old in held.items():
        p = inner[i].get_parameter(name)
        if p.main_grad is not old:
            old.copy_(p.main_grad)
            p.main_grad = old


def ddp_buffer_layout(model: Sequence[Any], inference: bool = False) -> None:
    """Each chunk's trainable gradients (``main_grad``, values kept) as views of one buffer,
    parameters in reverse order, as a Megatron DDP keeps them; with ``inference``, the
    buffer made under ``torch.inference_mode()`` (an inference tensor)."""
    for chunk in model:
        params = [p for p in getattr(chunk, "module", chunk).parameters() if p.requires_grad][::-1]
        with torch.inference_mode(inference):
            buffer = torch.cat([p.main_grad.reshape(-1) for p in params])
        offset = 0
        for p in params:
            p.main_grad = buffer[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()


def _seeded(scenario: Scenario, step: int) -> Scenario:
    import dataclasses

    return dataclasses.replace(scenario, seed=scenario.seed + 1000 * step)


def param(model: Sequence[Any], name: str, chunk: int = 0) -> Any:
    return getattr(model[chunk], "module", model[chunk]).get_parameter(name)


def attempt(model: Sequence[Any], call: Callable[[Sequence[Any]], Any]) -> tuple[str, str, bool, float]:
    """(error type or "ok", message, everything bit-identical afterwards, seconds)."""
    before = snapshot(model)
    start = time.monotonic()
    try:
        call(model)
        kind, message = "ok", ""
    except Exception as err:  # recorded; the parent checks type and text
        kind, message = kind_of(err), str(err)
    return kind, message, snapshot(model) == before, time.monotonic() - start


# =========================================================================== world cases (every rank)


def _finalize(groups: Any, **kwargs: Any) -> Callable[[Sequence[Any]], None]:
    return lambda m: finalize_model_grads(m, pg_collection=groups, **kwargs)


def case_tp_group_of_non_peers(rank: int, world: int) -> tuple:
    # tp instances [0, 2], [1, 3] and dp_cp [0, 1], [2, 3]: a valid grid in another
    # rank order, but not tp's peers under SPEC's order.
    groups = timed_collection(DP_TP, override={Group.TP: [[0, 2], [1, 3]], Group.DP_CP: [[0, 1], [2, 3]]})
    return attempt(setup_model(DP_TP, rank, {"strict_groups": True}), _finalize(groups))


def case_tp_size_differs_from_config(rank: int, world: int) -> tuple:
    model = setup_model(DP_TP, rank, {"tensor_model_parallel_size": 4, "strict_groups": True})
    return attempt(model, _finalize(timed_collection(DP_TP)))


def case_expt_dp_size_differs_from_config(rank: int, world: int) -> tuple:
    groups = timed_collection(DP_TP, dims=ParallelDims(dp=2, tp=2, ep=1, etp=1))  # expt_dp of size 4
    return attempt(setup_model(DP_TP, rank, {"strict_groups": True}), _finalize(groups))


def case_missing_tp_dp_cp(rank: int, world: int) -> tuple:
    return attempt(setup_model(DP_TP, rank), _finalize(timed_collection(DP_TP, drop=("tp_dp_cp",))))


def case_num_tokens_float(rank: int, world: int) -> tuple:
    return attempt(setup_model(DP_TP, rank), _finalize(timed_collection(DP_TP), num_tokens=torch.tensor([3, 3])))


def case_position_embedding_without_grad(rank: int, world: int) -> tuple:
    model = setup_model(PP_TP, rank)
    param(model, POS_EMB).main_grad = None
    return attempt(model, _finalize(timed_collection(PP_TP)))


def case_extra_param_on_rank1(rank: int, world: int) -> tuple:
    model = setup_model(DP_TP, rank)
    if rank == 1:
        extra = nn.Parameter(torch.zeros(3))
        extra.main_grad = torch.ones(3)
        model[0].register_parameter("extra", extra)
    return attempt(model, _finalize(timed_collection(DP_TP)))


def case_shape_differs_on_rank2(rank: int, world: int) -> tuple:
    model = setup_model(DP_TP, rank)
    if rank == 2:
        layer = model[0].get_submodule(LINEAR.rsplit(".", 1)[0])
        wide = nn.Parameter(torch.zeros(5, 4))
        wide.main_grad = torch.ones(5, 4)
        layer.register_parameter("weight", wide)
    return attempt(model, _finalize(timed_collection(DP_TP)))


def case_dtype_differs_on_rank3(rank: int, world: int) -> tuple:
    model = setup_model(DP_TP, rank)
    if rank == 3:
        p = param(model, LINEAR)
        p.main_grad = p.main_grad.to(torch.bfloat16)
    return attempt(model, _finalize(timed_collection(DP_TP)))


def case_config_differs_on_rank0(rank: int, world: int) -> tuple:
    model = setup_model(DP_TP, rank, {"calculate_per_token_loss": rank == 0})
    return attempt(model, _finalize(timed_collection(DP_TP)))


def case_embedding_frozen_on_one_stage(rank: int, world: int) -> tuple:
    model = setup_model(PP_TP, rank)
    if rank >= 2:  # pp stage 1
        param(model, WORD_EMB).main_grad = None
    return attempt(model, _finalize(timed_collection(PP_TP)))


def case_num_tokens_on_rank0_only(rank: int, world: int) -> tuple:
    tokens = torch.tensor(4) if rank == 0 else None
    return attempt(setup_model(DP_TP, rank), _finalize(timed_collection(DP_TP), num_tokens=tokens))


def case_nan_on_rank2_checked(rank: int, world: int) -> tuple:
    model = setup_model(DP_TP, rank, {"check_for_nan_in_grad": True})
    if rank == 2:
        param(model, LINEAR).main_grad[1, 2] = float("nan")
    return attempt(model, _finalize(timed_collection(DP_TP)))


def case_inf_on_rank3_checked(rank: int, world: int) -> tuple:
    model = setup_model(PP_TP, rank, {"check_for_nan_in_grad": True})
    if rank == 3:
        param(model, WORD_EMB).main_grad[0, 0] = float("-inf")
    return attempt(model, _finalize(timed_collection(PP_TP)))


def case_plan_changes_on_one_rank_every_step(rank: int, world: int) -> tuple:
    groups = timed_collection(DP_TP)
    model = setup_model(DP_TP, rank, {"consistency_check": "every_step"})
    finalize_model_grads(model, pg_collection=groups)  # step 1: consistent
    load_inputs(model, DP_TP, make_rank_inputs(_seeded(DP_TP, 1), rank))
    if rank == 1:
        param(model, LINEAR).requires_grad_(False)
    return attempt(model, _finalize(groups))


def case_check_collectives_per_mode(rank: int, world: int) -> dict[str, list[int]]:
    """The checks' collectives (status rounds, the comparison's all-gathers) over two
    steps, per consistency_check mode, and the data collectives of the second step."""
    from bench.counting import CollectiveCounter
    from torch_impl.run import rounds as consensus  # the rounds' reductions (status SUM, follow-up MAX)

    groups = timed_collection(DP_TP)
    rounds: list[int] = []
    originals = {name: getattr(consensus, name) for name in ("all_reduce_status", "all_reduce_max")}

    def counting(original: Any) -> Any:
        def counted(*args: Any) -> None:
            rounds.append(1)
            original(*args)
        return counted

    out: dict[str, list[int]] = {}
    for name, original in originals.items():
        setattr(consensus, name, counting(original))
    try:
        for mode in ("off", "once", "every_step"):
            model = setup_model(DP_TP, rank, {"consistency_check": mode})
            counts = []
            for _ in range(2):
                start = len(rounds)
                with CollectiveCounter() as counter:
                    finalize_model_grads(model, pg_collection=groups)
                counts.append(counter.checks + len(rounds) - start)
            out[mode] = counts + [counter.total]
    finally:
        for name, original in originals.items():
            setattr(consensus, name, original)
    return out


CASES = local_cases(globals())


# =========================================================================== world tests (parent)


@pytest.fixture(scope="module")
def world() -> dict[str, list[tuple[str, Any]]]:
    return run_cases(__name__, CASES, WORLD, timeout=240)


def _results(world: dict[str, list[tuple[str, Any]]], name: str) -> list[Any]:
    got = world[name]
    problems = [f"rank {r}: {s}: {v}" for r, (s, v) in enumerate(got) if s != "ok"]
    assert not problems, "\n".join(problems)
    return [v for _, v in got]


def _check_all_raise(
    world: dict[str, list[tuple[str, Any]]], name: str, error: type, texts: Callable[[int], Sequence[str]]
) -> list[tuple]:
    results = _results(world, name)
    for rank, (kind, message, untouched, seconds) in enumerate(results):
        assert kind == error.__name__, (name, rank, kind, message)
        for text in texts(rank):
            assert text in message, (name, rank, text, message)
        assert untouched, (name, rank, "gradients or router state changed")
        assert seconds < TIMEOUT, (name, rank, seconds)  # no rank waited for a timeout
    return results


GROUP_CASES = [
    ("tp group holds ranks that are not tp peers (collection), strict_groups=True", "case_tp_group_of_non_peers", ValueError,
     lambda r: [f"rank {r}: process group 'tp'", f"peers are {[r - r % 2, r - r % 2 + 1]}"]),
    ("tp group size != config.tensor_model_parallel_size, strict_groups=True", "case_tp_size_differs_from_config", ValueError,
     lambda r: [f"rank {r}:", "'tp'", "has size 2, but config.tensor_model_parallel_size = 4"]),
    ("expt_dp size != what config ep / etp imply, strict_groups=True", "case_expt_dp_size_differs_from_config", ValueError,
     lambda r: [f"rank {r}:", "'expt_dp'", "has size 4", "implies 2"]),
    ("required group missing (tp_dp_cp with expert bias)", "case_missing_tp_dp_cp", ValueError,
     lambda r: [f"rank {r}:", "'tp_dp_cp' is missing"]),
    ("num_tokens of shape [2]", "case_num_tokens_float", TypeError,
     lambda r: [f"rank {r}:", "num_tokens must be a one-element tensor"]),
    ("position embedding without gradient", "case_position_embedding_without_grad", ValueError,
     lambda r: [f"rank {r}:", POS_EMB, "pos_embd"]),
]


@pytest.mark.parametrize("label,name,error,texts", GROUP_CASES, ids=[c[1] for c in GROUP_CASES])
def test_bad_groups_and_inputs_raise_on_every_rank_and_change_nothing(world, reliability, label, name, error, texts):
    _check_all_raise(world, name, error, texts)
    reliability("bad input", f"{label} [4 ranks]", f"{error.__name__} on every rank before communication; nothing changed")


CONSISTENCY_CASES = [
    # (label, case, group, members that see it, the ranks of each variant, text of the first difference)
    ("different parameter sets in a coalesced group", "case_extra_param_on_rank1", "dp_cp", [1, 3], "extra[3]"),
    ("different shapes in a coalesced group", "case_shape_differs_on_rank2", "dp_cp", [0, 2], f"{LINEAR}[5, 4]"),
    ("different gradient dtypes", "case_dtype_differs_on_rank3", "dp_cp", [1, 3], LINEAR),
    ("different configs", "case_config_differs_on_rank0", "tp_dp_cp", [0, 1, 2, 3], "config.calculate_per_token_loss"),
    ("tied embedding frozen on one stage only", "case_embedding_frozen_on_one_stage", "embd", None, "word_embedding sum"),
    ("num_tokens passed on some ranks only", "case_num_tokens_on_rank0_only", "dp_cp_gtp_remat", [0, 2], "token_scale"),
    ("plan changes on one rank after step 1 (every_step)", "case_plan_changes_on_one_rank_every_step", "dp_cp", [1, 3], LINEAR),
]


@pytest.mark.parametrize("label,name,group,members,text", CONSISTENCY_CASES, ids=[c[1] for c in CONSISTENCY_CASES])
def test_ranks_that_would_launch_different_collectives_are_reported_by_name(
    world, reliability, label, name, group, members, text
):
    results = _results(world, name)
    reporters = set()
    for rank, (kind, message, untouched, seconds) in enumerate(results):
        assert kind == "ConsistencyError", (name, rank, kind, message)
        assert untouched, (name, rank, "changed")
        assert seconds < TIMEOUT, (name, rank, seconds)
        if f"group '{group}'" in message:
            reporters.add(rank)
            assert f"rank {rank}: the ranks of group '{group}' (global ranks " in message, message
            assert "first difference, line" in message and text in message, message
        else:
            assert f"rank {rank}: rank " in message and "found ranks of one of its groups" in message, message
    want = set(members) if members is not None else {0, 1, 2, 3}  # embd: {0, 2} and {1, 3}
    assert reporters == want, (name, reporters)
    reliability(
        "bad input",
        f"{label} [4 ranks]",
        f"ConsistencyError on every rank naming group {group!r}, its ranks and the first differing line; nothing changed",
    )


def test_nan_and_inf_are_found_on_every_rank_before_communication(world, reliability):
    for name, bad_rank, what in (("case_nan_on_rank2_checked", 2, LINEAR), ("case_inf_on_rank3_checked", 3, WORD_EMB)):
        results = _results(world, name)
        for rank, (kind, message, untouched, seconds) in enumerate(results):
            assert kind == "NonFiniteGradError", (name, rank, message)
            assert untouched and seconds < TIMEOUT, (name, rank)
            if rank == bad_rank:
                assert message.startswith(f"rank {rank}: NaN or Inf in the gradient of {what!r} (chunk 0)"), message
            else:
                assert message.startswith(f"rank {rank}: rank {bad_rank} has NaN or Inf in a gradient"), message
    reliability("bad input", "NaN / Inf on one rank, check_for_nan_in_grad [4 ranks]",
                "NonFiniteGradError on every rank (the parameter named where it is); nothing changed")


def test_consistency_check_runs_once_per_plan_or_every_step(world, reliability):
    for rank, counts in enumerate(_results(world, "case_check_collectives_per_mode")):
        data = counts["off"][2]
        assert counts["off"] == [0, 0, data], rank
        first = counts["once"][0]
        # groups of size > 1 on a 2x2 dp x tp mesh with ep 2: the status round (a MAX
        # all-reduce over tp, then dp_cp: the world's timeout is longer than theirs); on a
        # new plan, a hash exchange (all-gather) over tp, dp_cp, expt_dp, tp_dp_cp,
        # dp_cp_gtp_remat (= dp_cp) and the outcome's status round.
        assert counts["once"] == [first, 2, data] and first == 2 + 5 + 2, (rank, counts)
        assert counts["every_step"] == [first, first, data], (rank, counts)
    reliability("check cost", "consistency_check off / once / every_step [4 ranks]",
                "0 / 9 then 2 / 9 every step small collectives (status all-reduces over tp and dp_cp, 5 group "
                "hashes, outcome); the same data collectives in every mode")


# =========================================================================== in-process (world of one)


PARAMS = (
    ParamLayout("embedding.word_embeddings.weight", (3, 2), role="word_embedding"),
    ParamLayout("layer.norm.weight", (2,), sequence_parallel=True),
    ParamLayout("layer.linear.weight", (2, 2)),
    ParamLayout("layer.experts.weight", (2,), expert=True),
)
LOCAL = Scenario(
    "rel-local",
    params=PARAMS,
    routers=(RouterLayout("layer.router", 4, has_qb_beta=True),),
    config=dict(calculate_per_token_loss=True, moe_router_enable_expert_bias=True),
)


def _local_model(**config: Any) -> list[Any]:
    cfg = FinalizeConfig.from_mapping({**LOCAL.config, **config})
    model = build_model(LOCAL, 0, cfg)
    load_inputs(model, LOCAL, make_rank_inputs(LOCAL, 0))
    return model


def _set_grad(name: str, value: Callable[[Any], Any]) -> Callable[[list[Any]], None]:
    def apply(model: list[Any]) -> None:
        p = param(model, name)
        p.main_grad = value(p.main_grad)

    return apply


def _nothing(model: list[Any]) -> None:
    return None


LOCAL_CASES = [
    # (label, prepare, call kwargs, error, text)
    ("num_tokens complex", _nothing, dict(num_tokens=torch.tensor(2j)), TypeError, "floating tensor, got torch.complex64"),
    ("num_tokens bool", _nothing, dict(num_tokens=torch.tensor(True)), TypeError, "floating tensor, got torch.bool"),
    ("num_tokens of shape [2]", _nothing, dict(num_tokens=torch.tensor([1, 2])), TypeError, "one-element tensor, got Tensor(2,)"),
    ("num_tokens a Python int", _nothing, dict(num_tokens=4), TypeError, "one-element tensor, got int"),
    ("num_tokens on the meta device", _nothing, dict(num_tokens=torch.tensor(2, device="meta")), ValueError,
     "num_tokens is on the meta device"),
    ("gradient of an integer dtype", _set_grad("layer.linear.weight", lambda g: g.to(torch.int64)), {}, TypeError,
     "'layer.linear.weight'"),
    ("gradient of the wrong shape", _set_grad("layer.linear.weight", lambda g: g.reshape(4)), {}, ValueError,
     "the gradient (main_grad) of 'layer.linear.weight' (chunk 0) has shape (4,), the parameter (2, 2)"),
    ("gradient on the meta device", _set_grad("layer.norm.weight", lambda g: torch.empty(2, device="meta")), {},
     ValueError, "the gradient (main_grad) of 'layer.norm.weight' (chunk 0) is on the meta device"),
    ("gradient a list, not a tensor", _set_grad("layer.norm.weight", lambda g: [1.0, 2.0]), {}, TypeError,
     "'layer.norm.weight' (chunk 0): main_grad is a list, not a tensor"),
]


@pytest.mark.parametrize("label,prepare,kwargs,error,text", LOCAL_CASES, ids=[c[0] for c in LOCAL_CASES])
def test_bad_local_inputs_raise_before_touching_anything(reliability, label, prepare, kwargs, error, text):
    model = _local_model()
    prepare(model)
    kind, message, untouched, _ = attempt(model, lambda m: finalize_model_grads(m, **kwargs))
    assert kind == error.__name__, (kind, message)
    assert message.startswith("rank 0: ") and text in message, message
    assert untouched
    what = "num_tokens" if label.startswith("num_tokens") else "the parameter"
    reliability("bad input", f"{label} [1 rank]", f"{error.__name__} naming the rank and {what}; nothing changed")


@pytest.mark.parametrize("label,prepare,kwargs,error,text", LOCAL_CASES, ids=[c[0] for c in LOCAL_CASES])
def test_torch_raises_meshgrad_error_types(label, prepare, kwargs, error, text):
    from meshgrad.errors import FinalizeInputError, FinalizeTypeError

    model = _local_model()
    prepare(model)
    with pytest.raises(error, match=re.escape(text)) as raised:
        finalize_model_grads(model, **kwargs)
    assert isinstance(raised.value, FinalizeInputError if error is ValueError else FinalizeTypeError), raised.value


def test_nan_check_world_of_one_names_the_parameter(reliability):
    model = _local_model(check_for_nan_in_grad=True)
    param(model, "layer.experts.weight").main_grad[1] = float("inf")
    kind, message, untouched, _ = attempt(model, lambda m: finalize_model_grads(m, num_tokens=torch.tensor(3)))
    assert kind == "NonFiniteGradError" and untouched
    assert message.startswith("rank 0: NaN or Inf in the gradient of 'layer.experts.weight' (chunk 0)")
    assert issubclass(NonFiniteGradError, ValueError)
    reliability("bad input", "Inf in a gradient, check_for_nan_in_grad [1 rank]", "NonFiniteGradError; nothing changed")


BAD_CONFIGS = [
    (dict(consistency_check="sometimes"), ValueError, "consistency_check must be one of"),
    (dict(moe_router_bias_update_rate="0.1"), TypeError, "moe_router_bias_update_rate must be a real number"),
    (dict(moe_router_quantile_balancing_ema=float("nan")), ValueError, "moe_router_quantile_balancing_ema must be finite"),
    (dict(embedding_stages=(0, 1.5)), ValueError, "embedding_stages must be None or a sequence of ints"),
    (dict(position_embedding_stages=(-1,)), ValueError, "position_embedding_stages must be None or a sequence of ints"),
    (dict(mtp_num_layers=-1), ValueError, "mtp_num_layers must be None or an int >= 0"),
    (dict(sequence_parallel="yes"), TypeError, "sequence_parallel must be a bool"),
    (dict(no_such_option=True), ValueError, "unknown option(s) ['no_such_option']"),
]


@pytest.mark.parametrize("values,error,text", BAD_CONFIGS, ids=[next(iter(c[0])) for c in BAD_CONFIGS])
def test_unknown_config_values_are_rejected(reliability, values, error, text):
    with pytest.raises(error) as info:
        FinalizeConfig.from_mapping(values)
    assert text in str(info.value)
    reliability("bad input", f"config {values}", f"{error.__name__} naming the field")


def test_bad_megatron_config_value_raises_before_touching_anything(reliability):
    model = _local_model()
    model[0].config = types.SimpleNamespace(consistency_check="sometimes", calculate_per_token_loss=True)
    kind, message, untouched, _ = attempt(model, lambda m: finalize_model_grads(m))
    assert kind == "ValueError" and message.startswith("rank 0: ") and "sometimes" in message and untouched
    model[0].config = types.SimpleNamespace(expert_model_parallel_size=0)
    kind, message, untouched, _ = attempt(model, lambda m: finalize_model_grads(m))
    assert kind == "ValueError" and "config.expert_model_parallel_size must be a positive int" in message and untouched
    reliability("bad input", "Megatron config: consistency_check typo, ep = 0", "ValueError naming the field; nothing changed")


def test_error_classes():
    assert issubclass(ConsistencyError, RuntimeError) and issubclass(CollectiveError, RuntimeError)
    assert issubclass(NonFiniteGradError, ValueError)
