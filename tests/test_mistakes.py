"""meshgrad.mistakes.likely_mistakes: the messages for mistakes Megatron accepts silently."""

from __future__ import annotations

import warnings

from meshgrad import FinalizeConfig, ParamSpec
from meshgrad.errors import LikelyMistakeWarning
from meshgrad.mistakes import NAMES_SHOWN, likely_mistakes

LN = ParamSpec("decoder.layers.0.input_layernorm.weight", 0, (4,), sequence_parallel=True)
FC = ParamSpec("decoder.layers.0.mlp.linear_fc1.weight", 0, (3, 4))


def test_num_tokens_without_per_token_loss_names_the_field():
    (msg,) = likely_mistakes([FC], FinalizeConfig(), num_tokens_given=True)
    assert "calculate_per_token_loss=False" in msg and "num_tokens" in msg and "token count" in msg


def test_num_tokens_with_per_token_loss_or_absent_is_fine():
    assert likely_mistakes([FC], FinalizeConfig(calculate_per_token_loss=True), num_tokens_given=True) == ()
    assert likely_mistakes([FC], FinalizeConfig(), num_tokens_given=False) == ()


def test_sequence_parallel_flags_ignored_name_the_parameters():
    (msg,) = likely_mistakes([LN, FC], FinalizeConfig(), num_tokens_given=False)
    assert "config.sequence_parallel is False" in msg
    assert "'decoder.layers.0.input_layernorm.weight' (chunk 0)" in msg and "linear_fc1" not in msg


def test_sequence_parallel_flags_honoured_or_irrelevant_are_fine():
    assert likely_mistakes([LN], FinalizeConfig(sequence_parallel=True), num_tokens_given=False) == ()
    assert likely_mistakes([LN], FinalizeConfig(), num_tokens_given=False, tp_size=1) == ()
    frozen = ParamSpec(LN.name, 0, (4,), sequence_parallel=True, has_grad=False)
    averaged = ParamSpec("x.weight", 0, (4,), sequence_parallel=True, average_gradients_across_tp_domain=True)
    qk = ParamSpec("attn.q_layernorm.weight", 0, (2,), sequence_parallel=True)
    assert likely_mistakes([frozen, averaged, qk], FinalizeConfig(qk_layernorm=True), num_tokens_given=False) == ()


def test_many_parameters_are_counted_and_both_mistakes_reported():
    many = [ParamSpec(f"ln{i}.weight", 1, (4,), sequence_parallel=True) for i in range(NAMES_SHOWN + 3)]
    msgs = likely_mistakes(many, FinalizeConfig(), num_tokens_given=True, tp_size=2)
    assert len(msgs) == 2 and "and 3 more" in msgs[1] and "'ln0.weight' (chunk 1)" in msgs[1]


def test_warning_class_is_a_user_warning_and_silenceable():
    assert issubclass(LikelyMistakeWarning, UserWarning)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=LikelyMistakeWarning)
        warnings.warn("x", LikelyMistakeWarning)
    assert caught == []
