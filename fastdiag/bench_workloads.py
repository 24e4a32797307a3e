"""What `fastdiag bench` measures: its kernel shapes and its sweep workloads (fastdiag/bench.py times
them). Torch-free, so that `fastdiag bench --help`, which lists them, loads no torch."""
from __future__ import annotations

# (name, [N, B, H, T]) — N stacked problems (layers) in one call.
KERNEL_SHAPES = {
    "grokking": (4, 512, 8, 3),
    "gpt2-small": (1, 8, 12, 1024),
    "long-context": (1, 1, 16, 4096),
}


# The target model, and the small model of the README sweep (where per-op overhead matters more).
ENSEMBLE_WORKLOADS: dict[str, dict] = {
    "canonical": dict(epochs=3),
    "small": dict(preset="custom", n_layers=2, n_heads=4, d_model=64, d_ff=256, p=31, train_frac=0.7,
                  lr=3e-3, batch_size=128, epochs=30),
    # the small Mamba of tests/test_ensemble.py (2 layers, d 32, expand 4, d_state 16; 42 k parameters)
    "mamba-small": dict(arch="mamba", n_layers=2, d_model=32, p=31, train_frac=0.7, lr=3e-3, batch_size=128,
                        epochs=30),
}
