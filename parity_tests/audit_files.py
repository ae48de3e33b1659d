"""Reading audit records: file names, the ``.npz`` step and plan files, the whole-load path.

A rank's step file is merged with its plan file into a :class:`RankFile` (all values in
memory); :func:`load` reads every file of a directory that way and checks that the steps
are complete and from one recording. The streamed replay reads the same files through
:mod:`parity_tests.audit_index` and applies the same checks (:func:`check_complete`,
:func:`check_one_run`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Callable
from typing import Any

import numpy as np

#: Version of the file layout this replay reads (``torch_impl.audit`` writes it).
FORMAT_VERSION = 2
#: Router buffers recorded whole.
ROUTER_FIELDS = ("local_tokens_per_expert", "expert_bias", "qb_beta", "qb_beta_accum", "qb_beta_count")
#: Parameter flags recorded per parameter (as ``ParamLayout``'s).
FLAGS = ("sequence_parallel", "average_gradients_across_tp_domain", "pipeline_parallel",
         "flextron_router_pp_sync", "is_gtp_weight_remat")
#: A step file's name: step and rank.
FILE_NAME = re.compile(r"^step(\d+)\.rank(\d+)\.npz$")


class AuditError(ValueError):
    """The recorded files cannot be replayed (missing ranks, mixed steps, bad layout)."""


@dataclasses.dataclass
class RankFile:
    """One rank's record of one step."""

    path: str
    meta: dict[str, Any]
    arrays: dict[str, np.ndarray]

    @property
    def rank(self) -> int:
        """The rank that wrote the file."""
        return int(self.meta["rank"])


