"""ParamSpecs and RouterSpecs from torch model chunks, with Megatron's attribute conventions.

Conventions read (all optional):

* ``param.allreduce = False``: an expert parameter (reduced over expert DP).
* ``param.sequence_parallel``, ``param.average_gradients_across_tp_domain``,
  ``param.pipeline_parallel``, ``param.flextron_router_pp_sync``,
  ``param.is_gtp_weight_remat``: the flags of docs/semantics.md.
* gradient: ``param.main_grad`` when the attribute exists, else ``param.grad``.
* word embedding: ``module.shared_embedding_or_output_weight()`` when the module's
  ``share_embeddings_and_output_weights`` is True or the config has MTP layers;
  position embedding: ``module.position_embeddings.weight``.
* routers: modules with ``expert_bias`` / ``qb_beta`` buffers or a
  ``reset_global_aux_loss_tracker()`` method (:mod:`torch_impl.sources.routers`).
* a ``torch.compile(module)`` wrapper (``OptimizedModule``) is seen through wherever it
  sits in the ``.module`` chain: names come from the module it compiled (no
  ``_orig_mod.`` prefix), so they match the uncompiled twin on other ranks and chunks.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from meshgrad.config import FinalizeConfig
from meshgrad.params import ParamKey, ParamSpec, Role, RouterSpec
from meshgrad.steps import QK_MARK, is_qk_layernorm, may_touch
from meshgrad.errors import FinalizeTypeError
from torch_impl.call.probes import Probes
from torch_impl.run.grads import get_grad
from torch_impl.sources.fsdp2 import FsdpGroup, fsdp_groups, settings as fsdp_settings
from torch_impl.sources.torch_ddp import TorchDdp, ddp_wrappers, settings as ddp_settings
from torch_impl.sources.config import chunk_configs
from torch_impl.sources.routers import router_spec
from torch_impl.sources.wrappers import NO_ATTR, ReadRecorder, attr_or, param_name, unwrap

#: Parameter attributes copied into ParamSpec flags.
FLAG_ATTRS = (
    "sequence_parallel",
    "average_gradients_across_tp_domain",
    "pipeline_parallel",
    "flextron_router_pp_sync",
    "is_gtp_weight_remat",
)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return _DTYPE_NAMES.get(dtype) or str(dtype).removeprefix("torch.")


_DTYPE_NAMES = {d: str(d).removeprefix("torch.") for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}


def param_spec(
    name: str, chunk: int, param: torch.Tensor, role: Role = Role.NONE, class_flags: dict[str, Any] | None = None
) -> ParamSpec:
    """The ParamSpec of one parameter.

    Megatron's flags are instance attributes, read from the parameter's ``__dict__``; a
    flag defined on the parameter's class counts too (``class_flags``: the class's values,
    :func:`class_flags`, computed here when not given).

    Raises:
      TypeError: its gradient is not a floating tensor.
    """
    attrs = vars(param)
    flags = class_flags if class_flags is not None else _instance_flags(param, _class_flags(type(param)))
    own = () if _FLAG_NAMES.isdisjoint(attrs) else attrs.keys() & _FLAG_NAMES
    if own:
        flags = {**flags, **{k: attrs[k] for k in own}}
    if "main_grad" in attrs or flags["main_grad"]:
        attr, grad = "main_grad", attrs["main_grad"] if "main_grad" in attrs else getattr(param, "main_grad")
    else:
        attr, grad = "grad", param.grad
    ref = grad if grad is not None else param
    if grad is not None and not isinstance(grad, torch.Tensor):
        raise FinalizeTypeError(f"parameter {name!r} (chunk {chunk}): {attr} is a {type(grad).__name__}, not a tensor")
    return ParamSpec(
        name,
        chunk,
        tuple(ref.shape),
        dtype_name(ref.dtype),
        not flags["allreduce"],  # Megatron: `not getattr(param, "allreduce", True)`
        bool(flags["sequence_parallel"]),
        bool(flags["average_gradients_across_tp_domain"]),
        bool(flags["pipeline_parallel"]),
        bool(flags["flextron_router_pp_sync"]),
        bool(flags["is_gtp_weight_remat"]),
        bool(param.requires_grad) and grad is not None,
        role,
    )


#: Attributes a parameter's ParamSpec reads, and their values when absent.
_FLAG_DEFAULTS = {"allreduce": True, **{flag: False for flag in FLAG_ATTRS}}
_FLAG_NAMES = frozenset(_FLAG_DEFAULTS)
_STEP_FLAGS = frozenset(FLAG_ATTRS)


def _class_flags(cls: type) -> dict[str, Any]:
    """The flag values a parameter class defines (defaults for the rest), and whether it
    defines ``main_grad``."""
    return {**{k: getattr(cls, k, v) for k, v in _FLAG_DEFAULTS.items()}, "main_grad": hasattr(cls, "main_grad")}


def _per_instance(class_flags: Mapping[str, Any]) -> bool:
    """Whether the class defines a flag as a descriptor (a ``property``): its value is
    each parameter's, read as Megatron reads it (``getattr(param, flag)``)."""
    return any(hasattr(v, "__get__") for k, v in class_flags.items() if k != "main_grad")


