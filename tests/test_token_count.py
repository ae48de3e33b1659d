"""The token count's collectives bound once (``torch_impl.run.token_count.TokenCount``), on
a host word (calls whose status round does not carry the count) against the device path of
``torch_impl.run.scaling.global_token_scale``, bit for bit, in one 4-rank gloo world, and
against the count worked out by hand; a failed collective on the host word."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from meshgrad.axes import Group  # noqa: E402
from meshgrad.errors import CollectiveError  # noqa: E402
from meshgrad.plan import TokenScale  # noqa: E402
from parity_tests.world_cases import case_values, run_cases  # noqa: E402
from tests.scaled_ddp import ScaledDDP, bits  # noqa: E402
from torch_impl.run.groups import TorchGroups  # noqa: E402
from torch_impl.run.scaling import HostFactor, global_token_scale, scale_by_tokens  # noqa: E402
from torch_impl.run.token_count import on_host, token_count  # noqa: E402

WORLD = 4
ACTION = TokenScale(keys=(), group=Group.DP_CP)
#: Each rank's count is ``base * (rank + 1)``: int8 and uint8 sums that wrap in their dtype,
#: int64 sums that wrap in int64, counts past 2**24 (the device factor), zero and negatives.
BASES = {
    torch.int64: [1, 3, 0, -2, 1 << 22, 1 << 40, (1 << 60) + 5],
    torch.int32: [1, 7, -1, 1 << 28],
    torch.int16: [5, 8000],
    torch.int8: [2, 30, -30],
    torch.uint8: [1, 50],
}
#: The layouts: (name, whether pp is 2, the token broadcast's source stage or None).
LAYOUTS = (("dp 4", False, None), ("pp 2 x dp 2", True, None), ("pp 2 x dp 2, token_broadcast from stage 0", True, 0))


def _layouts(rank: int) -> dict[str, TorchGroups]:
    """This rank's groups per layout (every rank makes every group, in the same order)."""
    import torch.distributed as dist

    world = dist.new_group(list(range(WORLD)))
    dp_pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # pp 2 x dp 2: stage = rank // 2
    pp_pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    dp, pp, pp_ranks = dp_pairs[rank // 2], pp_pairs[rank % 2], (rank % 2, rank % 2 + 2)
    out = {}
    for name, piped, source in LAYOUTS:
        if not piped:
            out[name] = TorchGroups(rank, {Group.DP_CP: world}, {Group.DP_CP: WORLD}, (rank,), {})
            continue
        broadcast = (pp, pp_ranks[source]) if source is not None else None
        out[name] = TorchGroups(rank, {Group.DP_CP: dp, Group.PP: pp}, {Group.DP_CP: 2, Group.PP: 2}, pp_ranks, {},
                                token_broadcast=broadcast)
    return out


def case_host_and_device_paths(rank: int, world_size: int) -> list[tuple[Any, ...]]:
    """Per layout, dtype and base: the host path's (factor bits, written count) twice (the
    second call reuses the bound collectives and the kept factor), the device path's,
    and the global count as an int."""
    out = []
    for name, groups in _layouts(rank).items():
        kept = HostFactor()
        for dtype, bases in BASES.items():
            for base in bases:
                mine = base * (rank + 1)
                device = torch.tensor(mine).to(dtype)
                factor = global_token_scale(device, ACTION, groups)
                host, bound = [], []
                for _ in range(2):
                    tokens, ddp = torch.tensor(mine).to(dtype), ScaledDDP()
                    scale_by_tokens(tokens, ACTION, groups, [ddp], None, None, kept)
                    host.append((bits(ddp.factors[0]), bits(tokens)))
                    bound.append(groups.token_counts[Group.DP_CP])
                reused = bound[0] is bound[1] is token_count(ACTION, groups)
                out.append((name, str(dtype), base, host, (bits(factor), bits(device)), int(device), reused))
    return out


@pytest.fixture(scope="module")
def world() -> dict[str, list[Any]]:
    return run_cases(__name__, ["case_host_and_device_paths"], WORLD, timeout=240)


def _expected_count(name: str, rank: int, base: int) -> int:
    """The global count by hand: the source stage's count summed over the token group."""
    if name == "dp 4":
        return sum(base * (r + 1) for r in range(WORLD))
    stage = 0 if name.endswith("stage 0") else 1  # the source's pp stage: rank // 2
    return sum(base * (stage * 2 + column + 1) for column in range(2))


def _wrapped(value: int, dtype: str) -> int:
    """``value`` as ``torch.tensor(value, int64)`` wraps it, then written into ``dtype``."""
    wide = (value + (1 << 63)) % (1 << 64) - (1 << 63)
    return int(torch.tensor(wide).to(getattr(torch, dtype.removeprefix("torch."))))


def test_the_host_path_gives_the_device_paths_factor_and_count_bit_for_bit(world: dict[str, list[Any]]) -> None:
    """On every rank, layout, dtype and count: the host word's collectives and the host
    factor give the device path's factor and written-back count, bit for bit (the kept
    factor and bound collectives too); the count is the one worked out by hand, wrapped
    to the count's dtype as the device path wraps it."""
    for rank, rows in enumerate(case_values(world, "case_host_and_device_paths")):
        assert len(rows) == len(LAYOUTS) * sum(map(len, BASES.values()))
        for name, dtype, base, host, device, written, reused in rows:
            where = (rank, name, dtype, base)
            assert host[0] == host[1] == device, where
            assert written == _wrapped(_expected_count(name, rank, base), dtype), where
            assert reused, where


def test_a_failed_count_collective_is_named_and_its_word_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A collective of the host word that fails raises the device path's CollectiveError
    (this rank, what the count's collectives do), leaves ``num_tokens`` and the DDP
    untouched, and drops the bound collectives (the failed one may still hold the word):
    the next call binds them anew."""
    groups = TorchGroups(0, {}, {}, (0,), {})  # no group of size > 1: the count is this rank's own
    tokens, ddp = torch.tensor(6), ScaledDDP()
    count = token_count(ACTION, groups)
    assert on_host(tokens) and count.total(tokens, groups) == 6

    def fails(tensor: Any) -> None:
        raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")

    monkeypatch.setattr(count, "steps", [fails])
    with pytest.raises(CollectiveError) as caught:
        scale_by_tokens(tokens, ACTION, groups, [ddp], None)
    text = str(caught.value)
    assert text.startswith("rank 0: token_scale: num_tokens broadcast over 'pp' and sum over 'dp_cp' failed: "
                           "RuntimeError: Connection closed by peer"), text
    assert int(tokens) == 6 and not ddp.factors and Group.DP_CP not in groups.token_counts
    scale_by_tokens(tokens, ACTION, groups, [ddp], None)
    assert int(tokens) == 6 and float(ddp.factors[0]) == float(torch.tensor(6).reciprocal())
    assert token_count(ACTION, groups) is not count


class _Counted(torch.Tensor):
    """A tensor subclass (its ``__torch_function__`` is torch's default)."""


@pytest.mark.parametrize(
    "tokens",
    [torch.tensor(6.0), torch.tensor(6, dtype=torch.uint64), torch.tensor(6.0).to("meta"), torch.tensor(6).as_subclass(_Counted)],
    ids=["float", "uint64", "meta", "subclass"],
)
def test_floating_uint64_device_and_subclass_counts_take_the_device_path(tokens: Any) -> None:
    assert not on_host(tokens)
    assert on_host(torch.tensor(6, dtype=torch.int32)) and on_host(torch.tensor([6], dtype=torch.uint8))


def test_a_cuda_graph_capture_takes_the_device_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a capture nothing is read back on the host: the count takes the device path
    (``tests/test_cuda_graph_path.py`` checks the captured calls' host reads)."""
    assert on_host(torch.tensor(6))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not on_host(torch.tensor(6))
