#!/usr/bin/env bash
# Checks memsave against another LibTorch 2.x release from PyPI, by default the GPU machine's 2.11, so that a
# version difference outside src/compat.h shows here first.
#   scripts/check-torch-compat.sh [VERSION]         compiles every translation unit (no linking) against its
#                                                  headers
#   scripts/check-torch-compat.sh [VERSION] --run  builds everything against it and runs the test suite but
#                                                  its long tests on its libraries (CI's way): differences at
#                                                  run time show too, in behaviour or in what its libtorch.so
#                                                  exports
# Compiling only, C++ goes through the front end (-fsyntax-only, in a build type of its own): a version
# difference is one of declarations, which it sees, template instantiations included, without the optimizer's
# time. It writes no object, so every run compiles every unit again.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
version="2.11.0"
run=0
for arg in "$@"; do
  if [[ "$arg" == "--run" ]]; then run=1; else version="$arg"; fi
done
cache="${MEMSAVE_COMPAT_CACHE:-$root/build-compat/torch-$version}"
if [[ ! -d "$cache/torch/share/cmake/Torch" ]]; then
  mkdir -p "$cache"
  if ! "$root/.venv/bin/pip" download --quiet --no-deps "torch==$version" -d "$cache"; then
    echo "check-torch-compat: could not download torch $version; skipped" >&2
    exit 0
  fi
  (cd "$cache" && python3 -m zipfile -e torch-"$version"-*.whl . && rm -f torch-"$version"-*.whl)
fi

if ((run)); then
  # The wheel's libraries look for CUDA's beside them (nvidia/, where pip installs its dependencies): the venv's,
  # those of the newest torch, stand in. When they do not satisfy this release, it is not a fault of memsave's.
  site="$("$root/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  ln -sfn "$site/nvidia" "$cache/nvidia"
  missing=$(ldd "$cache/torch/lib/libtorch_cuda.so" | grep "not found" || true)
  if [[ -n "$missing" ]]; then
    echo "check-torch-compat: torch $version's libraries need what the venv lacks; skipped:" >&2
    echo "$missing" >&2
    exit 0
  fi
  build="$root/build-compat/run-$version"
  MEMSAVE_BUILD_DIR="$build" CMAKE_PREFIX_PATH="$cache/torch/share/cmake" "$root/scripts/build.sh"
  # The tests labelled long (60 s or more on a processor without AVX-512: the zoo's estimates, the CLI's
  # rescues, the Fashion-MNIST trainings, the consumer built from source; tests/costs.cmake) ran on the newest
  # release already; what differs between releases shows in the others, which call the same code.
  ctest --test-dir "$build" --output-on-failure --parallel "$(nproc)" --label-exclude long
  echo "check-torch-compat: built against LibTorch $version and passed every test but the long ones on its libraries"
  exit
fi

build="$root/build-compat/build-$version"
# (no precompiled header: -fsyntax-only writes none, so each unit would parse the header anyway)
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Compat -DCMAKE_CXX_FLAGS_COMPAT=-fsyntax-only \
      -DMEMSAVE_PRECOMPILE_HEADERS=OFF \
      -DCMAKE_PREFIX_PATH="$cache/torch/share/cmake" \
      >"$build.configure.log" 2>&1 || { cat "$build.configure.log"; exit 1; }
objects=$(ninja -C "$build" -t targets all | grep -oE '^[^:]+\.(cpp|cu)\.o' | sort -u)
ninja -C "$build" $objects
echo "check-torch-compat: every translation unit compiles against LibTorch $version"
