"""``python -m parity_tests audit DIR``: replay recorded finalize steps against the reference.

Every rank of an audited run wrote, per step, one ``.npz`` file (``torch_impl.audit``):
the gradient values at sampled flat positions before and after finalize, router buffers
and ``num_tokens``; and once per plan a ``plan.*.npz`` file its step files refer to: its
groups, config, parameters and the sampled positions. The replay rebuilds the global view
(a mesh whose ranks are the recorded ones, in the reference's order), runs the
independent numpy reference (:mod:`parity_tests.reference`) on the sampled "before"
values and compares its outputs with the recorded "after" values, per step and
parameter; ``--jax`` also runs the JAX oracle on the same inputs.

The replay streams: it indexes every file once (:mod:`parity_tests.audit_index`), then
reads and replays a block of parameters of all ranks at a time
(:mod:`parity_tests.audit_stream`), so its memory does not grow with the number of
ranks times parameters. ``replay(..., stream=False)`` is the whole-load replay
(:mod:`parity_tests.audit_whole`), every value in memory at once: the same result.

Modules: ``audit_files`` (reading, the whole load), ``audit_index`` (the streamed index),
``audit_view`` (mesh, parameters and routers of a step), ``audit_sampled`` (the reference
and JAX on sampled values), ``audit_compare`` (rows and tolerances), ``audit_whole`` and
``audit_stream`` (one step), ``audit_blocks`` (the streamed replay's blocks).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from parity_tests import audit_stream, audit_whole
from parity_tests.audit_compare import FAILING, NONFINITE, Row
from parity_tests.audit_files import FLAGS, FORMAT_VERSION, ROUTER_FIELDS, AuditError, RankFile, load
from parity_tests.audit_index import scan

__all__ = ["FAILING", "FLAGS", "FORMAT_VERSION", "NONFINITE", "ROUTER_FIELDS", "AuditError", "RankFile", "Row",
           "format_report", "load", "main", "replay", "replay_step", "scan"]


def replay(directory: str, use_jax: bool = False, stream: bool = True) -> dict[str, Any]:
    """Load and replay every step of ``directory``.

    Args:
      directory: the recording.
      use_jax: also run the JAX oracle on the same inputs.
      stream: a block of parameters at a time (False: every value in memory at once).

    Returns:
      ``{"directory", "steps": [...], "ok"}``.

    Raises:
      AuditError: the files cannot be replayed.
    """
    if stream:
        results = [audit_stream.replay_step(records, use_jax) for records in scan(directory).values()]
    else:
        results = [audit_whole.replay_step(files, use_jax) for files in load(directory).values()]
    return {"directory": directory, "steps": results, "ok": all(s["ok"] for s in results)}


def replay_step(files: list[RankFile], use_jax: bool = False) -> dict[str, Any]:
    """Replay one step of whole-loaded files (:func:`load`); see :func:`replay`."""
    return audit_whole.replay_step(files, use_jax)


def format_report(result: dict[str, Any]) -> str:
    """The human-readable table of :func:`replay`'s result."""
    lines = []
    for s in result["steps"]:
        expert_axes = ("edp", "egtp", "ep") if s.get("has_experts", True) else ()
        lay = " ".join(f"{'ep*etp' if k == 'ep' else k}{v}" for k, v in s["layout"].items()
                       if v > 1 and k != "etp" and (k not in ("edp", "egtp", "ep") or k in expert_axes)) or "one rank"
        lines.append(f"step {s['step']}: world {s['world_size']} ({lay}), finalize {s['finalize']}")
        width = max([len(f"{r['chunk']}/{r['name']}") for r in s["rows"]] + [20])
        head = f"  {'chunk/parameter':<{width}}  ranks  max|diff|  verdict"
        lines.append(head + ("  jax max|diff|" if s["jax"] else ""))
        for r in s["rows"]:
            label = f"{r['chunk']}/{r['name']}" if r["kind"] != "num_tokens" else "num_tokens"
            line = f"  {label:<{width}}  {r['ranks']:>5}  {r['max_abs_diff']:9.3g}  {r['status']}"
            if s["jax"]:
                line += f"  {'' if r['jax_max_abs_diff'] is None else format(r['jax_max_abs_diff'], '.3g')} {r['jax_status'] or ''}"
            if r["status"] != "ok" or r["detail"]:
                line += f"  [{r['detail']}]" if r["detail"] else ""
            if r["status"] in FAILING and r["steps"]:
                line += f"  (steps touching it: {', '.join(r['steps'])})"
            lines.append(line)
        bad = [r for r in s["rows"] if r["status"] in FAILING or r["jax_status"] == "MISMATCH"]
        counts = {v: sum(1 for r in bad if (r["status"] if r["status"] in FAILING else "MISMATCH") == v) for v in FAILING}
        summary = ", ".join(f"{n} {v}" for v, n in counts.items() if n)
        lines.append(f"step {s['step']}: {'ok' if s['ok'] else summary}"
                     + "".join(f"\n  {r['status'] if r['status'] in FAILING else 'MISMATCH'} step {s['step']} "
                               f"{r['kind']} {r['chunk']}/{r['name']}" for r in bad))
        lines.append("")
    n_bad = sum(not s["ok"] for s in result["steps"])
    lines.append(f"audit {'PASS' if result['ok'] else 'FAIL'}: {len(result['steps'])} step(s), {n_bad} with mismatches")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m parity_tests audit DIR [--jax] [--json PATH]``; exit 0 pass, 1 mismatch,
    2 unreadable records."""
    parser = argparse.ArgumentParser(prog="python -m parity_tests audit",
                                     description="Replay recorded finalize steps (torch_impl.audit) against the numpy reference.")
    parser.add_argument("directory", help="the directory every rank recorded into")
    parser.add_argument("--jax", action="store_true", help="also run the JAX oracle on the same inputs")
    parser.add_argument("--json", metavar="PATH", help="write the result as JSON to PATH ('-' for stdout)")
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.jax:
        from jax_impl.mesh import ensure_host_devices

        try:
            world = next(iter(scan(args.directory).values()))[0].meta["world_size"]
            ensure_host_devices(max(world, 1))
        except AuditError:
            pass
    try:
        result = replay(args.directory, use_jax=args.jax)
    except AuditError as err:
        print(f"audit: {err}", file=sys.stderr)
        return 2
    if args.json == "-":
        print(json.dumps(result, indent=1, default=float))
    else:
        print(format_report(result))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(result, fh, indent=1, default=float)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
