#!/usr/bin/env bash
# Installs what memsave needs on Debian 12 / Ubuntu: the Debian packages, and a project-local virtual
# environment (.venv) with PyPI's torch, whose LibTorch the build uses. Idempotent; quick when all is there.
#   MEMSAVE_TORCH   pip requirement for torch (default: torch, the newest)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

packages=(build-essential cmake ninja-build git python3 libgtest-dev googletest libbenchmark-dev
          nlohmann-json3-dev libcli11-dev zlib1g-dev dataset-fashion-mnist gnuplot-nox)
if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then packages+=(python3-venv); fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    echo "memsave set-up needs these Debian packages; run as root:" >&2
    echo "  apt-get update && apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
  echo "memsave set-up: installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

venv="$root/.venv"
if ! "$venv/bin/python" -c 'import torch' >/dev/null 2>&1; then
  echo "memsave set-up: creating $venv with ${MEMSAVE_TORCH:-torch} (a few GiB)"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --upgrade pip
  "$venv/bin/pip" install --quiet "${MEMSAVE_TORCH:-torch}" numpy
fi
