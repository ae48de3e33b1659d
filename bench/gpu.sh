#!/usr/bin/env bash
# bench/gpu.sh -- meshgrad against megatron-core on one GPU, in one go.
#
# For a machine with one CUDA GPU, torch preinstalled, no internet, this repository
# copied to it (megatron-core is optional: without it, meshgrad's numbers alone).
#
#   1. python -m bench.cuda --backend nccl       a world of one rank on NCCL: finalize
#      with num_tokens against megatron-core and the floor (the count's all-reduce and the
#      scale), the status round priced against a bare tiny all-reduce + synchronize (its
#      share of a finalize), then the whole finalize captured in a CUDA graph and replayed
#      (no host sync inside), checked by value; megatron-core tried under capture too.
#      Run at three sizes (24 layers x hidden 1024, 2048; 12 layers x 4096).
#   2. python -m bench.cuda --backend fake       the same capture / replay / check for
#      the multi-rank layout under the fake backend.
#   3. python -m bench.full_graph                with megatron-core: megatron's own
#      FullCudaGraphWrapper around get_forward_backward_func() (a tiny GPTModel in
#      megatron-core's real DDP, per-token loss, config.finalize_model_grads_func =
#      torch_impl.finalize_model_grads): eager warm-up steps, capture, replays on new
#      batches; losses, gradients and parameters compared with eager twins (torch_impl's
#      finalize, megatron-core's), max abs diff per step, PASS / FAIL; replay and eager
#      step timed. Without megatron-core: the hand-rolled capture of step 4.
#   4. python -m bench.full_graph --impl hand    the hand-rolled capture: one step
#      (forward, backward, the DDP's sync, torch_impl's finalize with num_tokens) in one
#      torch.cuda.graph, replays on new inputs compared with a twin's eager steps, timed.
#   5. python -m bench --device cuda             side by side on the fake backend
#      (TP=8, PP=2, DP=2 layouts), gradients on the GPU: local overhead per step and per
#      finalize, collectives and bytes copied per call. The rows that use no GPU (gloo
#      worlds, real DDP on gloo, JAX, MoE scale and at-scale plans) are left to `python -m bench`.
#
# The GPU steps come first. The whole script keeps to a budget (BUDGET seconds, default 450:
# it ends inside 8 minutes on one GPU whatever a step does): each step may run for
# STEP_TIMEOUT or what is left of the budget, whichever is less, and is then stopped; a step
# with less than 20 s left is skipped. Either way the next step runs and the report is
# written.
# Usage: bash bench/gpu.sh [--quick] [--cpu-smoke]
#   --quick      fewer rounds, the 24-layer layouts only
#   --cpu-smoke  no GPU needed: every step on the CPU with tiny layouts (tests this script;
#                steps 4-5 take the capture path with the torch.cuda graph calls stood in)
# Every step's JSON, its status, time and log are merged into one file at the end:
# $OUT/gpu_report.json (beside the steps' own JSON files: eight files in all; the logs are
# kept in a temporary folder, not in $OUT).
# Environment: OUT (results folder; default bench/results), PYTHON (default python3),
#   BUDGET (seconds for the whole script, default 450), STEP_TIMEOUT (seconds per step at
#   most, default 150).
# Exit status: 0 when every step succeeded, 1 when one failed or was skipped, 2 when no GPU
# is usable.

set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
RESULTS="${OUT:-$ROOT/bench/results}"
QUICK=()
SMOKE=0
for arg in "$@"; do
  case "$arg" in
    --quick) QUICK=(--quick) ;;
    --cpu-smoke) SMOKE=1; QUICK=(--quick) ;;
    -h|--help) awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "bench/gpu.sh: unknown argument: $arg (try --help)" >&2; exit 2 ;;
  esac
done
mkdir -p "$RESULTS"
rm -f "$RESULTS"/gpu_*.json  # this script's own files from an earlier run: the report merges what is there

say() { printf '\n==== %s ====\n' "$*"; }

