#!/usr/bin/env bash
# Set-up, build, then the main job: the memory walk-through of one training step on the default model.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
"$root/scripts/build.sh" >/dev/null
exec "$root/build/memsave" report "$@"
