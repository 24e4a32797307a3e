"""The CPU path against its previous version and torch.compile of the reference, side by side.

    python benchmarks/cpu_path_side_by_side.py SHAPE [REPEATS] [THREADS] [DTYPE] [OLD_COMMIT] [INPUT]

One process; per repeat, in this order: `head_stats_torch` as of OLD_COMMIT (read with `git show`),
the current chunked pass, the current pass with ``causal=True`` (causal input only), and
`torch.compile` of the float32 reference. INPUT is ``causal`` (the benchmark's P, as in `fastdiag
bench`) or ``dense`` (no zero key: nothing to skip). Each sample repeats a call until it has run
≥ 50 ms (grokking calls take ~1 ms). Prints, per method, the median wall time and the median CPU time
of this process (on a machine shared with other jobs, CPU time is the steadier of the two), then the
median over repeats of the per-repeat ratios, by CPU time and (in brackets) by wall time."""
import statistics
import sys
import time
import types

import torch

from fastdiag.bench_workloads import KERNEL_SHAPES
from fastdiag.core.kernels.head_stats_ref import head_stats_ref
from fastdiag.core.kernels.head_stats_torch import head_stats_torch
from fastdiag.testing import random_probs
from history import source_at


def old_module(commit: str) -> types.ModuleType:
    source, path = source_at(commit, "kernels/head_stats_ref.py")
    module = types.ModuleType("old_head_stats_ref")
    exec(compile(source, f"{commit}:{path}", "exec"), module.__dict__)
    return module


def sample(fn, calls: int) -> tuple[float, float]:
    """(wall ms, CPU ms) per call, over ``calls`` back-to-back calls."""
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - w0) * 1e3 / calls, (time.process_time() - c0) * 1e3 / calls


def main(shape="gpt2-small", repeats="5", threads="1", dtype="float32", commit="0d19b91", data="causal"):
    if data not in ("causal", "dense"):
        raise SystemExit(f"INPUT: expected causal or dense, got {data!r}")
    torch.set_num_threads(int(threads))
    old = old_module(commit)
    n, b, h, t = KERNEL_SHAPES[shape]
    p = random_probs((n, b, h, t, t), seed=0, dtype=getattr(torch, dtype), causal=data == "causal")
    compiled = torch.compile(lambda x: head_stats_ref(x, None, acc_dtype=torch.float32))
    fns = {"old": lambda: old.head_stats_torch(p), "new": lambda: head_stats_torch(p)}
    if data == "causal":
        fns["new+causal"] = lambda: head_stats_torch(p, causal=True)
    fns["compiled-ref"] = lambda: compiled(p)
    calls = {}
    for k, f in fns.items():
        f()
        calls[k] = max(1, int(50 / max(sample(f, 1)[0], 1e-3)))
    wall = {k: [] for k in fns}
    cpu = {k: [] for k in fns}
    for _ in range(int(repeats)):
        for k, f in fns.items():
            w, c = sample(f, calls[k])
            wall[k].append(w)
            cpu[k].append(c)

    def ratio(times, a, c):
        return statistics.median(x / y for x, y in zip(times[a], times[c]))

    pairs = [("old", "new")] + ([("old", "new+causal")] if "new+causal" in fns else []) + [("compiled-ref", "new")]
    if "new+causal" in fns:
        pairs.append(("compiled-ref", "new+causal"))
    print(f"{shape} {dtype} {data} threads={threads} repeats={repeats} median wall / CPU ms: "
          + ", ".join(f"{k} {statistics.median(wall[k]):.2f} / {statistics.median(cpu[k]):.2f}" for k in fns)
          + " | CPU-time ratios (wall): "
          + ", ".join(f"{a}/{c} {ratio(cpu, a, c):.2f} ({ratio(wall, a, c):.2f})" for a, c in pairs))


if __name__ == "__main__":
    main(*sys.argv[1:])
