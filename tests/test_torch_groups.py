"""torch_impl.run.groups and finalize_model_grads' group validation in a gloo world of 8.

One world runs every ``case_*`` below on every rank; the tests compare with the groups
meshgrad.axes computes, and check that every validation error names the rank and the
group and leaves gradients and router state bit-identical.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from meshgrad import Group, ParallelDims, stage_set  # noqa: E402
from parity_tests.scenarios import Scenario, gpt_params, make_rank_inputs, moe_routers  # noqa: E402
from parity_tests.torch_world import build_model, collection, load_inputs, read_outputs, scenario_config  # noqa: E402
from parity_tests.world_cases import case_values, local_cases, run_cases  # noqa: E402

WORLD = 8
_CACHE: dict[Any, Any] = {}  # per worker process (tests only)

EXPERT_LAYOUTS = ((1, None, 1), (2, 1, 1), (4, 1, 1), (2, 2, 1))
MOE = Scenario(
    "pp2dp2tp2-moe",
    pp=2,
    dp=2,
    tp=2,
    ep=2,
    etp=1,
    params=gpt_params(experts=True),
    routers=moe_routers(),
    config=dict(moe_router_enable_expert_bias=True, sequence_parallel=True),
)


def _describe(groups: Any) -> dict[str, Any]:
    """What a TorchGroups says about every group (plain data)."""
    import torch.distributed as dist

    out: dict[str, Any] = {}
    for group in Group:
        pg = groups.group(group)
        out[group.value] = (None if pg is None else sorted(dist.get_process_group_ranks(pg)), groups.size(group))
    out["pp_ranks"] = list(groups.pp_ranks)
    out["stages"] = {g.value: groups.stages.get(g) for g in (Group.EMBD, Group.POS_EMBD)}
    return out


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    key = ("mesh", shape, names)
    if key not in _CACHE:
        _CACHE[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _CACHE[key]


# =========================================================================== cases (run on every rank)


def case_mesh_groups(rank: int, world: int) -> list[dict[str, Any]]:
    from torch_impl import mesh_groups

    mesh = _mesh((2, 2, 2), ("pp", "dp", "tp"))
    return [_describe(mesh_groups(mesh).resolve(ep=ep, etp=etp, egtp=egtp)) for ep, etp, egtp in EXPERT_LAYOUTS]


def case_mesh_gtp(rank: int, world: int) -> dict[str, Any]:
    from torch_impl import mesh_groups

    mesh = _mesh((2, 2, 2), ("dp", "gtp", "tp"))
    groups = mesh_groups(mesh)
    first = groups.resolve(ep=2, etp=1, egtp=2)
    assert groups.resolve(ep=2, etp=1, egtp=2) is first  # cached
    return _describe(first)


def case_mesh_permuted(rank: int, world: int) -> dict[str, Any]:
    from torch_impl import mesh_groups

    return _describe(mesh_groups(_mesh((2, 2, 2), ("tp", "dp", "pp"))).resolve())


def case_mesh_pp4_stages(rank: int, world: int) -> list[dict[str, Any]]:
    from torch_impl import mesh_groups

    groups = mesh_groups(_mesh((4, 2), ("pp", "tp")))
    return [_describe(groups.resolve()), _describe(groups.resolve(embedding_stages=(0, 1, 3), position_embedding_stages=(0, 2)))]


def case_bad_mesh_names(rank: int, world: int) -> str:
    from torch_impl import mesh_groups

    try:
        mesh_groups(_mesh((8,), ("data",)))
    except ValueError as err:
        return str(err)
    return "no error"


def case_collection_pp4(rank: int, world: int) -> tuple[dict[str, Any], Any]:
    from meshgrad import FinalizeConfig
    from torch_impl import TorchGroups

    scenario = Scenario("pp4tp2", pp=4, tp=2)
    groups = TorchGroups.from_collection(collection(scenario, _CACHE))
    sizes = groups.group_sizes(FinalizeConfig())
    return _describe(groups), (sizes.embd_stages, sizes.pos_embd_stages, sizes.pp, sizes[Group.TP])


def case_non_member_group(rank: int, world: int) -> str:
    import torch.distributed as dist

    from torch_impl import TorchGroups

    tp = dist.new_group([0, 1])  # NON_GROUP_MEMBER on ranks 2..7
    try:
        TorchGroups.from_collection(types.SimpleNamespace(tp=tp, pp=None, embd=None, pos_embd=None, dp_cp=None))
    except ValueError as err:
        return str(err)
    return "no error"


def case_reduce_scatter_layouts(rank: int, world: int) -> dict[str, Any]:
    """The documented shard layout, whether or not group ranks follow global ranks (where
    this torch can make a group whose ranks do not: :func:`_unsorted_groups`)."""
    import torch.distributed as dist

    from meshgrad.plan import ReduceOp
    from torch_impl.run.collectives import bind_reduce_scatter, reduce_scatter_into

    out: dict[str, Any] = {}
    queries: list[str] = []
    originals = {name: getattr(dist, name) for name in ("get_group_rank", "get_process_group_ranks")}

    def counted(name: str) -> Any:
        def query(*args: Any, **kwargs: Any) -> Any:
            queries.append(name)
            return originals[name](*args, **kwargs)

        return query

    layouts = [("sorted", list(range(8)), True), ("unsorted", list(range(7, -1, -1)), False)]
    out["unsorted"] = _unsorted_groups()
    for name, ranks, sort in layouts if out["unsorted"] else layouts[:1]:
        group = dist.new_group(ranks, sort_ranks=sort) if out["unsorted"] else dist.new_group(ranks)
        for op in (ReduceOp.SUM, ReduceOp.AVG):
            flat = torch.arange(11, dtype=torch.float32) + 100 * rank
            reduce_scatter_into(flat, group, op, 8, rank)
            out[f"{name}-{op}"] = flat.tolist()
            # bound once, run twice: the same values each time, and no question to the group
            bound = bind_reduce_scatter(group, op, 8, rank, 11)
            for name_ in originals:
                setattr(dist, name_, counted(name_))
            try:
                runs = []
                for _ in range(2):
                    flat = torch.arange(11, dtype=torch.float32) + 100 * rank
                    bound(flat)
                    runs.append(flat.tolist())
            finally:
                for name_, original in originals.items():
                    setattr(dist, name_, original)
            out[f"{name}-{op}-bound"] = runs
    out["queries while bound"] = queries
    return out


UNSORTED_MISSING = ("this torch's new_group has no sort_ranks (torch 2.11 has none, 2.13 has it): "
                    "its group ranks follow the global order")


def _unsorted_groups() -> bool:
    """Whether ``torch.distributed.new_group`` can keep the ranks in the order given
    (``sort_ranks=False``), so that group ranks run against the global order."""
    import inspect

    import torch.distributed as dist

    return "sort_ranks" in inspect.signature(dist.new_group).parameters


def _with(pgc: Any, **changes: Any) -> types.SimpleNamespace:
    fields = dict(vars(pgc))
    for name, value in changes.items():
        if value is _DROP:
            fields.pop(name)
        else:
            fields[name] = value
    return types.SimpleNamespace(**fields)


_DROP = object()


def case_finalize_validation(rank: int, world: int) -> list[tuple[str, bool]]:
    """Each bad call raises on every rank and leaves grads and router state untouched."""
    from torch_impl import finalize_model_grads

    pgc = collection(MOE, _CACHE)
    mesh_no_gtp = _mesh((2, 2, 2), ("pp", "dp", "tp"))
    calls = [
        ("tp_dp_cp", {}, lambda m: finalize_model_grads(m, pg_collection=_with(pgc, tp_dp_cp=_DROP))),
        ("expt_dp", {}, lambda m: finalize_model_grads(m, pg_collection=_with(pgc, expt_dp=_DROP))),
        ("gtp_remat", {"gtp_weight_remat_size": 2, "strict_groups": True}, lambda m: finalize_model_grads(m, pg_collection=pgc)),
        ("expt_gtp_remat", {"expert_gtp_weight_remat_size": 2, "strict_groups": True}, lambda m: finalize_model_grads(m, pg_collection=pgc)),
        ("gtp_remat", {"gtp_weight_remat_size": 2, "strict_groups": True}, lambda m: finalize_model_grads(m, pg_collection=mesh_no_gtp)),
        ("pg_collection", {}, lambda m: finalize_model_grads(m)),
        ("embd", {"embedding_stages": (0,)}, lambda m: finalize_model_grads(m, pg_collection=pgc)),
        ("ep", {"expert_model_parallel_size": 3}, lambda m: finalize_model_grads(m, pg_collection=mesh_no_gtp)),
        ("num_tokens", {}, lambda m: finalize_model_grads(m, num_tokens=torch.tensor([1, 2]), pg_collection=pgc)),
    ]
    out = []
    for _, extra, call in calls:
        config = scenario_config(MOE, finalize_config=False)
        for name, value in extra.items():
            setattr(config, name, value)
        model = build_model(MOE, rank, config)
        data = make_rank_inputs(MOE, rank)
        load_inputs(model, MOE, data)
        before = read_outputs(model, MOE, data)
        try:
            call(model)
            message = "no error"
        except (ValueError, TypeError) as err:
            message = f"{type(err).__name__}: {err}"
        after = read_outputs(model, MOE, data)
        same = all(
            (a is None and after.grads[k] is None) or np.array_equal(a, after.grads[k]) for k, a in before.grads.items()
        ) and all(
            np.array_equal(s.expert_bias, after.routers[k].expert_bias)
            and np.array_equal(s.local_tokens_per_expert, after.routers[k].local_tokens_per_expert)
            for k, s in before.routers.items()
        )
        out.append((message, same))
    return out


def case_one_collective_per_action(rank: int, world: int) -> tuple[int, int, int]:
    """Count all_reduce calls of a finalize; a second call reuses the cached plan."""
    import torch.distributed as dist

    from meshgrad.plan import Reduction, StageReduction
    from torch_impl import finalize_model_grads
    from torch_impl.finalize import ModelState

    scenario = Scenario("count", pp=2, dp=2, tp=2, num_chunks=2, params=gpt_params(),
                        config=dict(sequence_parallel=True, qk_layernorm=True, has_cond_embedder=True, flextron=True))
    model = build_model(scenario, rank, scenario_config(scenario, False))
    load_inputs(model, scenario, make_rank_inputs(scenario, rank))
    pgc = collection(scenario, _CACHE)
    calls = []
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        finalize_model_grads(model, pg_collection=pgc)
        first = len(calls)
        finalize_model_grads(model, pg_collection=pgc)
    finally:
        dist.all_reduce = original
    (bound,) = ModelState.of(model).plans.values()
    stage = rank // 4
    expected = sum(
        1 for a in bound.plan.actions
        if isinstance(a, Reduction) or (isinstance(a, StageReduction) and a.key_for(stage) is not None)
    )
    return first, len(calls) - first, expected


def _distributed_frames(run: Any) -> list[str]:
    """The ``torch.distributed`` Python functions ``run()`` enters, in order."""
    import sys

    names: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and "torch/distributed" in frame.f_code.co_filename.replace("\\", "/"):
            names.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return names


class _Tagged(torch.Tensor):
    """A tensor subclass: torch.distributed's functions honour its __torch_function__."""


