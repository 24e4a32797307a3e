"""Size of a run's checkpoint and the time of one save (fastdiag.grokking.checkpoint), for the canonical
transformer and the README's small one, after one epoch of training, one CPU thread:

    python benchmarks/checkpoint_cost.py

The README's "Long runs resume" paragraph quotes these numbers."""
import os
import statistics
import tempfile
import time

import torch

from fastdiag.grokking.checkpoint import Checkpointer
from fastdiag.grokking.config import RunConfig
from fastdiag.grokking.train import Trainer

SMALL = dict(preset="custom", n_layers=2, n_heads=4, d_model=64, d_ff=256, p=31, train_frac=0.7, lr=3e-3,
             batch_size=128)


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        for name, fields in (("canonical", {}), ("small", SMALL)):
            cfg = RunConfig(device="cpu", epochs=2, **fields)
            trainer = Trainer(cfg)
            trainer.run_epoch()
            checkpoint = Checkpointer(os.path.join(tmp, f"{name}.ckpt.pt"), cfg.run_id(), every_epochs=1)
            seconds = []
            for _ in range(7):
                started = time.perf_counter()
                checkpoint.save(trainer.state(), trainer.epoch)
                seconds.append(time.perf_counter() - started)
            n = sum(p.numel() for p in trainer.model.parameters())
            print(f"{name}: {n:,} parameters, checkpoint {os.path.getsize(checkpoint.path) / 2**20:.2f} MiB, "
                  f"one save {statistics.median(seconds) * 1000:.0f} ms median of 7 (min {min(seconds) * 1000:.0f})")


if __name__ == "__main__":
    main()
