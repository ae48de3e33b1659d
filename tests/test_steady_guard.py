"""The steady check written down as probes (``torch_impl.call.steady.SteadyGuard``,
``torch_impl.call.probes``): a Megatron-DDP step answered by its probes gives the numbers
the full check gives, and every change the full check sees makes the probes miss.

World of one rank (no process group): each step's gradients are checked after the
num_tokens scale, and for every change the probes are held against the full check
itself (probes that hold while the full check fails would be a bug).
"""

from __future__ import annotations

import functools
import importlib
import operator
import random
import sys
import types
from collections.abc import Callable

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from meshgrad import FinalizeConfig  # noqa: E402
from torch_impl import finalize_model_grads, invalidate_plans  # noqa: E402
from torch_impl.call.config_memo import ConfigMemo  # noqa: E402
from torch_impl.call.group_memo import GroupMemo, probe_world_size  # noqa: E402
from torch_impl.call.memo import probe_absent  # noqa: E402
from torch_impl.call.model_state import ModelState  # noqa: E402
from torch_impl.call.probes import Probes  # noqa: E402
from torch_impl.call.read import Request  # noqa: E402
from torch_impl.sources.megatron import PARALLEL_STATE  # noqa: E402
from torch_impl.sources.wrappers import ReadRecorder, find_attr, unwrap  # noqa: E402
from test_steady_path import fake_parallel_state  # noqa: E402

steady = importlib.import_module("torch_impl.call.steady")

#: Attributes no result reads (a Megatron config holds hundreds: then it is read by name).
FILLER = {f"unread_{i}": i for i in range(60)}


class Config:
    """A Megatron-like config: a plain class (as a dataclass is), whose missing names are
    probed on its instance dict and class dict."""

    def __init__(self, **fields: object) -> None:
        vars(self).update(fields)


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(3))
        self.b = nn.Parameter(torch.zeros(2, 2))


class DDP(nn.Module):
    """A Megatron-DDP-like chunk: it owns the DP sync (counted) and the scale."""

    def __init__(self, inner: nn.Module, config: object) -> None:
        super().__init__()
        self.module, self.config = inner, config
        self.ddp_config = types.SimpleNamespace(use_distributed_optimizer=False, grad_reduce_in_fp32=False)
        self.syncs = 0
        self.fill()

    def fill(self) -> None:
        for i, p in enumerate(self.module.parameters()):
            if getattr(p, "main_grad", None) is None:
                p.main_grad = torch.empty(p.shape)
            p.main_grad.fill_(float(4 * (i + 1)))

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        self.syncs += 1

    def scale_gradients(self, scale: torch.Tensor) -> None:
        for p in self.module.parameters():
            p.main_grad.mul_(scale)


def model() -> list[DDP]:
    return [DDP(Inner(), Config(calculate_per_token_loss=True, qk_layernorm=False, **FILLER))]


def step(chunks: list[DDP], n: int) -> None:
    """One finalize of freshly filled gradients, checked: each gradient divided by n (a
    power of two: exact), one DP sync per chunk."""
    syncs = [c.syncs for c in chunks]
    for c in chunks:
        c.fill()
    want = [p.main_grad / n for c in chunks for p in c.module.parameters()]
    finalize_model_grads(chunks, num_tokens=torch.tensor(n))
    got = [p.main_grad for c in chunks for p in c.module.parameters()]
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert [c.syncs for c in chunks] == [s + 1 for s in syncs]


def guard_of(chunks: list[DDP]) -> steady.SteadyGuard:
    (guard,) = ModelState.of(chunks).steady_guards.values()
    return guard


def probes_hold(chunks: list[DDP]) -> bool:
    """Whether the kept probes answer the next finalize call."""
    state = ModelState.of(chunks)
    if not state.steady:
        return False
    (kind, last), = state.steady.items()
    guard = state.steady_guards.get(kind)
    return guard is not None and guard.holds(last, None, Request(num_tokens=torch.tensor(1)))


