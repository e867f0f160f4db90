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
wall() { { /usr/bin/time -f %e "${train[@]}" 2>&1 >/dev/null || true; } | tail -1; }  # seconds, any accuracy
side_by_side() {  # POLICY (empty: the default): two trainings at once, their wall seconds
  local a b; a=$(mktemp); b=$(mktemp)
  (
    unset OMP_WAIT_POLICY
    if [[ -n "$1" ]]; then export OMP_WAIT_POLICY="$1"; fi
    wall >"$a" &
    wall >"$b"
    wait
  )
  echo "$(cat "$a") s and $(cat "$b") s"
  rm -f "$a" "$b"
}
echo "fashion_mnist --epochs 1 --limit $images --state-bits 4 (fp32 then 4-bit AdamW), $(nproc) cores, $(nproc) intra-op threads each"
for rep in $(seq "$reps"); do
  echo "repetition $rep: alone $(unset OMP_WAIT_POLICY; wall) s; two side by side, default policy $(side_by_side "");" \
       "passive $(side_by_side passive)"
done
