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
    """``pg_collection=None`` every step: while the globals the getters read are what they
    were, the last groups are kept without a getter call; a changed one (a getter
    replaced, a group it returns set) reads them again, and keeps the last groups when the
    getters return the same objects. A global no getter reads changes nothing."""
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
    ps._UNREAD = object()  # a global no getter reads
    assert parallel_state_keyed(ps, second) is second and calls == ["tp", "tp2"]
    # A getter of the module itself (as Megatron's are): the globals its code reads count.
    exec("def get_pipeline_model_parallel_group(**kwargs):\n    _CALLS.append('pp')\n    return _PP_GROUP", vars(ps))
    ps._CALLS, ps._PP_GROUP = calls, None
    third = parallel_state_keyed(ps, second)
    assert calls == ["tp", "tp2", "tp2", "pp"] and dict(third.groups.groups) == {Group.TP: None, Group.PP: None}
    assert parallel_state_keyed(ps, third) is third and len(calls) == 4
    ps._PP_GROUP = None  # the same value again: nothing to read
    assert parallel_state_keyed(ps, third) is third and len(calls) == 4
    later: list[str] = []
    ps._CALLS = later  # another object under a name the getter reads
    fourth = parallel_state_keyed(ps, third)
    assert calls == ["tp", "tp2", "tp2", "pp", "tp2"] and later == ["pp"] and fourth.groups is third.groups
    assert parallel_state_keyed(ps, fourth) is fourth and later == ["pp"]


def test_global_reads_follow_the_code_and_fall_back_to_every_global():
    """What ``GlobalReads`` compares: the names the entry functions' code reads, followed
    into the module's other functions (nested code included); where a reached object's
    reads cannot be told from code (a decorated function, a class of the module), every
    global; a read name deleted, or an absent one defined, is a change."""
    from torch_impl.sources.global_reads import GlobalReads

    mod = types.ModuleType("fake_module")
    exec(
        "def entry():\n    return helper() + [x for x in _LISTED]\n"
        "def helper():\n    return [_HELPED]\n"
        "def unrelated():\n    return _OTHER\n"
        "_LISTED, _HELPED, _OTHER = [1], 2, 3\n",
        vars(mod),
    )
    reads = GlobalReads(mod, ["entry"])
    assert reads.whole is None and set(reads.names) == {"entry", "helper", "_LISTED", "_HELPED"}
    assert reads.same(mod)
    mod._OTHER = 4  # not read
    assert reads.same(mod)
    mod._HELPED = 5  # read through helper()
    assert not reads.same(mod)
    reads = GlobalReads(mod, ["entry"])
    del mod._LISTED  # read in a comprehension (a nested code object)
    assert not reads.same(mod)
    mod._LISTED = [1]
    reads = GlobalReads(mod, ["entry", "missing"])
    assert reads.absent == ("missing",) and reads.same(mod)
    mod.missing = None  # a name absent then, defined now
    assert not reads.same(mod)

    exec("import functools\n@functools.lru_cache\ndef cached():\n    return _OTHER\n", vars(mod))
    whole = GlobalReads(mod, ["cached"])  # its reads are not in its code: every global counts
    assert whole.whole is not None and whole.same(mod)
    mod._OTHER = 6
    assert not whole.same(mod)
