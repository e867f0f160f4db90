#!/usr/bin/env python3
"""Merges bench_optim's Google Benchmark JSON and peers_optim.py's JSON into the table of RESULTS-optim.md."""
import json
import sys

FLOOR_BYTES = {  # bytes moved per parameter by an ideal step: fp32 Adam reads p, g, m, v and writes p, m, v
    "fp32": 28,
    "8bit": 16,   # reads p, g (4 + 4), m, v codes (1 + 1); writes p (4), m, v codes (1 + 1); absmax aside
    "4bit": 14,   # as 8-bit with half a byte per code
}


def main(cpp_path, peers_path, command):
    cpp = json.load(open(cpp_path))
    peers = json.load(open(peers_path))
    rows = {}
    probes = {}
    for b in cpp["benchmarks"]:
        if b.get("aggregate_name") != "median":
            continue
        name = b["run_name"].split("/")[0]
        seconds = b["real_time"] / 1e3  # ms
        if name.startswith("BM_Bandwidth"):
            probes[name[len("BM_Bandwidth"):]] = b["bytes_moved"] / seconds
            continue
        rows[name] = {"seconds": seconds, "state": b["state_bytes_per_param"], "floor": b["floor_bytes_per_param"],
                      "transient": b.get("transient_bytes_per_param")}
    labels = {
        "BM_TorchOptimAdam": "LibTorch torch::optim::Adam (C++)",
        "BM_TorchFusedAdamW": "LibTorch at::_fused_adamw_ (C++)",
        "BM_MemsaveAdamW32": "memsave AdamW8bit, fp32 state (fused)",
        "BM_MemsaveAdamW8bit": "memsave AdamW8bit, 8-bit state",
        "BM_MemsaveAdamW4bit": "memsave AdamW4bit, 4-bit state",
    }
    sgd_labels = {
        "BM_TorchOptimSGD": "LibTorch torch::optim::SGD, momentum 0.9 (C++)",
        "BM_MemsaveSGD32": "memsave SGD8bit, fp32 state (fused)",
        "BM_MemsaveSGD8bit": "memsave SGD8bit, 8-bit state",
        "BM_MemsaveSGD4bit": "memsave SGD4bit, 4-bit state",
    }
    bf16_labels = {
        "BM_TorchOptimAdamWBf16": "LibTorch torch::optim::AdamW, bf16 state (C++)",
        "BM_MemsaveAdamW8bitBf16": "memsave AdamW8bit, 8-bit state, rounding to nearest",
        "BM_MemsaveAdamW8bitBf16Stochastic": "memsave AdamW8bit, 8-bit state, bf16_stochastic_round",
    }
    channels_last_labels = {
        "BM_TorchOptimAdamWChannelsLast": "LibTorch torch::optim::AdamW (C++)",
        "BM_MemsaveAdamW8bitChannelsLast": "memsave AdamW8bit, 8-bit state",
    }
    table = [(labels[k], v["seconds"], v["state"], v["floor"], "meter", v["transient"])
             for k, v in rows.items() if k in labels]
    for peer in peers:
        if "error" in peer:
            table.append((peer["name"], None, None, None, peer["error"], None))
            continue
        state = peer["state_bytes_per_param"]
        floor = FLOOR_BYTES["4bit"] if state < 1.5 else FLOOR_BYTES["8bit"] if state < 4 else FLOOR_BYTES["fp32"]
        table.append((peer["name"], peer["seconds"], peer["state_bytes_per_param"], floor, "its state tensors",
                      None))
    bandwidth = max(probes.values())
    params = 1 << 24
    print(f"Command: `{command}`\n")
    print("2^24 parameters in one tensor, 2 threads, median of 5 repetitions. Memory bandwidth, the best of "
          "the probes over 256 MiB (LibTorch's sum, copy_ and add_, and a loop of the fused Adam step's seven "
          "streams without its arithmetic): " + ", ".join(f"{k.lower()} {v / 1e9:.1f} GB/s" for k, v in
                                                          probes.items()) +
          f"; the floor divides the bytes an ideal step moves by {bandwidth / 1e9:.1f} GB/s.\n")
    if "BM_TorchOptimAdam" in rows:
        print_adam(table, rows["BM_TorchOptimAdam"]["seconds"], bandwidth, params)
    print_table("SGD with momentum (fp32 state: reads p, g, buffer and writes p, buffer, 20 B per parameter; "
                "8-bit 14 B; 4-bit 13 B):", sgd_labels, "BM_TorchOptimSGD", "torch::optim::SGD", rows, bandwidth,
                params)
    print_table("AdamW on bf16 parameters and gradients, no fp32 copy (LibTorch's state in bf16: reads p, g, m, "
                "v and writes p, m, v, 14 B per parameter; 8-bit state 10 B):", bf16_labels,
                "BM_TorchOptimAdamWBf16", "torch::optim::AdamW", rows, bandwidth, params)
    print_table("AdamW on a convolution weight in channels_last, 1024 x 256 x 8 x 8, fp32:", channels_last_labels,
                "BM_TorchOptimAdamWChannelsLast", "torch::optim::AdamW", rows, bandwidth, params)


def print_adam(table, base, bandwidth, params):
    # (a Python peer's transient bytes are not counted: the meter sees LibTorch's allocator in this process only)
    print("| optimizer | step time | vs torch::optim::Adam | state B/param | step's transient B/param | counted by | "
          "floor B/param | floor time | fraction of floor |")
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |")
    for name, seconds, state, floor, source, transient in table:
        if seconds is None:
            print(f"| {name} | did not run | | | | {source} | | | |")
            continue
        floor_time = floor * params / bandwidth
        shown = "" if transient is None else f"{transient:.4f}"
        print(f"| {name} | {seconds * 1e3:.2f} ms | {base / seconds:.2f}× | {state:.4f} | {shown} | {source} | "
              f"{floor} | {floor_time * 1e3:.2f} ms | {floor_time / seconds:.2f} |")


def print_table(title, labels, base_name, base_label, rows, bandwidth, params):
    """A table of the rows named in `labels`, as ratios to `base_name`'s step time (when it ran)."""
    present = [(labels[k], rows[k]) for k in labels if k in rows]
    if not present or base_name not in rows:
        return
    base = rows[base_name]["seconds"]
    print(f"\n{title}\n")
    print(f"| optimizer | step time | vs {base_label} | state B/param | step's transient B/param | counted by | "
          "floor B/param | floor time | fraction of floor |")
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |")
    for name, v in present:
        floor_time = v["floor"] * params / bandwidth
        transient = "" if v["transient"] is None else f"{v['transient']:.4f}"
        print(f"| {name} | {v['seconds'] * 1e3:.2f} ms | {base / v['seconds']:.2f}× | {v['state']:.4f} | "
              f"{transient} | meter | {v['floor']:.0f} | {floor_time * 1e3:.2f} ms | "
              f"{floor_time / v['seconds']:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
