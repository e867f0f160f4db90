#!/usr/bin/env bash
# Set-up, build, then every test (unit tests, CLI tests, consumer projects).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
"$root/scripts/build.sh"
ctest --test-dir "$root/build" --output-on-failure --parallel "$(nproc)" "$@"
