#!/usr/bin/env bash
# How often a fresh process's first float tanh differs from its second (oneMKL's VML first-call race,
# pytorch/pytorch#188792), without and with the one-element warm-up of tests/settle_cpu_math.cpp.
#   bench/run_vml_first_call.sh [RUNS] [PARALLEL] [THREADS]   (after scripts/build.sh)
# RUNS fresh processes per case, PARALLEL at a time, each with THREADS intra-op threads: more threads than
# cores, as on a loaded test machine, make the race likelier.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
runs="${1:-480}"
parallel="${2:-4}"
threads="${3:-8}"
for warm in "" --warm; do
  seq "$runs" | OMP_NUM_THREADS="$threads" xargs -P "$parallel" -I{} "$root/build/bench/memsave_vml_first_call" $warm \
    | awk -v runs="$runs" -v case="${warm:-cold}" '
        $1 > 0 { bad++; what[$0]++ }
        END {
          printf "%s: %d of %d first calls differed from the second\n", case, bad, runs
          for (w in what) { split(w, f, " "); printf "  %d times: %d elements in [%d, %d], largest difference %s\n", what[w], f[1], f[2], f[3], f[4] }
        }'
done
