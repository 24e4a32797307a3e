"""Seconds per epoch of a grokking run under different torch/OpenMP thread settings, side by side.

Each measurement is a fresh process (OpenMP reads OMP_WAIT_POLICY when torch loads it), the settings
alternate round by round, and each line carries the 1-minute load average at its start, so a setting
is never compared with another measured in a different minute of a shared machine.

    python benchmarks/threads_side_by_side.py --rounds 3 --epochs 3             # canonical (make demo)
    python benchmarks/threads_side_by_side.py --small --rounds 3 --epochs 20    # README sweep's model
    python benchmarks/threads_side_by_side.py --settings 2,2p,2s10000 --rounds 3 --epochs 3
    SETTINGS: 1 (one thread), 2 (two threads, OpenMP's default waiting), 2p (two threads, passive waiting),
    2sN (two threads, the wait policy unset and a bounded spin: GOMP_SPINCOUNT=N, KMP_BLOCKTIME from it),
    2c (two threads, the environment `fastdiag run` gives itself: fastdiag.cli's default)

One warm-up epoch is not timed; the median epoch of the rest is reported, then per setting the median
over rounds and the ratio to the first setting.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time
import torch
from fastdiag.grokking.config import RunConfig
from fastdiag.grokking.train import Trainer
threads, epochs, fields = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
torch.set_num_threads(threads)
trainer = Trainer(RunConfig(**fields, epochs=epochs + 1, stop_at_grok=False, device="cpu"), None)
trainer.run_epoch()                      # warm-up: allocator, oneDNN primitives
times = []
for _ in range(epochs):
    t0 = time.perf_counter()
    trainer.run_epoch()
    times.append(time.perf_counter() - t0)
print(json.dumps(times))
"""

SMALL = dict(preset="custom", n_layers=2, n_heads=4, d_model=64, d_ff=256, p=31, train_frac=0.7, lr=3e-3,
             batch_size=128, eval_every=10)


def measure(setting: str, epochs: int, fields: dict) -> tuple[float, float]:
    """(median seconds per epoch, load average at the start) of one fresh process."""
    threads = int(setting[0])
    env = dict(os.environ)
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"):
        env.pop(name, None)
    if setting.endswith("p"):
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    elif setting[1:2] == "s":
        env["GOMP_SPINCOUNT"] = setting[2:]
    elif setting.endswith("c"):
        from fastdiag.cli.threads import wait_policy_env
        env.update(wait_policy_env(env))
    load = os.getloadavg()[0]
    out = subprocess.run([sys.executable, "-c", CHILD, str(threads), str(epochs), json.dumps(fields)],
                         env=env, check=True, capture_output=True, text=True).stdout
    return statistics.median(json.loads(out.strip().splitlines()[-1])), load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", default="1,2,2p")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs per process")
    parser.add_argument("--small", action="store_true", help="the README sweep's 2x4x64 model, p 31")
    args = parser.parse_args()
    settings = args.settings.split(",")
    fields = SMALL if args.small else {}
    results: dict[str, list[float]] = {s: [] for s in settings}
    print(f"# {'small' if args.small else 'canonical'} model, {args.epochs} timed epochs per process, "
          f"{time.strftime('%H:%M:%S', time.gmtime())} UTC, {os.cpu_count()} cores", flush=True)
    for r in range(args.rounds):
        order = settings if r % 2 == 0 else settings[::-1]
        for s in order:
            sec, load = measure(s, args.epochs, fields)
            results[s].append(sec)
            print(f"round {r}  threads {s:>3}  {sec:8.3f} s/epoch  load {load:5.2f}", flush=True)
    base = statistics.median(results[settings[0]])
    for s in settings:
        med = statistics.median(results[s])
        print(f"threads {s:>3}: median {med:.3f} s/epoch  ({med / base:.2f}x of threads {settings[0]})")
    print(f"# load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
