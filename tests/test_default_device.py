"""Every tensor meshgrad makes names its device: under an ambient default device (``with
torch.device("meta")``, as ``torch.set_default_device`` sets one) each helper that makes
one gives what it gives without it, on the device its inputs are on. (The whole call under
such a context, mixed with normal calls: tests/test_reliability_torch_modes.py.) The
inputs are made on the CPU by name, as a caller's are."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from meshgrad.axes import Group
from meshgrad.plan import TokenScale
from torch_impl.call import tensor_guard
from torch_impl.call.checks import _overlap
from torch_impl.run import rounds
from torch_impl.run.scaling import HostFactor, global_token_scale, host_scale
from torch_impl.run.strided_runs import _index_select_fills_strided_out


def _values(out: Any) -> Any:
    """A comparable form of ``out`` that keeps each tensor's device, dtype and values."""
    if isinstance(out, torch.Tensor):
        return (out.device.type, out.dtype, out.tolist())
    if isinstance(out, tuple):
        return tuple(map(_values, out))
    return out


def _token_scale_of_a_large_count() -> tuple[torch.Tensor, torch.Tensor]:
    """The device path of a count the host path does not take (over 2**24)."""
    tokens = torch.zeros((), dtype=torch.int64, device="cpu")
    factor = global_token_scale(tokens, TokenScale(keys=(), group=Group.DP_CP), None, (1 << 24) + 1)
    return factor, tokens


def _host_factor() -> torch.Tensor:
    factor = host_scale(torch.zeros((), dtype=torch.int64, device="cpu"), 12, HostFactor())
    assert factor is not None
    return factor


def _strided_overlap() -> tuple[bool, bool]:
    """Two strided views of one storage: interleaved columns (no shared element), and a
    column against a row (one shared element)."""
    base = torch.zeros(4, 4, device="cpu")
    return _overlap(base[:, 0::2], base[:, 1::2]), _overlap(base[:, 0], base[0, :])


CASES: dict[str, Callable[[], Any]] = {
    "a status vector on the host (rounds.encode)": lambda: rounds.encode(rounds.status_vector(error=True), 4, 9),
    "the host token factor (host_scale)": _host_factor,
    "a large count's token scale (global_token_scale)": _token_scale_of_a_large_count,
    "the strided runs' probe of index_select": _index_select_fills_strided_out.__wrapped__,
    "the overlap check of strided views (_overlap)": _strided_overlap,
    "the compiled tensor guard's probe": lambda: tensor_guard._guard_type.__wrapped__() is not None,
}


@pytest.mark.parametrize("make", CASES.values(), ids=CASES.keys())
def test_a_default_meta_device_changes_nothing_meshgrad_makes(make: Callable[[], Any]) -> None:
    want = _values(make())
    with torch.device("meta"):
        got = make()
    assert _values(got) == want
    assert want != () and "meta" not in repr(want)
