"""Run a function on every rank of a fresh gloo world of processes and collect what it emits.

:func:`spawn_world` is the generic part of every multi-process test and of the parity
report: ranks are forked from a fork server that imported torch once per session (or, with
a ``prepare``, from one process that ran it), join one gloo process group and emit results
through a :class:`Sink` (:func:`parity_tests.world_cases.run_cases` runs many named cases
in one world: spawning is the slow part). A rank ended by a signal (a crash in native
code, the OOM killer) leaves its exit code, its stderr and faulthandler's dump of its
stack in the outcome, and such a world may be run once more (``crash_retries``).
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import functools
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any


class Sink:
    """Where a rank emits results: one pickle file per (rank, key), written atomically."""

    def __init__(self, directory: str, rank: int) -> None:
        self.directory = directory
        self.rank = rank

    def put(self, key: int | str, value: Any) -> None:
        path = os.path.join(self.directory, f"r{self.rank}-{key}.pkl")
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            pickle.dump(value, f)
        os.replace(tmp, path)


def _stderr_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"r{rank}.stderr")


def _capture_stderr(directory: str, rank: int) -> None:
    """Send this process's fd 2 to the rank's stderr file, and faulthandler's dump of a
    fatal signal with it: what native code prints (gloo, ``std::terminate``) and the
    Python stack of a crash reach the outcome instead of a terminal nobody reads."""
    stream = open(_stderr_path(directory, rank), "w", buffering=1)  # noqa: SIM115 -- open for the process's life
    os.dup2(stream.fileno(), 2)
    faulthandler.enable(file=stream, all_threads=True)


def _worker(
    rank: int,
    world_size: int,
    store: str,
    directory: str,
    target: Callable[[int, int, Any, Sink], None],
    payload: Any,
    pg_timeout: float,
) -> None:
    _capture_stderr(directory, rank)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    sink = Sink(directory, rank)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        target(rank, world_size, payload, sink)
    except BaseException:  # report, then exit non-zero
        sink.put("fatal", traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def exit_text(code: int | None) -> str:
    """A process's exit code in words: ``"0"``, ``"3"``, a signal's name, or ``"none"``
    (killed with its world before it was reaped)."""
    if code is None:
        return "none"
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return str(code)


#: How much of a crashed rank's stderr an outcome quotes.
STDERR_TAIL = 4000


@dataclasses.dataclass
class WorldOutcome:
    """What a spawned world left behind.

    Args:
      results: per rank, ``{key: value}`` of everything the rank emitted.
      fatal: per rank, the traceback of an uncaught error, if any.
      timed_out: the world was killed after ``timeout`` seconds.
      exitcodes: per rank, the process exit code (negative: the signal that ended it;
        None when killed before it was reaped).
      seconds: wall time of the whole world.
      stderr: per rank, what it wrote to stderr (faulthandler's dump of a crash included).
      killed: the ranks the world killed itself: still running ``GRACE`` seconds after
        another rank died, or at the timeout.
      attempts: how many times the world was run (more than once after a crash retried).
    """

    results: list[dict[Any, Any]]
    fatal: list[str | None]
    timed_out: bool
    exitcodes: list[int | None]
    seconds: float
    stderr: list[str] = dataclasses.field(default_factory=list)
    killed: list[int] = dataclasses.field(default_factory=list)
    attempts: int = 1

    def crashed_ranks(self) -> list[int]:
        """The ranks ended by a signal the world did not send (a crash in native code, the
        OOM killer, a signal from outside)."""
        return [
            rank for rank, code in enumerate(self.exitcodes)
            if code is not None and code < 0 and rank not in self.killed
        ]

    def crashed(self) -> bool:
        """Whether a rank crashed (:meth:`crashed_ranks`) in a world that did not time out."""
        return not self.timed_out and bool(self.crashed_ranks())

    def why(self) -> str:
        """Why ranks stopped reporting: ``"timed out"``, or every rank's exit and the first
        crashed rank's stderr, else the first Python traceback."""
        if self.timed_out:
            return "timed out"
        codes = ", ".join(f"rank {r}: {exit_text(c)}" for r, c in enumerate(self.exitcodes))
        crashed = [r for r in self.crashed_ranks() if r < len(self.stderr)]
        if crashed:
            detail = f"rank {crashed[0]}'s stderr:\n{self.stderr[crashed[0]][-STDERR_TAIL:]}"
        else:
            detail = next((f for f in self.fatal if f), "no Python error")
        return f"world died (exit codes {codes}): {detail}"


#: Modules the fork server imports once, so that every world's processes start warm.
PRELOAD = [
    "torch", "torch.distributed", "numpy", "meshgrad", "torch_impl",
    "parity_tests.process_world", "parity_tests.torch_world",
]


def _context() -> Any:
    """A fork-server context (torch imported once per test session), its server started,
    or, where that is not available, spawn."""
    try:
        ctx = multiprocessing.get_context("forkserver")
    except ValueError:  # pragma: no cover - platforms without fork
        return multiprocessing.get_context("spawn")
    ctx.set_forkserver_preload(PRELOAD)
    from multiprocessing import forkserver

    forkserver.ensure_running()  # its one-time start does not count against a world's timeout
    return ctx


def spawn_world(
    target: Callable[[int, int, Any, Sink], None],
    world_size: int,
    payload: Any = None,
    timeout: float = 600.0,
    prepare: Callable[[], Any] | None = None,
    crash_retries: int = 0,
) -> WorldOutcome:
    """Run ``target(rank, world_size, payload, sink)`` on every rank of a new gloo world.

    Args:
      target: a module-level (picklable) function; it emits results with ``sink.put``.
      world_size: number of processes.
      payload: picklable argument passed to every rank.
      timeout: seconds before every process of the world is killed (per run).
      prepare: a picklable set-up (e.g. importing megatron-core) run once, in one process
        that then forks every rank: the ranks start with its result in memory instead of
        each repeating it (see :func:`_zygote`).
      crash_retries: how many times a world is run again after it crashed
        (:meth:`WorldOutcome.crashed`: a rank ended by a signal the world did not send, no
        timeout), with a RuntimeWarning quoting the crash; a world whose ranks only raised
        Python errors, or that timed out, is never run again.

    Returns:
      A :class:`WorldOutcome` of the last run; emitted results survive a timeout or a crash.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if crash_retries < 0:
        raise ValueError(f"crash_retries must be >= 0, got {crash_retries}")
    _context()
    outcome = _spawn_once(target, world_size, payload, timeout, prepare)
    for attempt in range(2, crash_retries + 2):
        if not outcome.crashed():
            break
        warnings.warn(
            f"a world of {world_size} running {getattr(target, '__name__', target)} crashed and is run again: "
            f"{outcome.why()}",
            RuntimeWarning,
            stacklevel=2,
        )
        outcome = _spawn_once(target, world_size, payload, timeout, prepare)
        outcome.attempts = attempt
    return outcome


def _spawn_once(
    target: Callable[[int, int, Any, Sink], None],
    world_size: int,
    payload: Any,
    timeout: float,
    prepare: Callable[[], Any] | None,
) -> WorldOutcome:
    """One run of :func:`spawn_world`."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="meshgrad-world-") as directory:
        store = os.path.join(directory, "store")
        pg_timeout = max(30.0, min(timeout, 300.0))
        args = (world_size, store, directory, target, payload, pg_timeout)
        run = _run_ranks if prepare is None else functools.partial(_run_zygote, prepare=prepare)
        timed_out, exitcodes, killed = run(args, deadline=start + timeout)
        results: list[dict[Any, Any]] = [{} for _ in range(world_size)]
        fatal: list[str | None] = [None] * world_size
        for name in os.listdir(directory):
            if not (name.startswith("r") and name.endswith(".pkl")):
                continue
            rank_text, key_text = name[1:-4].split("-", 1)
            with open(os.path.join(directory, name), "rb") as f:
                value = pickle.load(f)
            rank = int(rank_text)
            if key_text == "fatal":
                fatal[rank] = value
            else:
                results[rank][int(key_text) if key_text.isdigit() else key_text] = value
        stderr = [_read_text(_stderr_path(directory, rank)) for rank in range(world_size)]
    for rank, text in enumerate(stderr):
        if text:  # shown where the caller's stderr goes (pytest: with a failing test)
            sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))
    return WorldOutcome(results, fatal, timed_out, exitcodes, time.monotonic() - start, stderr, killed)


