"""``python -m bench.dropin_parts``: where the drop-in non-TP step's time goes, next to
its copy floor, in one interleaved run (fake backend, one process as rank 0).

The step is ``torch_impl._allreduce_non_tensor_model_parallel_grads`` on
:class:`bench.ddp.MiniDDP` chunks (the DDP owns ``main_grad``; meshgrad stages the
non-TP gradients). Each part is the same work the steady step does, timed alone:

* ``probes``: the steady check's whole replay (the step's read stage, less its glue),
  and of it the touched parameters' passes (``requires_grad`` and shapes of the
  parameters, of their ``main_grad`` tensors -- one compiled guard call each --, their
  attribute dicts, the ``main_grad`` data pointers) and the module-tree edges;
* ``program``: the bound program alone (the staging copies and the collective);
* ``probes, then program``: the two in a row, as the step runs them (against their sum
  alone: what each costs the other in cache);
* ``step without probes and program``: the step with those two stubbed (the pipeline's
  own calls, the local checks, the status round);
* ``floor``: :func:`bench.fake.copy_floor` (``_foreach_copy_`` staging and the collective);
* ``staging floor``: :func:`bench.fake.staging_floor`, the same copies as the step's own
  staging (strided runs on CPU) and the collective, no check: the step's time beyond it is
  what its checks and pipeline cost.

What the step costs beyond ``probes, then program`` and the stubbed step is what its parts
cost more inside it than alone: there each runs after the other parts and the copies of
the step before, with colder caches (see docs/performance.md). With ``--copies`` each
other staging is checked by value before it is timed.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from bench import fake
from bench.ddp import MiniDDP
from bench.models import Layout, non_tp_params
from bench.run import FAKE_LAYOUTS
from bench.timing import interleaved
from torch_impl.run.strided_runs import RunCopies


def _helper_watch(model: list[Any]) -> tuple[Any, Any, Any]:
    """(the steady guard's probes, the helper's GradWatch, the model watch) of ``model``
    after its steady calls (torch_impl internals: this is a profile)."""
    from torch_impl.call.model_state import ModelState

    state = ModelState.of(model)
    (guard,) = state.steady_guards.values()
    ((_, _, watch, _),) = state.found.values()
    touched, _ = watch._helper
    return guard.probes, touched, watch


def _without_watch_and_copies(step: Callable[[], object], probes: Any, program: Any) -> Callable[[], object]:
    """``step`` with the steady check's replay answering True at once and the bound program
    doing nothing, put back after each call: what is left is the pipeline's own calls, the
    local checks and the status round."""
    from torch_impl.call.probes import Probes

    hold = Probes.hold

    def call() -> None:
        Probes.hold = lambda self: True  # the class's: Probes has slots
        program.run = lambda on_step=None: None
        try:
            step()
        finally:
            Probes.hold = hold
            del program.run

    return call


def _check_parts(probes: Any, touched: Any, watch: Any) -> dict[str, Callable[[], bool]]:
    """The steady check's replay and its passes over the watched parameters, each a call
    that answers True while nothing it checks changed (as the step's check answers)."""
    params, grads = touched.params, touched.tensors
    param_guard, grad_guard = touched.param_check.guard, touched.grad_check.guard
    data_ptr = torch.Tensor.data_ptr
    return {
        "probes": probes.hold,
        "params: requires_grad, shapes": lambda: param_guard.check(*params),
        "main_grads: shapes, dtypes": lambda: grad_guard.check(*grads),
        "attribute dicts": touched.attributes.same,
        "main_grad pointers": lambda: list(map(data_ptr, grads)) == touched.ptrs,
        "module-tree edges": watch.param_edges.same,
    }


def staging_variants(grads: list[torch.Tensor], base: torch.Tensor) -> dict[str, Callable[[], object]]:
    """Other ways to stage ``grads`` (views of the DDP's flat buffer ``base``) into one
    flat buffer and back, each way timed apart: the floor's ``_foreach_copy_``,
    ``torch.cat`` / ``split_with_sizes_copy`` through flat views, ``index_select`` /
    ``index_copy_`` with the gradients' element indices into ``base``, and meshgrad's own
    strided runs (:class:`torch_impl.run.strided_runs.RunCopies`, where they apply). All
    keep the gradients' order (megatron-core's flatten order: the sums must be
    bit-identical)."""
    sizes = [g.numel() for g in grads]
    staged = torch.empty(sum(sizes), dtype=grads[0].dtype)
    views = [v.view(g.shape) for v, g in zip(staged.split(sizes), grads)]
    flats = [g.view(-1) for g in grads]
    index = torch.cat([torch.arange(g.storage_offset(), g.storage_offset() + g.numel()) for g in grads])
    if base.storage_offset() != 0 or any(g.untyped_storage().data_ptr() != base.untyped_storage().data_ptr() for g in grads):
        raise ValueError("the gradients are not views of the DDP's buffer")
    variants = {
        "in: _foreach_copy_": lambda: torch._foreach_copy_(views, grads),
        "out: _foreach_copy_": lambda: torch._foreach_copy_(grads, views),
        "in: torch.cat": lambda: torch.cat(flats, out=staged),
        "out: split_with_sizes_copy": lambda: torch.split_with_sizes_copy(staged, sizes, out=flats),
        "in: index_select": lambda: torch.index_select(base, 0, index, out=staged),
        "out: index_copy_": lambda: base.index_copy_(0, index, staged),
    }
    runs = RunCopies.build(grads, staged, views)
    if runs is not None:  # meshgrad's own staging on CPU
        variants.update({"in: strided runs": runs.copy_in, "out: strided runs": runs.copy_out})
    _check_variants(variants, grads, staged)
    return variants


def _check_variants(variants: dict[str, Callable[[], object]], grads: list[torch.Tensor], staged: torch.Tensor) -> None:
    """Each way in stages the gradients' values in their order, each way out puts a staged
    buffer back into them (integer values, so equality is exact); the gradients are left as
    they were."""
    saved = [g.clone() for g in grads]
    expected = torch.cat([g.reshape(-1) for g in saved])
    try:
        for name, fn in variants.items():
            if name.startswith("in: "):
                staged.zero_()
                fn()
                ok = torch.equal(staged, expected)
            else:
                for g in grads:
                    g.zero_()
                staged.copy_(expected)
                fn()
                ok = all(torch.equal(g, s) for g, s in zip(grads, saved))
            if not ok:
                raise RuntimeError(f"staging {name!r} moved other values than the gradients'")
    finally:
        torch._foreach_copy_(grads, saved)


def measure(lay: Layout, rounds: int, batch: int, copies: bool = False) -> dict[str, Any]:
    """Median seconds per call of the step, the floor and each part (one interleaved run).

    Args:
      lay: one of the bench's fake-backend layouts (:data:`bench.run.FAKE_LAYOUTS`;
        gpt-24L-h1024: 96 non-TP gradients on rank 0, its pp1 twin: 193).
      rounds: timed rounds.
      batch: calls per round.
      copies: also time :func:`staging_variants` (in the same run).

    Returns:
      {"layout", "non_tp_grads", "watched", "answers" (each check part's answer), "time" and
      "copies": name -> {"median", ...}}.

    Raises:
      RuntimeError: a check part did not answer "unchanged" (it would time something other
        than the step's check), or a staging moved other values.
    """
    import torch_impl
    from torch_impl.call.model_state import ModelState

    fake.init_fake(lay.world)
    groups = fake.fake_groups(lay)
    chunk = fake.first_stage_chunk(lay, "cpu")
    model = [MiniDDP(chunk, groups.dp_cp, device="cpu")]
    grads = [p.main_grad for p in non_tp_params(model[0].module)]

    def step() -> None:
        torch_impl._allreduce_non_tensor_model_parallel_grads(model, chunk.config, groups.tp)

    for _ in range(3):  # the first call plans; the next ones record and take the steady path
        step()
    probes, touched, watch = _helper_watch(model)
    program = list(ModelState.of(model).programs.values())[-1][1]
    checks = _check_parts(probes, touched, watch)
    answers = {name: check() for name, check in checks.items()}
    failed = [name for name, ok in answers.items() if ok is not True]
    if failed:
        raise RuntimeError(f"{lay.name}: the steady check's parts did not hold: {failed}")
    candidates = {
        "step": step,
        "floor": fake.copy_floor(grads, groups.tp),
        "staging floor": fake.staging_floor(grads, groups.tp),
        **checks,
        "program": program.run,
        "probes, then program": lambda: (probes.hold(), program.run()),
        "step without probes and program": _without_watch_and_copies(step, probes, program),
    }
    if copies:
        for g in grads:  # integer values (bench.models leaves the buffers uninitialized)
            g.copy_(torch.randint(-8, 8, g.shape, dtype=g.dtype))
    variants = staging_variants(grads, model[0].grad_buffers[0][0]) if copies else {}
    timed = interleaved({**candidates, **variants}, rounds=rounds, batch=batch)
    return {"layout": lay.name, "non_tp_grads": len(grads), "watched": len(touched), "answers": answers,
            "time": {name: timed[name] for name in candidates},
            "copies": {name: timed[name] for name in variants}}


def report(result: dict[str, Any]) -> str:
    """The parts as a table: us per call, and as a share of the step's time beyond the
    floor of its own staging (the same copies and collective, no check)."""
    t = {name: v["median"] * 1e6 for name, v in result["time"].items()}
    own = t["staging floor"]
    beyond = t["step"] - own
    lines = [
        f"{result['layout']}: drop-in non-TP step, {result['non_tp_grads']} non-TP grads, "
        f"{result['watched']} parameters watched in full (median us per call, parts timed alone)",
        f"  step {t['step']:9.1f}   floor {t['floor']:9.1f}   step / floor {t['step'] / t['floor']:.3f}",
        f"  staging floor {own:9.1f} (meshgrad's staging, no check)   step / it {t['step'] / own:.3f}   "
        f"beyond it {beyond:.1f}",
    ]
    for name, us in t.items():
        if name in ("step", "floor", "staging floor"):
            continue
        if name == "program":
            share = f"staging floor x {us / own:.3f}"
        elif name == "probes, then program":
            share = f"their sum alone x {us / (t['probes'] + t['program']):.3f}"
        else:
            share = f"{us / beyond:6.1%} of beyond"
        lines.append(f"  {name:32s} {us:9.1f}   {share}")
    cold = t["step"] - t["probes, then program"] - t["step without probes and program"]
    lines.append(f"  {'the step less those two':32s} {cold:9.1f}   {cold / beyond:6.1%} of beyond (colder caches)")
    if result["copies"]:
        lines.append("  staging one way, alone (the floor is one in + one out + the collective):")
        lines += [f"    {name:30s} {v['median'] * 1e6:9.1f}" for name, v in result["copies"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.dropin_parts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", default=["gpt-24L-h1024", "gpt-24L-h1024-pp1"],
                        choices=list(FAKE_LAYOUTS), help="the bench's fake-backend layouts to run")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--copies", action="store_true", help="also time other ways to stage the gradients")
    args = parser.parse_args(argv)
    for name in args.layouts:
        print(report(measure(FAKE_LAYOUTS[name], args.rounds, args.batch, args.copies)))


__all__ = ["measure", "report"]


if __name__ == "__main__":
    main()

