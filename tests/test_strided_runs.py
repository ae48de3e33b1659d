"""Staging by strided runs (torch_impl.run.strided_runs): which gradients form runs, and
that the run copies move exactly the values ``_foreach_copy_`` moves, nothing else.

The layout is a Megatron DDP's: every gradient a view of one buffer, parameters in
reverse order, the staged (layernorm-like) gradients scattered between others that the
copies must not touch.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

torch = pytest.importorskip("torch")

from torch_impl.run.staging import _Staging  # noqa: E402
from torch_impl.run.row_gather import RowGather  # noqa: E402
from torch_impl.run.strided_runs import RunCopies, find_runs  # noqa: E402


def _ddp_layout(layers: int, per_layer: Sequence[int], gap: int, reverse: bool = True, tail: Sequence[int] = ()):
    """(the buffer, the staged views in model order): each layer's staged gradients of
    ``per_layer`` numels with ``gap`` elements of other gradients after each, the layers
    laid out in reverse (a Megatron DDP) or in order; ``tail``: gradients after the last
    layer (a final layernorm), in model order. Integer values, distinct everywhere."""
    numels = [n for _ in range(layers) for n in per_layer] + list(tail)
    order = list(range(len(numels)))[::-1] if reverse else list(range(len(numels)))
    total = sum(numels) + gap * len(numels)
    buffer = torch.arange(1.0, total + 1.0)
    offsets, offset = {}, 0
    for i in order:
        offsets[i] = offset
        offset += numels[i] + gap
    views = [buffer[offsets[i]:offsets[i] + n] for i, n in enumerate(numels)]
    return buffer, views


def test_find_runs_groups_each_layer_position():
    """24 layers of 4 staged gradients laid out in reverse: 4 runs of 24 (one per
    position in the layer); a final gradient of another size stays single."""
    numels = [16, 16, 8, 16] * 24 + [12]
    _, views = _ddp_layout(24, [16, 16, 8, 16], gap=5, tail=[12])
    targets, t = [], 0
    for n in numels:
        targets.append(t)
        t += n
    runs, singles = find_runs(numels, [v.storage_offset() for v in views], targets)
    assert sorted(map(len, runs)) == [24, 24, 24, 24] and singles == [96]
    assert sorted(run[0] for run in runs) == [0, 1, 2, 3]
    assert all(run == list(range(run[0], 96, 4)) for run in runs)


def test_find_runs_refuses_overlapping_rows():
    """Items closer than their length (overlapping memory) never form a run."""
    runs, singles = find_runs([4] * 6, [0, 2, 4, 6, 8, 10], [0, 4, 8, 12, 16, 20])
    assert runs == [] and singles == list(range(6))


def _round_trips(buffer: torch.Tensor, views: Sequence[torch.Tensor], calls: int = 3):
    """(the kept staging of ``views``, whether each call found runs, the last staged
    buffer) after ``calls`` copies in and out, each checked: the buffer equals the views
    concatenated in order; after new values are written to it and copied out, every view
    holds its part and every other element of ``buffer`` keeps its value."""
    sizes = [v.numel() for v in views]
    stage = _Staging(views, sizes, torch.float32, keep=True)
    mask = torch.ones_like(buffer, dtype=torch.bool)
    for v in views:
        mask[v.storage_offset():v.storage_offset() + v.numel()] = False
    others, runs_seen = buffer[mask].clone(), []
    for step in range(calls):
        staged = stage.copy_in()
        runs_seen.append(stage.runs is not None)
        flat = staged[0]
        assert torch.equal(flat, torch.cat([v.reshape(-1) for v in views])), step
        flat.copy_(-torch.arange(flat.numel(), dtype=torch.float32) * (step + 2))
        stage.copy_out(staged)
        assert all(torch.equal(v, part) for v, part in zip(views, torch.split(flat, sizes))), step
        assert torch.equal(buffer[mask], others), step
    return stage, runs_seen, flat


@pytest.mark.parametrize("reverse", [True, False], ids=["reversed (Megatron DDP)", "in order"])
def test_run_staging_moves_exactly_the_gradients(reverse):
    """Copy in: the staging buffer equals the gradients concatenated in model order. Copy
    out: every gradient gets its part of the buffer back, every element between them
    (other parameters' gradients) keeps its value. Three calls on the kept buffer: the
    first by ``_foreach_copy_`` (no search on a first call), the others by the runs."""
    buffer, views = _ddp_layout(6, [16, 16, 8], gap=3, reverse=reverse, tail=[12, 5])
    stage, runs_seen, flat = _round_trips(buffer, views)
    assert runs_seen == [False, True, True]
    assert len(stage.runs.forward) + len(stage.runs.reversed) == 3
    assert len(stage.runs.reversed if reverse else stage.runs.forward) == 3
    assert len(stage.runs.single_tensors) == 2
    assert stage.copy_in()[0] is flat  # the buffer is kept


def test_runs_not_used_where_foreach_is_as_good():
    """No runs for tensors of separate storages, of another dtype than the buffer's, for a
    buffer made per call, or where runs would not halve the ops; the copies are then
    ``_foreach_copy_``'s, with the same values."""
    def after_two_calls(tensors, dtype=torch.float32, keep=True):
        stage = _Staging(tensors, [t.numel() for t in tensors], dtype, keep=keep)
        for _ in range(2):
            buffer, _ = stage.copy_in()
            assert torch.equal(buffer, torch.cat([t.reshape(-1) for t in tensors]).to(dtype))
        return stage

    assert after_two_calls([torch.arange(8.0) + i for i in range(12)]).runs is None  # separate storages
    _, views = _ddp_layout(6, [8, 8], gap=2)
    assert after_two_calls(views).runs is not None  # (the layout itself has runs)
    assert after_two_calls(views, torch.float64).runs is None
    assert after_two_calls(views, keep=False).runs is None
    assert after_two_calls(_ddp_layout(1, [3, 5, 7, 9, 11, 13], gap=1)[1]).runs is None  # no numel repeats
    assert RunCopies.build(views[:3], *_Staging(views[:3], [8] * 3, torch.float32, keep=True).kept) is None
    # Not on another device (on CUDA ``_foreach_copy_`` is a few fused kernels already):
    # the same layout on the meta device finds its runs but builds none.
    meta = torch.empty(int(views[0]._base.numel()), device="meta")
    meta_views = [meta[v.storage_offset():v.storage_offset() + v.numel()] for v in views]
    meta_stage = _Staging(meta_views, [8] * 12, torch.float32, keep=True)
    assert find_runs([8] * 12, [v.storage_offset() for v in meta_views], list(range(0, 96, 8)))[0]
    assert RunCopies.build(meta_views, *meta_stage.kept) is None


@pytest.mark.parametrize("reverse", [True, False], ids=["reversed (Megatron DDP)", "in order"])
def test_row_gather_copies_in_exactly_the_gradients(reverse):
    """Gradients that start and end on whole rows of 64 or more elements of their storage
    are copied in by gathers of those rows (in parts that torch runs on one thread), the
    buffer equal to the gradients concatenated in model order; the copy out stays with
    the runs and leaves every other element as it was."""
    buffer, views = _ddp_layout(24, [1024, 512], gap=384, reverse=reverse, tail=[256])
    stage, runs_seen, _ = _round_trips(buffer, views)
    assert runs_seen == [False, True, True]
    gather = stage.runs.gather
    assert gather is not None and gather.source.shape[1] == 128  # gcd of 1024, 512, 384, 256
    assert len(gather.parts) == 2  # 36,864 elements: two parts of at most 32,768
    assert sum(index.numel() for index, _ in gather.parts) * 128 == sum(v.numel() for v in views)


def test_row_gather_not_built_for_short_rows():
    """Rows shorter than MIN_ROW (here offsets on 3-element boundaries): no gather, the
    runs copy in, with the same values."""
    _, views = _ddp_layout(6, [16, 16, 8], gap=3)
    stage = _Staging(views, [v.numel() for v in views], torch.float32, keep=True)
    for _ in range(3):
        flat = stage.copy_in()[0]
        assert torch.equal(flat, torch.cat([v.reshape(-1) for v in views]))
    assert stage.runs is not None and stage.runs.gather is None
    assert RowGather.build(views, stage.kept[0]) is None
