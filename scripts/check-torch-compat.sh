#!/usr/bin/env bash
# Compiles every memsave translation unit (no linking) against the headers of another LibTorch 2.x release from
# PyPI, by default the GPU machine's 2.11, so a version difference outside src/compat.h shows here first.
# C++ goes through the front end only (-fsyntax-only, in a build type of its own): a version difference is one of
# declarations, which it sees, template instantiations included, without the optimizer's time. It writes no
# object, so every run compiles every unit again.
#   scripts/check-torch-compat.sh [VERSION]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
version="${1:-2.11.0}"
cache="${MEMSAVE_COMPAT_CACHE:-$root/build-compat/torch-$version}"
build="$root/build-compat/build-$version"
if [[ ! -d "$cache/torch/share/cmake/Torch" ]]; then
  mkdir -p "$cache"
  if ! "$root/.venv/bin/pip" download --quiet --no-deps "torch==$version" -d "$cache"; then
    echo "check-torch-compat: could not download torch $version; skipped" >&2
    exit 0
  fi
  (cd "$cache" && python3 -m zipfile -e torch-"$version"-*.whl . && rm -f torch-"$version"-*.whl)
fi
# (no precompiled header: -fsyntax-only writes none, so each unit would parse the header anyway)
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Compat -DCMAKE_CXX_FLAGS_COMPAT=-fsyntax-only \
      -DMEMSAVE_PRECOMPILE_HEADERS=OFF \
      -DCMAKE_PREFIX_PATH="$cache/torch/share/cmake" \
      >"$build.configure.log" 2>&1 || { cat "$build.configure.log"; exit 1; }
objects=$(ninja -C "$build" -t targets all | grep -oE '^[^:]+\.(cpp|cu)\.o' | sort -u)
ninja -C "$build" $objects
echo "check-torch-compat: every translation unit compiles against LibTorch $version"
