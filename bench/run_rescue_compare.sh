#!/usr/bin/env bash
# `memsave rescue` of two builds side by side: for each case, ROUNDS rounds alternating the OTHER build's CLI and
# this checkout's (build/memsave), each run --json with --steps 6. Prints a Markdown row per run: the recipe
# recommended, its step time and peak, the fastest that fit, how many candidates ran (fit or out of memory) and
# the run's wall time; then per case and build the medians of the recommended step time and the wall time.
#   bench/run_rescue_compare.sh OTHER_CLI [ROUNDS]      (after scripts/build.sh; OTHER_CLI: another build's
#                                                        memsave, e.g. the parent commit's in a worktree)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
other="${1:?usage: bench/run_rescue_compare.sh OTHER_CLI [ROUNDS]}"
rounds="${2:-3}"
cases=("--model gpt-12l --batch 2 --budget 140MiB" "--model gpt-tiny --batch 64 --budget 80MiB"
       "--model gpt-tiny --batch 64 --budget 20MiB" "--model mlp --batch 64 --budget 2GiB")
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "| case | build | recommended | its step | its peak | fastest that fits | candidates run | wall |"
echo "| --- | --- | --- | ---: | ---: | --- | ---: | ---: |"
for ((round = 1; round <= rounds; ++round)); do
  for c in "${cases[@]}"; do
    for which in other this; do
      cli="$root/build/memsave"
      [[ $which == other ]] && cli="$other"
      start=$(date +%s.%N)
      # shellcheck disable=SC2086
      "$cli" rescue $c --steps 6 --json >"$tmp/out.json"
      end=$(date +%s.%N)
      python3 - "$tmp/out.json" "$c" "$which" "$start" "$end" <<'PY' | tee -a "$tmp/rows"
import json, sys
path, case, which, start, end = sys.argv[1:]
plan = json.load(open(path))
c = plan["candidates"]
ran = sum(1 for x in c if x["status"] in ("fits", "out of memory"))
r = c[plan["recommended"]]
f = c[plan["fastest"]]
print(f"| {case} | {which} | {r['recipe']} | {r['seconds'] * 1e3:.1f} ms | {r['peak'] / 2**20:.2f} MiB | "
      f"{f['recipe']} ({f['seconds'] * 1e3:.1f} ms) | {ran} | {float(end) - float(start):.1f} s |")
PY
    done
  done
done
echo
python3 - "$tmp/rows" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    cells = [x.strip() for x in line.strip().strip("|").split("|")]
    key = (cells[0], cells[1])
    rows.setdefault(key, []).append((float(cells[3].split()[0]), float(cells[7].split()[0])))
print("| case | build | recommended step, median | wall, median |")
print("| --- | --- | ---: | ---: |")
for (case, which), v in rows.items():
    print(f"| {case} | {which} | {statistics.median(x for x, _ in v):.1f} ms | "
          f"{statistics.median(w for _, w in v):.1f} s |")
PY