def full_check_passes(chunks: list[DDP]) -> bool:
    """The full steady check of the next finalize call, without the probes."""
    state = ModelState.of(chunks)
    kept = dict(state.steady_guards)
    state.steady_guards.clear()
    try:
        return steady.steady_read(chunks, None, Request(num_tokens=torch.tensor(1)), {}) is not None
    finally:
        state.steady_guards.update(kept)


@pytest.fixture
def full_checks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the full steady checks (the probes answer without resolving the configs)."""
    seen: list[int] = []
    original = steady.config_sources

    def counted(*args: object) -> object:
        seen.append(1)
        return original(*args)

    monkeypatch.setattr(steady, "config_sources", counted)
    return seen


def test_the_probes_answer_a_repeated_ddp_step_with_the_same_numbers(full_checks: list[int]) -> None:
    chunks = model()
    for n in (2, 4, 8, 4, 2):
        step(chunks, n)
    # call 1 reads and plans, call 2 takes the full check and writes the probes, the rest hold
    assert len(full_checks) == 1
    guard = guard_of(chunks)
    assert guard.probes is not None and guard.builds == 1
    assert 0 < len(guard.probes) < 40


def _set_read_field(chunks: list[DDP]) -> None:
    chunks[0].config.qk_layernorm = True


def _define_absent_field(chunks: list[DDP]) -> None:
    chunks[0].config.check_for_nan_in_grad = True


def _define_absent_on_class(chunks: list[DDP]) -> None:
    Config.check_for_nan_in_grad = True


def _replace_config(chunks: list[DDP]) -> None:
    chunks[0].config = Config(calculate_per_token_loss=True, qk_layernorm=False, **FILLER)


def _replace_ddp_config(chunks: list[DDP]) -> None:
    chunks[0].ddp_config = types.SimpleNamespace(use_distributed_optimizer=False, grad_reduce_in_fp32=False)


def _change_ddp_config(chunks: list[DDP]) -> None:
    chunks[0].ddp_config.grad_reduce_in_fp32 = True


def _tie_embeddings(chunks: list[DDP]) -> None:
    inner = chunks[0].module
    inner.share_embeddings_and_output_weights = True
    inner.shared_embedding_or_output_weight = lambda: inner.a


def _add_position_embedding(chunks: list[DDP]) -> None:
    chunks[0].module.position_embeddings = nn.Embedding(2, 2)


def _stop_unwrap_early(chunks: list[DDP]) -> None:
    chunks[0].pre_process = True


def _replace_inner_module(chunks: list[DDP]) -> None:
    chunks[0].module = Inner()


def _register_parameter(chunks: list[DDP]) -> None:
    chunks[0].module.c = nn.Parameter(torch.zeros(1))


def _load_parallel_state(chunks: list[DDP]) -> None:
    module = types.ModuleType(PARALLEL_STATE)
    module.model_parallel_is_initialized = lambda: False  # loaded, not initialized: still no groups
    sys.modules[PARALLEL_STATE] = module


def _invalidate(chunks: list[DDP]) -> None:
    invalidate_plans(chunks)


CHANGES = [
    _set_read_field, _define_absent_field, _define_absent_on_class, _replace_config, _replace_ddp_config,
    _change_ddp_config, _tie_embeddings, _add_position_embedding, _stop_unwrap_early, _replace_inner_module,
    _register_parameter, _load_parallel_state, _invalidate,
]


@pytest.fixture
def restore(monkeypatch: pytest.MonkeyPatch) -> None:
    """Undo what the changes do outside the model (a class attribute, sys.modules)."""
    monkeypatch.delitem(sys.modules, PARALLEL_STATE, raising=False)
    monkeypatch.delattr(Config, "check_for_nan_in_grad", raising=False)
    yield
    if "check_for_nan_in_grad" in vars(Config):
        del Config.check_for_nan_in_grad
    # the stub a change loaded goes (monkeypatch then puts back the module it removed, if
    # any): left in sys.modules, it would break a later import of megatron-core itself
    sys.modules.pop(PARALLEL_STATE, None)


@pytest.mark.parametrize("change", CHANGES, ids=lambda f: f.__name__.strip("_"))
def test_every_change_the_full_check_sees_makes_the_probes_miss(change, restore: None) -> None:
    chunks = model()
    for n in (2, 4, 8):
        step(chunks, n)
    assert probes_hold(chunks) and full_check_passes(chunks)
    change(chunks)
    holds, passes = probes_hold(chunks), full_check_passes(chunks)
    assert not holds, "the probes hold over a change"
    # parallel_state loaded but not initialized gives no groups, as before: the full check
    # passes, the probes (the module absent) miss and are written again
    assert not passes or change is _load_parallel_state, "a change the full check ignores"
    for n in (16, 32):  # the stages (or the full check) read the change; the numbers stay right
        step(chunks, n)
    assert full_check_passes(chunks)
    # probes again (an embedding weight now watched is checked by its watch, in the probes)
    assert probes_hold(chunks)


def test_a_change_nothing_reads_keeps_the_probes(full_checks: list[int]) -> None:
    chunks = model()
    for n in (2, 4):
        step(chunks, n)
    chunks[0].config.unread_3 = "changed"  # no FinalizeConfig field
    chunks[0].module.a.main_grad.fill_(7.0)  # gradient values: every step
    chunks[0].training = False
    assert probes_hold(chunks)
    step(chunks, 16)
    assert len(full_checks) == 1


def test_probes_that_miss_every_step_are_written_a_bounded_number_of_times(full_checks: list[int]) -> None:
    chunks = model()
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
        # a new bound sync function each step: the full check passes (still callable), the
        # probes (the same function of the same object) miss
        chunks[0].finish_grad_sync = types.MethodType(lambda self, **kw: DDP.finish_grad_sync(self, **kw), chunks[0])
        step(chunks, n)
    guard = guard_of(chunks)
    assert guard.probes is None and guard.builds == steady.MAX_GUARD_BUILDS + 1
    assert len(full_checks) == 9  # every call after the first


def test_probes_compare_by_identity_by_value_and_live_containers() -> None:
    one, state, box = torch.ones(1), {"x": 1}, [0]
    probes = Probes()
    probes.same(lambda: one, one)
    probes.equal(lambda: (1, "a"), (1, "a"))
    probes.live(state, dict(state))
    probes.same(lambda: box[0], 0)
    assert probes.hold() and len(probes) == 4
    box[0] = 1
    assert not probes.hold()
    box[0] = 0
    state["x"] = 2
    assert not probes.hold()
    state["x"] = 1
    assert probes.hold()
    identity = Probes()
    other = torch.ones(1)  # equal, not the same object
    identity.same(lambda: other, one)
    assert not identity.hold()
    raising = Probes()
    raising.equal(lambda: torch.ones(3), torch.zeros(3))  # an elementwise comparison's error
    raising.same(lambda: 1 / 0, 0)
    assert not raising.hold()
    checked = Probes()
    checked.check(lambda: box[0] == 0)  # a bulk check: it must answer True
    assert checked.hold() and len(checked) == 1
    box[0] = 2
    assert not checked.hold()
    checked.check(lambda: 1 / 0)
    box[0] = 0
    assert not checked.hold()  # a check that raises: a change


def test_partial_probes_replay_the_same_call_without_the_partial() -> None:
    one, box = torch.ones(1), {"x": 1}
    tensor_box = {"t": one}
    probes = Probes()
    probes.same(functools.partial(dict.get, tensor_box, "t"), one)  # kept as (dict.get, tensor_box, "t")
    probes.equal(functools.partial(dict.get, box, "x", 0), 1)
    probes.equal(functools.partial(int, "11", base=2), 3)  # keywords: the partial itself is called
    probes.same(lambda: box.get("x"), 1)
    assert probes.same_probes[0] == (dict.get, tensor_box, "t") and probes.equal_probes[0] == (dict.get, box, "x", 0)
    assert len(probes.equal_probes[1]) == 1 and probes.hold() and len(probes) == 4
    tensor_box["t"] = torch.ones(1)  # equal, another object: a change for a same probe
    assert not probes.hold()
    tensor_box["t"] = one
    box["x"] = 2
    assert not probes.hold()
    box["x"] = 1
    assert probes.hold()
    del tensor_box["t"]  # dict.get gives None: a change
    assert not probes.hold()
    raising = Probes()
    raising.equal(functools.partial(operator.truediv, 1, 0), 0)  # a call that raises: a change
    assert not raising.hold()


def test_absent_names_are_probed_on_the_instance_and_every_class() -> None:
    class Base:
        pass

    class Cfg(Base):
        pass

    cfg = Cfg()
    probes = Probes()
    probe_absent(probes, cfg, ("x", "y"))
    assert probes.hold() and len(probes) == 5  # class, dict, its keys, each class's keys
    for owner in (cfg, Base, Cfg):
        owner.y = 1
        assert not probes.hold()
        del owner.y
        assert probes.hold()
    Cfg.__getattr__ = lambda self, name: 0  # every missing name readable now
    assert not probes.hold()
    per_name = Probes()
    probe_absent(per_name, cfg, ("x", "y"))  # a look-up hook of its own: one hasattr per name
    assert len(per_name) == 2 and not per_name.hold()
    del Cfg.__getattr__
    assert probes.hold() and per_name.hold()


def test_the_read_recorder_writes_each_read_once_and_sees_a_compiled_wrapper() -> None:
    chunk = model()[0]
    probes = Probes()
    read = ReadRecorder(probes)
    assert unwrap(chunk, read=read) is chunk.module
    assert find_attr(chunk, "config", read) is chunk.config
    # unwrap: pre_process and module on both objects; find_attr: config on the first
    assert len(probes) == 5 and probes.hold() and not read.compiled
    chunk.module.pre_process = True
    assert not probes.hold()
    compiled = torch.compile(nn.Linear(1, 1))  # a wrapper the walks read through, unprobed
    first = ReadRecorder(Probes())
    first.start(compiled)
    holder = nn.Module()
    holder.module = compiled
    inner = ReadRecorder(Probes())
    inner.start(holder)
    assert not inner.compiled
    assert inner(holder, "module") is compiled
    assert first.compiled and inner.compiled


def _written(write: Callable[[Probes], object]) -> Probes:
    probes = Probes()
    assert write(probes) is not False
    return probes


def test_the_config_memos_probes_hold_exactly_while_the_memo_is_unchanged() -> None:
    memo = ConfigMemo()
    raw, ddp = Config(calculate_per_token_loss=True, **FILLER), types.SimpleNamespace(bucket_size=4)
    config, requested = memo.config(raw, ddp), memo.requested(raw)
    probes = _written(lambda p: memo.probe(p, raw, ddp, requested))

    def agree(want: bool) -> None:
        assert memo.unchanged(raw, ddp, config, requested) is want and probes.hold() is want

    agree(True)
    raw.tensor_model_parallel_size = 2  # a stated size
    agree(False)
    del raw.tensor_model_parallel_size
    agree(True)
    raw.unread_1 = "changed"  # nothing reads it
    agree(True)
    Config.sequence_parallel = True  # a read name, defined on the class
    agree(False)
    del Config.sequence_parallel
    agree(True)
    ddp.grad_reduce_in_fp32 = True  # a small config: its whole dict
    agree(False)
    del ddp.grad_reduce_in_fp32
    agree(True)
    memo.config(Config(**FILLER), None)  # another call resolved another config
    assert not probes.hold() and not memo.unchanged(raw, ddp, config, requested)


def test_the_group_memos_probes_follow_parallel_state(monkeypatch: pytest.MonkeyPatch) -> None:
    ps = fake_parallel_state(monkeypatch)
    memo, config = GroupMemo(), FinalizeConfig()
    groups = memo.parallel_state_groups()
    probes = _written(lambda p: memo.probe(p, None, config, groups))

    def agree(want: bool) -> None:
        assert memo.unchanged(None, config, groups) is want and probes.hold() is want

    agree(True)
    ps._SOME_GLOBAL = 1  # a global no getter reads
    agree(True)
    getter = ps.get_tensor_model_parallel_group
    ps.get_tensor_model_parallel_group = lambda **kwargs: None  # a getter replaced
    agree(False)
    ps.get_tensor_model_parallel_group = getter
    agree(True)
    ps.initialized = False  # no longer initialized
    agree(False)
    ps.initialized = True
    agree(True)
    monkeypatch.delitem(sys.modules, PARALLEL_STATE)  # unloaded
    agree(False)
    monkeypatch.setitem(sys.modules, PARALLEL_STATE, types.ModuleType(PARALLEL_STATE))  # another module
    agree(False)


def test_the_world_size_probe_follows_the_default_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from torch_impl.run.groups import world_size

    class Group:  # stands in for a default process group (all the world size reads of it)
        def __init__(self, size: int) -> None:
            self.ranks = size

        def size(self) -> int:
            return self.ranks

    world = dist.distributed_c10d._world
    monkeypatch.setattr(world, "_default_pg", None)
    probes = _written(lambda p: probe_world_size(p, world_size()))
    assert world_size() == 1 and probes.hold()
    first = Group(4)
    monkeypatch.setattr(world, "_default_pg", first)  # initialized: another world size
    assert world_size() == 4 and not probes.hold()
    probes = _written(lambda p: probe_world_size(p, 4))
    assert probes.hold()
    monkeypatch.setattr(world, "_default_pg", Group(4))  # re-initialized, the same size: a miss all the same
    assert world_size() == 4 and not probes.hold()
    monkeypatch.setattr(world, "_default_pg", first)
    assert probes.hold()
    stale = _written(lambda p: probe_world_size(p, 2))  # a size the world does not have: read again
    assert not stale.hold() and len(stale) == 1


def test_a_watch_that_comes_to_cover_more_makes_the_probes_miss() -> None:
    chunks = model()
    for n in (2, 4, 8):
        step(chunks, n)
    assert probes_hold(chunks)
    (_, _, watch, _), = ModelState.of(chunks).found.values()
    watch.cover([(0, "a")])  # what another call's plan reads is watched from now on
    assert not probes_hold(chunks) and full_check_passes(chunks)
    step(chunks, 16)  # the full check passes and writes the probes of the new watch
    assert probes_hold(chunks)
    step(chunks, 32)


def _toggle_read_field(chunks: list[DDP]) -> None:
    chunks[0].config.qk_layernorm = not chunks[0].config.qk_layernorm


def _toggle_absent_field(chunks: list[DDP]) -> None:
    config = chunks[0].config
    if "check_for_nan_in_grad" in vars(config):
        del config.check_for_nan_in_grad
    else:
        config.check_for_nan_in_grad = False


def _toggle_absent_on_class(chunks: list[DDP]) -> None:
    if "check_for_nan_in_grad" in vars(Config):
        del Config.check_for_nan_in_grad
    else:
        Config.check_for_nan_in_grad = False


def _toggle_ddp_config(chunks: list[DDP]) -> None:
    ddp_config = chunks[0].ddp_config
    ddp_config.grad_reduce_in_fp32 = not ddp_config.grad_reduce_in_fp32


def _toggle_parallel_state(chunks: list[DDP]) -> None:
    if PARALLEL_STATE in sys.modules:
        del sys.modules[PARALLEL_STATE]
    else:
        _load_parallel_state(chunks)


def _unread_change(chunks: list[DDP]) -> None:
    chunks[0].config.unread_7 = object()
    chunks[0].training = not chunks[0].training


def test_random_changes_between_steps_never_leave_probes_holding_over_a_change(restore: None) -> None:
    """80 steps, a random change before each (a reversible one, so later steps return to
    states seen before): every step's numbers are right, and whenever the probes would
    answer, the full check passes too."""
    rng = random.Random(0)
    changes = [
        _toggle_read_field, _toggle_absent_field, _toggle_absent_on_class, _replace_config, _replace_ddp_config,
        _toggle_ddp_config, _toggle_parallel_state, _invalidate, _unread_change, _unread_change, _unread_change,
    ]
    chunks = model()
    held = 0
    for _ in range(80):
        rng.choice(changes)(chunks)
        if probes_hold(chunks):
            held += 1
            assert full_check_passes(chunks)
        step(chunks, rng.choice((1, 2, 4, 8, 16)))
    assert held > 10  # the probes did answer between the changes