def _instance_flags(param: torch.Tensor, class_flags: dict[str, Any]) -> dict[str, Any]:
    """``class_flags`` with each descriptor-defined flag read from ``param`` itself
    (``class_flags`` unchanged when the class defines none)."""
    if not _per_instance(class_flags):
        return class_flags
    return {k: getattr(param, k) if k != "main_grad" and hasattr(v, "__get__") else v for k, v in class_flags.items()}


def shared_word_embedding(
    module: Any, has_mtp: bool, tied: Any = NO_ATTR, read: Callable[..., Any] = attr_or
) -> torch.Tensor | None:
    """semantics `word_embedding`: the tied word-embedding weight of an unwrapped chunk, or
    None. ``tied``: its ``share_embeddings_and_output_weights`` when already read;
    ``read`` as in :func:`~torch_impl.sources.wrappers.unwrap`."""
    if tied is NO_ATTR:
        tied = read(module, "share_embeddings_and_output_weights", False)
    if not (tied or has_mtp):
        return None
    getter = read(module, "shared_embedding_or_output_weight", None)
    return getter() if callable(getter) else None


def position_embedding(module: Any, read: Callable[..., Any] = attr_or) -> torch.Tensor | None:
    """semantics `pos_embedding`: ``module.position_embeddings.weight``, or None."""
    emb = read(module, "position_embeddings", None)
    return read(emb, "weight", None) if emb is not None else None


@dataclasses.dataclass(frozen=True, eq=False)
class Discovered:
    """What discovery found in a model list.

    Args:
      params: one ParamSpec per parameter of every chunk.
      routers: one RouterSpec per router module.
      tensors: the parameter objects by key.
      router_modules: the router modules by key.
      chunks: the unwrapped chunks (index = chunk).
      complete: every parameter has a spec (False: the Megatron-DDP chunks' parameters
        that no step of meshgrad touches were left out, :func:`discover`).
      untouched_experts: some left-out parameter is a trained expert parameter.
      fsdp: the FSDP2 parameter groups of the chunks (:func:`torch_impl.sources.fsdp2.fsdp_groups`).
      torch_ddp: the torch DDP wrappers of the chunks (:func:`torch_impl.sources.torch_ddp.ddp_wrappers`).
      module_ids: the ids of every module of the unwrapped chunks, in ``modules()`` order
        (discovery's one walk of the module tree); None: not walked.
      lineage: shared by this discovery and its :meth:`renewal` copies only (what the checks
        found for one holds for the others, but for the NaN scan's spans).
    """

    params: tuple[ParamSpec, ...]
    routers: tuple[RouterSpec, ...]
    tensors: Mapping[ParamKey, torch.Tensor]
    router_modules: Mapping[ParamKey, nn.Module]
    chunks: tuple[Any, ...]
    complete: bool = True
    untouched_experts: bool = False
    fsdp: tuple[FsdpGroup, ...] = ()
    torch_ddp: tuple[TorchDdp, ...] = ()
    module_ids: tuple[int, ...] | None = None
    lineage: object = dataclasses.field(default_factory=object)

    def fingerprint(self) -> tuple[Any, ...]:
        """What may change between steps and changes the plan: requires_grad, gradient
        presence and dtype of every parameter; mode and accumulator presence of routers."""
        out: list[Any] = []
        for key, param in self.tensors.items():
            grad = get_grad(param)
            out.append((param.requires_grad, None if grad is None else grad.dtype))
        for module in self.router_modules.values():
            out.append((module.training, getattr(module, "qb_beta_accum", None) is None))
        return tuple(out)

    def wrapper_settings(self) -> tuple[Any, ...]:
        """What torch's FSDP2 and DDP wrappers of the chunks are set to do to the gradients
        now, as far as it changes what finalize leaves to them: part of the plan's key
        (() for a model without them)."""
        return (fsdp_settings(self.fsdp), ddp_settings(self.torch_ddp)) if self.fsdp or self.torch_ddp else ()

    def refresh(self) -> "Discovered":
        """Re-read the per-step facts (grad presence, dtype, router mode) of the same
        parameters and routers."""
        params = tuple(
            param_spec(s.name, s.chunk, self.tensors[s.key], s.role) for s in self.params
        )
        routers = tuple(router_spec(r.name, r.chunk, self.router_modules[r.key]) for r in self.routers)
        # module_ids dropped: the watch made for the refreshed specs walks the modules again
        return dataclasses.replace(self, params=params, routers=routers, lineage=object(),  # type: ignore[arg-type]
                                   module_ids=None)

    def renewal(self) -> "Discovered":
        """This discovery as a new object of the same :attr:`lineage`, for gradients renewed
        under the same specs (:meth:`~torch_impl.call.watches.GradWatch.renewed`: the same
        facts, inference flags and disjoint memory as the gradients the checks passed)."""
        return dataclasses.replace(self)


