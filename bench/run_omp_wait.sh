#!/usr/bin/env bash
# What OpenMP's wait policy and thread count do to LibTorch processes that share a machine's cores, as
# `ctest --parallel` runs them: one job alone, then two side by side under the default policy, under
# OMP_WAIT_POLICY=passive, and under that policy with one intra-op thread each (what tests/CMakeLists.txt sets for
# every LibTorch test). Prints each run's wall time.
#   bench/run_omp_wait.sh [REPETITIONS] [JOB]   (after scripts/build.sh; default 3 repetitions)
#   JOB: fashion (default; a Fashion-MNIST training of 10,000 images, fp32 then 4-bit AdamW) or estimate (the
#        test that predicts every candidate of resnet18's checklist: many small parallel regions)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
reps="${1:-3}"
case "${2:-fashion}" in
  fashion) job=("$root/build/examples/fashion_mnist" --epochs 1 --limit 10000 --state-bits 4) ;;
  estimate) job=("$root/build/tests/memsave_tests"
                 --gtest_filter=Estimate/EstimateOfTheZoo.PredictsEveryCandidateOfTheChecklist/resnet18) ;;
  *) echo "usage: run_omp_wait.sh [REPETITIONS] [fashion|estimate]" >&2; exit 2 ;;
esac
wall() { { /usr/bin/time -f %e "${job[@]}" 2>&1 >/dev/null || true; } | tail -1; }  # seconds, any result
side_by_side() {  # POLICY (empty: the default) THREADS (empty: LibTorch's default): two at once, their seconds
  local a b; a=$(mktemp); b=$(mktemp)
  (
    unset OMP_WAIT_POLICY OMP_NUM_THREADS
    if [[ -n "$1" ]]; then export OMP_WAIT_POLICY="$1"; fi
    if [[ -n "$2" ]]; then export OMP_NUM_THREADS="$2"; fi
    wall >"$a" &
    wall >"$b"
    wait
  )
  echo "$(cat "$a") s and $(cat "$b") s"
  rm -f "$a" "$b"
}
echo "${job[*]#$root/}: $(nproc) cores"
for rep in $(seq "$reps"); do
  echo "repetition $rep: alone $(unset OMP_WAIT_POLICY OMP_NUM_THREADS; wall) s; two side by side:" \
       "default policy $(side_by_side "" "");" "passive $(side_by_side passive "");" \
       "passive, one thread each $(side_by_side passive 1)"
done
