"""The steady path of finalize_model_grads (``torch_impl.call.steady``): a call that finds
everything the last call read unchanged takes its inputs and plan without the read and
plan stages; any change a stage would see sends the call through them again.

World of one rank (no process group): num_tokens scaling makes every gradient the plan
touches observable, so each step's values are checked, and the read stage's calls are
counted.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from meshgrad import FinalizeConfig, Group  # noqa: E402
from torch_impl import finalize_model_grads, invalidate_plans, reset_model_temporary_tensors  # noqa: E402
from torch_impl.call.config_memo import ConfigMemo  # noqa: E402
from torch_impl.call.group_memo import GroupMemo  # noqa: E402
from torch_impl.call.model_state import ModelState  # noqa: E402
from torch_impl.run.groups import TorchGroups  # noqa: E402
from torch_impl.sources.config import Requested  # noqa: E402
from torch_impl.sources.megatron import PARALLEL_STATE  # noqa: E402
from stage_counts import counted_reads  # noqa: E402

#: Attributes no result reads: a Megatron config holds hundreds (then it is checked by name).
FILLER = {f"unread_{i}": i for i in range(60)}


def megatron_like_config(**fields: object) -> types.SimpleNamespace:
    return types.SimpleNamespace(calculate_per_token_loss=True, **fields, **FILLER)


class Chunk(nn.Module):
    def __init__(self, config: object) -> None:
        super().__init__()
        self.config = config
        self.a = nn.Parameter(torch.zeros(3))
        self.b = nn.Parameter(torch.zeros(2, 2))
        self.fill()

    def fill(self) -> None:
        """Gradients in place (as in a DDP's buffer), made on the first fill."""
        for i, p in enumerate(self.parameters()):
            if getattr(p, "main_grad", None) is None:
                p.main_grad = torch.empty(p.shape)
            p.main_grad.fill_(float(4 * (i + 1)))


@pytest.fixture
def reads() -> Iterator[list[int]]:
    """Counts the calls that went through the read stage."""
    with counted_reads() as seen:
        yield seen


def step(model: list[Chunk], n: int = 2, **kwargs: object) -> dict[str, torch.Tensor]:
    """One finalize of freshly filled gradients; returns the gradients after it."""
    for chunk in model:
        chunk.fill()
    finalize_model_grads(model, num_tokens=torch.tensor(n), **kwargs)
    return {f"{i}.{name}": p.main_grad.clone() for i, chunk in enumerate(model) for name, p in chunk.named_parameters()}


def scaled(model: list[Chunk], n: int, frozen: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """The gradients a step with ``n`` tokens leaves (frozen ones untouched)."""
    out = {}
    for i, chunk in enumerate(model):
        chunk.fill()
        for name, p in chunk.named_parameters():
            key = f"{i}.{name}"
            out[key] = p.main_grad.clone() if key in frozen else p.main_grad / n
    return out


def assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key in got:
        assert torch.equal(got[key], want[key]), key


def test_a_repeat_call_takes_the_steady_path_with_the_same_numbers(reads: list[int]) -> None:
    model = [Chunk(megatron_like_config()), Chunk(megatron_like_config())]
    for n in (2, 4, 8, 4):
        assert_equal(step(model, n), scaled(model, n))
    assert len(reads) == 1  # the first call only
    assert ModelState.of(model).stats.plans_built == 1


def _mutate_config(model: list[Chunk]) -> None:
    model[0].config.sequence_parallel = True  # a field FinalizeConfig reads


def _add_absent_field(model: list[Chunk]) -> None:
    model[0].config.consistency_check = "every_step"


def _replace_config(model: list[Chunk]) -> None:
    model[0].config = megatron_like_config()  # equal values, another object


def _freeze(model: list[Chunk]) -> None:
    model[0].b.requires_grad_(False)


def _replace_parameter(model: list[Chunk]) -> None:
    model[0].a = nn.Parameter(torch.zeros(3))


def _replace_parameter_directly(model: list[Chunk]) -> None:
    model[0]._parameters["a"] = nn.Parameter(torch.zeros(3))  # no registration hook sees it


def _invalidate(model: list[Chunk]) -> None:
    invalidate_plans(model)


@pytest.mark.parametrize("change", [
    _mutate_config, _add_absent_field, _replace_config, _freeze, _replace_parameter, _replace_parameter_directly,
    _invalidate,
])
def test_a_change_takes_the_stages_once_then_the_steady_path_again(change, reads: list[int]) -> None:
    model = [Chunk(megatron_like_config())]
    step(model)
    step(model)
    assert len(reads) == 1
    change(model)
    frozen = ("0.b",) if change is _freeze else ()
    for n in (2, 4, 2):
        want = scaled(model, n, frozen)
        assert_equal(step(model, n), want)
    assert len(reads) == 2  # once for the change, then steady again


def test_the_call_options_are_part_of_what_is_kept(reads: list[int]) -> None:
    model = [Chunk(FinalizeConfig(calculate_per_token_loss=True))]
    step(model)
    step(model, force_all_reduce=True)  # another option: the stages
    step(model, force_all_reduce=True)
    assert len(reads) == 2
    for chunk in model:
        chunk.fill()
    before = {name: p.main_grad.clone() for name, p in model[0].named_parameters()}
    finalize_model_grads(model)  # no num_tokens: the stages, and no scaling
    assert len(reads) == 3
    for name, p in model[0].named_parameters():
        assert torch.equal(p.main_grad, before[name]), name
    assert_equal(step(model, 4), scaled(model, 4))
    assert len(reads) == 3  # the first kind again: its own kept inputs, checked in full


def test_a_group_source_is_kept_by_identity(reads: list[int]) -> None:
    model = [Chunk(megatron_like_config())]
    groups = TorchGroups.from_mapping({g: None for g in Group}, source="test")  # a world of one
    for n in (2, 4):
        assert_equal(step(model, n, pg_collection=groups), scaled(model, n))
    assert len(reads) == 1
    other = TorchGroups.from_mapping({g: None for g in Group}, source="test")
    assert_equal(step(model, 2, pg_collection=other), scaled(model, 2))
    assert_equal(step(model, 2), scaled(model, 2))  # None again: the stages
    assert len(reads) == 3


def test_a_seed_helper_between_steps_keeps_finalize_exact(reads: list[int]) -> None:
    model = [Chunk(megatron_like_config())]
    step(model)
    reset_model_temporary_tensors(model[0].config, model)  # a helper: its own kind of call
    assert_equal(step(model, 4), scaled(model, 4))
    assert len(reads) == 2  # finalize's first call, and the helper's
    for n in (2, 4):
        reset_model_temporary_tensors(model[0].config, model)
        assert_equal(step(model, n), scaled(model, n))
    assert len(reads) == 2  # each kind steady


def test_the_config_memo_is_unchanged_exactly_while_it_would_give_the_same_results() -> None:
    memo = ConfigMemo()
    raw, ddp = megatron_like_config(), types.SimpleNamespace(bucket_size=4)
    config, requested = memo.config(raw, ddp), memo.requested(raw)
    assert memo.unchanged(raw, ddp, config, requested)
    assert not memo.unchanged(raw, None, config, requested)  # another DDP config object
    assert not memo.unchanged(raw, ddp, FinalizeConfig(), requested)  # not what it resolved
    raw.tensor_model_parallel_size = 2  # a stated size
    assert not memo.unchanged(raw, ddp, config, requested)
    del raw.tensor_model_parallel_size
    assert memo.unchanged(raw, ddp, config, requested)
    ddp.grad_reduce_in_fp32 = True
    assert not memo.unchanged(raw, ddp, config, requested)
    final = FinalizeConfig()
    assert memo.unchanged(final, None, final, Requested())  # immutable
    assert not memo.unchanged(final, None, FinalizeConfig(), Requested())


def fake_parallel_state(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """An initialized ``parallel_state`` of one getter, loaded (for this test only)."""
    ps = types.ModuleType("fake_parallel_state")
    ps.initialized = True
    ps.model_parallel_is_initialized = lambda: ps.initialized
    ps.get_tensor_model_parallel_group = lambda **kwargs: None
    monkeypatch.setitem(sys.modules, PARALLEL_STATE, ps)
    return ps


def test_the_group_memo_follows_parallel_state_and_the_source(monkeypatch: pytest.MonkeyPatch) -> None:
    ps = fake_parallel_state(monkeypatch)
    memo, config = GroupMemo(), FinalizeConfig()
    groups = memo.parallel_state_groups()
    assert groups is not None and groups.size(Group.TP) == 1
    assert memo.unchanged(None, config, groups)
    assert not memo.unchanged(None, config, TorchGroups.from_mapping({}, source="test"))
    ps._SOME_GLOBAL = 1  # a global no getter reads: nothing to read again
    assert memo.unchanged(None, config, groups)
    ps.get_tensor_model_parallel_group = lambda **kwargs: None  # a getter replaced: read again
    assert not memo.unchanged(None, config, groups)
    assert memo.parallel_state_groups() is groups and memo.unchanged(None, config, groups)
    ps.initialized = False  # no longer initialized: parallel_state is not read
    assert not memo.unchanged(None, config, groups)
    monkeypatch.delitem(sys.modules, PARALLEL_STATE)
    mapping = {Group.TP: None}
    resolved = memo.resolve_groups(mapping, config, Requested())
    assert memo.unchanged(mapping, config, resolved)
    mapping[Group.PP] = None  # the source's values changed
    assert not memo.unchanged(mapping, config, resolved)
    assert memo.unchanged(resolved, config, resolved)  # TorchGroups: the object itself


def test_a_helpers_own_groups_are_kept_by_name_order_and_identity() -> None:
    memo = GroupMemo()
    first = object()
    values = {Group.TP: None, Group.PP: None}
    groups = memo.explicit(values)
    assert groups.size(Group.TP) == 1 and groups.size(Group.PP) == 1
    assert memo.explicit_unchanged({Group.TP: None, Group.PP: None}, groups)  # a new mapping, the same groups
    assert not memo.explicit_unchanged({Group.PP: None, Group.TP: None}, groups)  # another order
    assert not memo.explicit_unchanged({Group.TP: first, Group.PP: None}, groups)  # another object
    assert not memo.explicit_unchanged(values, memo.explicit({Group.TP: None}))
