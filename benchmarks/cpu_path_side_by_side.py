"""The CPU path against its previous version and torch.compile of the reference, side by side.

    python benchmarks/cpu_path_side_by_side.py SHAPE [REPEATS] [THREADS] [DTYPE] [OLD_COMMIT]

One process; per repeat, in this order: `head_stats_torch` as of OLD_COMMIT (read with `git show`),
the current chunked pass, the current pass with ``causal=True``, and `torch.compile` of the float32
reference. Prints medians and the median of the per-repeat ratios (issue 14)."""
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

from fastdiag.bench import KERNEL_SHAPES
from fastdiag.kernels.head_stats_ref import head_stats_ref, head_stats_torch
from fastdiag.testing import random_probs


def old_module(commit: str) -> types.ModuleType:
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(["git", "show", f"{commit}:kernels/head_stats_ref.py"], cwd=root,
                            capture_output=True, text=True, check=True).stdout
    module = types.ModuleType("old_head_stats_ref")
    exec(compile(source, f"{commit}:kernels/head_stats_ref.py", "exec"), module.__dict__)
    return module


def main(shape="gpt2-small", repeats="5", threads="1", dtype="float32", commit="0d19b91"):
    torch.set_num_threads(int(threads))
    old = old_module(commit)
    n, b, h, t = KERNEL_SHAPES[shape]
    p = random_probs((n, b, h, t, t), seed=0, dtype=getattr(torch, dtype))
    compiled = torch.compile(lambda x: head_stats_ref(x, None, acc_dtype=torch.float32))
    fns = {"old": lambda: old.head_stats_torch(p), "new": lambda: head_stats_torch(p),
           "new+causal": lambda: head_stats_torch(p, causal=True), "compiled-ref": lambda: compiled(p)}
    for f in fns.values():
        f()
    ts = {k: [] for k in fns}
    for _ in range(int(repeats)):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            ts[k].append((time.perf_counter() - t0) * 1e3)

    def ratio(a, c):
        return statistics.median(x / y for x, y in zip(ts[a], ts[c]))

    print(f"{shape} {dtype} threads={threads} repeats={repeats} median ms: "
          + ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in ts.items())
          + f" | old/new {ratio('old', 'new'):.2f}, old/new+causal {ratio('old', 'new+causal'):.2f}, "
            f"compiled/new {ratio('compiled-ref', 'new'):.2f}")


if __name__ == "__main__":
    main(*sys.argv[1:])
