"""CPU cost of a Mamba training step against the transformer's, robust to a loaded machine.

    python benchmarks/mamba_step.py [--before COMMIT] [--rounds 9]

One torch thread; each round times one training step (batch 512, T 3, AdamW) of every model in
rotating order and reads the process CPU time (``time.process_time``), which other processes on a
shared machine do not inflate the way they inflate wall time. Then, one fresh process per model, the
peak resident memory of five training steps. ``--before COMMIT`` adds the Mamba as it was at that
commit (models/mamba.py read with ``git show``), e.g. 0d19b91.
"""
from __future__ import annotations

import argparse
import importlib.util
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fastdiag.grokking.config import RunConfig
from fastdiag.grokking.build import build_model
from fastdiag.models import count_parameters
from history import source_at

MODELS = {"transformer": dict(), "transformer-0.96M": dict(preset="custom", d_ff=648), "mamba": dict(arch="mamba")}


def build(name: str, before: str | None):
    torch.manual_seed(0)
    if name == "mamba-before":
        source, _ = source_at(before, "models/mamba.py")
        path = Path(tempfile.mkdtemp()) / "mamba_before.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location("mamba_before", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["mamba_before"] = module   # dataclasses look their module up
        spec.loader.exec_module(module)
        return module.MambaLM(module.MambaConfig())
    return build_model(RunConfig(**MODELS[name]), device="cpu")


def step_fn(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.98), weight_decay=1.0)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 97, (512, 3), generator=g)
    x[:, 2] = 97
    y = torch.randint(0, 97, (512,), generator=g)

    def step():
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def peak_memory(name: str, before: str | None) -> None:
    step = step_fn(build(name, before))
    start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(5):
        step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"{peak / 1024:.0f} {(peak - start) / 1024:.0f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default=None, help="also time models/mamba.py as of this commit")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--memory-of", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.memory_of:
        return peak_memory(args.memory_of, args.before)
    names = list(MODELS) + (["mamba-before"] if args.before else [])
    memory = {}   # first, while this process is small: a child's peak RSS starts from its parent's at fork
    for n in names:
        memory[n] = subprocess.run([sys.executable, __file__, "--memory-of", n] + (["--before", args.before] if args.before else []),
                                   capture_output=True, text=True, check=True).stdout.split()
    models = {n: build(n, args.before) for n in names}
    steps = {n: step_fn(m) for n, m in models.items()}
    for step in steps.values():
        step()
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.process_time()
            steps[n]()
            cpu[n].append(1e3 * (time.process_time() - t0))
    print(f"{'model':<18} {'params':>9} {'CPU ms/step':>12} {'x transformer':>14} {'peak RSS MiB':>13} {'step adds MiB':>14}")
    for n in names:
        ratio = statistics.median(a / b for a, b in zip(cpu[n], cpu["transformer"]))
        out = memory[n]
        print(f"{n:<18} {count_parameters(models[n]):>9,} {statistics.median(cpu[n]):>12.1f} {ratio:>14.2f} "
              f"{out[0]:>13} {out[1]:>14}")


if __name__ == "__main__":
    main()
