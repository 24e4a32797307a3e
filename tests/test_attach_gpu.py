"""attach on a CUDA device (run by benchmarks/gpu_check.sh on a lent GPU; skipped elsewhere): a measured
step never syncs with the host (torch's own sync debug mode raises on any), and runs under
torch.compile(mode="reduce-overhead") and inside a user's CUDA graph capture."""
import pytest
import torch

import fastdiag
from fastdiag.testing import NanoGPT

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _nanogpt():
    torch.manual_seed(0)
    model = NanoGPT(vocab=64, d_model=64, n_heads=4, n_layers=2, seq_len=64).cuda()
    x = torch.randint(0, 64, (4, 64), device="cuda")
    return model, x


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_measured_steps_never_sync(backend):
    model, x = _nanogpt()
    monitor = fastdiag.attach(model, every=1, backend=backend)
    try:
        model(x).float().square().mean().backward()     # the careful first pass (may compile kernels)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                model(x).float().square().mean().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert monitor.latest()["s_bar"] == monitor.latest()["s_bar"]
    finally:
        monitor.detach()


def test_reduce_overhead_compile_measures_each_step():
    model, x = _nanogpt()
    reference = fastdiag.attach(model, every=1, backend="reference")
    model(x)
    want = reference.latest()["s_bar"]
    reference.detach()
    monitor = fastdiag.attach(model, every=1)
    compiled = torch.compile(model, mode="reduce-overhead")
    try:
        for _ in range(4):
            compiled(x)
        got = monitor.history()
        assert len(got) == 4
        assert all(abs(r["s_bar"] - want) < 1e-3 for r in got)
    finally:
        monitor.detach()


def test_measured_step_in_a_users_cuda_graph():
    model, x = _nanogpt()
    monitor = fastdiag.attach(model, every=1, keep_records=False)
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                model(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, model(x))
        stats = monitor.latest_stats()
        assert stats and all(torch.isfinite(s.gram).all() for s in stats.values())
    finally:
        monitor.detach()
