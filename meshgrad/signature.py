"""What one action launches on one group, as data (:class:`Signature`, its tensors
:class:`Operand`): the members of a group must produce equal signatures, and a
comparison round exchanges them as lines (:meth:`Signature.line`)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from meshgrad.axes import Group
from meshgrad.params import ParamKey

if TYPE_CHECKING:  # the actions module builds signatures: imported for the annotation only
    from meshgrad.actions import ReduceOp


@dataclasses.dataclass(frozen=True)
class Operand:
    """One tensor of a collective: its name (None where members hold different ones) and shape."""

    name: str | None
    shape: tuple[int, ...]

    def text(self) -> str:
        """``name[d0, d1]`` (``[d0, d1]`` without a name)."""
        return f"{self.name or ''}{list(self.shape)}"


@dataclasses.dataclass(frozen=True)
class Signature:
    """What one action launches on one group, as data.

    The members of a group must produce equal signatures, or the collectives they launch
    would not match (a hang or mixed data). The collective fields (op, scale, dtype,
    operands, expert counts) decide the launch; the identities (routers, stages) say
    which data meet in it.

    Args:
      group: the group it communicates over.
      step: its step(s), ``"+"``-joined when fused.
      op: the reduction, or None (a router update's collective).
      pre_scale: multiplier before the collective, or None when the action has none.
      dtype: the tensors' dtype, or None.
      scatter: a reduce-scatter.
      operands: the tensors, or None when the action reduces router buffers.
      experts: per router, its expert count (router updates), else None.
      routers: the routers whose buffers meet in the collective.
      stages: the pp stages of a stage-subset group.
    """

    group: Group
    step: str
    op: ReduceOp | None = None
    pre_scale: float | None = None
    dtype: str | None = None
    scatter: bool = False
    operands: tuple[Operand, ...] | None = None
    experts: tuple[int, ...] | None = None
    routers: tuple[ParamKey, ...] = ()
    stages: tuple[int, ...] | None = None

    def without_names(self) -> "Signature":
        """The same signature with operand names dropped (members over pp hold other layers)."""
        if self.operands is None:
            return self
        return dataclasses.replace(self, operands=tuple(Operand(None, o.shape) for o in self.operands))

    def line(self) -> str:
        """The collective as one line: ``step op xscale dtype [scatter] [operands]``."""
        words = [self.step]
        if self.op is not None:
            words.append(str(self.op))
        if self.pre_scale is not None:
            words.append(f"x{self.pre_scale!r}")
        if self.dtype is not None:
            words.append(self.dtype)
        if self.scatter:
            words.append("scatter")
        if self.experts is not None:
            words.append(f"experts {list(self.experts)}")
        if self.operands is not None:
            words.append("[" + ",".join(o.text() for o in self.operands) + "]")
        return " ".join(words)

    def identity_lines(self) -> tuple[str, ...]:
        """The identities as lines: ``step routers [chunk:name,...]``, ``step stages [...]``."""
        lines = []
        if self.routers:
            names = ",".join(f"{chunk}:{name}" for chunk, name in self.routers)
            lines.append(f"{self.step} routers [{names}]")
        if self.stages is not None:
            lines.append(f"{self.step} stages {list(self.stages)}")
        return tuple(lines)


__all__ = ["Operand", "Signature"]
