"""``python -m bench.fsdp2``: a steady finalize of a model under torch's ``fully_shard``
(FSDP2), torchtitan's way (each block, then the root, on a ``dp_shard`` DeviceMesh given as
``pg_collection``), against the floor, in a gloo world (real collectives, one process per
rank). ``--wrap ddp``: the same model under torch's ``DistributedDataParallel`` instead
(its defaults: gradients not views of its buckets; ``ddp_sum_hook``; a ``dp`` mesh).

FSDP2 has reduce-scattered every gradient in backward (DDP has all-reduced it), so with
a per-token loss what is left is the token count's all-reduce and the scale of each local
shard. The floor is that, as a training loop writes it per step: the count all-reduced,
each gradient's ``to_local()`` (FSDP2 makes new gradients every step; DDP's ``.grad``
itself) and one ``_foreach_mul_`` by the count's reciprocal. torch_impl's call also runs what its contract adds: the read of the
FSDP2 state (which ``set_*`` calls may change between steps) and the checks, the status
round that carries the count, and the plan's actions.

Two measures: the steady call, repeated on the same gradients; and the call of a training
step, each after ``zero_grad(set_to_none=True)`` (torch's default), a forward and a backward
(untimed): FSDP2 (and DDP, whose gradients are not bucket views) makes every gradient
anew, as in training. Per call: wall time (median of
interleaved rounds), torch_impl / floor (median of the rounds' paired ratios, mean of the
ranks), the calling thread's CPU, and the Python functions one steady call, and one call
after a training step, enter (exact).
Values: twin models (same seed, same input) must hold bit-identical gradients after the
first call of each, after the steady calls and after the training steps (each twin scaled
as often as the other; the global count is a power of two, so the scales are exact).
Float64, as gloo has no PREMUL_SUM for FSDP2's float32 reduction.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

#: Each rank's token count: the global count is 4 x world, a power of two for a world of 2 or 4.
TOKENS = 4
#: Per wrap: the row's name, the mesh dimension's name, and what the model runs under.
WRAPS = {"fully_shard": ("fsdp2", "dp_shard", "torch's fully_shard per block and root"),
         "ddp": ("ddp", "dp", "torch DDP, gradients not bucket views, ddp_sum_hook")}


def world_main(rank: int, world: int, payload: dict[str, Any], sink: Any) -> None:
    """One rank (``parity_tests.process_world.spawn_world`` target)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    import torch_impl
    from bench.cpu_parts import functions_entered
    from bench.timing import interleaved, paired_ratio
    from meshgrad import FinalizeConfig

    warnings.simplefilter("ignore")
    hidden, ddp = payload["hidden"], payload["wrap"] == "ddp"
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=(WRAPS[payload["wrap"]][1],))

    def build() -> nn.Module:
        torch.manual_seed(0)
        f64 = torch.float64
        blocks = [nn.Sequential(nn.LayerNorm(hidden, dtype=f64), nn.Linear(hidden, hidden, dtype=f64), nn.ReLU(),
                                nn.Linear(hidden, hidden, dtype=f64))
                  for _ in range(payload["layers"])]
        model = nn.Sequential(*blocks)
        model.config = FinalizeConfig(calculate_per_token_loss=True)
        if ddp:  # per-token loss: DDP sums (the hook), finalize scales
            wrapped = DistributedDataParallel(model, process_group=mesh.get_group())
            wrapped.register_comm_hook(wrapped.process_group, torch_impl.ddp_sum_hook)
            return wrapped
        for module in (*blocks, model):  # torchtitan's order: the blocks, then the root
            fully_shard(module, mesh=mesh)
            module.set_gradient_divide_factor(1.0)  # per-token loss: FSDP2 sums, finalize scales
        return model

    def local(grad: torch.Tensor) -> torch.Tensor:
        return grad if ddp else grad.to_local()

    x = torch.randn(4, hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    models = {name: build() for name in ("torch_impl", "floor")}
    for model in models.values():
        model(x).sum().backward()

    def ours() -> None:
        torch_impl.finalize_model_grads([models["torch_impl"]], num_tokens=torch.tensor(TOKENS), pg_collection=mesh)

    floor_params = list(models["floor"].parameters())

    def floor() -> None:
        count = torch.tensor(TOKENS)
        dist.all_reduce(count, group=mesh.get_group())
        with torch.no_grad():
            torch._foreach_mul_([local(p.grad) for p in floor_params], 1.0 / count)

    finals: dict[str, Callable[[], None]] = {"torch_impl": ours, "floor": floor}

    def identical() -> bool:
        """Whether the twins' gradients are bit-identical (each scaled as often as the other)."""
        ours_now, floor_now = ([local(p.grad) for p in model.parameters()] for model in models.values())
        return all(map(torch.equal, ours_now, floor_now))

    for fn in finals.values():  # the first call of each (torch_impl's plans), from the same gradients
        fn()
    agreed = [identical()]

    def measure(prepare: Callable[[str], None] | None, batch: int) -> list[float]:
        """torch_impl / floor, then each one's CPU and median wall seconds per call."""
        cpu = {name: [0.0, 0] for name in finals}

        def timed(name: str) -> Callable[[], None]:
            fn, spent = finals[name], cpu[name]

            def run() -> None:
                start = time.thread_time()
                fn()
                spent[0] += time.thread_time() - start
                spent[1] += 1

            return run

        times = interleaved({name: timed(name) for name in finals}, rounds=payload["rounds"],
                            batch=batch, prepare=prepare)
        return [paired_ratio(times["torch_impl"], times["floor"]), *(cpu[n][0] / cpu[n][1] for n in finals),
                *(times[n]["median"] for n in finals)]

    def training_step(name: str) -> None:  # FSDP2 (DDP: its gradients not bucket views) makes every gradient anew
        models[name].zero_grad(set_to_none=True)
        models[name](x).sum().backward()

    steady = measure(None, payload["batch"])
    entered = functions_entered(ours)  # one more steady call of each: every rank calls both
    floor()
    agreed.append(identical())  # after every steady call, as often scaled as the floor's
    training = measure(training_step, payload["training_batch"])
    for name in finals:  # one more training step of each, its finalize counted for torch_impl's
        training_step(name)
    trained = functions_entered(ours)
    floor()
    agreed.append(identical())  # after the training steps (each twin's last: a finalize)
    per_rank = torch.tensor([*steady, *training, float(all(agreed))], dtype=torch.float64)
    dist.all_reduce(per_rank)
    per_rank /= world
    if rank == 0:
        values = per_rank.tolist()

        def row(ratio: float, cpu_ours: float, cpu_floor: float, wall_ours: float, wall_floor: float) -> dict[str, Any]:
            return {"seconds per call": {"torch_impl": wall_ours, "floor": wall_floor},
                    "cpu seconds per call": {"torch_impl": cpu_ours, "floor": cpu_floor}, "torch_impl / floor": ratio}

        sink.put("result", {
            "wrap": payload["wrap"], "world": world, "layers": payload["layers"], "hidden": hidden,
            "parameters": sum(p.numel() for p in models["floor"].parameters()), "gradients": len(floor_params),
            **row(*values[:5]), "training steps": row(*values[5:10]),
            "python functions per call": list(entered), "python functions per training-step call": list(trained),
            "identical": values[10] == 1.0,
        })
    dist.barrier()


def run_fsdp2(*, world: int = 2, layers: int = 24, hidden: int = 256, rounds: int = 21, batch: int = 10,
              training_batch: int = 2, wrap: str = "fully_shard", timeout: float = 600.0) -> dict[str, Any]:
    """Run the benchmark world (``wrap``: ``"fully_shard"`` or ``"ddp"``); its result, or
    ``{"error": ...}`` when the world failed."""
    from parity_tests.process_world import spawn_world

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    payload = dict(layers=layers, hidden=hidden, rounds=rounds, batch=batch, training_batch=training_batch, wrap=wrap)
    outcome = spawn_world(world_main, world, payload, timeout=timeout)
    if any(outcome.fatal) or "result" not in outcome.results[0]:
        return {"error": outcome.why()}
    return outcome.results[0]["result"]


def format_fsdp2(result: dict[str, Any]) -> str:
    """The result as a few lines."""
    if "error" in result:
        return f"fsdp2: failed: {result['error']}"
    distinct, calls = result["python functions per call"]
    name, dim, how = WRAPS[result["wrap"]]
    lines = [f"{name}-{result['layers']}L-h{result['hidden']}-{dim}{result['world']}  ({how}, {result['gradients']} "
             f"gradients, {result['parameters']} parameters, per-token loss, float64)"]
    for what, row in (("steady call (the same gradients)", result),
                      ("after each training step (zero_grad(set_to_none=True), forward, backward: new gradients)",
                       result["training steps"])):
        wall, cpu = row["seconds per call"], row["cpu seconds per call"]
        lines += [
            f"  {what}:",
            f"    torch_impl {1e3 * wall['torch_impl']:.3f} ms, floor {1e3 * wall['floor']:.3f} ms per call; "
            f"torch_impl / floor {row['torch_impl / floor']:.3f} (median of same-round ratios, mean of the ranks)",
            f"    CPU of the calling thread: torch_impl {1e6 * cpu['torch_impl']:.0f} us, floor "
            f"{1e6 * cpu['floor']:.0f} us per call",
        ]
    return "\n".join([
        *lines,
        f"  torch_impl enters {distinct} Python functions ({calls} calls) per steady call, "
        "{} ({}) per call after a training step".format(*result["python functions per training-step call"]),
        f"  gradients: {'bit-identical' if result['identical'] else 'DIFFERENT'} (torch_impl vs floor, after the first "
        "call, after the steady calls and after the training steps)",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--batch", type=int, default=10, help="steady calls per round")
    parser.add_argument("--training-batch", type=int, default=2,
                        help="training steps per round (each a forward and backward, untimed, and a finalize)")
    parser.add_argument("--wrap", choices=tuple(WRAPS), default="fully_shard",
                        help="torch's fully_shard (FSDP2), or its DistributedDataParallel")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    result = run_fsdp2(world=args.world, layers=args.layers, hidden=args.hidden, rounds=args.rounds, batch=args.batch,
                        training_batch=args.training_batch, wrap=args.wrap)
    print(format_fsdp2(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 1 if "error" in result or not result["identical"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
