"""Whether a model still is what its cached plan was made for (:class:`ModelWatch`):
module registration hooks, the module dicts on the paths to the watched objects, and
the watched parameters' :class:`~torch_impl.call.watches.GradWatch`."""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any

from torch import nn

from meshgrad.params import ParamKey
from torch_impl.call.probes import Probes
from torch_impl.call.registration_hooks import drop_retired, register, retire
from torch_impl.call.dict_watch import BUFFERS, MODULES, PARAMETERS, DictWatch, ExactDicts, by_value, differs, split
from torch_impl.call.watches import GradWatch, Renewal


class _Edges:
    """The module-tree dicts (``_modules`` / ``_parameters``) on the paths from the chunks'
    roots down to some objects, each compared whole with a copy (which also sees a removal
    or a direct dict assignment, which no registration hook reports).

    A copy is compared by ``==`` in one list comparison (identical values short-cut); a
    dict holding a value that could compare equal to its replacement (a one-element or
    meta parameter, a subclass) is compared key by key, by identity (:class:`ExactDicts`).

    Args:
      roots: the unwrapped chunks.
      targets: (chunk, dotted path, leaf kind -- ``PARAMETERS`` for a parameter, None
        for a module) of each watched object.
    """

    def __init__(self, roots: Sequence[Any], targets: Iterable[tuple[int, str, Any]]) -> None:
        stores: dict[tuple[int, Any], tuple[dict[str, Any], Any]] = {}  # (owner, kind) -> (owner's __dict__, kind)
        modules: dict[tuple[int, str], Any] = {}  # (chunk, module path) -> the module there, or None

        def add(owner: Any, kind: Any) -> None:
            stores.setdefault((id(owner), kind), (vars(owner), kind))

        def module_at(chunk: int, path: str) -> Any:
            """The module at ``path`` (each prefix walked once), adding the edges to it."""
            key = (chunk, path)
            if key not in modules:
                found = roots[chunk] if isinstance(roots[chunk], nn.Module) else None
                if path:
                    head, _, last = path.rpartition(".")
                    parent = module_at(chunk, head)
                    found = parent._modules.get(last) if parent is not None else None
                    if found is not None:
                        add(parent, MODULES)
                modules[key] = found
            return modules[key]

        for chunk, path, leaf_kind in targets:
            if leaf_kind is None:
                module_at(chunk, path)
            elif path:
                owner = module_at(chunk, path.rpartition(".")[0])
                if owner is not None:
                    add(owner, leaf_kind)
        owners = list(stores.values())
        plain, exact = split(owners, (by_value(kind(owner)) for owner, kind in owners))
        # Per kind of dict: (its getter, the owners' __dict__s, copies of their dicts).
        self.plain: list[tuple[Any, list[dict[str, Any]], list[dict[str, Any]]]] = []
        for kind in {id(k): k for _, k in plain}.values():
            of_kind = [o for o, k in plain if k is kind]
            self.plain.append((kind, of_kind, list(map(dict.copy, map(kind, of_kind)))))
        self.exact_owners, self.exact_kinds = [o for o, _ in exact], [k for _, k in exact]
        self.exact = ExactDicts(map(operator.call, self.exact_kinds, self.exact_owners)) if exact else None

    def same(self) -> bool:
        """Each module's dict (whichever object it now is) holds the same objects under the
        same names."""
        for kind, owners, copies in self.plain:
            if differs(list(map(kind, owners)), copies):
                return False
        return self.exact is None or self.exact.same(map(operator.call, self.exact_kinds, self.exact_owners))

    def probe(self, probes: Probes) -> None:
        """Write :meth:`same` down as probes: itself, as one ``check`` (its comparisons run
        over fixed lists already), where there is any edge."""
        if self.plain or self.exact is not None:
            probes.check(self.same)


