"""Wall times of the commands the README and the docs give, measured, with the machine.

    .venv/bin/python -m bench.setup_times                 # the checkout's commands (a set-up .venv)
    .venv/bin/python -m bench.setup_times --fresh-clone   # also `make demo` on a fresh clone (makes its .venv)
    .venv/bin/python -m bench.setup_times --only semantics_variant --only megatron_schedule

Each command runs from the repository root (``--fresh-clone``: from a ``git clone`` of it
in a temporary folder, removed afterwards) with its output captured; its wall time is the
time to its exit. The script prints one markdown table (docs/install.md and
examples/README.md hold its output): a line naming the machine (CPU cores and model,
Python, torch, the 1-minute load average before, at its highest during and after the
runs, which counts other jobs sharing the machine), then a row per command with its wall time and the last line it printed (its
verdict). A command that fails gets ``failed (exit N)`` in place of its time, and the
script exits 1.

A benchmark, never a timed test: tests/test_docs.py checks only the table's format.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = ".venv/bin/python"


@dataclasses.dataclass(frozen=True)
class Command:
    """One documented command: its ``name`` (for ``--only``), the command line as the docs
    write it, and what it does."""

    name: str
    line: str
    what: str
    fresh: bool = False  # run in a fresh clone (it sets up its own .venv)


COMMANDS = (
    Command("make_demo_fresh", "make demo",
            "on a fresh clone: makes .venv, installs everything at constraints.txt's versions, runs the parity report",
            fresh=True),
    Command("parity_report", f"{PY} -m parity_tests", "the parity report alone (`make demo` in a set-up checkout)"),
    Command("verify_torch_train", f"{PY} examples/verify_torch_train.py --pp 2 --dp 2 --tp 2 --ep 2 --steps 3",
            "8 torch processes, then one process; compares every step"),
    Command("jax_train", f"{PY} examples/jax_train.py --pp 2 --dp 2 --tp 2 --steps 3",
            "flax.nnx GPT on 8 fake devices against one device"),
    Command("semantics_variant", f"{PY} examples/semantics_variant.py",
            "a planned and an edited plan, in jax (4 fake devices) and torch (4 gloo processes)"),
    Command("megatron_schedule", f"{PY} examples/megatron_schedule.py",
            "megatron-core's 1F1B schedule and DDP, tp2-pp2-dp1 and tp1-pp2-dp2 on 4 processes"),
    Command("test_examples", f"{PY} -m pytest -q -p no:cacheprovider tests/test_examples.py",
            "the examples' tests (pytest's own closing line)"),
)

#: The table's header, then its separator: what tests/test_docs.py looks for in the docs.
HEADER = "| command | wall time | what it did | its last line |"
SEPARATOR = "|---|---|---|---|"
#: The line above the table: ``machine_line``'s format.
MACHINE_RE = re.compile(
    r"^Measured by `\.venv/bin/python -m bench\.setup_times[^`]*` on (\d+) CPU cores? \(([^)]*)\), "
    r"Python (\d+\.\d+\.\d+), torch (\S+), load average (\d+\.\d+) before, up to (\d+\.\d+) during, "
    r"(\d+\.\d+) after:$"
)
#: One row: the command in backticks, a wall time in seconds (or a failure), text, a line.
ROW_RE = re.compile(r"^\| `([^`]+)` \| (\d+\.\d s|failed \(exit -?\d+\)) \| ([^|]+) \| `([^`]*)` \|$")


@dataclasses.dataclass(frozen=True)
class Measured:
    command: Command
    seconds: float
    returncode: int
    last_line: str


def machine(load_before: float, load_peak: float, load_after: float, args: str = "") -> str:
    """The line naming the machine (``MACHINE_RE``'s format); the loads are 1-minute load
    averages: before the first command, the highest sampled while they ran, after the last."""
    model = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = f"{platform.machine()}, {line.split(':', 1)[1].strip()}"
                break
    except OSError:
        pass
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = "absent"
    model = model.replace("(", "").replace(")", "")  # the CPU name inside the line's own parentheses
    suffix = f" {args}" if args else ""
    return (f"Measured by `.venv/bin/python -m bench.setup_times{suffix}` on {os.cpu_count()} CPU cores ({model}), "
            f"Python {platform.python_version()}, torch {torch_version}, "
            f"load average {load_before:.2f} before, up to {load_peak:.2f} during, {load_after:.2f} after:")


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("`", "'").strip()


def format_table(rows: list[Measured], machine_line: str) -> str:
    """The markdown the docs hold: the machine line, a blank line, the table."""
    out = [machine_line, "", HEADER, SEPARATOR]
    for m in rows:
        took = f"{m.seconds:.1f} s" if m.returncode == 0 else f"failed (exit {m.returncode})"
        last = _cell(m.last_line)[:120]
        out.append(f"| `{m.command.line}` | {took} | {_cell(m.command.what)} | `{last}` |")
    return "\n".join(out) + "\n"


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def run(command: Command, cwd: Path, timeout: float) -> Measured:
    """Run ``command`` in ``cwd`` (a shell line, as the docs write it); time it to its exit."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    start = time.monotonic()
    try:
        proc = subprocess.run(command.line, shell=True, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
        code, out = proc.returncode, proc.stdout + "\n" + proc.stderr if proc.returncode else proc.stdout
    except subprocess.TimeoutExpired as err:
        code, out = 124, f"timed out after {timeout:.0f} s: {err}"
    seconds = time.monotonic() - start
    if code != 0:
        print(f"{command.name}: exit {code}\n{out[-3000:]}", file=sys.stderr)
    return Measured(command, seconds, code, _last_line(out))


class LoadPeak:
    """The highest 1-minute load average sampled every ``every`` seconds while it runs."""

    def __init__(self, every: float = 5.0) -> None:
        self.peak = os.getloadavg()[0]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(every,), daemon=True)

    def _sample(self, every: float) -> None:
        while not self._stop.wait(every):
            self.peak = max(self.peak, os.getloadavg()[0])

    def __enter__(self) -> "LoadPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, os.getloadavg()[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.setup_times", description=__doc__.split("\n\n")[0])
    parser.add_argument("--fresh-clone", action="store_true",
                        help="also time `make demo` on a fresh clone of this checkout (makes its own .venv)")
    parser.add_argument("--only", action="append", choices=[c.name for c in COMMANDS],
                        help="time only these commands (repeatable)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per command")
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)

    chosen = [c for c in COMMANDS if (args.only and c.name in args.only) or
              (not args.only and (args.fresh_clone or not c.fresh))]
    load_before = os.getloadavg()[0]
    rows = []
    with LoadPeak() as load:
        for command in chosen:
            print(f"timing: {command.line}", file=sys.stderr, flush=True)
            if command.fresh:
                with tempfile.TemporaryDirectory(prefix="meshgrad-clone-") as tmp:
                    clone = Path(tmp) / "meshgrad"
                    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
                    rows.append(run(command, clone, args.timeout))
                    shutil.rmtree(clone, ignore_errors=True)
            else:
                rows.append(run(command, ROOT, args.timeout))
            print(f"  {rows[-1].seconds:.1f} s, exit {rows[-1].returncode}: {rows[-1].last_line}", file=sys.stderr)
    shown = " ".join(["--fresh-clone"] * bool(args.fresh_clone) + [f"--only {n}" for n in args.only or ()])
    table = format_table(rows, machine(load_before, load.peak, os.getloadavg()[0], shown))
    print(table, end="")
    if args.markdown:
        args.markdown.write_text(table)
    return 0 if all(m.returncode == 0 for m in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