say "environment"
if ! "$PY" - <<'EOF'
import importlib.util, platform, sys
from pathlib import Path
import torch
print(f"python {platform.python_version()}  torch {torch.__version__}  cuda build {torch.version.cuda}")
print(f"cuda available: {torch.cuda.is_available()}"
      + (f"  device: {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""))
if importlib.util.find_spec("megatron") is None:
    print("megatron-core: no (meshgrad only)")
else:  # installed is not importable: steps 3 and 4 then run meshgrad's stand-ins, say so here
    try:
        from parity_tests.megatron_state import import_megatron_core
        import_megatron_core()
        from megatron.core import package_info  # the version imported, whichever path it came from
        print(f"megatron-core: {package_info.__version__} from {Path(package_info.__file__).parents[2]}")
    except Exception as err:  # noqa: BLE001 -- reported, the steps fall back
        print(f"megatron-core: installed but not importable ({type(err).__name__}: {err}); meshgrad's stand-ins")
import meshgrad, torch_impl  # noqa: F401  (the repository imports)
print(f"meshgrad {meshgrad.__version__} from {meshgrad.__file__}")
EOF
then
  echo "bench/gpu.sh: python / torch / meshgrad import failed (PYTHON=$PY)" >&2
  exit 2
fi

if [[ $SMOKE -eq 1 ]]; then
  DEVICE=cpu
  WORLD1=(--backend gloo --device cpu --layers 2 --hidden 128)
  FAKE=(--backend fake --device cpu --layers 2 --hidden 128)
  SIDE=(--no-gloo --layouts gpt-24L-h1024 --rounds 2 --no-scale --no-jax --no-real-ddp --no-fsdp2 --no-at-scale)
  GRAPH=(--device cpu --rounds 2)
else
  if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "bench/gpu.sh: no usable CUDA device (use --cpu-smoke to test the script on a CPU)" >&2
    exit 2
  fi
  DEVICE=cuda
  WORLD1=(--backend nccl --device cuda)
  FAKE=(--backend fake --device cuda)
  SIDE=(--no-gloo --no-jax --no-real-ddp --no-fsdp2 --no-at-scale --no-scale)
  GRAPH=(--device cuda)
fi

BUDGET="${BUDGET:-450}"
STEP_TIMEOUT="${STEP_TIMEOUT:-150}"
RESERVE=15      # seconds kept for the summary
MIN_STEP=20     # a step with less than this left is skipped
KILL_AFTER=10   # a step that ignores its stop signal is killed this much later
LOGS="$(mktemp -d)"
trap 'rm -rf "$LOGS"' EXIT
RUNS="$LOGS/runs.tsv"  # one line per step: key, outcome, seconds, limit, name
: > "$RUNS"
run() {  # run KEY NAME CMD...: run a step inside the budget, keep going on failure
  local key="$1" name="$2"; shift 2
  say "$name"
  echo "+ $*"
  local left=$(( BUDGET - SECONDS - RESERVE - KILL_AFTER ))
  local start=$SECONDS limit=0 status outcome=skipped
  if (( left >= MIN_STEP )); then
    limit=$(( left < STEP_TIMEOUT ? left : STEP_TIMEOUT ))
    set +e
    timeout --kill-after="$KILL_AFTER" "$limit" "$@" 2>&1 | tee "$LOGS/$key.log"
    status=${PIPESTATUS[0]}
    set -e
    if (( status == 0 )); then
      outcome=ok
    elif (( status == 124 || (status == 137 && SECONDS - start >= limit) )); then
      outcome=timeout  # stopped at its limit (137: killed after ignoring the stop signal)
    else
      outcome=failed
    fi
  fi
  case $outcome in
    ok) echo "---- $name: ok ($((SECONDS - start)) s)" ;;
    skipped) echo "---- $name: skipped (${left} s left of the ${BUDGET} s budget)" >&2 ;;
    *) echo "---- $name: FAILED with status $status ($outcome after $((SECONDS - start)) s, limit $limit s)" >&2 ;;
  esac
  printf '%s\t%s\t%s\t%s\t%s\n' "$key" "$outcome" "$((SECONDS - start))" "$limit" "$name" >> "$RUNS"
}

