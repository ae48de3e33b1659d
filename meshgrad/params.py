"""ParamSpec and RouterSpec: what the plan needs to know about parameters and routers.

Backends discover these from their models (torch ``nn.Module`` attributes, flax metadata
or explicit trees); the plan reads only these records.
"""

from __future__ import annotations

import dataclasses
import enum
import math

from meshgrad.errors import FinalizeInputError, FinalizeTypeError

#: Dtype names the plan accepts.
FLOAT_DTYPES = frozenset({"float32", "bfloat16", "float16", "float64"})


class Role(str, enum.Enum):
    """A parameter's special role in pipeline-parallel embedding sync."""

    NONE = "none"
    WORD_EMBEDDING = "word_embedding"
    POSITION_EMBEDDING = "position_embedding"

    def __str__(self) -> str:
        return self.value


ParamKey = tuple[int, str]
"""(chunk index, parameter name): unique within one rank's model list."""


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter of one model chunk, with the flags of docs/semantics.md.

    Args:
      name: the parameter's qualified name inside its chunk.
      chunk: index of the (virtual pipeline) chunk in the model list.
      shape: gradient shape.
      dtype: gradient dtype name (``"float32"``, ``"bfloat16"``, ...).
      expert: Megatron ``allreduce=False`` (reduced over edp, not dp_cp).
      sequence_parallel: flagged ``sequence_parallel=True``.
      average_gradients_across_tp_domain: AVG over tp.
      pipeline_parallel: conditional-embedder param synced over pp.
      flextron_router_pp_sync: flextron router param synced over pp.
      is_gtp_weight_remat: sharded over gtp (skipped by the GTP step).
      has_grad: ``requires_grad`` and a gradient exists.
      role: word / position embedding role, or NONE.
    """

    name: str
    chunk: int = 0
    shape: tuple[int, ...] = ()
    dtype: str = "float32"
    expert: bool = False
    sequence_parallel: bool = False
    average_gradients_across_tp_domain: bool = False
    pipeline_parallel: bool = False
    flextron_router_pp_sync: bool = False
    is_gtp_weight_remat: bool = False
    has_grad: bool = True
    role: Role = Role.NONE
    #: ``(chunk, name)``, computed once (plans look it up for every parameter).
    key: ParamKey = dataclasses.field(init=False, repr=False, compare=False)
    #: Number of elements of ``shape``, computed once.
    numel: int = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if type(self.name) is not str or not self.name:
            raise FinalizeInputError(f"ParamSpec.name must be a non-empty str, got {self.name!r}")
        if type(self.chunk) is not int or self.chunk < 0:
            raise FinalizeInputError(f"ParamSpec {self.name!r}: chunk must be an int >= 0, got {self.chunk!r}")
        fields = self.__dict__  # frozen: set through the instance dict (one store each)
        shape = fields["shape"] = tuple(map(int, self.shape))
        if self.dtype not in FLOAT_DTYPES:
            raise FinalizeTypeError(
                f"ParamSpec {self.name!r} (chunk {self.chunk}): gradient dtype {self.dtype!r} "
                f"is not a floating type in {sorted(FLOAT_DTYPES)}"
            )
        if type(self.role) is not Role:
            fields["role"] = Role(self.role)
        fields["key"] = (self.chunk, self.name)
        fields["numel"] = math.prod(shape)


@dataclasses.dataclass(frozen=True)
class RouterSpec:
    """One MoE router module (expert bias / quantile balancing state).

    Args:
      name: the router module's qualified name inside its chunk.
      chunk: chunk index.
      num_experts: length of its per-expert vectors.
      training: module in training mode.
      has_expert_bias: has an ``expert_bias`` buffer (and ``local_tokens_per_expert``).
      frozen_expert_bias: flagged ``frozen_expert_bias``.
      has_qb_beta: has ``qb_beta`` / ``qb_beta_accum`` / ``qb_beta_count``.
      qb_accum_present: ``qb_beta_accum`` is not None.
      has_aux_loss_tracker: has ``reset_global_aux_loss_tracker()``.
    """

    name: str
    chunk: int = 0
    num_experts: int = 1
    training: bool = True
    has_expert_bias: bool = False
    frozen_expert_bias: bool = False
    has_qb_beta: bool = False
    qb_accum_present: bool = True
    has_aux_loss_tracker: bool = False

    @property
    def key(self) -> ParamKey:
        return (self.chunk, self.name)
