"""How ``finalize_model_grads(pg_collection=None)`` calls Megatron's ``parallel_state``
getters (``torch_impl.sources.megatron.parallel_state_group``): a keyword that an older
Megatron's getter lacks is dropped, any other is passed, whatever kind of callable the
getter is (read every step: the keywords come from a plain function's code object)."""

from __future__ import annotations

import functools
import types

import pytest

pytest.importorskip("torch")

from meshgrad import Group  # noqa: E402
from torch_impl.sources.megatron import UNDEFINED, parallel_state_group  # noqa: E402


def _recording(seen: list[dict]) -> types.SimpleNamespace:
    def new_api(with_context_parallel=False, with_gtp_remat=True):
        seen.append({"with_context_parallel": with_context_parallel, "with_gtp_remat": with_gtp_remat})
        return "new"

    def old_api(with_context_parallel=False, partial_data_parallel=False):
        seen.append({"with_context_parallel": with_context_parallel})
        return "old"

    @functools.wraps(old_api)
    def wrapped(*args, **kwargs):
        return old_api(*args, **kwargs)

    def keyword_only(*, with_context_parallel=False):
        seen.append({"with_context_parallel": with_context_parallel})
        return "keyword-only"

    return types.SimpleNamespace(new=new_api, old=old_api, wrapped=wrapped, keyword_only=keyword_only)


@pytest.mark.parametrize(
    "getter, expected, passed",
    [
        ("new", "new", {"with_context_parallel": True, "with_gtp_remat": False}),
        ("old", "old", {"with_context_parallel": True}),  # an older Megatron: with_gtp_remat dropped
        ("wrapped", "old", {"with_context_parallel": True}),  # a decorated getter: its signature
        ("keyword_only", "keyword-only", {"with_context_parallel": True}),
    ],
)
def test_the_dp_getter_gets_the_keywords_it_takes(getter, expected, passed):
    seen: list[dict] = []
    fns = _recording(seen)
    ps = types.SimpleNamespace(get_data_parallel_group=getattr(fns, getter))
    assert parallel_state_group(ps, Group.DP_CP) == expected
    assert seen == [passed]


def test_an_absent_or_failing_getter():
    assert parallel_state_group(types.SimpleNamespace(), Group.DP_CP) is UNDEFINED

    def not_initialized(**kwargs):
        raise AssertionError("data parallel group is not initialized")

    ps = types.SimpleNamespace(get_data_parallel_group=not_initialized, get_embedding_group=not_initialized)
    assert parallel_state_group(ps, Group.DP_CP) is UNDEFINED
    assert parallel_state_group(ps, Group.EMBD) is None  # Megatron holds none for this rank


def test_the_groups_are_read_again_only_when_the_module_changes():
    """``pg_collection=None`` every step: while parallel_state's globals are what they
    were, the last groups are kept without a getter call; a changed global (a getter
    replaced, a group set) reads them again, and keeps the last groups when the getters
    return the same objects."""
    from torch_impl.sources.megatron import parallel_state_keyed

    calls: list[str] = []
    ps = types.ModuleType("fake_parallel_state")

    def getter(name):
        def get_group(**kwargs):
            calls.append(name)
            return None  # Megatron holds none for this rank

        return get_group

    ps.get_tensor_model_parallel_group = getter("tp")
    first = parallel_state_keyed(ps)
    assert calls == ["tp"]
    assert parallel_state_keyed(ps, first) is first and calls == ["tp"]  # nothing read
    ps.get_tensor_model_parallel_group = getter("tp2")  # a getter replaced
    second = parallel_state_keyed(ps, first)
    assert calls == ["tp", "tp2"] and second[1] is first[1]  # the same groups: the same TorchGroups
    ps._GROUP = None  # another global
    third = parallel_state_keyed(ps, second)
    assert calls == ["tp", "tp2", "tp2"] and third[1] is first[1]
    assert parallel_state_keyed(ps, third) is third and len(calls) == 3
