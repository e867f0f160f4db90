#!/usr/bin/env python3
"""The Python peer of bench_checkpoint.cpp: torch.utils.checkpoint on the same architectures (the zoo's
gpt-12l and ResNet-50), the same settings (torch.autocast for the bf16 ones), batch and threads, and one more:
the sqrt(n) segments cut where memsave's checkpoint_sequential cuts them. Memory is counted by memsave's own
meter, loaded into this process with ctypes (build/bench/libmemsave_pymeter.so installs the
counting CPU allocator in the LibTorch this Python imported), so both columns come from the same counter.

Prints one JSON object per line, as the C++ benchmark. Called by bench/run_checkpoint_bench.sh:
    peers_checkpoint.py METER_SO THREADS STEPS
"""
import ctypes
import json
import math
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

meter = ctypes.CDLL(sys.argv[1])
meter.memsave_cpu_current.restype = ctypes.c_int64
meter.memsave_cpu_peak.restype = ctypes.c_int64
meter.memsave_install_meter()
torch.set_num_threads(int(sys.argv[2]))
STEPS = int(sys.argv[3])


class AttentionResidual(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.c_attn = nn.Linear(width, 3 * width)
        self.attn_proj = nn.Linear(width, width)

    def forward(self, x):
        b, t, w = x.shape
        qkv = self.c_attn(self.ln1(x)).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        return x + self.attn_proj(y.transpose(1, 2).reshape(b, t, w))


class MLPResidual(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.ln2 = nn.LayerNorm(width)
        self.c_fc = nn.Linear(width, 4 * width)
        self.mlp_proj = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln2(x)), approximate="tanh"))


class Embedding(nn.Module):
    def __init__(self, vocab, context, width):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)

    def forward(self, tokens):
        return self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))


class TiedHead(nn.Module):
    def __init__(self, embedding):
        super().__init__()
        self.embedding = [embedding]  # not registered: the weight is counted once

    def forward(self, x):
        return x @ self.embedding[0].wte.weight.t()


def gpt(vocab=512, context=256, layers=12, heads=4, width=256):
    emb = Embedding(vocab, context, width)
    elements = [("embedding", emb)]
    for i in range(layers):
        elements += [(f"attn{i}", AttentionResidual(width, heads)), (f"mlp{i}", MLPResidual(width))]
    elements += [("ln_f", nn.LayerNorm(width)), ("head", TiedHead(emb))]
    return elements


class Bottleneck(nn.Module):
    def __init__(self, cin, planes, stride):
        super().__init__()
        out = planes * 4
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.down = None
        if stride != 1 or cin != out:
            self.down = nn.Sequential(nn.Conv2d(cin, out, 1, stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (self.down(x) if self.down is not None else x))


def resnet50(classes=1000):
    elements = [("stem", nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                       nn.MaxPool2d(3, 2, 1)))]
    cin = 64
    for stage, blocks in enumerate([3, 4, 6, 3]):
        planes = 64 << stage
        for i in range(blocks):
            elements.append((f"layer{stage + 1}_{i}", Bottleneck(cin, planes, 2 if stage > 0 and i == 0 else 1)))
            cin = planes * 4
    elements.append(("head", nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))))
    return elements


def policy_keeps(model, name):
    if model.startswith("gpt"):
        return not name.startswith("mlp")
    return not (name.startswith("layer1") or name.startswith("layer2"))


def make_forward(model, elements, setting):
    modules = [m for _, m in elements]
    n = len(modules)
    net = nn.Sequential(*modules)
    if setting in ("none", "bf16"):
        return net, net
    if setting == "sqrt(n) segments":
        segments = round(math.sqrt(n))
        return net, lambda x: checkpoint_sequential(net, segments, x, use_reentrant=False)
    if setting == "sqrt(n) segments, memsave's cut":
        # checkpoint_sequential cuts pieces 1..k-1 of n // k elements and gives the last the rest; memsave's
        # cuts piece i at [i * n // k, (i + 1) * n // k). Its cut here tells the cut from the implementation.
        segments = round(math.sqrt(n))
        bounds = [i * n // segments for i in range(segments + 1)]
        pieces = [nn.Sequential(*modules[bounds[i]:bounds[i + 1]]) for i in range(segments)]

        def forward_cut(x):
            for i, piece in enumerate(pieces):
                x = checkpoint(piece, x, use_reentrant=False) if i + 1 < segments else piece(x)
            return x

        return net, forward_cut
    if setting in ("every layer", "bf16, every layer"):
        recompute = [True] * (n - 1) + [False]  # as checkpoint_sequential: the last one is needed at once
    else:
        recompute = [not policy_keeps(model, name) for name, _ in elements]

    def forward(x):
        for m, r in zip(modules, recompute):
            x = checkpoint(m, x, use_reentrant=False) if r else m(x)
        return x

    return net, forward


def run(model, batch, setting):
    torch.manual_seed(0)
    if model.startswith("gpt"):
        elements = gpt()
        x = torch.randint(512, (batch, 256))
        target = torch.randint(512, (batch, 256))
        loss_fn = lambda out: F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
    else:
        elements = resnet50()
        x = torch.randn(batch, 3, 224, 224)
        target = torch.randint(1000, (batch,))
        loss_fn = lambda out: F.cross_entropy(out, target)
    net, forward = make_forward(model, elements, setting)
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    times, forward_times, activations = [], [], 0
    for step in range(STEPS + 1):
        for p in net.parameters():
            p.grad.zero_()
        start_bytes = meter.memsave_cpu_current()
        meter.memsave_cpu_reset_peak()
        start = time.perf_counter()
        with torch.autocast("cpu", torch.bfloat16, enabled=setting.startswith("bf16")):
            loss = loss_fn(forward(x))
        forward_end = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        activations = meter.memsave_cpu_peak() - start_bytes
        if step > 0:
            times.append(end - start)
            forward_times.append(forward_end - start)
    return activations, statistics.median(times), statistics.median(forward_times)


for model, batch in [("gpt-12l", 8), ("resnet50", 8)]:
    for setting in ["none", "every layer", "sqrt(n) segments", "sqrt(n) segments, memsave's cut",
                    "per-layer policy", "bf16", "bf16, every layer"]:
        activations, seconds, forward_seconds = run(model, batch, setting)
        print(json.dumps({"impl": "torch.utils.checkpoint", "model": model, "batch": batch, "setting": setting,
                          "activations": activations, "seconds": seconds, "forward_seconds": forward_seconds,
                          "threads": torch.get_num_threads()}), flush=True)
