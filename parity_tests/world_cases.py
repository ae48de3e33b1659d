"""Many named case functions run in one gloo world (spawning a world is the slow part).

:func:`run_cases` runs ``module.name(rank, world_size)`` for every name on every rank of
one :func:`~parity_tests.process_world.spawn_world` world and returns each rank's result
or error per case; :func:`case_values` turns one case's results into values (:func:`local_cases`: a module's
cases), failing the
test that asked for them with every rank's problem.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from parity_tests.process_world import Sink, spawn_world


def _call_cases(rank: int, world_size: int, payload: tuple[str, list[str]], sink: Sink) -> None:
    import importlib

    module_name, names = payload
    module = importlib.import_module(module_name)
    for name in names:
        try:
            value: tuple[str, Any] = ("ok", getattr(module, name)(rank, world_size))
        except Exception as err:  # recorded per rank; the next case still runs
            value = ("error", f"{type(err).__name__}: {err}")
        sink.put(name, value)


def run_cases(
    module_name: str,
    names: Sequence[str],
    world_size: int,
    timeout: float = 300.0,
    prepare: Callable[[], Any] | None = None,
    crash_retries: int = 1,
) -> dict[str, list[tuple[str, Any]]]:
    """Run functions ``module.name(rank, world_size)`` on every rank of one gloo world.

    Every rank runs every case in order (cases must make the same collective calls on
    every rank).

    Args:
      module_name: importable module holding the case functions.
      names: function names, run in this order.
      world_size: number of processes.
      timeout: seconds before the world is killed.
      prepare: set-up run once before the ranks are forked (:func:`spawn_world`).
      crash_retries: runs again after a rank died by a signal the world did not send
        (:func:`spawn_world`; the cases are run from the first again).

    Returns:
      ``{name: [(status, value) per rank]}`` with status ``"ok"`` (value = the return
      value), ``"error"`` (value = the error text) or ``"missing"`` (the rank never
      reported: timeout or crash).
    """
    outcome = spawn_world(_call_cases, world_size, (module_name, list(names)), timeout, prepare, crash_retries)
    why = outcome.why()
    return {
        name: [outcome.results[r].get(name, ("missing", why)) for r in range(world_size)] for name in names
    }


def local_cases(namespace: Mapping[str, Any]) -> list[str]:
    """The names of the ``case_*`` functions a test module defines itself, in order, given
    its ``globals()`` (an imported one, such as :func:`case_values`, is not a case)."""
    module = namespace["__name__"]
    return [name for name, value in namespace.items()
            if name.startswith("case_") and callable(value) and getattr(value, "__module__", None) == module]


def case_values(world: dict[str, list[tuple[str, Any]]], name: str) -> list[Any]:
    """Per-rank values of case ``name`` from :func:`run_cases`; fails (pytest) naming every
    rank whose case did not return "ok"."""
    results = world[name]
    problems = [f"rank {r}: {s}: {v}" for r, (s, v) in enumerate(results) if s != "ok"]
    if problems:
        raise AssertionError("\n".join(problems))
    return [v for _, v in results]
