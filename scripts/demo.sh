#!/usr/bin/env bash
# Set-up, build, then the main job: the OOM rescue on a built-in model with a budget that forces the checklist
# (gpt-tiny at batch 64 needs about 170 MiB; the budget is 80 MiB), which prints the table of candidates and the
# recommended recipe. Arguments replace the defaults and go to `memsave rescue`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
"$root/scripts/build.sh" >/dev/null
if (($# == 0)); then set -- --model gpt-tiny --batch 64 --budget 80MiB; fi
exec "$root/build/memsave" rescue "$@"
