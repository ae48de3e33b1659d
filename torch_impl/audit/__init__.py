"""Record a finalize step on every rank, for replay against the numpy reference.

Wrap any function with Megatron's signature ``f(model, num_tokens=None,
pg_collection=None, force_all_reduce=False)`` -- :func:`torch_impl.finalize_model_grads`,
megatron-core's own, a user's -- and every call writes, on every rank, portable ``.npz``
files (no pickle: ``np.load(path, allow_pickle=False)`` reads them):

* once per rank and *plan* (what stays the same from step to step), ``plan.rankRRRRR.<id>.npz``:
  the layout (this rank's coordinates and the members of every named group, resolved by
  the code finalize uses, :func:`resolve_layout`), the config fields that matter
  (:class:`meshgrad.config.FinalizeConfig`) and the parallel sizes the (Megatron) config
  asks for, each parameter's name, chunk, flags, role, shape, dtype and numel, the
  deterministic sampled flat positions (the same on every rank for the same name and size),
  the routers and which of their buffers exist;
* per step and rank, ``stepSSSSSSSS.rankRRRRR.npz``: the id of its plan, the gradient values
  at the sampled positions before and after the call, which parameters had a gradient, the
  router buffers (``local_tokens_per_expert``, ``expert_bias``, ``qb_beta``,
  ``qb_beta_accum``, ``qb_beta_count``) whole before and after, ``num_tokens`` before and
  after, ``force_all_reduce``.

Per step the recorder does no per-parameter Python work: the sampled values are read with
one ``index_select`` per gradient storage (meshgrad's flat buffers, a DDP grad buffer) at
indices computed once, whether the gradient tensors are still the same is checked at C
speed, and the file is written by a background
thread.

Usage::

    from torch_impl import audit, finalize_model_grads

    with audit.record("runs/step100", sample=64) as finalize:   # default: torch_impl's
        finalize(model, num_tokens=n, pg_collection=groups)

    step = audit.audited(megatron_finalize_model_grads, "runs/audit", sample=64)
    step(model, n, groups)                                      # one file per rank per call

Replay with ``python -m parity_tests audit runs/step100``. The "before" values are read
before the wrapped function runs, so a Megatron DDP whose ``finish_grad_sync`` does the
DP sync is audited too. A DDP with ``overlap_grad_reduce=True`` reduces during backward:
pass ``model=`` to :func:`record` / :func:`audited` (or call ``Recorder.watch``) before
the first recorded backward, and its bucket groups' gradients are read as each starts to
reduce (:mod:`.overlap`).

Modules (one job each): :mod:`.recorder` (the :class:`Recorder`), :mod:`.options` (its
argument checks), :mod:`.planner` (how samples are chosen), :mod:`.step` (what is read and
written per step), :mod:`.writer` (writing the files, in a thread), :mod:`.api`
(:func:`record`, :func:`audited`), :mod:`.overlap` (reading an overlapping DDP's
gradients as its buckets start to reduce), :mod:`.sampling` (sampled positions, reading them),
:mod:`.plan` (what a rank's step files share), :mod:`.layout` (groups and config as
recorded), :mod:`.fileformat` (names, ``.npz`` writing) and :mod:`.internals` (the only
module that reads torch_impl's internals).
"""

from torch_impl.audit.api import audited, record
from torch_impl.audit.fileformat import FORMAT_VERSION, ROUTER_FIELDS, file_name, npz_bytes, plan_file_name
from torch_impl.audit.internals import model_state, resolve_layout
from torch_impl.audit.recorder import PARAM_FLAGS, FinalizeFn, Recorder, agree_run_id
from torch_impl.audit.sampling import ROLE_KEYS, sample_key, sample_positions

__all__ = ["FORMAT_VERSION", "PARAM_FLAGS", "ROLE_KEYS", "ROUTER_FIELDS", "FinalizeFn", "Recorder", "agree_run_id",
           "audited", "file_name", "model_state", "npz_bytes", "plan_file_name", "record", "resolve_layout",
           "sample_key", "sample_positions"]