def _watched_module_ids(chunks: Sequence[Any], found: Any) -> list[int]:
    """The ids of the modules the registration hooks watch.

    Args:
      chunks: the chunks as given (each one's ``.module`` wrapper chain is walked).
      found: the discovered model (every module of its unwrapped chunks: the discovery's
        ``module_ids`` where it walked them).

    Returns:
      The module ids, wrapper chains first.
    """
    module_ids: list[int] = []
    for chunk in chunks:  # the wrapper chain
        module_ids.append(id(chunk))
        inner = chunk
        for _ in range(64):
            inner = getattr(inner, "module", None)
            if not isinstance(inner, nn.Module):
                break
            module_ids.append(id(inner))
    if found.module_ids is not None:
        module_ids.extend(found.module_ids)
        return module_ids
    for root in found.chunks:
        if isinstance(root, nn.Module):
            module_ids.extend(id(m) for m in root.modules())
    return module_ids


class ModelWatch:
    """Whether a model still is what its cached plan was made for.

    Structure -- parameters, buffers or submodules registered, replaced or removed
    anywhere in the chunks -- is seen without visiting the parameters: torch's module
    registration hooks (filtered to this model's modules) set a dirty flag, and the
    module dicts on the paths to the watched parameters and routers are compared with
    copies (:class:`_Edges`: this also sees removals and direct dict edits, which no hook
    reports). Per step, then, the cost
    is that of the watched parameters' :class:`GradWatch`, the routers' attributes and
    buffers, and a few calls per chunk (wrapper chain, DDP object, embedding getters).

    Watched parameters: every parameter of a plain chunk (meshgrad reads every gradient
    for the DP sync), and of a Megatron-DDP chunk those a step of meshgrad may touch: a
    flag set (sequence_parallel, average_gradients_across_tp_domain, pipeline_parallel,
    flextron_router_pp_sync, is_gtp_weight_remat), an embedding role or a q/k layernorm
    name, plus whatever the bound plan reads (:meth:`cover`). Flags and requires_grad of
    the other parameters of a DDP chunk are read once per discovery
    (``torch_impl.invalidate_plans(model)`` forces a re-read). A seed helper checks less
    (:meth:`touched_same`: in full only what its plan may read), the router helpers only
    the routers (:meth:`routers_same`).

    Args:
      found: the discovered model.
      chunks: the chunks as given (wrappers included).
      facts: per chunk, the facts that decide discovery (:func:`chunk_facts`; called with
        ``roles=False``: without those that decide the embedding roles).
      watched: the keys of the parameters to watch.
      touched: the keys of the parameters a step besides the DP sync may touch (what a
        seed helper's plan may read: :meth:`touched_same`); None: all watched ones.
      own_views: meshgrad's own buffer views by id, watched by identity only
        (:class:`~torch_impl.call.watches.GradWatch`).
      probe_facts: writes down as probes what ``facts`` reads, with or without the roles'
        (:meth:`probe`; None: it cannot be).
    """

    def __init__(
        self,
        found: Any,
        chunks: Sequence[Any],
        facts: Callable[..., tuple[Any, ...]],
        watched: Iterable[ParamKey],
        touched: Iterable[ParamKey] | None = None,
        own_views: Mapping[int, Any] | None = None,
        probe_facts: Callable[..., bool] | None = None,
    ) -> None:
        self.found = found
        self.own_views = own_views
        self.facts, self.probe_facts = facts, probe_facts
        self.chunk_facts = facts()  # held: their ids cannot be reused while watched
        # by whether the roles are read: a seed helper's plan reads none (ROLE_STEPS)
        self.fact_ids = {True: tuple(map(id, self.chunk_facts)), False: tuple(map(id, facts(roles=False)))}
        self.keys = set(watched)
        self.touched = self.keys if touched is None else set(touched) & self.keys
        self.grads = self._grad_watch(self.keys)
        self._helper: tuple[GradWatch, DictWatch] | None = None  # made on a helper's first check
        self._covered: Any = None  # the last plan cover_plan() covered
        routers = list(found.router_modules.values())
        # A router's attributes against a copy (its containers, _buffers among them, are the
        # same objects, so they compare by identity); its buffers key by key, by identity
        # (a one-element buffer replaced by an equal one is still seen).
        self.router_dicts = list(map(vars, routers))
        self.router_snapshots = list(map(dict.copy, self.router_dicts))
        self.router_buffers = ExactDicts(map(BUFFERS, self.router_dicts))
        # The modules the hooks watch, and the module-tree edges down to the watched
        # parameters and, apart, to the routers.
        self.module_ids = _watched_module_ids(chunks, found)
        self.param_edges = self._parameter_edges()
        self.router_edges = _Edges(found.chunks, [(k[0], k[1], None) for k in found.router_modules])
        self.dirty = [False]
        self.renewing = False  # the last change seen was a renewal of the gradients (renew)
        self._hooks = register(set(self.module_ids), self.dirty)
        self._finalizer = weakref.finalize(self, retire, self._hooks)  # collected anywhere: only retired

    def _parameter_edges(self) -> _Edges:
        """The module-tree edges to the watched parameters."""
        return _Edges(self.found.chunks, [(k[0], k[1], PARAMETERS) for k in self.keys])

    def structure_same(self, roles: bool = True) -> bool:
        """No registration in the model since construction, the same module-tree edges to
        the watched objects, and the same per-chunk facts (without ``roles``: but those
        that decide the embedding roles)."""
        return (
            not self.dirty[0]
            and self.param_edges.same()
            and self.router_edges.same()
            and self._facts_same(roles)
        )

    def _facts_same(self, roles: bool) -> bool:
        return tuple(map(id, self.facts(roles=roles))) == self.fact_ids[roles]

    def routers_same(self) -> bool:
        """What a plan of router steps only (expert bias, qb_beta, reset) depends on: no
        registration in the model, the same edges to the routers, chunk facts (not the
        roles'), router attributes and buffers (not the parameters)."""
        return (
            not self.dirty[0]
            and self.router_edges.same()
            and self._facts_same(False)
            and self._routers_unchanged()
        )

    def _routers_unchanged(self) -> bool:
        if not self.router_dicts:  # no router: nothing to compare
            return True
        return not differs(self.router_dicts, self.router_snapshots) and self.router_buffers.same(
            map(BUFFERS, self.router_dicts)  # whichever dict each router holds now
        )

    def same(self) -> bool:
        """True when the cached discovery (and every plan made from it) still holds. At
        once False after :meth:`release` (the gradients' watch holds none of them: its own
        ``same`` answers False), with nothing else compared: a training step's call then
        asks :meth:`renewed`, which compares the rest."""
        return self.grads.weak is None and self.structure_same() and self._routers_unchanged() and self.grads.same()

    def probe(self, probes: Probes, reads: str = "all") -> bool:
        """Write the check of ``reads`` down as probes (:meth:`same` for ``"all"``,
        :meth:`touched_same` for ``"touched"``, :meth:`routers_same` for ``"routers"``), for
        a watch that has just answered True: the dirty flag, the module-tree edges, what the
        chunk facts are read from, and the bulk checks of the routers and the parameters
        (``check`` probes: each the watch's own comparison over its fixed lists). False
        where it cannot be: facts that cannot be probed (a ``torch.compile`` wrapper)."""
        if self.probe_facts is None:
            return False
        probes.same(partial(operator.getitem, self.dirty, 0), False)
        if self.router_dicts:
            probes.check(self._routers_unchanged)
        roles = reads == "all"  # a helper's plan reads no role (ROLE_STEPS)
        if reads == "routers":
            self.router_edges.probe(probes)
            return self.probe_facts(probes, roles=roles)
        # Replaced when a plan covers more (cover): the probes below check the old ones.
        probes.same(partial(getattr, self, "param_edges"), self.param_edges)
        if reads == "touched":
            if self._helper is None:  # made by a touched_same that answered True
                return False
            probes.same(partial(getattr, self, "_helper"), self._helper)
            checks: tuple[GradWatch | DictWatch, ...] = self._helper
        else:
            probes.same(partial(getattr, self, "grads"), self.grads)
            checks = (self.grads,)
        for watch in checks:
            if len(watch):
                probes.check(watch.same)
        self.param_edges.probe(probes)
        self.router_edges.probe(probes)
        return self.probe_facts(probes, roles=roles)

    def touched_same(self) -> bool:
        """What a seed helper's plan depends on (it does no DP sync): structure, chunk
        facts (but those that decide the embedding roles, which no helper step of the
        discovery reads: :data:`~meshgrad.steps.ROLE_STEPS`; a change there is seen by the
        next finalize) and routers as :meth:`same`, the parameters a step besides the DP
        sync may touch (and what bound plans read) in full, and of the other watched parameters
        their attributes only (a flag set later makes one a candidate); their gradients
        and requires_grad are the DP sync's, which :meth:`same` checks."""
        if self._helper is None:
            if not self.same():  # the helper's snapshot starts from the discovered state
                return False
            rest = [self.found.tensors[k] for k in self.found.tensors if k in self.keys and k not in self.touched]
            full = self.grads if not rest else self._grad_watch(self.touched)
            self._helper = (full, DictWatch(map(vars, rest)))
        full, rest = self._helper
        return self.structure_same(roles=False) and self._routers_unchanged() and full.same() and rest.same()

    def renewal(self) -> Renewal | None:
        """Whether the model is what :meth:`same` watches but for new plain ``.grad``
        tensors that read as the old ones: then the discovery's specs, and every plan made
        from them, still hold. Returns what it read of the new gradients
        (:meth:`~torch_impl.call.watches.GradWatch.renewal`, for :meth:`renew`), else None."""
        # the gradients first: a watch that cannot be renewed answers at once
        renewal = self.grads.renewal()
        return renewal if renewal is not None and self.structure_same() and self._routers_unchanged() else None

    def renew(self, found: Any, renewal: Renewal | None = None) -> bool:
        """Watch the renewed gradients from now on, for ``found``: the same discovery
        as a new object (what was checked or bound against the old gradients is keyed on
        the old one).

        Args:
          found: the renewed discovery.
          renewal: what :meth:`renewal` read of the new gradients just now (None: read again).

        Returns:
          Whether to release them after the call: renewed twice running, they are renewed
          every step. False where they are the very tensors released after the last call
          (:meth:`~torch_impl.call.watches.GradWatch.returned`: ``set_to_none=False``, or
          DDP's bucket views): they are held, and watched by identity, again.
        """
        returned = self.grads.returned(renewal)
        self.found = found
        self.grads.renew(renewal)
        self._helper = None  # a seed helper's own watch holds the old gradients
        again, self.renewing = self.renewing and not returned, not returned
        return again

    def release(self) -> None:
        """Hold no gradient tensor past the call (:meth:`~torch_impl.call.watches.GradWatch.release`)."""
        self.grads.release()
        self._helper = None

    def _grad_watch(self, keys: set[ParamKey]) -> GradWatch:
        return GradWatch((self.found.tensors[k] for k in self.found.tensors if k in keys), self.own_views)

    def cover(self, keys: Iterable[ParamKey], helper: bool = False) -> None:
        """Also watch ``keys`` (what a bound plan reads or writes; a seed helper's plan:
        also in :meth:`touched_same`): their flags and gradient tensors, and the module
        dicts on their paths."""
        keys = set(keys)
        if keys - self.keys:
            self.keys |= keys
            self.grads = self._grad_watch(self.keys)
            self.param_edges = self._parameter_edges()
            self._helper = None
        if helper and keys - self.touched:
            self.touched = self.touched | keys
            self._helper = None

    def cover_plan(self, bound: Any) -> None:
        """:meth:`cover` what the bound plan ``bound`` reads or writes (its gradient keys;
        a seed helper's: touched too), skipped for the plan covered last: the watched and
        touched keys only ever grow, so a plan covered stays covered (a renewed training
        step binds its plan anew on every call)."""
        if bound is not self._covered:
            self.cover(bound.plan.gradient_keys(bound.plain_scale_keys), bound.helper)
            self._covered = bound

    def has_dtensor(self) -> bool:
        return self.grads.has_dtensor()

    def close(self) -> None:
        """Remove the registration hooks now (when the watch is collected instead, they are
        retired, and removed at the next registration: :mod:`~torch_impl.call.registration_hooks`)."""
        self._finalizer()
        drop_retired(self._hooks)
