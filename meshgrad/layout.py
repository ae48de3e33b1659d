"""Where gradients lie in flat buffers: the reduce-scatter shard and the buffer order.

:func:`scatter_shard` is the documented shard layout of a distributed optimizer's
reduce-scatter. :func:`buffer_layout` orders every gradient for flat per-dtype buffers so
that each reduction whose keys can be contiguous reduces them in place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from meshgrad.actions import Action, Reduction
from meshgrad.axes import Group
from meshgrad.params import ParamKey, ParamSpec

#: Per gradient dtype, every key with a gradient in buffer order.
Layout = tuple[tuple[str, tuple[ParamKey, ...]], ...]

#: Groups whose members all sit on one pp stage and so plan identically: a reduction over
#: them may order its keys for the buffer layout. Reductions over pp-spanning groups keep
#: the plan's key order (their members hold different models), as do reduce-scatters
#: (their key order is the documented shard layout).
STAGE_LOCAL_GROUPS = frozenset(
    {Group.DP_CP, Group.EDP, Group.TP, Group.GTP, Group.EGTP, Group.TP_DP_CP, Group.DP_CP_GTP}
)


def scatter_shard(total: int, size: int, index: int) -> tuple[int, int]:
    """The elements a group member keeps after a reduce-scatter (distributed optimizer).

    Layout: the flat buffer of one :class:`~meshgrad.actions.Reduction` holds the
    gradients of its ``keys`` in plan order, each flattened row-major, zero-padded to a
    multiple of the group size; member ``index`` (members ordered by global rank) owns the
    contiguous shard ``[index * s, (index + 1) * s)`` with ``s = ceil(total / size)``.
    After the collective its shard holds the reduced values; every other element keeps
    this rank's local, pre-scaled value.

    Args:
      total: elements in the buffer (before padding).
      size: group size.
      index: the member's index in the group.

    Returns:
      (start, stop) into the unpadded buffer (empty when the shard is all padding).
    """
    if size < 1 or not 0 <= index < size:
        raise ValueError(f"scatter_shard: member {index} outside a group of {size}")
    shard = -(-total // size)
    start = min(index * shard, total)
    return start, min(start + shard, total)


@dataclasses.dataclass
class _Block:
    """A reduction's request for contiguous keys (``fixed``: in exactly this order)."""

    where: int
    keys: tuple[ParamKey, ...]
    members: frozenset[ParamKey]
    fixed: bool
    first: int
    children: list["_Block"] = dataclasses.field(default_factory=list)


def _nests(inner: _Block, outer: _Block) -> bool:
    """Whether ``inner`` (a subset of ``outer``) can lie contiguously inside it."""
    if not outer.fixed:
        return True
    pos = [outer.keys.index(k) for k in inner.keys]
    if max(pos) - min(pos) + 1 != len(pos):
        return False
    return not inner.fixed or pos == sorted(pos)


def _requests(
    actions: Sequence[Action], order: Mapping[ParamKey, int], dtype_of: Mapping[ParamKey, str]
) -> list[_Block]:
    """One block per reduction whose keys are distinct and all of its dtype."""
    out = []
    for where, a in enumerate(actions):
        if not isinstance(a, Reduction) or not a.keys:
            continue
        if any(dtype_of.get(k) != a.dtype for k in a.keys) or len(set(a.keys)) != len(a.keys):
            continue
        fixed = a.scatter or a.group not in STAGE_LOCAL_GROUPS
        out.append(_Block(where, a.keys, frozenset(a.keys), fixed, min(order[k] for k in a.keys)))
    return out


def _laminar(requests: Sequence[_Block]) -> tuple[list[_Block], list[_Block]]:
    """Keep requests, largest first, that nest in (or are disjoint from) every kept one.

    Returns:
      (kept blocks, root blocks); each kept block is a child of the smallest kept block
      around it.
    """
    kept: list[_Block] = []
    roots: list[_Block] = []
    for block in sorted(requests, key=lambda b: -len(b.keys)):  # stable: plan order on ties
        parent: _Block | None = None
        ok = True
        for other in kept:
            common = block.members & other.members
            if not common:
                continue
            if common != block.members or not _nests(block, other):
                ok = False
                break
            if parent is None or len(other.members) <= len(parent.members):
                parent = other
        if ok:
            kept.append(block)
            (parent.children if parent is not None else roots).append(block)
    return kept, roots


def _emit(block: _Block, order: Mapping[ParamKey, int], placed: dict[ParamKey, int], out: list[ParamKey]) -> None:
    """Append ``block``'s keys depth-first: nested blocks and other keys in parameter order."""
    if block.fixed:
        items: list[_Block | ParamKey] = list(block.keys)
    else:
        inner = {k for child in block.children for k in child.members}
        ranked: list[tuple[int, _Block | ParamKey]] = [(b.first, b) for b in block.children]
        ranked += [(order[k], k) for k in block.keys if k not in inner]
        items = [item for _, item in sorted(ranked, key=lambda i: i[0])]
    for item in items:
        if isinstance(item, _Block):
            _emit(item, order, placed, out)
        elif item not in placed:
            placed[item] = len(out)
            out.append(item)


def _reordered(action: Reduction, placed: Mapping[ParamKey, int]) -> Reduction:
    """``action`` with its keys (and copies) in buffer order."""
    ranked = sorted(range(len(action.keys)), key=lambda i: placed[action.keys[i]])
    if ranked == list(range(len(action.keys))):
        return action
    keys = tuple(action.keys[i] for i in ranked)
    copies = tuple(action.copies[i] for i in ranked) if action.copies else ()
    return dataclasses.replace(action, keys=keys, copies=copies)


def buffer_layout(actions: Sequence[Action], params: Sequence[ParamSpec]) -> tuple[Layout, tuple[Action, ...]]:
    """Order gradients for flat buffers so that reductions run in place.

    Every reduction whose keys share one dtype asks for its keys to be contiguous. The
    requests are taken largest first and kept when they nest in (or are disjoint from)
    every kept one -- a laminar family, laid out by a depth-first walk: inside a block
    its nested blocks first, then its other keys, each in parameter order. Reductions
    over pp-spanning groups and reduce-scatters keep their key order (a block nested in
    them must be a run of it). A request that cannot be kept just costs that reduction
    a copy in backends that use the layout.

    Args:
      actions: the plan's actions.
      params: the plan's parameters (their order is the default order).

    Returns:
      (per dtype, every key with a gradient in buffer order; the actions with the keys of
      each reorderable, contiguous reduction in buffer order).
    """
    order = {p.key: i for i, p in enumerate(params)}
    dtype_of = {p.key: p.dtype for p in params}
    kept, roots = _laminar(_requests(actions, order, dtype_of))
    placed: dict[ParamKey, int] = {}
    layout: dict[str, list[ParamKey]] = {}
    for block in sorted(roots, key=lambda b: b.first):
        _emit(block, order, placed, layout.setdefault(dtype_of[block.keys[0]], []))
    for p in params:
        if p.has_grad and p.key not in placed:
            out = layout.setdefault(p.dtype, [])
            placed[p.key] = len(out)
            out.append(p.key)
    new_actions = list(actions)
    for block in kept:
        action = actions[block.where]
        if not block.fixed and isinstance(action, Reduction):
            new_actions[block.where] = _reordered(action, placed)
    return tuple((d, tuple(keys)) for d, keys in layout.items()), tuple(new_actions)


__all__ = ["Layout", "STAGE_LOCAL_GROUPS", "buffer_layout", "scatter_shard"]
