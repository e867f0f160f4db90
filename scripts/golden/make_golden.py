#!/usr/bin/env python3
"""Golden values for memsave's tests, computed by the reference implementations (bitsandbytes, torchao, PyTorch).

Run from the repository root with the project's environment:
    .venv/bin/pip install bitsandbytes torchao && .venv/bin/python scripts/golden/make_golden.py
It rewrites tests/data/golden.txt: one record a line, "name v1 v2 ...", floats in hexadecimal (exact).
The tests read that file; they never run Python.
"""
import sys

import torch

N = 256       # elements of the optimizer trajectories
STEPS = 100   # steps of each trajectory
RECORDED = (1, 10, 100)
LATE_START = 20000  # Adam's steps counted from here after the trajectory: 1 - beta2^t rounds to 1 in float
LATE_STEPS = 10


def hexes(t):
    return " ".join(float(x).hex() for x in t.reshape(-1).tolist())


def initial_params():
    i = torch.arange(N)
    return ((i * 31) % 101 - 50).float() / 50


def gradient(step):
    """Exactly reproducible in float32 anywhere: integer pattern / 1000 times a per-element power of ten."""
    i = torch.arange(N)
    ints = ((i * 7919 + step * 104729) % 2001 - 1000).float()
    scale = torch.tensor([1.0, 0.1, 0.01, 0.001, 0.0001], dtype=torch.float32)[i % 5]
    return ints / 1000 * scale


OPTIMIZERS = {
    "adam": lambda p: torch.optim.Adam([p], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, foreach=False),
    "adam_l2": lambda p: torch.optim.Adam([p], lr=1e-2, weight_decay=0.01, foreach=False),
    "adamw": lambda p: torch.optim.AdamW([p], lr=1e-2, weight_decay=0.01, foreach=False),
    "sgd_momentum": lambda p: torch.optim.SGD([p], lr=0.05, momentum=0.9, weight_decay=1e-3, foreach=False),
    "sgd_nesterov": lambda p: torch.optim.SGD([p], lr=0.05, momentum=0.9, nesterov=True, foreach=False),
}


SCALER_STEPS = 12
SCALER_INJECT = {2: float("inf"), 5: float("nan"), 6: float("inf")}  # step -> value put into a gradient


def scaler_sequence():
    """torch.amp.GradScaler on the CPU over 12 steps of SGD with momentum, with infs and a NaN injected."""
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0, 0.5]))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, foreach=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_factor=2.0, backoff_factor=0.5,
                                  growth_interval=3)
    scales, trackers, stepped, params = [], [], [], []
    for step in range(1, SCALER_STEPS + 1):
        opt.zero_grad()
        loss = (p * p).sum() * 0.5 * step
        scaler.scale(loss).backward()
        if step in SCALER_INJECT:
            p.grad[1] = SCALER_INJECT[step]
        scaler.step(opt)
        found = sum(v.item() for v in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values())
        stepped.append(0.0 if found else 1.0)
        scaler.update()
        scales.append(scaler.get_scale())
        trackers.append(float(scaler._get_growth_tracker()))
        params.extend(p.detach().tolist())
    return scales, trackers, stepped, params


QUAD_N = 4096        # the quadratic of tests/kernels/test_optim_cpu.cpp (run_quadratic)
QUAD_RECORDED = (100, 300)
QUAD_EVERY = 8       # parameters recorded: every 8th


def quadratic_adam4bit():
    """torchao's Adam4bit (block 128) on sum_i c_i (x_i - 1)^2 with curvatures over two decades per block."""
    from torchao.optim import Adam4bit

    i = torch.arange(QUAD_N)
    curvature = torch.pow(10.0, (i % 5).float() * 0.5 - 1.0)
    p = torch.nn.Parameter(((i * 37) % 101).float() / 25.0 - 2.0)
    opt = Adam4bit([p], lr=5e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, block_size=128)
    records = []
    for step in range(1, max(QUAD_RECORDED) + 1):
        p.grad = 2 * curvature * (p.detach() - 1)
        opt.step()
        if step in QUAD_RECORDED:
            records.append((step, p.detach()[::QUAD_EVERY].clone()))
    return records


def main():
    import bitsandbytes.functional as F
    import torchao
    from torchao.optim import subclass_4bit

    lines = [f"# made by scripts/golden/make_golden.py: torch {torch.__version__}, "
             f"bitsandbytes {sys.modules['bitsandbytes'].__version__}, torchao {torchao.__version__}"]
    lines.append("codebook.signed " + hexes(F.create_dynamic_map(signed=True)))
    lines.append("codebook.unsigned " + hexes(F.create_dynamic_map(signed=False)))
    # torchao's AdamW4bit books, as the float32 tensors its optimizer state holds
    lines.append("codebook4.signed " + hexes(torch.tensor(subclass_4bit.get_qmap_signed(), dtype=torch.float32)))
    lines.append("codebook4.unsigned " + hexes(torch.tensor(subclass_4bit.get_qmap_unsigned(),
                                                            dtype=torch.float32)))
    lines.append("trajectory.initial " + hexes(initial_params()))
    for name, make in OPTIMIZERS.items():
        p = torch.nn.Parameter(initial_params())
        opt = make(p)
        for step in range(1, STEPS + 1):
            p.grad = gradient(step)
            opt.step()
            if step in RECORDED:
                lines.append(f"{name}.params.{step} " + hexes(p.detach()))
        state = opt.state[p]
        for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
            if key in state:
                lines.append(f"{name}.{key}.{STEPS} " + hexes(state[key]))
        if "exp_avg_sq" in state:
            # late in training: the same state, its step count moved to LATE_START, LATE_STEPS more steps
            state["step"] = torch.tensor(float(LATE_START))
            for step in range(1, LATE_STEPS + 1):
                p.grad = gradient(STEPS + step)
                opt.step()
            lines.append(f"{name}.late.params " + hexes(p.detach()))
            for key in ("exp_avg", "exp_avg_sq"):
                lines.append(f"{name}.late.{key} " + hexes(state[key]))
    for step, params in quadratic_adam4bit():
        lines.append(f"torchao_adam4bit.quadratic.params.{step} " + hexes(params))
    scales, trackers, stepped, params = scaler_sequence()
    lines.append("scaler.scale " + hexes(torch.tensor(scales)))
    lines.append("scaler.tracker " + hexes(torch.tensor(trackers)))
    lines.append("scaler.stepped " + hexes(torch.tensor(stepped)))
    lines.append("scaler.params " + hexes(torch.tensor(params)))
    with open("tests/data/golden.txt", "w") as out:
        out.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
