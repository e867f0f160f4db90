#!/usr/bin/env bash
# The optimizer benchmark: memsave and LibTorch (C++) and the Python peers, in one invocation; prints the table.
#   bench/run_optim_bench.sh [THREADS [FILTER]]   (after scripts/build.sh; the peers: .venv/bin/pip install
#                                                   bitsandbytes torchao deepspeed)
# FILTER: a --benchmark_filter regular expression (the bandwidth probes always run); with it the Python peers
# do not run.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
threads="${1:-2}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
filter="${2:-}"
MEMSAVE_BENCH_THREADS="$threads" "$root/build/bench/memsave_bench_optim" --benchmark_repetitions=5 \
  --benchmark_report_aggregates_only=true --benchmark_min_time=1 --benchmark_format=json \
  ${filter:+--benchmark_filter="Bandwidth|$filter"} >"$tmp/cpp.json"
if [[ -z "$filter" ]]; then
  "$root/.venv/bin/python" "$root/bench/peers_optim.py" "$threads" "$tmp/peers.json" >"$tmp/peers.log" 2>&1 ||
    { cat "$tmp/peers.log" >&2; exit 1; }
else
  echo '[]' >"$tmp/peers.json"
fi
"$root/.venv/bin/python" "$root/bench/optim_report.py" "$tmp/cpp.json" "$tmp/peers.json" \
  "bench/run_optim_bench.sh $threads${filter:+ '$filter'}"
