#!/usr/bin/env bash
# How often `memsave rescue` names the same recipe, quiet and beside a busy process: runs the README's main job
# RUNS times (--json), with no load and then with LOAD processes spinning beside it, and counts per condition
# which recipe it recommended (the earliest within the tie of the fastest) and which was fastest (the rule
# before the tie: the fastest alone), the timing noise it measured (RescuePlan::noise) and the fastest's lead
# over the next candidate outside the tie (where the noise reaches the lead, the table output ends with a note
# that another run may recommend otherwise). Prints a Markdown table for bench/RESULTS-rescue.md.
#   bench/run_rescue_stability.sh [RUNS] [LOAD] [rescue arguments ...]   (after scripts/build.sh)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
runs="${1:-5}"
load="${2:-1}"
shift $(($# < 2 ? $# : 2))
if (($# == 0)); then set -- --model gpt-tiny --batch 64 --budget 80MiB; fi
tmp="$(mktemp -d)"
hogs=()
cleanup() {
  ((${#hogs[@]})) && kill "${hogs[@]}" 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT
for condition in quiet loaded; do
  if [[ $condition == loaded ]]; then
    for ((h = 0; h < load; ++h)); do
      (while :; do :; done) &
      hogs+=($!)
    done
  fi
  for ((i = 0; i < runs; ++i)); do
    "$root/build/memsave" rescue "$@" --json >"$tmp/$condition-$i.json"
  done
done
"$root/.venv/bin/python" - "$tmp" "$runs" "$load" "bench/run_rescue_stability.sh $runs $load $*" <<'EOF'
import collections, json, sys
tmp, runs, load, command = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
print(f"Command: `{command}`\n")
print("| condition | rule | recipes named (of %d runs) | timing noise per run | lead per run | runs with the note (noise >= lead) |" % runs)
print("| --- | --- | --- | --- | --- | ---: |")
for condition in ("quiet", "loaded"):
    picks = {"recommended (tie)": collections.Counter(), "fastest (no tie)": collections.Counter()}
    noise, lead = [], []
    for i in range(runs):
        j = json.load(open(f"{tmp}/{condition}-{i}.json"))
        noise.append(j["noise"])
        lead.append(j["lead"])
        for rule, key in (("recommended (tie)", "recommended"), ("fastest (no tie)", "fastest")):
            picks[rule][j["candidates"][j[key]]["recipe"] if j[key] is not None else "none"] += 1
    name = condition if condition == "quiet" else f"beside {load} spinning process(es)"
    spread = " / ".join(f"{100 * n:.0f}%" for n in noise)
    leads = " / ".join("-" if l is None else f"{100 * l:.0f}%" for l in lead)
    noted = sum(l is not None and n >= l for n, l in zip(noise, lead))
    for rule, counter in picks.items():
        print(f"| {name} | {rule} | " + "; ".join(f"{r}: {n}" for r, n in counter.most_common()) +
              f" | {spread} | {leads} | {noted} |")
EOF
