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


def test_a_dict_config_rejects_a_key_meshgrad_does_not_read_naming_the_closest():
    from meshgrad.config import MEGATRON_SIZE_FIELDS
    from meshgrad.errors import FinalizeInputError

    with pytest.raises(FinalizeInputError, match=r"unknown option\(s\) \['sequence_paralel'\] in config "
                                                 r"\('sequence_paralel': did you mean 'sequence_parallel'\?\)"):
        FinalizeConfig.from_megatron({"sequence_paralel": True})
    with pytest.raises(FinalizeInputError, match=r"\['use_distributed_optimiser'\] in ddp_config .*"
                                                 r"did you mean 'use_distributed_optimizer'"):
        FinalizeConfig.from_megatron({}, {"use_distributed_optimiser": True})
    with pytest.raises(FinalizeInputError, match=r"'no_such_option': no close match"):
        FinalizeConfig.from_mapping({"no_such_option": True})
    # What it reads: every field and the Megatron sizes torch_impl checks against the groups.
    sizes = {name: 2 for name in MEGATRON_SIZE_FIELDS}
    config = FinalizeConfig.from_megatron({"sequence_parallel": True, "strict_groups": True, **sizes},
                                          {"use_distributed_optimizer": True})
    assert config == FinalizeConfig(sequence_parallel=True, strict_groups=True, use_distributed_optimizer=True)
    # An object's other attributes stay ignored (a TransformerConfig has hundreds).
    assert FinalizeConfig.from_megatron(types.SimpleNamespace(hidden_size=8, qk_layernorm=True)) == FinalizeConfig(
        qk_layernorm=True)


def test_a_dict_chunk_config_with_a_typo_raises_before_anything_changes():
    torch = pytest.importorskip("torch")
    from meshgrad.errors import FinalizeInputError
    from torch_impl import finalize_model_grads

    model = torch.nn.Linear(3, 2)
    model.config = {"calculate_per_token_loss": True, "sequence_paralel": True}
    model(torch.arange(12.0).reshape(4, 3)).sum().backward()
    before = model.weight.grad.clone()
    with pytest.raises(FinalizeInputError, match="did you mean 'sequence_parallel'"):
        finalize_model_grads([model], num_tokens=torch.tensor([4]))
    assert torch.equal(model.weight.grad, before)  # nothing changed
    model.config = {"calculate_per_token_loss": True, "sequence_parallel": True}
    finalize_model_grads([model], num_tokens=torch.tensor([4]))
    assert torch.equal(model.weight.grad, before / 4)
