"""The config memo's check by name (``Snapshot(..., by_names=True)``): a config is read
again exactly when an attribute FinalizeConfig (or the stated sizes) reads changed, was
added or went away; what it does not read never costs a new resolve."""

from __future__ import annotations

import importlib.util
import types

import pytest

from torch_impl.call.config_memo import ConfigMemo
from torch_impl.call.memo import Snapshot

NAMES = ("sequence_parallel", "consistency_check", "tensor_model_parallel_size")
#: Attributes no result is derived from: a config-like object holds many (a TransformerConfig
#: hundreds), and only then is it checked by name.
FILLER = {f"unread_{i}": i for i in range(40)}


def config_like(**fields: object) -> types.SimpleNamespace:
    """An object with ``fields`` and many attributes no result reads."""
    return types.SimpleNamespace(**fields, **FILLER)


def test_a_named_value_changed_added_or_removed_is_seen() -> None:
    source = config_like(sequence_parallel=True, tensor_model_parallel_size=2, hidden_size=8)
    snap = Snapshot(source, NAMES, by_names=True)
    assert snap.getter is not None and snap.absent == ("consistency_check",)
    assert snap.values == (True, 2) and snap.same()
    source.hidden_size = 16  # not read: the result cannot differ
    source.unrelated = object()
    assert snap.same()
    source.sequence_parallel = 1  # an equal value reads the same
    assert snap.same()
    source.sequence_parallel = False
    assert not snap.same()
    source.sequence_parallel = True
    assert snap.same()
    source.consistency_check = "off"  # absent before: now present
    assert not snap.same()
    del source.consistency_check
    assert snap.same()
    del source.tensor_model_parallel_size  # present before: now gone
    assert not snap.same()


def test_a_small_object_is_compared_whole() -> None:
    source = types.SimpleNamespace(sequence_parallel=True, bucket_size=1)
    snap = Snapshot(source, NAMES, by_names=True)
    assert snap.getter is None and snap.live is vars(source) and snap.same()
    source.bucket_size = 2  # any attribute: one dict comparison is cheaper than the names
    assert not snap.same()


def test_a_class_attribute_and_a_single_name_are_read_as_getattr_reads_them() -> None:
    class Config:
        consistency_check = "once"  # a class-level default, not in the instance dict

        def __init__(self) -> None:
            vars(self).update(FILLER)

    config = Config()
    snap = Snapshot(config, ("consistency_check",), by_names=True)
    assert snap.values == "once" and snap.same()  # one name: the bare value
    Config.consistency_check = "every_step"
    assert not snap.same()
    none = Snapshot(config_like(), NAMES, by_names=True)  # has none of the names
    assert none.values == () and none.same()
    none.source.tensor_model_parallel_size = 4
    assert not none.same()


def test_a_property_that_raises_falls_back_to_the_other_checks() -> None:
    class Raising:
        def __init__(self) -> None:
            self.sequence_parallel = True
            vars(self).update(FILLER)

        @property
        def consistency_check(self) -> str:
            raise RuntimeError("broken property")

    source = Raising()
    snap = Snapshot(source, NAMES, by_names=True)  # no error here: the resolve that follows raises it
    assert snap.getter is None and snap.live is source.__dict__ and snap.same()
    source.sequence_parallel = False
    assert not snap.same()


def test_the_memo_resolves_again_exactly_when_a_read_field_changes() -> None:
    memo = ConfigMemo()
    raw = config_like(sequence_parallel=True, calculate_per_token_loss=True, hidden_size=8, tensor_model_parallel_size=2)
    ddp = types.SimpleNamespace(use_distributed_optimizer=False, bucket_size=1 << 18)  # small: compared whole
    first = memo.config(raw, ddp)
    assert first.sequence_parallel and first.calculate_per_token_loss and not first.use_distributed_optimizer
    raw.hidden_size = 16  # read by nothing: the same result object
    assert memo.config(raw, ddp) is first
    ddp.bucket_size = 1 << 20  # a small object is compared whole: resolved again, to equal values
    assert memo.config(raw, ddp) == first
    raw.consistency_check = "off"  # a field set for the first time
    second = memo.config(raw, ddp)
    assert second.consistency_check == "off" and second.sequence_parallel
    ddp.use_distributed_optimizer = True
    third = memo.config(raw, ddp)
    assert third.use_distributed_optimizer and third.consistency_check == "off"
    assert memo.requested(raw).tp == 2
    raw.tensor_model_parallel_size = 4
    assert memo.requested(raw).tp == 4


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core's TransformerConfig")
def test_a_megatron_transformer_config_mutated_between_steps() -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer.transformer_config import TransformerConfig

        config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    memo = ConfigMemo()
    first = memo.config(config, None)
    assert not first.calculate_per_token_loss and first.consistency_check == "once"
    config.hidden_size = 16  # one of its hundreds of fields FinalizeConfig does not read
    assert memo.config(config, None) is first
    config.calculate_per_token_loss = True
    assert memo.config(config, None).calculate_per_token_loss
    config.consistency_check = "every_step"  # meshgrad's own field, absent from TransformerConfig
    resolved = memo.config(config, None)
    assert resolved.consistency_check == "every_step" and resolved.calculate_per_token_loss


@pytest.mark.parametrize("filler", [{}, FILLER], ids=["compared_whole", "by_names"])
def test_a_list_value_changed_in_place_is_seen(filler: dict) -> None:
    """A config's list (``moe_router_load_balancing_type`` may be one) appended to in place
    is the same object holding another value: the memo resolves again."""
    source = types.SimpleNamespace(calculate_per_token_loss=True, moe_router_load_balancing_type=["aux_loss"],
                                   **filler)
    memo = ConfigMemo()
    first = memo.config(source, None)
    assert memo.config(source, None) is first and first.moe_router_load_balancing_type == ("aux_loss",)
    assert not first.global_aux_loss
    source.moe_router_load_balancing_type.append("global_aux_loss")
    second = memo.config(source, None)
    assert second is not first and second.moe_router_load_balancing_type == ("aux_loss", "global_aux_loss")
    assert second.global_aux_loss
    assert memo.config(source, None) is second  # steady again


def test_a_mapping_and_a_single_name_keep_copies_of_their_containers() -> None:
    mapping = {"sequence_parallel": True, "stages": [0, 1]}
    snap = Snapshot(mapping, ("sequence_parallel", "stages"))
    assert snap.same()
    mapping["stages"].append(2)
    assert not snap.same()
    one = config_like(consistency_check=["once"])
    snap = Snapshot(one, ("consistency_check",), by_names=True)
    assert snap.getter is not None and snap.values == ["once"] and snap.same()
    one.consistency_check[0] = "off"
    assert not snap.same()
