#!/usr/bin/env python3
"""The Python peers of bench_optim.cpp: one optimizer step on 2^24 fp32 parameters on the CPU, same threads.

Writes a JSON list to OUT: name, median seconds per step over repetitions, state bytes per parameter (as the
peer's own state tensors report them), or the error that kept a peer from running. (A file, not stdout: some
peers print to stdout when imported.) Called by bench/run_optim_bench.sh:  peers_optim.py THREADS OUT
"""
import json
import statistics
import sys
import time
import traceback

import torch

PARAMS = 1 << 24
REPETITIONS = 5
STEPS = 5


def state_bytes(optimizer):
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if not torch.is_tensor(value):
                continue
            inner = [getattr(value, name) for name in ("codes", "scale", "qmap") if hasattr(value, name)]
            for t in inner or [value]:
                total += t.numel() * t.element_size()
    return total / PARAMS


def measure(name, make):
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(PARAMS))
    param.grad = torch.randn(PARAMS) * 1e-2
    try:
        optimizer = make([param])
        optimizer.step()
        optimizer.step()
        times = []
        for _ in range(REPETITIONS):
            start = time.perf_counter()
            for _ in range(STEPS):
                optimizer.step()
            times.append((time.perf_counter() - start) / STEPS)
        return {"name": name, "seconds": statistics.median(times), "state_bytes_per_param": state_bytes(optimizer)}
    except Exception as error:  # a peer that cannot run here is reported, not fatal
        traceback.print_exc(file=sys.stderr)
        return {"name": name, "error": f"{type(error).__name__}: {error}".splitlines()[0][:200]}


def peers():
    yield "torch.optim.AdamW(fused=True)", lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True)

    def bnb(p):
        import bitsandbytes as bnb
        return bnb.optim.AdamW8bit(p, lr=1e-3)
    yield "bitsandbytes AdamW8bit (CPU)", bnb

    def torchao(p):
        from torchao.optim import AdamW8bit
        return AdamW8bit(p, lr=1e-3)
    yield "torchao AdamW8bit (CPU)", torchao

    def torchao4(p):
        from torchao.optim import AdamW4bit
        return AdamW4bit(p, lr=1e-3)
    yield "torchao AdamW4bit (CPU)", torchao4

    def deepspeed(p):
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        return DeepSpeedCPUAdam(p, lr=1e-3, adamw_mode=True)
    yield "DeepSpeedCPUAdam", deepspeed


def main():
    threads, out = int(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(threads)
    results = [measure(name, make) for name, make in peers()]
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
