"""Overhead of attach on a nanoGPT-style SDPA training step (CPU, one thread): blocks of 10 steps
alternate none / every=10 / every=1 on one model; prints the median step and the two ratios.

    python benchmarks/attach_step_overhead.py [blocks]
"""
import statistics
import sys
import time

import torch

import fastdiag
from fastdiag.testing import NanoGPT

torch.set_num_threads(1)
torch.manual_seed(0)
model = NanoGPT(vocab=64, d_model=128, n_heads=4, n_layers=4, seq_len=128)
x = torch.randint(0, 64, (8, 128))
opt = torch.optim.SGD(model.parameters(), lr=0.0)


def steps(n):
    for _ in range(n):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


times = {0: [], 10: [], 1: []}
steps(3)
for block in range(int(sys.argv[1]) if len(sys.argv) > 1 else 7):
    for every in (0, 10, 1):
        mon = fastdiag.attach(model, every=every) if every else None
        t0 = time.perf_counter(); steps(10); times[every].append((time.perf_counter() - t0) / 10)
        if mon:
            mon.detach()
base = statistics.median(times[0])
print(f"{fastdiag.__file__}: step {base*1e3:.1f} ms; every=10 x{statistics.median(times[10])/base:.3f}; every=1 x{statistics.median(times[1])/base:.3f}")
