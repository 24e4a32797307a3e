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


@pytest.fixture
def one_thread():
    """Training tests run one torch thread: on a shared 2-core machine two threads per process
    slow tiny models down several times."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
