#!/usr/bin/env bash
# What starting the longest tests first (tests/costs.cmake) does to the wall time of the test suite: ctest as
# scripts/test.sh runs it (all cores, no timings from an earlier run, as on a clean checkout), with the discovered
# tests' costs and without them (MEMSAVE_TEST_COSTS=off: discovery order), alternating. Prints each run's wall
# time and the sum of its tests' times, then the medians.
#   bench/run_ctest_order.sh [REPETITIONS] [--avx2]   (after scripts/build.sh; default 3; each run takes minutes)
#   --avx2 caps oneDNN and ATen at AVX2 (ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY), as on a processor without
#   native bf16, where the bf16 tests take ten times longer and the order matters.
set -euo pipefail
shopt -s inherit_errexit
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="$root/build"
reps="${1:-3}"
cap=()
if [[ "${2:-}" == "--avx2" ]]; then
  cap=(ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2)
fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
source "$root/bench/alternate.sh"
one_run() {  # on|off: prints "WALL SUM" in seconds
  rm -f "$build/Testing/Temporary/CTestCostData.txt"
  local start end
  start=$(date +%s.%N)
  env "${cap[@]}" MEMSAVE_TEST_COSTS="$1" ctest --test-dir "$build" --parallel "$(nproc)" >"$log" 2>&1 ||
    { tail -30 "$log" >&2; exit 1; }
  end=$(date +%s.%N)
  grep -E '^ *[0-9]+/[0-9]+ Test +#' "$log" |
    awk -v start="$start" -v end="$end" '{sum += $(NF - 1)} END {printf "%.1f %.1f\n", end - start, sum}'
}
echo "ctest --parallel $(nproc), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)${cap[*]:+, ${cap[*]}}"
alternate "$reps" costs tests one_run off on
