"""What the paper reproduction measures on the training side: CPU cost of a canonical epoch and its
evaluation (`fastdiag paper cost`) and s̄, σ_H of the initialised model (`fastdiag paper init`)."""
from __future__ import annotations

import time

import numpy as np
import torch

from fastdiag.grokking.config import RunConfig
from fastdiag.grokking.train import Trainer


def measure_cost(epochs: int = 4, threads: int = 1) -> dict:
    """CPU seconds (process time, so other processes on the machine do not inflate it) of a canonical
    training epoch without and with its evaluation, one torch thread as a sweep worker has; the two
    trainers alternate epoch by epoch."""
    torch.set_num_threads(threads)
    trainers = {"train only": Trainer(RunConfig(weight_decay=1.0, epochs=10_000, eval_every=10_000, seed=0,
                                                device="cpu")),
                "train + eval": Trainer(RunConfig(weight_decay=1.0, epochs=10_000, eval_every=1, seed=0,
                                                  device="cpu"))}
    for t in trainers.values():                     # warm-up epoch (allocator, first-call costs)
        t.run_epoch()
    cpu = {k: [] for k in trainers}
    for _ in range(epochs):
        for name, t in trainers.items():
            start = time.process_time()
            t.run_epoch()
            cpu[name].append(time.process_time() - start)
    steps_per_epoch = trainers["train only"].step // trainers["train only"].epoch
    train = float(np.median(cpu["train only"]))
    both = float(np.median(cpu["train + eval"]))
    return {"threads": threads, "epochs_timed": epochs, "steps_per_epoch": steps_per_epoch,
            "cpu_s_per_epoch_train": train, "cpu_ms_per_step": 1000 * train / steps_per_epoch,
            "cpu_s_per_epoch_train_eval": both, "cpu_s_per_eval": both - train,
            "torch_version": torch.__version__}


def initial_diagnostics(seeds: list[int]) -> list[dict]:
    """s̄ and σ_H of step 0 (the initialised model on its first minibatch), per seed: one epoch of a
    trainer evaluated at epoch 1 records exactly one diagnostic step (diag_every 10 ≥ 10 steps per
    epoch). The same numbers as a sweep run with eval_every 1, without training the rest."""
    torch.set_num_threads(1)       # a sweep worker's share; more threads only spin on a loaded machine
    out = []
    for seed in seeds:
        t = Trainer(RunConfig(weight_decay=1.0, epochs=1, eval_every=1, seed=seed, device="cpu"))
        row = t.run_epoch()
        if t.step > t.cfg.diag_every:                  # more than step 0 would be merged into the row
            raise ValueError(f"epoch 1 has {t.step} steps > diag_every {t.cfg.diag_every}: not step 0 alone")
        out.append({"seed": seed, "s_bar": row["s_bar"], "sigma_h": row["sigma_h"]})
    return out


