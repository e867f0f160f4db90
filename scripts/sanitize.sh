#!/usr/bin/env bash
# The whole library (LibTorch glue included) and its tests under a sanitizer, against the uninstrumented
# LibTorch of .venv, CUDA off. Too slow for CI (CI runs the torch-free kernels under the sanitizers): run it
# after changing the glue's memory handling or its threads. Any report stops the test that made it.
#   scripts/sanitize.sh            AddressSanitizer + UndefinedBehaviorSanitizer (build-asan/): the unit tests,
#                                  then the CLI tests and two examples (extra arguments go to that ctest);
#                                  a clean build ~15 min on 2 cores, the tests ~5 min
#   scripts/sanitize.sh --thread   ThreadSanitizer (build-tsan-glue/): the unit tests in one process (extra
#                                  arguments go to it, e.g. --gtest_filter='Offload*'); a clean build ~6 min,
#                                  the tests ~2 min
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
prefix="$("$root/.venv/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
configure_and_build() {  # build directory, sanitizer flags
  cmake -S "$root" -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_PREFIX_PATH="$prefix" \
        -DMEMSAVE_WITH_CUDA=OFF -DMEMSAVE_BUILD_BENCH=OFF -DCMAKE_CXX_FLAGS="$2 -fno-omit-frame-pointer" \
        -DCMAKE_EXE_LINKER_FLAGS="$2" -DCMAKE_SHARED_LINKER_FLAGS="$2" >/dev/null
  cmake --build "$1" --parallel "$(nproc)"
}

if [[ "${1:-}" == "--thread" ]]; then
  shift
  build="$root/build-tsan-glue"
  configure_and_build "$build" "-fsanitize=thread"
  # One OpenMP thread: ThreadSanitizer cannot see the barriers of LibTorch's OpenMP runtime (futexes in an
  # uninstrumented library), so it reports every parallel loop's hand-over. What remains are the threads of
  # memsave's own (step_during_backward's host thread) against the backward's, which is what this checks; the
  # data the OpenMP workers of a parallel loop would touch is the data its thread touches alone here.
  # The two tests that ask for several intra-op threads themselves (tests/intra_op_threads.h) would report
  # just that hand-over, so they are left out (a --gtest_filter among the arguments replaces this one).
  export OMP_NUM_THREADS=1 TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1"
  "$build/tests/memsave_tests" \
    --gtest_filter='-Threads.EveryCpuPathGivesTheSameBitsOnOneIntraOpThreadAsOnSeveral:Meter.CountsLibTorchIntraOpThreads' \
    "$@"
  exit
fi

build="$root/build-asan"
configure_and_build "$build" "-fsanitize=address,undefined"
# LibTorch keeps some allocations to the end of the process on purpose: no leak check.
export ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# The unit tests in one process (a fresh process each adds LibTorch's start-up under ASan, ~1 s per test),
# then the CLI tests and two examples through ctest, each in its own process as the CLI runs.
"$build/tests/memsave_tests"
ctest --test-dir "$build" -R '^Cli|example\.wrap|example\.rescue' --output-on-failure --parallel "$(nproc)" "$@"