def _read_text(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


#: Seconds the other ranks get once one rank died (they may wait for it forever).
GRACE = 5.0


#: (timed out, exit codes, the ranks this module killed) of one run of a world.
RunEnd = tuple[bool, list[int | None], list[int]]


def _run_ranks(args: tuple[Any, ...], deadline: float) -> RunEnd:
    """Every rank a process of the fork server; the ranks still running at ``deadline``
    are killed (a rank that outlives a dead peer has its process group's timeout to raise)."""
    ctx = _context()
    world_size = args[0]
    procs = [ctx.Process(target=_worker, args=(rank, *args), daemon=True) for rank in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    killed = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for rank in killed:
        procs[rank].kill()
        procs[rank].join(5.0)
    return bool(killed), [p.exitcode for p in procs], killed


def _run_zygote(args: tuple[Any, ...], prepare: Callable[[], Any], deadline: float) -> RunEnd:
    """One fork-server process runs ``prepare`` and forks every rank (:func:`_zygote`);
    the whole process group is killed at ``deadline``."""
    world_size, directory = args[0], args[2]
    zygote = _context().Process(target=_zygote, args=(prepare, *args), daemon=True)
    zygote.start()
    zygote.join(max(0.0, deadline - time.monotonic()))
    timed_out = zygote.is_alive()
    if timed_out:
        try:
            os.killpg(zygote.pid, signal.SIGKILL)  # the zygote leads its ranks' group
        except ProcessLookupError:  # pragma: no cover - killed before it made the group
            zygote.kill()
        zygote.join(5.0)
    path = os.path.join(directory, "exitcodes.pkl")
    if os.path.exists(path):
        with open(path, "rb") as f:
            codes, killed = pickle.load(f)
        return timed_out, codes, killed
    return timed_out, [None] * world_size, list(range(world_size)) if timed_out else []


def _zygote(prepare: Callable[[], Any], world_size: int, store: str, directory: str, *rest: Any) -> None:
    """Run ``prepare`` once, fork every rank (each runs :func:`_worker`), reap them and
    write their exit codes and which it killed: the ranks still running ``GRACE`` seconds
    after one died. A failing ``prepare`` leaves its traceback as every rank's fatal error."""
    os.setpgrp()
    # terminated (its parent exiting): take the ranks along
    signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        prepare()
    except BaseException:
        text = traceback.format_exc()
        for rank in range(world_size):
            Sink(directory, rank).put("fatal", f"prepare failed: {text}")
        raise
    pids: dict[int, int] = {}
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:  # the rank: never returns
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            code = 1
            try:
                _worker(rank, world_size, store, directory, *rest)
                code = 0
            except SystemExit as err:
                code = err.code if isinstance(err.code, int) else 1
            except BaseException:  # already reported by _worker
                pass
            finally:
                os._exit(code)
        pids[pid] = rank
    codes: list[int | None] = [None] * world_size
    killed: list[int] = []
    give_up: float | None = None
    while pids:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if give_up is not None and time.monotonic() > give_up:
                for other, other_rank in pids.items():
                    os.kill(other, signal.SIGKILL)
                    killed.append(other_rank)
                give_up = None
            time.sleep(0.05)
            continue
        rank = pids.pop(pid)
        codes[rank] = os.waitstatus_to_exitcode(status)
        if codes[rank] and give_up is None:
            give_up = time.monotonic() + GRACE
    path = os.path.join(directory, "exitcodes.pkl")
    with open(path + ".tmp", "wb") as f:
        pickle.dump((codes, killed), f)
    os.replace(path + ".tmp", path)

