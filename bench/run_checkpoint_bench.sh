#!/usr/bin/env bash
# The checkpointing benchmark: memsave (C++) and torch.utils.checkpoint (Python, same architectures, counted by
# the same meter) in one invocation, repeated; prints the table of bench/RESULTS-checkpoint.md.
#   bench/run_checkpoint_bench.sh [RUNS] [STEPS]   (after scripts/build.sh)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
runs="${1:-3}"
steps="${2:-3}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
for ((i = 0; i < runs; ++i)); do
  OMP_NUM_THREADS=2 "$root/build/bench/memsave_bench_checkpoint" --steps "$steps" >>"$tmp/results.jsonl"
  "$root/.venv/bin/python" "$root/bench/peers_checkpoint.py" "$root/build/bench/libmemsave_pymeter.so" 2 "$steps" \
    >>"$tmp/results.jsonl"
done
"$root/.venv/bin/python" "$root/bench/checkpoint_report.py" "$tmp/results.jsonl" \
  "bench/run_checkpoint_bench.sh $runs $steps"
