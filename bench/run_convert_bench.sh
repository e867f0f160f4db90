#!/usr/bin/env bash
# copy_state's conversions against LibTorch's save + load; prints the table of bench/RESULTS-convert.md.
#   bench/run_convert_bench.sh [THREADS]   (after scripts/build.sh)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
threads="${1:-2}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
MEMSAVE_BENCH_THREADS="$threads" "$root/build/bench/memsave_bench_convert" --benchmark_repetitions=5 \
  --benchmark_report_aggregates_only=true --benchmark_min_time=1 --benchmark_format=json >"$tmp/run.json"
"$root/.venv/bin/python" "$root/bench/convert_report.py" "$tmp/run.json" "bench/run_convert_bench.sh $threads"
