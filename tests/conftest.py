import os
import signal

# The fused kernel runs in Triton's interpreter on machines without CUDA; this must be set before
# anything imports triton.
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(min(2, torch.get_num_threads()))

# A test run started in the background (`cmd &`, nohup) inherits SIGINT ignored, and so would every
# process the signal tests start; those tests check what a user's Ctrl-C does, so give it back.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


import pytest  # noqa: E402

from fastdiag.grokking.config import RunConfig  # noqa: E402
from fastdiag.grokking.train import train_run  # noqa: E402

# A configuration small enough for CI that still shows the phenomenon: a 2-layer, 4-head, width-64
# transformer on a + b mod 31 with 70 % of the pairs for training, lr 3e-3, batch 128 (6 steps per
# epoch). Seed 0 at λ = 1 memorises at epoch ~40 and groks at ~120; at λ = 0 it memorises and is
# still far from generalising at the 300-epoch horizon. Seed and λ are left to each run.
SMALL_GROK = dict(arch="transformer", preset="custom", n_layers=2, n_heads=4, d_model=64, d_ff=256, op="+",
                  p=31, train_frac=0.7, lr=3e-3, batch_size=128, epochs=300, eval_every=10, patience=20,
                  device="cpu")


@pytest.fixture
def one_thread():
    """Training tests run one torch thread: on a shared 2-core machine two threads per process
    slow tiny models down several times."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def small_grok_runs():
    """Two real single runs of `SMALL_GROK`, seed 0, [λ = 1 (groks), λ = 0 (memorises)], trained once per
    session at one thread (about a minute) and shared by the tests that need a trained run."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [train_run(RunConfig(seed=0, weight_decay=wd, **SMALL_GROK)) for wd in (1.0, 0.0)]
    finally:
        torch.set_num_threads(previous)
