#!/usr/bin/env python3
"""Turns the JSON lines of bench_checkpoint.cpp and peers_checkpoint.py into the markdown table of
bench/RESULTS-checkpoint.md:  checkpoint_report.py RESULTS.jsonl COMMAND"""
import collections
import json
import statistics
import sys

rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    r = json.loads(line)
    rows[(r["model"], r["batch"], r["impl"], r["setting"])].append(r)


def median(key, runs):
    return statistics.median(r[key] for r in runs)


print(f"Command: `{sys.argv[2]}`; {len(next(iter(rows.values())))} invocations, median step time of each, then the "
      "median over invocations. Activation peak: the step's peak minus what was in use when it began "
      "(parameters and gradients), from memsave's meter in both columns (exact bytes; the spread over invocations "
      "is shown when there is one).\n")
print("| model | batch | implementation | setting | activation peak | vs none | step time | vs none | "
      "extra time / forward time | time vs torch |")
print("| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
for (model, batch, impl, setting), runs in rows.items():
    # Each checkpointed setting against the same precision without checkpointing; "bf16" against fp32.
    base = rows[(model, batch, impl, "bf16" if setting.startswith("bf16,") else "none")]
    # The module's Checkpoint blocks are the plan of "every layer", reached another way.
    peer = rows.get((model, batch, "torch.utils.checkpoint",
                     "every layer" if setting == "module's Checkpoint blocks" else setting))
    act = [r["activations"] for r in runs]
    act_text = f"{median('activations', runs) / 2**20:.1f} MiB"
    if max(act) != min(act):
        act_text += f" ({min(act) / 2**20:.1f}–{max(act) / 2**20:.1f})"
    t, t0, f0 = median("seconds", runs), median("seconds", base), median("forward_seconds", base)
    versus = f"{t / median('seconds', peer):.2f}×" if impl == "memsave" and peer else ""
    extra = f"{(t - t0) / f0:.2f}" if setting not in ("none", "bf16") else ""
    print(f"| {model} | {batch} | {impl} | {setting} | {act_text} | "
          f"{median('activations', runs) / median('activations', base):.2f}× | {t:.3f} s | {t / t0:.2f}× | "
          f"{extra} | {versus} |")
