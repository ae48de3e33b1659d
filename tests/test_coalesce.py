"""torch_impl.run.scaling.coalesce / bind_scale: back-to-back gradients become one span,
whatever order they come in; everything else is kept apart; the scale equals one
multiplication per tensor."""

from __future__ import annotations

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