def _on_path(name: str, path: str, run: Any, note: Any) -> tuple[list[str], list[Any]]:
    """``run()`` with ``torch.distributed.<name>`` wrapped when ``path`` is "wrapped" (the
    wrapper appends ``note(*args, **kwargs)`` and calls torch's function).

    Returns:
      The ``torch.distributed`` Python functions ``run()`` entered, and what the wrapper noted.
    """
    import torch.distributed as dist

    original, noted = getattr(dist, name), []

    def spy(*args: Any, **kwargs: Any) -> Any:
        noted.append(note(*args, **kwargs))
        return original(*args, **kwargs)

    if path == "wrapped":
        setattr(dist, name, spy)
    try:
        return _distributed_frames(run), noted
    finally:
        setattr(dist, name, original)


def case_bound_all_reduce_paths(rank: int, world: int) -> dict[str, Any]:
    """bind_all_reduce over this rank's group of four, on each of its paths: the process
    group called directly (torch's own ``all_reduce`` in place, a plain tensor), and
    ``torch.distributed.all_reduce`` itself (a wrapper installed over it, a tensor subclass,
    an active torch function mode). Per call: the values, and the ``torch.distributed``
    Python functions it entered."""
    import contextlib

    import torch.distributed as dist
    from torch.overrides import TorchFunctionMode

    from meshgrad.plan import ReduceOp
    from torch_impl.run.collectives import bind_all_reduce

    halves = [dist.new_group([0, 1, 2, 3]), dist.new_group([4, 5, 6, 7])]
    group = halves[rank // 4]

    class Recording(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    out: dict[str, Any] = {}
    for op in (ReduceOp.SUM, ReduceOp.AVG):
        reduce = bind_all_reduce(group, op, 4)
        for path in ("direct", "wrapped", "subclass", "mode"):
            tensor = torch.arange(5, dtype=torch.float32) + 10 * rank
            if path == "subclass":
                tensor = tensor.as_subclass(_Tagged)
            mode = Recording()

            def run() -> None:
                with mode if path == "mode" else contextlib.nullcontext():
                    reduce(tensor)

            functions, spied = _on_path("all_reduce", path, run, lambda t, *args, **kwargs: t.numel())
            out[f"{op.value}-{path}"] = dict(values=tensor.as_subclass(torch.Tensor).tolist(), spied=spied,
                                             mode=mode.seen, all_reduce="all_reduce" in functions)
    untouched = torch.arange(3, dtype=torch.float32)
    bind_all_reduce(None, ReduceOp.SUM, 1)(untouched)
    out["no group"] = untouched.tolist()
    return out


def case_broadcast_paths(rank: int, world: int) -> dict[str, Any]:
    """collectives.bind_broadcast from a global rank over a group whose ranks run against
    the global order (group rank 0 is global rank 7), bound before each path is set up, on
    its paths: the group called directly, and ``torch.distributed.broadcast`` (a wrapper
    installed over it after binding, a tensor subclass). Per source and path: the values,
    whether torch's Python layer was entered, what the wrapper saw."""
    import torch.distributed as dist

    from torch_impl.run.collectives import bind_broadcast

    if not _unsorted_groups():
        return {"skipped": UNSORTED_MISSING}
    group = dist.new_group(list(range(7, -1, -1)), sort_ranks=False)
    out: dict[str, Any] = {"group rank of 7": dist.get_group_rank(group, 7)}
    for src in (7, 2):
        for path in ("direct", "wrapped", "subclass"):
            tensor = torch.full((3,), 10.0 * rank + 1, dtype=torch.float64)
            if path == "subclass":
                tensor = tensor.as_subclass(_Tagged)
            cast = bind_broadcast(src, group)
            entered, spied = _on_path("broadcast", path, lambda: cast(tensor),
                                      lambda t, *args, **kwargs: kwargs.get("src", args[0] if args else None))
            out[f"{src}-{path}"] = dict(values=tensor.as_subclass(torch.Tensor).tolist(), spied=spied,
                                        entered="broadcast" in entered)
    return out

CASES = local_cases(globals())


# =========================================================================== tests (parent)


@pytest.fixture(scope="module")
def world() -> dict[str, list[tuple[str, Any]]]:
    return run_cases(__name__, CASES, WORLD, timeout=300)


_ok = case_values


def _expected(dims: ParallelDims, rank: int, embd=None, pos=None) -> dict[str, Any]:
    embd = stage_set(embd, dims.pp, "first_last")
    pos = stage_set(pos, dims.pp, "first")
    out: dict[str, Any] = {}
    for group in Group:
        stages = embd if group is Group.EMBD else pos if group is Group.POS_EMBD else None
        ranks = dims.group_ranks(group, rank, stages)
        out[group.value] = (ranks if len(ranks) > 1 else None, max(len(ranks), 1))
    out["pp_ranks"] = dims.group_ranks(Group.PP, rank)
    stage = dims.coords(rank)["pp"]
    out["stages"] = {"embd": embd if stage in embd else None, "pos_embd": pos if stage in pos else None}
    return out


def test_mesh_groups_match_meshgrad_axes(world):
    for rank, layouts in enumerate(_ok(world, "case_mesh_groups")):
        for (ep, etp, egtp), got in zip(EXPERT_LAYOUTS, layouts):
            dims = ParallelDims(pp=2, dp=2, tp=2, ep=ep, etp=etp, egtp=egtp)
            assert got == _expected(dims, rank), (rank, ep, etp)


def test_mesh_groups_with_gtp_remat(world):
    dims = ParallelDims(dp=2, gtp=2, tp=2, ep=2, etp=1, egtp=2)
    for rank, got in enumerate(_ok(world, "case_mesh_gtp")):
        assert got == _expected(dims, rank)


def test_mesh_dim_order_is_taken_from_names(world):
    for rank, got in enumerate(_ok(world, "case_mesh_permuted")):
        tp, dp, pp = rank // 4, (rank // 2) % 2, rank % 2  # mesh tensor is arange(8) as (tp, dp, pp)
        assert got["tp"][0] == sorted(4 * t + 2 * dp + pp for t in range(2))
        assert got["dp_cp"][0] == sorted(4 * tp + 2 * d + pp for d in range(2))
        assert got["pp_ranks"] == [4 * tp + 2 * dp + p for p in range(2)]
        assert got["tp_dp_cp"][0] == sorted(4 * t + 2 * d + pp for t in range(2) for d in range(2))


def test_mesh_embedding_stage_sets(world):
    dims = ParallelDims(pp=4, tp=2)
    for rank, (default, custom) in enumerate(_ok(world, "case_mesh_pp4_stages")):
        assert default == _expected(dims, rank)
        assert custom == _expected(dims, rank, embd=(0, 1, 3), pos=(0, 2))


def test_bad_mesh_dim_names(world):
    for rank, message in enumerate(_ok(world, "case_bad_mesh_names")):
        assert f"rank {rank}" in message and "data" in message


def test_collection_groups_and_sizes(world):
    dims = ParallelDims(pp=4, tp=2)
    for rank, (got, sizes) in enumerate(_ok(world, "case_collection_pp4")):
        want = _expected(dims, rank)
        assert {k: v for k, v in got.items() if k != "stages"} == {k: v for k, v in want.items() if k != "stages"}
        stage = rank // 2
        assert got["stages"]["embd"] == ((0, 3) if stage in (0, 3) else None)
        # Non-members (and a None size-1 group) plan with the configured set without
        # their own stage: nothing to do for them.
        assert sizes == ((0, 3), () if stage == 0 else (0,), 4, 2)


def test_validation_errors_name_rank_and_group_and_mutate_nothing(world):
    expected = ["tp_dp_cp", "expt_dp", "gtp_remat", "expt_gtp_remat", "gtp_remat", "pg_collection", "embd", "ep", "num_tokens"]
    for rank, results in enumerate(_ok(world, "case_finalize_validation")):
        for what, (message, untouched) in zip(expected, results):
            assert message != "no error", what
            assert f"rank {rank}" in message and what.split("_size")[0] in message, (what, message)
            assert untouched, (what, message)


def test_one_collective_per_planned_reduction_and_cached_plan(world):
    for rank, (first, second, expected) in enumerate(_ok(world, "case_one_collective_per_action")):
        assert first == second == expected > 0, rank


def test_bound_all_reduce_calls_the_group_unless_torch_distributed_is_wrapped(world):
    """Values on both paths; the process group is called directly only where
    ``torch.distributed.all_reduce`` would do nothing else (it is torch's own, the tensor is
    plain, no torch function mode is active): a wrapper, a subclass and a mode see the call."""
    for rank, got in enumerate(_ok(world, "case_bound_all_reduce_paths")):
        members = range(4 * (rank // 4), 4 * (rank // 4) + 4)
        total = [float(sum(i + 10 * r for r in members)) for i in range(5)]
        assert got.pop("no group") == [0.0, 1.0, 2.0]
        for name, call in got.items():
            op, path = name.split("-")
            assert call["values"] == (total if op == "sum" else [t / 4 for t in total]), (rank, name)
            assert call["all_reduce"] == (path != "direct"), (rank, name)  # torch's own Python layer entered
            assert call["spied"] == ([5] if path == "wrapped" else []), (rank, name)
            assert ("all_reduce" in call["mode"]) == (path == "mode"), (rank, name, call["mode"])


def test_broadcast_calls_the_group_unless_torch_distributed_is_wrapped(world):
    """The source's values on every rank, the source given as a global rank and translated
    to its group rank; the group called directly only where ``torch.distributed.broadcast``
    would do nothing else."""
    for rank, got in enumerate(_ok(world, "case_broadcast_paths")):
        if got == {"skipped": UNSORTED_MISSING}:
            pytest.skip(UNSORTED_MISSING)
        assert got.pop("group rank of 7") == 0
        for name, call in got.items():
            src, path = name.split("-")
            assert call["values"] == [10.0 * int(src) + 1] * 3, (rank, name)
            assert call["entered"] == (path != "direct"), (rank, name)
            assert call["spied"] == ([int(src)] if path == "wrapped" else []), (rank, name)


def test_group_of_other_ranks_is_rejected(world):
    for rank, message in enumerate(_ok(world, "case_non_member_group")):
        if rank < 2:
            assert message == "no error"
        else:
            assert f"rank {rank} is not a member of the 'tp' group" in message


def test_reduce_scatter_keeps_own_shard(world):
    """Each rank's shard holds the reduction, the rest its own values; bound once, a
    reduce-scatter gives the same on every call and asks the group nothing per call."""
    for rank, got in enumerate(_ok(world, "case_reduce_scatter_layouts")):
        start, stop = min(2 * rank, 11), min(2 * rank + 2, 11)
        assert got["queries while bound"] == [], rank
        for name in ("sorted", "unsorted") if got["unsorted"] else ("sorted",):
            for op, n in (("sum", 1), ("avg", 8)):
                want = [float(i + 100 * rank) for i in range(11)]
                for i in range(start, stop):
                    want[i] = (8 * i + 100 * 28) / n
                assert got[f"{name}-{op}"] == want, (rank, name, op)
                assert got[f"{name}-{op}-bound"] == [want, want], (rank, name, op)


def test_a_group_size_warning_points_at_the_users_line():
    import warnings

    from meshgrad.axes import Group
    from torch_impl.run.groups import TorchGroups

    groups = TorchGroups.trivial(rank=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        groups.check(expected={Group.TP: (2, "config.tensor_model_parallel_size")}, strict=False)  # the user's line
    (warning,) = [w for w in caught if "expected size 2" in str(w.message)]
    assert warning.filename == __file__, warning.filename
    assert "process group 'tp'" in str(warning.message) and "config.tensor_model_parallel_size" in str(warning.message)
