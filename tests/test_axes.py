"""ParallelDims: validation, Megatron rank order and named-group membership."""

import itertools

import pytest

from meshgrad import Axis, Group, ParallelDims, stage_set


def test_dense_rank_order_is_megatron_tp_cp_dp_pp():
    dims = ParallelDims(pp=2, dp=2, cp=2, tp=2)
    for pp, dp, cp, tp in itertools.product(range(2), repeat=4):
        rank = ((pp * 2 + dp) * 2 + cp) * 2 + tp
        c = dims.coords(rank)
        assert (c[Axis.PP], c[Axis.DP], c[Axis.CP], c[Axis.TP]) == (pp, dp, cp, tp)
        assert dims.rank_of({"pp": pp, "dp": dp, "cp": cp, "tp": tp}) == rank


def test_expert_view_covers_the_same_ranks():
    dims = ParallelDims(pp=2, dp=4, tp=2, ep=2)  # etp = tp = 2, edp = 4*2/(2*2) = 2
    assert (dims.edp, dims.ep, dims.etp) == (2, 2, 2)
    for rank in range(dims.world_size):
        c = dims.coords(rank)
        expect = ((c[Axis.PP] * 2 + c[Axis.EDP]) * 2 + c[Axis.EP]) * 2 + c[Axis.ETP]
        assert expect == rank
        assert dims.rank_of({a: c[a] for a in (Axis.PP, Axis.EDP, Axis.EP, Axis.ETP)}, expert=True) == rank


def test_gtp_sits_between_cp_and_tp():
    dims = ParallelDims(dp=2, gtp=2, tp=2)
    assert dims.world_size == 8
    # rank = ((dp*GTP + gtp)*TP + tp)
    assert dims.coords(5) == {**dims.coords(5), Axis.DP: 1, Axis.GTP: 0, Axis.TP: 1}
    assert dims.group_ranks(Group.GTP, 5) == [5, 7]
    assert dims.group_ranks(Group.DP_CP, 5) == [1, 5]
    assert dims.group_ranks(Group.DP_CP_GTP, 5) == [1, 3, 5, 7]


def test_named_groups_of_a_4d_mesh():
    dims = ParallelDims(pp=2, dp=2, cp=1, tp=2)
    assert dims.group_ranks(Group.TP, 5) == [4, 5]
    assert dims.group_ranks(Group.PP, 5) == [1, 5]
    assert dims.group_ranks(Group.DP_CP, 5) == [5, 7]
    assert dims.group_ranks(Group.TP_DP_CP, 5) == [4, 5, 6, 7]
    assert dims.group_ranks(Group.EMBD, 5, stages=(0, 1)) == [1, 5]
    assert dims.all_groups(Group.TP) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.group_size(Group.TP_DP_CP) == 4


def test_embedding_subset_groups_exclude_other_stages():
    dims = ParallelDims(pp=4, tp=2)
    stages = stage_set(None, 4, "first_last")
    assert stages == (0, 3)
    assert dims.group_ranks(Group.EMBD, 2, stages) == []  # stage 1: not a member
    assert dims.group_ranks(Group.EMBD, 7, stages) == [1, 7]
    assert dims.all_groups(Group.EMBD, stages) == [[0, 6], [1, 7]]
    assert stage_set(None, 1, "first_last") == (0,)
    assert stage_set(None, 4, "first") == (0,)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tp=0), "tp must be a positive int"),
        (dict(pp=1.5), "pp must be a positive int"),
        (dict(dp=True), "dp must be a positive int"),
        (dict(dp=2, tp=2, ep=3), "does not divide"),
        (dict(dp=2, tp=2, ep=2, etp=1, edp=1), "expert view"),
    ],
)
def test_invalid_dims_raise_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kwargs)


def test_out_of_range_rank_and_stage():
    with pytest.raises(ValueError, match="outside the world"):
        ParallelDims(tp=2).coords(2)
    with pytest.raises(ValueError, match="outside pp stages"):
        stage_set((0, 4), 4, "first_last")
    with pytest.raises(ValueError, match="mix the dense and the expert view"):
        ParallelDims(tp=2).axis_ranks(0, ("tp", "ep"))