def discover(model: Sequence[Any], config: FinalizeConfig, untouched: Sequence[bool] = ()) -> Discovered:
    """ParamSpecs and RouterSpecs of every chunk of ``model``.

    Args:
      model: the model chunks of this rank (virtual pipeline chunks), possibly wrapped.
      config: the finalize config (MTP decides whether the shared weight is looked up).
      untouched: per chunk, leave out the parameters no step but the DP sync touches
        (no flag, role or q / k layernorm name: :func:`touched`); for Megatron-DDP
        chunks, whose DDP does the DP sync, when the GTP step is off.

    Returns:
      A :class:`Discovered`.

    Raises:
      TypeError: a gradient is not a floating tensor.
      ValueError: inconsistent router buffers.
    """
    params: list[ParamSpec] = []
    routers: list[RouterSpec] = []
    tensors: dict[ParamKey, torch.Tensor] = {}
    router_modules: dict[ParamKey, nn.Module] = {}
    chunks = []
    walks: list[list[tuple[str, nn.Module]]] = []  # per chunk, its named_modules()
    by_class: dict[type, dict[str, Any]] = {}
    step_defaults: dict[type, tuple[Any, ...]] = {}  # per class, its step flags' values
    per_instance: set[type] = set()  # classes defining a flag as a property (read per parameter)
    quiet: set[type] = set()  # the other classes whose step flags are all false
    left_out = experts = False
    for index, chunk in enumerate(model):
        skip = index < len(untouched) and untouched[index]
        module = unwrap(chunk)
        chunks.append(module)
        roles: dict[int, Role] = {}
        word = shared_word_embedding(module, config.has_mtp)
        if word is not None:
            roles[id(word)] = Role.WORD_EMBEDDING
        pos = position_embedding(module)
        if pos is not None:
            roles.setdefault(id(pos), Role.POSITION_EMBEDDING)
        submodules = list(module.named_modules())
        walks.append(submodules)
        seen: set[int] = set()
        # named_parameters() from the one walk of the module tree: its order, a shared
        # parameter once under its first name, None entries skipped; names made only for
        # the parameters kept, the prefix tested once per module.
        for prefix, sub in submodules:
            marked = QK_MARK in prefix
            for key, param in sub._parameters.items():
                pid = id(param)
                if param is None or pid in seen:
                    continue
                seen.add(pid)
                cls = type(param)
                # touched() inlined for most parameters: no step flag, role or q / k layernorm name
                if skip and cls in quiet and pid not in roles and _STEP_FLAGS.isdisjoint(vars(param)) and (
                        (not marked and QK_MARK not in key) or not is_qk_layernorm(param_name(prefix, key))):
                    left_out = True
                    experts = experts or _trained_expert(param, by_class[cls])
                    continue
                name = param_name(prefix, key)
                if cls not in by_class:
                    by_class[cls] = _class_flags(cls)
                    step_defaults[cls] = tuple(by_class[cls][flag] for flag in FLAG_ATTRS)
                    if _per_instance(by_class[cls]):
                        per_instance.add(cls)
                    elif not any(step_defaults[cls]):
                        quiet.add(cls)
                flags, steps = by_class[cls], step_defaults[cls]
                if cls in per_instance:  # a flag the class defines as a property: this parameter's value
                    flags = _instance_flags(param, flags)
                    steps = tuple(flags[flag] for flag in FLAG_ATTRS)
                role = roles.get(pid, Role.NONE)
                if skip and role is Role.NONE and not touched(name, param, flags, steps):
                    left_out = True
                    experts = experts or _trained_expert(param, flags)
                    continue
                spec = param_spec(name, index, param, role, flags)
                params.append(spec)
                tensors[spec.key] = param
        for name, sub in submodules:
            spec = router_spec(name, index, sub)
            if spec is not None:
                routers.append(spec)
                router_modules[spec.key] = sub
    found = (tuple(params), tuple(routers), tensors, router_modules, tuple(chunks))
    module_ids = tuple(id(sub) for root, walk in zip(chunks, walks) if isinstance(root, nn.Module) for _, sub in walk)
    return Discovered(*found, not left_out, experts, fsdp_groups(chunks, walks), ddp_wrappers(model, walks),
                      module_ids)


