"""FinalizeConfig: defaults, validation and duck-typed Megatron construction."""

import types

import pytest

from meshgrad import FinalizeConfig


def test_defaults_match_megatron():
    c = FinalizeConfig()
    assert c.share_embeddings_and_output_weights and not c.sequence_parallel
    assert c.moe_router_load_balancing_type == "aux_loss" and not c.quantile_balancing
    assert not c.has_mtp


def test_from_megatron_reads_transformer_and_ddp_configs():
    tc = types.SimpleNamespace(
        sequence_parallel=True, qk_layernorm=None, mtp_num_layers=2, calculate_per_token_loss=True,
        moe_router_load_balancing_type="global_aux_loss", unrelated_field=3,
    )
    ddp = types.SimpleNamespace(average_in_collective=True, use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    c = FinalizeConfig.from_megatron(tc, ddp)
    assert c.sequence_parallel and not c.qk_layernorm and c.has_mtp and c.mtp_num_layers == 2
    assert c.average_in_collective and c.use_distributed_optimizer and c.grad_reduce_in_fp32
    assert c.global_aux_loss and c.calculate_per_token_loss


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(sequence_parallel=1), TypeError, "sequence_parallel must be a bool"),
        (dict(mtp_num_layers=-1), ValueError, "mtp_num_layers"),
        (dict(moe_router_load_balancing_type=3), TypeError, "moe_router_load_balancing_type"),
    ],
)
def test_bad_values_raise(kwargs, error, message):
    with pytest.raises(error, match=message):
        FinalizeConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(moe_router_load_balancing_type="quantile"), "moe_router_load_balancing_type"),
        (dict(moe_router_quantile_balancing_ema=1.5), "quantile_balancing_ema"),
    ],
)
def test_values_megatron_accepts_only_warn(kwargs, message):
    # Megatron-Core runs with these; meshgrad warns and keeps the value.
    with pytest.warns(UserWarning, match=message):
        config = FinalizeConfig(**kwargs)
    assert all(getattr(config, k) == v for k, v in kwargs.items())


def test_load_balancing_type_list_and_megatron_defaults():
    config = FinalizeConfig.from_megatron(
        types.SimpleNamespace(moe_router_load_balancing_type=["quantile_balancing", "global_aux_loss"])
    )
    assert config.moe_router_load_balancing_type == ("quantile_balancing", "global_aux_loss")
    # Megatron compares the type with == "quantile_balancing": a list never runs the qb step,
    # but "global_aux_loss" in the list resets the tracker.
    assert not config.quantile_balancing and config.global_aux_loss
    assert FinalizeConfig.from_megatron(types.SimpleNamespace()).moe_router_quantile_balancing_ema == 0.0
    assert FinalizeConfig.from_megatron(types.SimpleNamespace(moe_router_load_balancing_type="quantile_balancing")).quantile_balancing


def test_from_mapping_rejects_unknown_keys():
    with pytest.raises(ValueError, match="unknown option"):
        FinalizeConfig.from_mapping({"sequence_paralel": True})
    assert FinalizeConfig.from_mapping({"qk_layernorm": True}).qk_layernorm
