"""One attention layer's Q/K statistics on CPU beside the layer's own SDPA forward: the native kernel
(`qk_stats_cpu`, what attach runs on CPU) and the PyTorch path it falls back to (`qk_stats_torch`,
CPU chunk `CPU_CHUNK_BYTES`), at HF GPT-2's shape in `attach_host_cost.py` ([4, 4, 256, 64] causal
float32, Q and K as head views of one QKV projection). Milliseconds per call, the lower quartile of
15 calls, three alternated rounds; at 1 thread in the thread's CPU time (what a loaded machine moves
least), else the wall clock.

    python benchmarks/qk_torch_cost.py [--threads N]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

from fastdiag.core.kernels import qk_stats_cpu
from fastdiag.core.kernels.qk_stats_torch import qk_stats_torch
from fastdiag.core.qk import CPU_CHUNK_BYTES


def per_call_ms(fn, clock, calls: int = 15) -> float:
    fn()
    times = []
    for _ in range(calls):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return sorted(times)[len(times) // 4] * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error("--threads: expected a positive number of threads")
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    b, h, t, d = 4, 4, 256, 64
    qkv = torch.randn(b, t, 3, h, d, generator=torch.Generator().manual_seed(0)) * 0.5
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    cases = {"SDPA forward": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
             "qk_stats_cpu": lambda: qk_stats_cpu.qk_stats_cpu(q, k, None, True, d ** -0.5, None, None, False),
             "qk_stats_torch": lambda: qk_stats_torch(q, k, None, True, d ** -0.5, None, None, CPU_CHUNK_BYTES, False)}
    if qk_stats_cpu.unavailable_reason() is not None:
        del cases["qk_stats_cpu"]
        print(f"qk_stats_cpu: {qk_stats_cpu.unavailable_reason()}")
    load = os.getloadavg()[0]
    ms = {name: [] for name in cases}
    for _ in range(3):
        for name, fn in cases.items():
            ms[name].append(per_call_ms(fn, clock))
    print(f"[{b}, {h}, {t}, {d}] causal float32, {args.threads} thread(s), "
          f"{'thread CPU time' if clock is time.thread_time else 'wall clock'}, load {load:.1f}-{os.getloadavg()[0]:.1f}")
    for name, values in ms.items():
        print(f"  {name:15s} " + " / ".join(f"{x:.2f}" for x in values) + " ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
