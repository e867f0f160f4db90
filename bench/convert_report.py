#!/usr/bin/env python3
"""bench_convert's Google Benchmark JSON as the table of RESULTS-convert.md."""
import json
import sys

LABELS = {
    "BM_TorchSaveLoad": "LibTorch: save to memory, load (AdamW -> AdamW)",
    "BM_CopyStateFp32ToFp32": "copy_state AdamW -> AdamW (fp32)",
    "BM_CopyStateFp32To8bit": "copy_state AdamW -> AdamW8bit",
    "BM_CopyStateFp32To4bit": "copy_state AdamW -> AdamW4bit",
    "BM_CopyState8bitToFp32": "copy_state AdamW8bit -> AdamW",
}


def main(path, command):
    runs = json.load(open(path))["benchmarks"]
    median = {b["run_name"].split("/")[0]: b for b in runs if b.get("aggregate_name") == "median"}
    probe = median["BM_BandwidthCopy"]
    bandwidth = probe["bytes_per_element"] * probe["elements"] / (probe["real_time"] / 1e3)
    base = median["BM_TorchSaveLoad"]["real_time"]
    print(f"Command: `{command}`\n")
    print("AdamW state of 2^24 fp32 parameters in one tensor (after one step), 2 threads, median of 5 "
          f"repetitions. Copy bandwidth (LibTorch's copy_ over 256 MiB arrays): {bandwidth / 1e9:.1f} GB/s; the "
          "floor divides the bytes a conversion must read and write by it.\n")
    print("| conversion | time | vs LibTorch save + load | floor B/param | floor time | fraction of floor |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, label in LABELS.items():
        b = median[name]
        ms = b["real_time"]
        floor_ms = b["floor_bytes_per_param"] * b["params"] / bandwidth * 1e3
        print(f"| {label} | {ms:.1f} ms | {base / ms:.2f}× | {b['floor_bytes_per_param']:.2f} | {floor_ms:.1f} ms | "
              f"{floor_ms / ms:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
