#!/usr/bin/env bash
# What OpenMP's wait policy does to LibTorch processes that share a machine's cores, as ctest --parallel runs
# them: one Fashion-MNIST training alone, then two side by side under the default policy and under
# OMP_WAIT_POLICY=passive (what tests/CMakeLists.txt sets for every LibTorch test). Prints each run's wall time.
#   bench/run_omp_wait.sh [REPETITIONS] [IMAGES]   (after scripts/build.sh; default 3 repetitions, 10000 images)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
reps="${1:-3}"
images="${2:-10000}"
train=("$root/build/examples/fashion_mnist" --epochs 1 --limit "$images" --state-bits 4)
wall() { { /usr/bin/time -f %e "$@" 2>&1 >/dev/null || true; } | tail -1; }  # seconds (whatever the accuracy)
echo "fashion_mnist --epochs 1 --limit $images --state-bits 4 (fp32 then 4-bit AdamW), $(nproc) cores, $(nproc) intra-op threads each"
declare -A pair
for rep in $(seq "$reps"); do
  alone=$(wall "${train[@]}")
  for policy in default passive; do
    env=(); [[ $policy == passive ]] && env=(OMP_WAIT_POLICY=passive)
    a=$(mktemp); b=$(mktemp)
    env "${env[@]}" bash -c "$(declare -f wall); wall \"\$@\" >$a" _ "${train[@]}" &
    env "${env[@]}" bash -c "$(declare -f wall); wall \"\$@\" >$b" _ "${train[@]}"
    wait
    pair[$policy]="$(cat "$a") s and $(cat "$b") s"; rm -f "$a" "$b"
  done
  echo "repetition $rep: alone $alone s; two side by side, default policy ${pair[default]}; passive ${pair[passive]}"
done
