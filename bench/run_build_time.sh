#!/usr/bin/env bash
# What precompiling <torch/torch.h> (MEMSAVE_PRECOMPILE_HEADERS) does to a clean build of memsave: the whole
# build (library, examples, tests, benchmarks; CUDA glue as configured) from an empty build directory, with the
# precompiled header and without, alternating, as scripts/build.sh runs it (all cores). Prints each build's wall
# time and the sum of its compile and link steps (ninja's log), then the medians.
#   bench/run_build_time.sh [REPETITIONS]   (after scripts/setup.sh; default 3; each build takes minutes)
#   Builds in build-time/ (removed after each build).
set -euo pipefail
shopt -s inherit_errexit  # (a failed step inside $(one_build ...) stops the script too)
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
reps="${1:-3}"
prefix="$("$root/.venv/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
dir="$root/build-time"
configure_log=$(mktemp)
trap 'rm -f "$configure_log"' EXIT
source "$root/bench/alternate.sh"
one_build() {  # ON|OFF: prints "WALL STEPS" in seconds
  rm -rf "$dir"
  cmake -S "$root" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
        -DMEMSAVE_PRECOMPILE_HEADERS="$1" >"$configure_log" 2>&1 || { cat "$configure_log" >&2; exit 1; }
  local start end
  start=$(date +%s.%N)
  cmake --build "$dir" --parallel "$(nproc)" >/dev/null
  end=$(date +%s.%N)
  awk -v start="$start" -v end="$end" 'NR > 1 {sum += ($2 - $1) / 1000}
      END {printf "%.1f %.1f\n", end - start, sum}' "$dir/.ninja_log"
  rm -rf "$dir"
}
echo "clean build of memsave, $(nproc) cores, $(c++ --version | head -1)"
alternate "$reps" "precompiled header" "compile and link steps" one_build OFF ON
