#!/usr/bin/env bash
# Installs what memsave needs on Debian 12 / Ubuntu: the Debian packages, and a project-local virtual
# environment (.venv) with PyPI's torch, whose LibTorch the build uses. Idempotent; quick when all is there.
#   MEMSAVE_TORCH   pip requirement for torch (default: torch, the newest)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

packages=(build-essential cmake ninja-build git python3 libgtest-dev googletest libbenchmark-dev
          nlohmann-json3-dev libcli11-dev zlib1g-dev dataset-fashion-mnist gnuplot-nox)
if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then packages+=(python3-venv); fi
# shellcheck source=debian-packages.sh
source "$root/scripts/debian-packages.sh"
install_debian_packages "memsave set-up" "${packages[@]}"

venv="$root/.venv"
if ! "$venv/bin/python" -c 'import torch' >/dev/null 2>&1; then
  echo "memsave set-up: creating $venv with ${MEMSAVE_TORCH:-torch} (a few GiB)"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --upgrade pip
  "$venv/bin/pip" install --quiet "${MEMSAVE_TORCH:-torch}" numpy
fi
