"""Training-step overhead of `attach` (pytest-benchmark form of `fastdiag bench`'s step table)."""
import copy

import pytest
import torch

import fastdiag
from fastdiag.bench import _training_step, step_workloads

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
WORKLOADS = step_workloads(DEVICE)


@pytest.mark.parametrize("every", [None, 10, 1], ids=["no-fastdiag", "every10", "every1"])
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_training_step(benchmark, name, every):
    model, batch, targets, last_only = WORKLOADS[name]()
    model = copy.deepcopy(model)
    monitor = fastdiag.attach(model, every=every) if every else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def ten_steps():
        for _ in range(10):
            _training_step(model, batch, targets, opt, last_only)
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()

    ten_steps()  # warm-up
    benchmark.pedantic(ten_steps, rounds=10, iterations=1)
    if monitor:
        assert monitor.history()
        monitor.detach()