def read_npz(path: str) -> dict[str, np.ndarray]:
    """Every array of an ``.npz`` file (no pickle)."""
    with np.load(path, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


def json_value(array: np.ndarray) -> Any:
    """The JSON value stored as the bytes of a uint8 array."""
    return json.loads(array.tobytes().decode())


def read_plan(directory: str, rank: int, plan: str, cache: dict[tuple[int, str], tuple[dict[str, Any], np.ndarray]]
               ) -> tuple[dict[str, Any], np.ndarray]:
    """(static facts, sampled positions) of one rank's plan file."""
    key = (rank, plan)
    if key not in cache:
        path = os.path.join(directory, f"plan.rank{rank:05d}.{plan}.npz")
        if not os.path.isfile(path):
            raise AuditError(f"{path}: missing (the step files of rank {rank} refer to it; copy the plan.* files "
                             "along with the step files)")
        try:
            arrays = read_npz(path)
            static = json_value(arrays["plan"])
            positions = np.asarray(arrays["positions"], dtype=np.int64)
        except Exception as err:
            raise AuditError(f"{path}: not a readable audit plan file ({type(err).__name__}: {err})") from None
        if static.get("format") != FORMAT_VERSION or static.get("rank") != rank:
            raise AuditError(f"{path}: format {static.get('format')!r} rank {static.get('rank')!r}, "
                             f"expected format {FORMAT_VERSION} rank {rank}")
        if positions.size != sum(p["samples"] for p in static["params"]):
            raise AuditError(f"{path}: {positions.size} sampled positions for {sum(p['samples'] for p in static['params'])} samples")
        cache[key] = (static, positions)
    return cache[key]


def read_rank_file(directory: str, path: str, step: int, rank: int, cache: dict[Any, Any]) -> RankFile:
    """One step file merged with its plan: ``meta`` (plan facts and step facts, per
    parameter ``has_grad`` / ``has_grad_after``) and arrays ``grad_before``,
    ``grad_after``, ``positions``, ``router{i}.{field}.before`` / ``.after``."""
    try:
        arrays = read_npz(path)
        meta = json_value(arrays.pop("meta"))
    except Exception as err:
        raise AuditError(f"{path}: not a readable audit file ({type(err).__name__}: {err})") from None
    if meta.get("format") != FORMAT_VERSION:
        raise AuditError(f"{path}: format {meta.get('format')!r}, this replay reads format {FORMAT_VERSION}")
    if int(meta["step"]) != step or int(meta["rank"]) != rank:
        raise AuditError(f"{path}: the file holds step {meta['step']} rank {meta['rank']}, its name says step {step} rank {rank}")
    static, positions = read_plan(directory, rank, str(meta["plan"]), cache)
    params = [dict(p) for p in static["params"]]
    try:
        before = np.asarray(arrays["grads_before"], dtype=np.float64)
        after = np.asarray(arrays["grads_after"], dtype=np.float64)
        has = np.asarray(arrays["has_grad"], dtype=bool)
        if before.shape != (positions.size,) or after.shape != before.shape or has.shape != (2, len(params)):
            raise ValueError(f"grads {before.shape} / {after.shape}, has_grad {has.shape} do not fit the plan's "
                             f"{positions.size} samples of {len(params)} parameters")
        out = {"grad_before": before, "grad_after": after, "positions": positions}
        for when, fields in (("before", static["router_fields"]), ("after", meta.get("router_fields_after", static["router_fields"]))):
            flat = np.asarray(arrays.get(f"routers_{when}", np.zeros(0)), dtype=np.float64)
            start = 0
            for index, field, shape in fields:
                n = int(np.prod(shape, dtype=np.int64))
                out[f"router{index}.{field}.{when}"] = flat[start:start + n].reshape(shape)
                start += n
            if start != flat.size:
                raise ValueError(f"routers_{when} holds {flat.size} values, its fields {start}")
    except (KeyError, ValueError) as err:
        raise AuditError(f"{path}: does not fit its plan file ({type(err).__name__}: {err})") from None
    for p, before, after in zip(params, has[0], has[1]):
        p["has_grad"], p["has_grad_after"] = bool(before), bool(after)
    check_finite(path, step, rank, params, out, meta.get("num_tokens"))
    merged = {k: v for k, v in static.items() if k not in ("params", "format", "rank")}
    merged.update(meta)
    merged["params"] = params
    return RankFile(path, merged, out)


def check_finite(path: str, step: int, rank: int, params: list[dict[str, Any]], arrays: dict[str, np.ndarray],
                 tokens: dict[str, Any] | None = None) -> None:
    """Refuse a record holding NaN or inf: finalize's inputs and outputs are recorded as
    they were, and a replay can verify finite values only, so a non-finite value (before
    or after, of a gradient present then, or of a router buffer) marks a damaged record.

    Args:
      path: the step file (for the message).
      step, rank: the file's step and rank.
      params: the plan's parameters with this file's ``has_grad`` / ``has_grad_after``.
      arrays: the file's values (``grad_before``, ``grad_after``, ``positions``, routers).
      tokens: the file's ``num_tokens`` record (``before`` / ``after``: a number or None).

    Raises:
      AuditError: one line naming the step, the rank, the parameter (chunk/name), router
        buffer or ``num_tokens``, the flat index and the value.
    """
    for when, value in (tokens or {}).items():
        if isinstance(value, (int, float)) and not math.isfinite(value):
            raise AuditError(f"step {step}: rank {rank}: the recorded num_tokens {when} finalize is {value!r}: a "
                             f"damaged record (the replay verifies finite values only; {path})")
    for when in ("before", "after"):
        values, start = arrays[f"grad_{when}"], 0
        for p in params:
            n = int(p["samples"])
            piece = values[start:start + n]
            if p["has_grad" if when == "before" else "has_grad_after"] and not np.isfinite(piece).all():
                k = int(np.flatnonzero(~np.isfinite(piece))[0])
                raise AuditError(
                    f"step {step}: rank {rank}: the recorded {when} value of parameter {p['chunk']}/{p['name']} at "
                    f"flat index {int(arrays['positions'][start + k])} is {float(piece[k])!r}: a damaged record "
                    f"(the replay verifies finite values only; {path})")
            start += n
    for name, value in arrays.items():
        if name.startswith("router") and not np.isfinite(value).all():
            raise AuditError(f"step {step}: rank {rank}: the recorded router buffer {name} holds "
                             f"{float(value[~np.isfinite(value)][0])!r}: a damaged record "
                             f"(the replay verifies finite values only; {path})")


def load(directory: str) -> dict[int, list[RankFile]]:
    """All steps' files, per step ordered by rank, every value in memory.

    Raises:
      AuditError: no files, unreadable files, a plan file missing, a rank missing from a
        step, files from different steps or runs (world sizes differ), a file whose name
        and content disagree.
    """
    return collect(directory, read_rank_file)


def collect(directory: str, reader: Callable[[str, str, int, int, dict[Any, Any]], RankFile]
            ) -> dict[int, list[RankFile]]:
    """Every step file of ``directory`` read by ``reader``, per step ordered by rank.

    Args:
      directory: the recording's directory.
      reader: ``(directory, path, step, rank, plan cache) -> RankFile``, e.g. :func:`read_rank_file`.

    Returns:
      step -> the step's records by rank.

    Raises:
      AuditError: as :func:`load`.
    """
    if not os.path.isdir(directory):
        raise AuditError(f"{directory}: not a directory")
    found: dict[int, dict[int, RankFile]] = {}
    cache: dict[Any, Any] = {}
    for name in sorted(os.listdir(directory)):
        match = FILE_NAME.match(name)
        if not match:
            continue
        step, rank = int(match.group(1)), int(match.group(2))
        found.setdefault(step, {})[rank] = reader(directory, os.path.join(directory, name), step, rank, cache)
    if not found:
        raise AuditError(f"{directory}: no audit files (stepNNNNNNNN.rankNNNNN.npz)")
    worlds = {f.meta["world_size"] for files in found.values() for f in files.values()}
    if len(worlds) > 1:
        raise AuditError(f"{directory}: files from runs of different world sizes {sorted(worlds)}")
    world = worlds.pop()
    check_complete(directory, found, world)
    steps = {s: [files[r] for r in range(world)] for s, files in sorted(found.items())}
    for files in steps.values():
        check_one_run(files)
    return steps


def check_complete(directory: str, found: dict[int, dict[int, RankFile]], world: int) -> None:
    """Every step has every rank's file.

    Raises:
      AuditError: naming each missing rank and the steps it is missing from; "files from
        different steps" only when no rank has files of more than one step (each rank's
        files come from another step).
    """
    incomplete = {s: sorted(set(range(world)) - set(files)) for s, files in found.items() if len(files) != world}
    if not incomplete:
        return
    have = {s: sorted(files) for s, files in found.items()}
    steps_of = {r: [s for s in sorted(found) if r in found[s]] for r in range(world)}
    if len(found) > 1 and all(len(s) <= 1 for s in steps_of.values()):
        raise AuditError(
            f"{directory}: files from different steps: ranks per step {have}; every step needs all {world} ranks"
        )
    missing: dict[int, list[int]] = {}
    for s, ranks in incomplete.items():
        for r in ranks:
            missing.setdefault(r, []).append(s)
    lines = "; ".join(f"rank {r} missing from step{'s' if len(ss) > 1 else ''} {ss if len(ss) > 1 else ss[0]}"
                      + (" (no file of this rank at all)" if not steps_of[r] else "")
                      for r, ss in sorted(missing.items()))
    per_step = "; ".join(f"step {s}: missing ranks {m}" for s, m in sorted(incomplete.items()))
    raise AuditError(f"{directory}: world of {world} ranks: {lines} ({per_step}; each step needs the "
                     "stepSSSSSSSS.rankRRRRR.npz file of every rank)")


def check_one_run(files: list[RankFile]) -> None:
    """All files of a step come from one recording (the same run id).

    Raises:
      AuditError: naming the ranks and files whose run id differs from most ranks'.
    """
    ids: dict[Any, list[RankFile]] = {}
    for f in files:
        ids.setdefault(f.meta.get("run"), []).append(f)
    if len(ids) <= 1:
        return
    main_id = max(ids, key=lambda k: (len(ids[k]), str(k)))
    odd = [f for k, fs in ids.items() if k != main_id for f in fs]
    names = "; ".join(f"rank {f.rank}: {f.path} (run {f.meta.get('run')!r})" for f in odd[:8])
    more = f" and {len(odd) - 8} more" if len(odd) > 8 else ""
    raise AuditError(
        f"step {files[0].meta['step']}: files of different recordings mixed: {len(ids[main_id])} of {len(files)} ranks "
        f"are from run {main_id!r}, these are not: {names}{more} (replace them with the files of the same run)"
    )


