#!/usr/bin/env bash
# The whole library (LibTorch glue included) and its unit and CLI tests under AddressSanitizer +
# UndefinedBehaviorSanitizer, against the uninstrumented LibTorch of .venv, CUDA off. Too slow for CI (a clean
# build takes ~15 min on 2 cores, the tests ~5 min; CI runs the torch-free kernels under the sanitizers): run it
# after changing the glue's memory handling. Any report stops the test that made it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
prefix="$("$root/.venv/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
flags="-fsanitize=address,undefined -fno-omit-frame-pointer"
cmake -S "$root" -B "$root/build-asan" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_PREFIX_PATH="$prefix" \
      -DMEMSAVE_WITH_CUDA=OFF -DMEMSAVE_BUILD_BENCH=OFF -DCMAKE_CXX_FLAGS="$flags" \
      -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" \
      -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined" >/dev/null
cmake --build "$root/build-asan" --parallel "$(nproc)"
# LibTorch keeps some allocations to the end of the process on purpose: no leak check.
export ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# The unit tests in one process (a fresh process each adds LibTorch's start-up under ASan, ~1 s per test),
# then the CLI tests and two examples through ctest, each in its own process as the CLI runs.
"$root/build-asan/tests/memsave_tests"
ctest --test-dir "$root/build-asan" -R '^Cli|example\.wrap|example\.rescue' --output-on-failure \
      --parallel "$(nproc)" "$@"
