"""Running the checkout's programs in subprocesses for the tests (docs snippets, examples).

``torch.distributed.run`` worlds on gloo sometimes abort at interpreter exit, after their
work is done and the process group destroyed ("terminate called without an active
exception", SIGABRT; a plain torch program of one all-reduce on a DeviceMesh group shows
it too, in about 1-3 % of runs on a loaded 2-core machine). :func:`launch` runs such a
command once more when, and only when, it failed that way.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: What a process that hits torch's gloo teardown abort prints (C++ std::terminate).
TEARDOWN_ABORT = "terminate called without an active exception"


def checkout_env() -> dict[str, str]:
    """The environment with the checkout first on PYTHONPATH, one OpenMP thread, no XLA flags."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    env.pop("XLA_FLAGS", None)
    return env


def _run_once(cmd: list[str], cwd: Path, timeout: float, env: dict[str, str]) -> tuple[int, str]:
    """(exit status, stdout and stderr together); the whole process group is killed on timeout."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout}s: {' '.join(cmd)}\n{out[-4000:]}")
    return proc.returncode, out


def teardown_abort_only(returncode: int, output: str) -> bool:
    """Whether a failed run is torch's gloo teardown abort and nothing else (no Python
    traceback from the program itself)."""
    return returncode != 0 and TEARDOWN_ABORT in output and "SIGABRT" in output and "Error:" not in output.split(
        "ChildFailedError", 1
    )[0]


def launch(cmd: list[str], cwd: Path = ROOT, timeout: float = 240, env: dict[str, str] | None = None) -> str:
    """Run ``cmd`` (from the checkout, :func:`checkout_env` unless ``env``) and return its
    output; fail the test on a non-zero exit, after one more run when the first ended in
    torch's gloo teardown abort only (:func:`teardown_abort_only`)."""
    env = checkout_env() if env is None else env
    returncode, out = _run_once(cmd, cwd, timeout, env)
    if teardown_abort_only(returncode, out):
        returncode, out = _run_once(cmd, cwd, timeout, env)
    if returncode != 0:
        pytest.fail(f"exit {returncode}: {' '.join(cmd)}\n{out[-6000:]}")
    return out
