#!/usr/bin/env bash
# The torch-free kernels and their tests on 64-bit Arm (the host processor of Grace Hopper machines, where an
# offloaded optimizer's state is stepped): cross-compiled with Debian's g++-aarch64-linux-gnu (build-aarch64/,
# cmake/aarch64-linux-gnu.cmake) and run under qemu-user. Checks that the code builds without the x86
# kernels and that the baseline kernels give the bits the tests expect there; says nothing of Arm's speed.
# Left out: the emulated CUDA tests (they still compile; under qemu they take 15 s each, and what they check,
# the CUDA kernels, CI checks on this machine's processor) and the emulator's death test (a death test
# re-executes the binary, which the kernel cannot run without qemu registered with binfmt_misc). Arguments
# go to ctest (e.g. -R Quantize).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# shellcheck source=debian-packages.sh
source "$root/scripts/debian-packages.sh"
install_debian_packages check-aarch64 cmake ninja-build g++-aarch64-linux-gnu qemu-user googletest

build="$root/build-aarch64"
cmake -S "$root" -B "$build" -G Ninja -DMEMSAVE_KERNELS_ONLY=ON -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_TOOLCHAIN_FILE="$root/cmake/aarch64-linux-gnu.cmake" \
      -DMEMSAVE_GTEST_SOURCE_DIR=/usr/src/googletest >/dev/null
cmake --build "$build" --parallel "$(nproc)" >/dev/null
ctest --test-dir "$build" --output-on-failure --parallel "$(nproc)" -E 'EmulatedCuda|SimtDeathTest' "$@"
