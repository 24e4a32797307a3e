"""pytest-benchmark suite: `pytest benchmarks/ --benchmark-only` (not part of the default test run).

The same shapes and the same reference functions as `fastdiag bench`; each benchmark first checks
that the timed path agrees with the float64 reference, so a fast wrong kernel cannot pass.
Set FASTDIAG_BENCH_SHAPES=grokking,gpt2-small to choose shapes (the long context needs ~4 GB on CPU).
"""
import os

import pytest
import torch

import fastdiag
from fastdiag.bench import kernel_dtypes
from fastdiag.bench_workloads import KERNEL_SHAPES
from fastdiag.core.kernels import head_stats_ref
from fastdiag.testing import random_probs

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SHAPES = os.environ.get("FASTDIAG_BENCH_SHAPES", "grokking,gpt2-small").split(",")
DTYPES = kernel_dtypes(DEVICE)


@pytest.fixture(scope="module", params=[(s, d) for s in SHAPES for d in DTYPES],
                ids=lambda p: f"{p[0]}-{str(p[1]).replace('torch.', '')}")
def probs(request):
    shape, dtype = request.param
    n, b, h, t = KERNEL_SHAPES[shape]
    return random_probs((n, b, h, t, t), dtype=dtype, seed=0, device=DEVICE)


def _sync(fn):
    def run():
        out = fn()
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        return out
    return run


def test_eager_reference(benchmark, probs):
    benchmark(_sync(lambda: head_stats_ref(probs, None, acc_dtype=torch.float32)))


def test_compiled_reference(benchmark, probs):
    compiled = torch.compile(lambda p: head_stats_ref(p, None, acc_dtype=torch.float32))
    compiled(probs)  # compile outside the timing
    benchmark(_sync(lambda: compiled(probs)))


def test_fastdiag(benchmark, probs):
    got = fastdiag.head_stats(probs)
    want = fastdiag.head_stats(probs, backend="reference")
    tol = 1e-5 if probs.dtype == torch.float32 else 1e-3
    torch.testing.assert_close(got.sync(), want.sync(), rtol=tol, atol=0)
    benchmark(_sync(lambda: fastdiag.head_stats(probs)))