run world_of_one "1/5 world of one (${WORLD1[1]}), CUDA graph capture" \
  "$PY" -m bench.cuda "${WORLD1[@]}" "${QUICK[@]}" --json "$RESULTS/gpu_world_of_one.json"
if [[ $SMOKE -eq 0 ]]; then
  run world_of_one_h2048 "1b/5 world of one (nccl), hidden 2048" \
    "$PY" -m bench.cuda "${WORLD1[@]}" --quick --hidden 2048 --json "$RESULTS/gpu_world_of_one_h2048.json"
  run world_of_one_h4096 "1c/5 world of one (nccl), 12 layers x hidden 4096" \
    "$PY" -m bench.cuda "${WORLD1[@]}" --quick --layers 12 --hidden 4096 --json "$RESULTS/gpu_world_of_one_h4096.json"
fi
run fake_graph "2/5 fake multi-rank layout, CUDA graph capture" \
  "$PY" -m bench.cuda "${FAKE[@]}" "${QUICK[@]}" --json "$RESULTS/gpu_fake_graph.json"
run full_step_graph "3/5 whole training step in one CUDA graph: megatron's FullCudaGraphWrapper (fallback: hand-rolled), torch_impl finalize" \
  "$PY" -m bench.full_graph "${GRAPH[@]}" --json "$RESULTS/gpu_full_step_graph.json"
run full_step_graph_hand "4/5 whole training step in one CUDA graph: hand-rolled torch.cuda.graph capture, torch_impl finalize" \
  "$PY" -m bench.full_graph "${GRAPH[@]}" --impl hand --json "$RESULTS/gpu_full_step_graph_hand.json"
run side_by_side "5/5 side by side, fake backend, gradients on $DEVICE" \
  "$PY" -m bench --device "$DEVICE" "${QUICK[@]}" "${SIDE[@]}" --json "$RESULTS/gpu_side_by_side.json"

say "summary"
"$PY" - "$RESULTS" "$RUNS" "$BUDGET" "$SECONDS" <<'EOF' || true
import glob, json, os, sys
results, runs_file, budget, elapsed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
runs = []
with open(runs_file) as f:
    for line in f.read().splitlines():
        key, outcome, seconds, limit, name = line.split("\t", 4)
        log = os.path.join(os.path.dirname(runs_file), key + ".log")
        tail = open(log, errors="replace").read().splitlines()[-200:] if os.path.exists(log) else []
        runs.append({"step": name, "outcome": outcome, "seconds": int(seconds), "limit_s": int(limit), "log_tail": tail})
report = {"failed steps": [r["step"] for r in runs if r["outcome"] != "ok"], "budget_s": budget,
          "elapsed_s": elapsed, "runs": runs, "steps": {}}
for path in sorted(glob.glob(os.path.join(results, "gpu_*.json"))):
    if os.path.basename(path) == "gpu_report.json":
        continue
    with open(path) as f:
        try:
            report["steps"][os.path.basename(path)] = json.load(f)
        except ValueError as err:
            report["steps"][os.path.basename(path)] = {"error": f"unreadable: {err}"}
with open(os.path.join(results, "gpu_report.json"), "w") as f:
    json.dump(report, f, indent=2, default=str)
ok = sum(r["outcome"] == "ok" for r in runs)
print(f"one file: {os.path.join(results, 'gpu_report.json')} ({ok} of {len(runs)} steps ok, "
      f"{len(report['steps'])} step files, {elapsed} s of the {budget} s budget)")
EOF
not_ok="$(awk -F '\t' '$2 != "ok" { print "  " $5 }' "$RUNS")"
if [[ -n $not_ok ]]; then
  printf 'failed or skipped steps:\n%s\n' "$not_ok" >&2
  exit 1
fi
echo "all steps succeeded"
