"""``python -m parity_tests``: run the parity suite and print the step x scenario table.

The steps are those of docs/semantics.md; ``--html`` also writes the grid as a coloured
page (a CI artifact).
"""

from __future__ import annotations

import argparse
import sys

from parity_tests.scenarios import Scenario, all_scenarios


def _mesh_filter(text: str):
    try:
        sizes = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise SystemExit(f"--mesh: expected comma-separated ints like 2,2,1,2, got {text!r}")
    if len(sizes) != 4:
        raise SystemExit(f"--mesh: expected 4 sizes (pp,dp,cp,tp), got {text!r}")
    return lambda s: s.mesh == sizes


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else list(argv)
    if args_in[:1] == ["audit"]:  # python -m parity_tests audit DIR: replay recorded steps
        from parity_tests.audit import main as audit_main

        return audit_main(args_in[1:])
    parser = argparse.ArgumentParser(
        prog="python -m parity_tests",
        description="Run every parity scenario through torch_impl (gloo worlds) and jax_impl "
        "(fake CPU devices), compare each finalization step (docs/semantics.md) with an "
        "independent numpy reference, and print a step x scenario table of max abs "
        "differences. Exit status: 0 parity, 1 a difference, 2 no scenario selected.",
    )
    parser.add_argument("--mesh", metavar="PP,DP,CP,TP", help="only scenarios on this dense mesh, e.g. 2,2,1,2")
    parser.add_argument("--scenario", metavar="TEXT", help="only scenarios whose name contains TEXT")
    parser.add_argument("--backend", choices=("torch", "jax", "both"), default="both", help="which backend(s) to run")
    parser.add_argument("--json", metavar="PATH", help="also write the full results as JSON to PATH")
    parser.add_argument(
        "--html", metavar="PATH", help="also write the scenario x step grid, coloured by difference / tolerance, to PATH"
    )
    parser.add_argument("--list", action="store_true", help="list the selected scenarios and exit")
    parser.add_argument("--summary-only", action="store_true", help="print the per-step summary, not the full table")
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress output on stderr (default: a bar on a terminal, a line per tenth of the runs otherwise)",
    )
    args = parser.parse_args(argv)

    mesh = _mesh_filter(args.mesh) if args.mesh else None
    from parity_tests.report import (
        build_report,
        format_html,
        format_summary,
        format_table,
        select,
        to_json,
        verdict,
    )

    scenarios: list[Scenario] = select(all_scenarios(), mesh, args.scenario)
    if not scenarios:
        print("no scenario matches the filters", file=sys.stderr)
        return 2
    if args.list:
        for s in scenarios:
            print(f"{s.name}  (world {s.world_size})")
        return 0
    if args.backend in ("jax", "both"):
        from jax_impl.mesh import ensure_host_devices

        ensure_host_devices(max(s.world_size for s in scenarios))
    backends = ("torch", "jax") if args.backend == "both" else (args.backend,)
    reports = build_report(scenarios, backends, stream=None if args.no_progress else sys.stderr)
    if not args.summary_only:
        print(format_table(reports, backends))
        print()
    print(format_summary(reports, backends))
    if args.json:
        with open(args.json, "w") as f:
            f.write(to_json(reports))
    if args.html:
        with open(args.html, "w", encoding="utf-8") as f:
            f.write(format_html(reports, backends))
    line = verdict(reports)
    print(line)
    return 0 if all(r.ok for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
