"""The token scale from a count the status round read back on the host
(``torch_impl.run.scaling.host_scale``) against the device path, bit for bit."""

from __future__ import annotations

import pytest
import torch

from meshgrad.axes import Group
from meshgrad.plan import TokenScale
from bench.cpu_parts import operations_run
from tests.scaled_ddp import ScaledDDP, bits
from torch_impl.run.scaling import HostFactor, global_token_scale, host_scale, scale_by_tokens


#: The plan's token-scale action (the device path only reads its group when it reduces).
ACTION = TokenScale(keys=(), group=Group.DP_CP)


def device_path(num_tokens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The factor and the written-back count of the device path (the round's reduced tensor)."""
    tokens = num_tokens.clone()
    factor = global_token_scale(tokens, ACTION, None, torch.tensor(total, dtype=torch.int64))
    return factor, tokens


@pytest.fixture(params=[torch.float32, torch.float64], ids=["float32", "float64"])
def default_dtype(request: pytest.FixtureRequest):
    before = torch.get_default_dtype()
    torch.set_default_dtype(request.param)
    yield request.param
    torch.set_default_dtype(before)


def test_the_double_rounded_quotient_is_the_device_reciprocal_for_every_count_up_to_2_24() -> None:
    counts = torch.arange(1, (1 << 24) + 1, dtype=torch.int64)
    device = counts.reciprocal()  # what the device path computes for an int64 count (float32)
    host = (1.0 / counts.to(torch.float64)).to(torch.float32)  # 1 / n in float64, rounded once more
    assert torch.equal(device.view(torch.int32), host.view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("shape", [(), (1,)])
def test_host_scale_equals_the_device_path(default_dtype: torch.dtype, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    rng = torch.Generator().manual_seed(0)
    totals = [-(1 << 31), -7, -1, 0, 1, 2, 3, 7, 1000, 4093, (1 << 24) - 1, 1 << 24]
    totals += torch.randint(1, 1 << 24, (200,), generator=rng).tolist()
    for total in totals:
        mine = torch.zeros(shape, dtype=dtype)
        factor = host_scale(mine, total)
        expected, written = device_path(torch.zeros(shape, dtype=dtype), total)
        assert factor is not None, total
        assert factor.dtype == expected.dtype == default_dtype and factor.shape == expected.shape == shape
        assert bits(factor) == bits(expected), total
        assert mine.tolist() == written.tolist() and int(mine.reshape(())) == total


@pytest.mark.parametrize(
    "dtype, total",
    [(torch.int64, (1 << 24) + 1), (torch.int64, 1 << 40), (torch.int32, 1 << 31), (torch.int8, 3), (torch.int16, 3),
     (torch.uint8, 3)],
)
def test_the_device_path_answers_where_the_host_cannot_be_exact(dtype: torch.dtype, total: int) -> None:
    mine = torch.zeros((), dtype=dtype)
    assert host_scale(mine, total) is None and int(mine) == 0  # nothing written
    # given the int, global_token_scale falls back to the device path: the same numbers
    factor = global_token_scale(mine, ACTION, None, total)
    expected, written = device_path(torch.zeros((), dtype=dtype), total)
    assert bits(factor) == bits(expected) and bits(mine) == bits(written)


def test_another_default_dtype_goes_to_the_device_path() -> None:
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        mine = torch.zeros((), dtype=torch.int64)
        assert host_scale(mine, 3) is None
        factor = global_token_scale(mine, ACTION, None, 3)
        assert factor.dtype == torch.bfloat16 and float(factor) == float(torch.tensor(3).reciprocal())
        assert int(mine) == 3
    finally:
        torch.set_default_dtype(before)


def test_a_kept_factor_is_reused_only_while_it_is_the_same() -> None:
    """``HostFactor``: the same tensor for the same count, shape and dtype, bit for bit the
    factor made afresh; another shape, a write into the kept tensor, or another count while
    the kept tensor is held elsewhere (here by the test itself) makes a new one."""
    kept = HostFactor()
    first = host_scale(torch.zeros((), dtype=torch.int64), 12, kept)
    assert first is not None and bits(first) == bits(host_scale(torch.zeros((), dtype=torch.int64), 12))
    mine = torch.zeros((), dtype=torch.int64)
    assert host_scale(mine, 12, kept) is first and int(mine) == 12  # the count is still written
    other = host_scale(torch.zeros((), dtype=torch.int64), 13, kept)
    assert other is not first and bits(other) == bits(host_scale(torch.zeros((), dtype=torch.int64), 13))
    shaped = host_scale(torch.zeros((1,), dtype=torch.int32), 13, kept)
    assert shaped is not other and shaped.shape == (1,)
    assert host_scale(torch.zeros((1,), dtype=torch.int32), 13, kept) is shaped
    shaped.mul_(2)  # someone wrote into it: not reused
    again = host_scale(torch.zeros((1,), dtype=torch.int32), 13, kept)
    assert again is not shaped and bits(again) == bits(host_scale(torch.zeros((1,), dtype=torch.int32), 13))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("shape", [(), (1,)])
def test_a_kept_factor_no_one_else_holds_is_rewritten_for_each_new_count(
    default_dtype: torch.dtype, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    """A count that changes every call (as in training) gets the kept tensor, rewritten in
    place through its memoryview: bit for bit the device path's factor for every count,
    ``num_tokens`` written as before, and one torch operation in all (that write)."""
    kept = HostFactor()
    first = host_scale(torch.zeros(shape, dtype=dtype), 7, kept)
    assert first is not None
    made = id(first)
    del first  # the test holds no reference: the kept tensor may be rewritten
    rng = torch.Generator().manual_seed(1)
    totals = [12, 13, 12, 1, 0, -5, 3, 4093, (1 << 24) - 1, 1 << 24, 7]
    totals += torch.randint(1, 1 << 24, (100,), generator=rng).tolist()
    for total in totals:
        mine = torch.zeros(shape, dtype=dtype)
        made_now: list[torch.Tensor | None] = []
        ops = operations_run(lambda: made_now.append(host_scale(mine, total, kept)))
        factor = made_now.pop()
        assert factor is not None and id(factor) == made, total
        got = bits(factor)
        assert factor.dtype == default_dtype and factor.shape == shape and factor._version == 0
        del factor
        expected, written = device_path(torch.zeros(shape, dtype=dtype), total)
        assert got == bits(expected), total
        assert mine.tolist() == written.tolist()
        assert ops == ["aten.fill_.Scalar"], ops


def test_a_factor_someone_kept_is_never_rewritten() -> None:
    """A DDP whose ``scale_gradients`` keeps its argument keeps each call's factor with its
    own value: a call with another count makes a new tensor instead of rewriting it."""
    kept, held = HostFactor(), ScaledDDP()
    for total in (12, 13, 12, 40):
        scale_by_tokens(torch.zeros((), dtype=torch.int64), ACTION, None, [held], None, total, kept)
    assert len({id(f) for f in held.factors}) == 4  # 12 again: the kept one was held, a new one made
    for factor, total in zip(held.factors, (12, 13, 12, 40)):
        assert bits(factor) == bits(device_path(torch.zeros((), dtype=torch.int64), total)[0])
    forty = id(held.factors[-1])
    del factor  # the loop's last: 40's
    held.factors.clear()  # let go: the kept tensor (40's) is rewritten again
    scale_by_tokens(torch.zeros((), dtype=torch.int64), ACTION, None, [held], None, 41, kept)
    again = held.factors.pop()
    assert id(again) == forty and bits(again) == bits(device_path(torch.zeros((), dtype=torch.int64), 41)[0])


def test_a_factor_made_under_inference_mode_is_kept_and_reused_in_either_mode() -> None:
    """A factor made during a call under ``torch.inference_mode()`` is a normal tensor (an
    inference tensor has no version counter to keep it by): bit for bit the one made
    outside, and reused by the next calls in and out of inference mode."""
    kept = HostFactor()
    with torch.inference_mode():
        mine = torch.zeros((), dtype=torch.int64)
        made = host_scale(mine, 12, kept)
        assert int(mine) == 12
    assert made is not None and not made.is_inference()
    assert bits(made) == bits(host_scale(torch.zeros((), dtype=torch.int64), 12))
    assert host_scale(torch.zeros((), dtype=torch.int64), 12, kept) is made
    with torch.inference_mode():
        assert host_scale(torch.zeros((), dtype=torch.int64), 12, kept) is made


@pytest.mark.parametrize("inference", [False, True], ids=["normal", "inference"])
@pytest.mark.parametrize("dtype, total", [(torch.int64, 12), (torch.int64, 1 << 40), (torch.int16, 3)])
def test_scale_by_tokens_with_the_rounds_count_scales_as_the_device_path(
    dtype: torch.dtype, total: int, inference: bool
) -> None:
    """The run stage's scale given the count the status round read back: the host factor
    where it is exact, else the device path (no collective either way); every DDP and the
    gradients meshgrad scales get that factor, bit for bit the device path's, and
    ``num_tokens`` holds the count afterwards -- one made under ``torch.inference_mode()``
    too, updated from a call outside it."""
    if inference:
        with torch.inference_mode():
            mine = torch.zeros((), dtype=dtype)
    else:
        mine = torch.zeros((), dtype=dtype)
    ddp, applied = ScaledDDP(), []
    scale_by_tokens(mine, ACTION, None, [ddp], applied.append, total, HostFactor())
    expected, written = device_path(torch.zeros((), dtype=dtype), total)
    assert len(ddp.factors) == 1 and applied == ddp.factors
    assert bits(ddp.factors[0]) == bits(expected) and bits(mine) == bits(written)
    # no gradient of meshgrad's own to scale (a plan whose DDP scales them all): apply is None
    alone = ScaledDDP()
    scale_by_tokens(torch.zeros((), dtype=dtype), ACTION, None, [alone], None, total)
    assert bits(alone.factors[0]) == bits(expected)
