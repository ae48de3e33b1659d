"""torch_impl.run.scaling.coalesce / bind_scale: back-to-back gradients become one span,
whatever order they come in; everything else is kept apart; the scale equals one
multiplication per tensor."""

from __future__ import annotations

import random

import pytest
import torch

from torch_impl.run.scaling import bind_scale, coalesce


def _spans(tensors: list[torch.Tensor]) -> list[tuple[int, int, int, torch.dtype]]:
    """Each span as (storage pointer, offset, elements, dtype)."""
    return [(t.untyped_storage().data_ptr(), t.storage_offset(), t.numel(), t.dtype) for t in coalesce(tensors)]


def test_views_of_one_buffer_in_any_order_are_one_span() -> None:
    flat = torch.arange(20, dtype=torch.float32)
    views = [flat[0:6].view(2, 3), flat[6:10], flat[10:20].view(5, 2)]
    ptr = flat.untyped_storage().data_ptr()
    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
        assert _spans([views[i] for i in order]) == [(ptr, 0, 20, torch.float32)]


def test_gaps_overlaps_storages_dtypes_and_strides_are_kept_apart() -> None:
    a = torch.arange(12, dtype=torch.float32)
    b = torch.arange(4, dtype=torch.float32)
    halves = a.view(torch.float16)  # the same storage read as another dtype
    strided = a[::2]
    empty = a[3:3]
    tensors = [a[8:12], b, a[0:4], a[2:6], halves[0:4], strided, empty]
    pa, pb = a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr()
    assert _spans(tensors) == [
        (pa, 0, 4, torch.float32), (pa, 2, 4, torch.float32), (pa, 8, 4, torch.float32),  # gap, overlap: apart
        (pb, 0, 4, torch.float32),  # storages in the order they first appear
        (pa, 0, 4, torch.float16),  # another dtype over the same memory: apart
        (pa, 0, 6, torch.float32),  # strided, then empty: as they came, after the spans
        (pa, 3, 0, torch.float32),
    ]


def test_tensors_of_their_own_storages_come_back_as_they_are() -> None:
    """Gradients allocated one by one (a training step's new ``.grad`` tensors): nothing
    merges; each comes back itself, in its order, the empty and strided ones after; one
    storage holding two of them (even apart) groups those by storage, as always."""
    own = [torch.arange(4.0), torch.arange(6.0).view(2, 3), torch.arange(3.0, dtype=torch.float64)]
    strided, empty = torch.arange(8.0)[::2], torch.zeros(0)
    got = coalesce([own[0], strided, own[1], empty, own[2]])
    assert [id(t) for t in got] == [id(t) for t in (*own, strided, empty)]
    want = [t * 0.5 for t in own]
    bind_scale(own)(torch.tensor(0.5))
    assert all(map(torch.equal, own, want))
    flat = torch.arange(10.0)
    apart = [flat[6:10], own[0], flat[0:3]]  # one storage, a gap between its two views
    ptr = flat.untyped_storage().data_ptr()
    assert _spans(apart) == [(ptr, 0, 3, torch.float32), (ptr, 6, 4, torch.float32),
                             (own[0].untyped_storage().data_ptr(), 0, 4, torch.float32)]


def test_a_bound_scale_multiplies_tensors_that_are_no_views_as_they_are() -> None:
    """No tensor a view: the scale takes them as they are (no spans looked for), also two
    set back to back on one storage (merging is only a saving): each element once."""
    flat = torch.arange(1.0, 11.0)
    first = torch.empty(0).set_(flat.untyped_storage(), 0, (4,), (1,))
    second = torch.empty(0).set_(flat.untyped_storage(), 4, (2, 3), (3, 1))
    lone = torch.arange(1.0, 4.0, dtype=torch.float64)
    assert first._base is None and second._base is None and lone._base is None
    bind_scale([second, lone, first])(torch.tensor(0.5))
    assert torch.equal(flat, torch.arange(1.0, 11.0) * 0.5)
    assert torch.equal(lone, torch.arange(1.0, 4.0, dtype=torch.float64) * 0.5)


