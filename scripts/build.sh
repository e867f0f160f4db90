#!/usr/bin/env bash
# Configures and builds memsave in build/ against the LibTorch of .venv (or of CMAKE_PREFIX_PATH when set).
#   MEMSAVE_BUILD_DIR   build directory (default: build)
#   extra arguments go to the CMake configure step, e.g. -DMEMSAVE_WITH_CUDA=OFF
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${MEMSAVE_BUILD_DIR:-$root/build}"
prefix="${CMAKE_PREFIX_PATH:-$("$root/.venv/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null)}"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [[ ! -f "$build/CMakeCache.txt" ]]; then
  cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" "$@"
elif (($#)); then
  cmake "$build" "$@"
fi
cmake --build "$build" --parallel "$(nproc)"
