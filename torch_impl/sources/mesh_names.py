"""Which dense meshgrad axis each dim of a torch ``DeviceMesh`` is: meshgrad's own names
(``pp``, ``dp``, ``cp``, ``gtp``, ``tp``) or torchtitan's, read without renaming.

torchtitan builds its world mesh with dims ``pp, dp_replicate, dp_shard, cp, tp`` (those of
size > 1), or with EP ``pp, dp_replicate, dp_shard_mod_ep, dp_shard_in_ep, cp, tp``; its
data-parallel dims together are meshgrad's ``dp`` (torchtitan flattens them into ``dp``
too), so ``dp_cp`` = dp x cp as in Megatron. A mesh of its flattened dims
(``dp_replicate, dp_shard_cp, tp``) is read with cp folded into dp: every group that spans
cp spans dp too. Expert dims (``ep``) and dims that overlap are refused with the mapping
(:func:`mapping_text`).
"""

from __future__ import annotations

from collections.abc import Sequence

from meshgrad.axes import DENSE_AXES, Axis
from meshgrad.errors import FinalizeInputError

#: torchtitan's data-parallel dims, outermost first: together they are meshgrad's ``dp``. Its
#: flattened ``dp_shard_cp`` / ``dp_cp`` are read as dp with cp folded in (every group that
#: spans cp spans dp too, so the groups are the same).
TORCHTITAN_DP = ("dp_replicate", "dp_cp", "dp_shard", "dp_shard_cp", "dp_shard_mod_ep", "dp_shard_in_ep")

#: Every dim name read, and the meshgrad axis it is (part of).
DIM_AXES: dict[str, Axis] = {**{a.value: a for a in DENSE_AXES}, **{name: Axis.DP for name in TORCHTITAN_DP}}

#: The data-parallel pieces each name covers (replicate, the two EP parts of shard, cp):
#: two dims that cover one piece both cannot be read.
_PIECES = {
    "dp": {"rep", "mod", "in"}, "dp_replicate": {"rep"}, "dp_shard": {"mod", "in"},
    "dp_shard_mod_ep": {"mod"}, "dp_shard_in_ep": {"in"}, "dp_shard_cp": {"mod", "in", "cp"},
    "dp_cp": {"rep", "mod", "in", "cp"}, "cp": {"cp"},
}

#: Names a mesh may carry that are expert dims, and why they cannot be read.
_EXPLAINED = {
    "ep": "an expert dim: EP borrows data-parallel (and cp / tp) ranks; set config.expert_model_parallel_size",
    "etp": "an expert dim: set config.expert_tensor_parallel_size",
    "edp": "an expert dim: it follows from the dense dims and the config's expert sizes",
}


def mapping_text() -> str:
    """The dim-name mapping, in words (part of every refusal)."""
    return (
        "meshgrad reads pp -> pp, dp_replicate x dp_shard (or dp_replicate x dp_shard_mod_ep x "
        "dp_shard_in_ep) -> dp, cp -> cp, tp -> tp (torchtitan's names; a flattened dp_shard_cp or dp_cp "
        "is dp with cp folded in), or its own pp, dp, cp, gtp, tp; dp_cp = dp x cp. Pass the mesh those "
        "dims were built on (torchtitan: the world mesh, not an expert mesh)"
    )


def dense_dims(names: Sequence[str], rank: int) -> dict[Axis, tuple[int, ...]]:
    """Per dense axis, the indices of the mesh dims it is made of (outermost first).

    Args:
      names: the DeviceMesh's dim names, in mesh order.
      rank: this rank (for the message).

    Returns:
      ``{axis: mesh dim indices}`` for the axes the mesh has.

    Raises:
      FinalizeInputError: a name meshgrad does not read, a repeated name, or meshgrad's
        ``dp`` mixed with torchtitan's data-parallel dims; the message shows the mapping.
    """
    problems = []
    for name in dict.fromkeys(names):
        if name not in DIM_AXES:
            why = _EXPLAINED.get(name, "not a dim name meshgrad reads")
            problems.append(f"{name!r} is {why}")
    if len(set(names)) != len(names):
        problems.append("a name is repeated")
    known = [n for n in dict.fromkeys(names) if n in _PIECES]
    for i, first in enumerate(known):
        for second in known[i + 1:]:
            if _PIECES[first] & _PIECES[second]:
                problems.append(f"{first!r} and {second!r} overlap (both cover the same data-parallel ranks)")
    if problems:
        raise FinalizeInputError(
            f"rank {rank}: DeviceMesh dim names {list(names)} cannot be read: {'; '.join(problems)}. "
            f"{mapping_text()}"
        )
    order = {name: i for i, name in enumerate((*TORCHTITAN_DP, *(a.value for a in DENSE_AXES)))}
    out: dict[Axis, tuple[int, ...]] = {}
    for axis in DENSE_AXES:
        dims = sorted((i for i, n in enumerate(names) if DIM_AXES[n] is axis), key=lambda i: order[names[i]])
        if dims:
            out[axis] = tuple(dims)
    return out


__all__ = ["DIM_AXES", "TORCHTITAN_DP", "dense_dims", "mapping_text"]