def _flag(attrs: Mapping[str, Any], class_flags: Mapping[str, Any], name: str) -> Any:
    return attrs[name] if name in attrs else class_flags[name]


def touched(
    name: str, param: torch.Tensor, class_flags: Mapping[str, Any], class_steps: tuple[Any, ...] | None = None
) -> bool:
    """Whether a step other than the DP sync and GTP may touch ``param`` (its role
    aside): a flag set or a q / k layernorm name -- :func:`candidate` before a spec is made.

    Args:
      name: the parameter's name.
      param: the parameter.
      class_flags: its class's flag values (:func:`_class_flags`).
      class_steps: its class's values of the step flags (``FLAG_ATTRS``), read when the
        parameter sets none of them itself (most parameters: one set operation then).
    """
    attrs = vars(param)
    if class_steps is not None and _STEP_FLAGS.isdisjoint(attrs):
        return may_touch(name, Role.NONE, class_steps)
    return may_touch(name, Role.NONE, (_flag(attrs, class_flags, flag) for flag in FLAG_ATTRS))


def _trained_expert(param: torch.Tensor, class_flags: Mapping[str, Any]) -> bool:
    """An expert parameter (``allreduce`` false) that trains and has a gradient."""
    return not _flag(vars(param), class_flags, "allreduce") and bool(param.requires_grad) and get_grad(param) is not None


def candidate(spec: ParamSpec) -> bool:
    """Whether a step other than the DP sync may touch this parameter (given a
    gradient): a flag, an embedding role or a q / k layernorm name."""
    return may_touch(spec.name, spec.role, (getattr(spec, flag) for flag in FLAG_ATTRS))


def candidate_keys(found: Discovered) -> list[ParamKey]:
    """The keys of the :func:`candidate` parameters (what a seed helper's plan may read)."""
    return [s.key for s in found.params if candidate(s)]


def watched_keys(found: Discovered, plain: Sequence[bool]) -> list[ParamKey]:
    """The parameters whose per-step state a cached plan depends on: all of a plain
    chunk (meshgrad's DP sync reads them), the :func:`candidate` ones of a DDP chunk."""
    return [s.key for s in found.params if plain[s.chunk] or candidate(s)]


def chunk_facts(
    model: Sequence[Any], has_mtp: bool, ddp_object: Any, read: Callable[..., Any] = attr_or, roles: bool = True
) -> tuple[Any, ...]:
    """Per chunk, what decides discovery beyond the parameters: the unwrapped module, its
    DDP object and, with ``roles``, the tied-embedding flag and weight and the position-
    embedding weight (``read`` as in :func:`~torch_impl.sources.wrappers.unwrap`). Without
    ``roles`` (a call of no :data:`~meshgrad.steps.ROLE_STEPS`) no getter is called."""
    out: list[Any] = []
    for chunk in model:
        module = unwrap(chunk, read=read)
        out += (module, ddp_object(chunk, read))
        if roles:
            tied = read(module, "share_embeddings_and_output_weights", None)
            out += (tied, shared_word_embedding(module, has_mtp, tied, read), position_embedding(module, read))
    return tuple(out)


_WORD_GETTER = operator.methodcaller("shared_embedding_or_output_weight")


def probe_chunk_reads(probes: Probes, model: Sequence[Any], has_mtp: bool, ddp_object: Any,
                      roles: bool = True) -> bool:
    """Write down as probes what a step reads of the chunks' ``.module`` chains: the reads
    of :func:`chunk_facts` (with or without ``roles``) and of ``chunk_configs`` (the configs
    a call resolves), made once through a :class:`~torch_impl.sources.wrappers.ReadRecorder`,
    and the tied word embedding's getter called where :func:`shared_word_embedding` calls
    it. False where a chain holds a ``torch.compile`` wrapper (read through per call)."""
    read = ReadRecorder(probes)
    chunk_configs(model, read)
    for chunk in model:
        read.start(chunk)
        facts = chunk_facts([chunk], has_mtp, ddp_object, read, roles)
        if roles:
            module, _, tied, word, _ = facts
            if (tied or has_mtp) and callable(attr_or(module, "shared_embedding_or_output_weight", None)):
                probes.same(partial(_WORD_GETTER, module), word)
    return not read.compiled
