"""Checks that need a CUDA device (run by benchmarks/gpu_check.sh on a lent GPU; skipped elsewhere)."""
import pytest
import torch

import fastdiag
from fastdiag.testing import random_probs, random_query_mask

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _probs(dtype=torch.bfloat16):
    mask = random_query_mask((2, 4, 257), seed=1, device="cuda")
    probs = random_probs((2, 4, 12, 257, 257), dtype=dtype, seed=1, device="cuda")
    return probs, mask


def test_triton_op_under_compile_fullgraph_matches_reference():
    probs, mask = _probs()
    fn = torch.compile(lambda p, m: fastdiag.head_stats(p, m).sync(), fullgraph=True)
    ref = fastdiag.head_stats(probs, mask, backend="reference").sync()
    torch.testing.assert_close(fn(probs, mask), ref, rtol=1e-3, atol=1e-6)


def test_triton_op_is_captured_by_cuda_graph():
    probs, mask = _probs(torch.float16)
    out = {}

    def step():
        out["stats"] = fastdiag.head_stats(probs, mask, backend="triton")

    step()  # compile the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    probs.copy_(random_probs(tuple(probs.shape), dtype=probs.dtype, seed=2, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    want = fastdiag.head_stats(probs, mask, backend="reference")
    torch.testing.assert_close(out["stats"].gram.double(), want.gram, rtol=1e-3, atol=1e-6)


def test_head_stats_has_no_host_sync():
    probs, mask = _probs()
    fastdiag.head_stats(probs, mask)  # warm-up: compile the kernel
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        s = fastdiag.head_stats(probs, mask)
        values = (s.sync(), s.entropy_spread(), s.participation_ratio(), s.valid())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(v.is_cuda for v in values)


def test_training_step_with_attach_has_no_host_sync():
    from fastdiag.testing import NanoGPT

    model = NanoGPT(vocab=128, d_model=128, n_heads=4, n_layers=2, seq_len=64).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True, foreach=True)
    batch = torch.randint(0, 128, (4, 64), device="cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(batch).flatten(0, 1), batch.flatten())
        loss.backward()
        opt.step()

    monitor = fastdiag.attach(model, every=1)
    for _ in range(2):  # warm-up: kernels compiled, optimizer state allocated
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    history = monitor.history()
    monitor.detach()
    assert len(history) >= 3


@pytest.mark.parametrize("autocast", [None, torch.bfloat16, torch.float16])
def test_attach_in_training_precision_matches_the_float64_reference(autocast):
    """attach on a CUDA model trained in fp32 or under autocast: the recorded s̄ and σ_H equal those of the
    float64 reference backend on the same forward pass (the Q and K the model really produced)."""
    from fastdiag.testing import NanoGPT

    torch.manual_seed(0)
    model = NanoGPT(vocab=128, d_model=128, n_heads=4, n_layers=2, seq_len=128).cuda()
    batch = torch.randint(0, 128, (4, 128), device="cuda")
    records = {}
    for backend in ("auto", "reference"):
        with fastdiag.attach(model, every=1, backend=backend) as monitor:
            with torch.autocast("cuda", dtype=autocast or torch.float32, enabled=autocast is not None):
                model(batch)
            records[backend] = monitor.history()[-1]
    tol = 1e-5 if autocast is None else 1e-3
    for key, want in records["reference"].items():
        if isinstance(want, float) and key.startswith(("s_bar", "sigma_h", "sync/", "spread/")):
            got = records["auto"][key]
            assert abs(got - want) <= tol * max(abs(want), 1e-3), (key, got, want)


@pytest.mark.parametrize("precision", ["highest", "high"])
def test_torch_backend_on_cuda_keeps_float32_accuracy(precision):
    """head_stats(backend="torch") on a CUDA tensor: one chunk's Gram is a cuBLAS product over ~10^6
    columns, computed in float64 (an fp32 chain lost 2e-5..6e-5), and a TF32 setting does not reach it."""
    probs = random_probs((1, 2, 12, 512, 512), dtype=torch.float32, seed=4, device="cuda")
    want = fastdiag.head_stats(probs.double(), backend="reference")
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        got = fastdiag.head_stats(probs, backend="torch")
    finally:
        torch.set_float32_matmul_precision(saved)
    for a, b in ((got.gram, want.gram), (got.entropy_sum, want.entropy_sum)):
        assert ((a.double() - b).abs().max() / b.abs().max()).item() <= 1e-5