def test_a_tensor_without_storage_is_kept_apart_and_the_rest_still_merge() -> None:
    flat = torch.arange(8, dtype=torch.float32)
    sparse = torch.eye(3).to_sparse()
    assert coalesce([flat[4:8], sparse, flat[0:4]])[1] is sparse
    assert _spans([flat[4:8], flat[0:4]]) == [(flat.untyped_storage().data_ptr(), 0, 8, torch.float32)]
    first = coalesce([flat[4:8], sparse, flat[0:4]])[0]
    assert (first.storage_offset(), first.numel()) == (0, 8)


def test_bound_scale_equals_one_multiplication_per_tensor() -> None:
    flat = torch.arange(1.0, 25.0, dtype=torch.float64)
    other = torch.arange(1.0, 7.0, dtype=torch.float32)
    tensors = [flat[12:24], flat[0:12].view(3, 4), other[::2], other[1::2]]
    want = [t * 0.25 for t in tensors]
    bind_scale(tensors)(torch.tensor(0.25))
    for got, expected in zip(tensors, want):
        assert torch.equal(got, expected)


def _expected_spans(tensors: list[torch.Tensor]) -> list[tuple[int, int, int, torch.dtype]]:
    """The spans by the rule itself, worked out apart: per (storage, dtype), in the order
    each first appears, the contiguous non-empty tensors sorted by offset (ties in their
    order) and merged where one starts at the previous one's end; then the others, in
    their order."""
    groups: dict[tuple[int, torch.dtype], list[tuple[int, int]]] = {}
    others = []
    for t in tensors:
        if t.is_contiguous() and t.numel():
            groups.setdefault((t.untyped_storage().data_ptr(), t.dtype), []).append((t.storage_offset(), t.numel()))
        else:
            others.append((t.untyped_storage().data_ptr(), t.storage_offset(), t.numel(), t.dtype))
    out = []
    for (ptr, dtype), spans in groups.items():
        merged: list[list[int]] = []
        for offset, numel in sorted(spans, key=lambda span: span[0]):
            if merged and merged[-1][0] + merged[-1][1] == offset:
                merged[-1][1] += numel
            else:
                merged.append([offset, numel])
        out += [(ptr, offset, numel, dtype) for offset, numel in merged]
    return out + others


@pytest.mark.parametrize("seed", range(40))
def test_random_layouts_match_the_rule_and_the_scale_stays_exact(seed: int) -> None:
    """Flat buffers cut into back-to-back views (FSDP2's shards of a parameter group, in
    order; or shuffled, with gaps, overlaps, a view as another dtype, strided, empty and
    lone tensors mixed in): the spans are the rule's, and a bound scale multiplies every
    element of every tensor exactly once."""
    rng = random.Random(seed)
    tensors: list[torch.Tensor] = []
    for _ in range(rng.randint(1, 5)):
        flat = torch.arange(1.0, 1.0 + rng.randint(8, 40), dtype=torch.float64)
        cuts = sorted(rng.sample(range(1, flat.numel()), rng.randint(0, min(6, flat.numel() - 1))))
        views = [flat[a:b] for a, b in zip([0, *cuts], [*cuts, flat.numel()])]
        if rng.random() < 0.3 and len(views) > 1:
            views.pop(rng.randrange(len(views)))  # a gap
        if rng.random() < 0.2:
            views.append(flat[1:4])  # overlapping the others
        tensors += views
    extras = [torch.arange(1.0, 5.0), torch.arange(1.0, 9.0)[::2], torch.zeros(0, dtype=torch.float64)]
    if rng.random() < 0.5:
        tensors += rng.sample(extras, rng.randint(1, len(extras)))
    if rng.random() < 0.3:
        tensors.append(tensors[0][:1].clone().view(torch.int64))  # its own storage, another dtype
    if rng.random() < 0.5:
        rng.shuffle(tensors)
    assert _spans(tensors) == _expected_spans(tensors)
    floats = [t for t in tensors if t.is_floating_point() and t.numel()]
    elements = [(t.untyped_storage().data_ptr(), t.storage_offset() + i * t.stride(0))
                for t in floats for i in range(t.numel())]
    if len(set(elements)) == len(elements):  # no element in two tensors: each scaled once
        want = [t * 0.5 for t in floats]
        bind_scale(floats)(torch.tensor(0.5))
        assert all(map(torch.equal, floats, want))
