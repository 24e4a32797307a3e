"""Q/K statistics on a CUDA device (run by benchmarks/gpu_check.sh on a lent GPU; skipped elsewhere):
the fused kernels against the float64 reference, `sdpa_with_stats` bit-identical to
F.scaled_dot_product_attention with the backend op's own LSE, one node under torch.compile, no sync."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from fastdiag.qk import _attention_with_lse, qk_head_stats, sdpa_with_stats
from fastdiag.testing import TOLERANCE, rel_err

DEVICE = "cuda"   # where the kernels run (the tests' logic was checked on "cpu" under TRITON_INTERPRET=1)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]



def _qkv(b, h, hk, t, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, h, t, d, device="cuda", generator=g, dtype=dtype)
    k = torch.randn(b, hk, t, d, device="cuda", generator=g, dtype=dtype)
    v = torch.randn(b, hk, t, d, device="cuda", generator=g, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("h,hk,d", [(12, 12, 64), (8, 2, 128), (4, 1, 24), (32, 32, 128)])
@pytest.mark.parametrize("mask_kind", ["causal", "bool", "additive"])
def test_triton_matches_reference(dtype, h, hk, d, mask_kind):
    q, k, _ = _qkv(2, h, hk, 257, d, dtype)
    mask, causal = None, mask_kind == "causal"
    if mask_kind == "bool":
        mask = torch.rand(2, 1, 257, 257, device="cuda") > 0.3
        mask[0, 0, 5] = False
    elif mask_kind == "additive":
        mask = torch.randn(2, h, 257, 257, device="cuda", dtype=dtype)
        mask[1, :, 7] = torch.finfo(dtype).min
    ref = qk_head_stats(q, k, mask, causal, backend="reference")
    got = qk_head_stats(q, k, mask, causal, backend="triton")
    tol = TOLERANCE[dtype]
    assert rel_err(got.gram, ref.gram) <= tol
    assert rel_err(got.entropy_sum, ref.entropy_sum) <= tol
    assert torch.equal(got.rows, ref.rows) and got.invalid.item() == 0
    assert rel_err(got.sync(), ref.sync()) <= tol


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_with_stats_bit_identical_and_uses_the_op_lse(dtype, causal):
    q, k, v = _qkv(2, 12, 12, 256, 64, dtype)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    want_grads = torch.autograd.grad(want.float().square().sum(), (q, k, v))
    got, stats = sdpa_with_stats(q, k, v, is_causal=causal)
    got_grads = torch.autograd.grad(got.float().square().sum(), (q, k, v))
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads))
    _, lse = _attention_with_lse(q, k, v, None, 0.0, causal, None, False)
    choice = SDPBackend(torch._fused_sdp_choice(q, k, v, None, 0.0, causal, scale=None, enable_gqa=False))
    # flash, efficient or cuDNN (torch 2.11's choice on an H200) hand over their LSE here
    assert lse is not None, f"{choice.name} should hand over its LSE here"
    ref = qk_head_stats(q, k, None, causal, backend="reference")
    assert rel_err(stats.gram, ref.gram) <= 1e-3 and stats.invalid.item() == 0


def test_sdpa_with_stats_mask_fallback_is_bit_identical():
    q, k, v = _qkv(2, 8, 8, 200, 64, torch.float16)
    mask = torch.rand(2, 1, 200, 200, device="cuda") > 0.2
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    got, stats = sdpa_with_stats(q, k, v, attn_mask=mask)
    assert torch.equal(got, want)
    ref = qk_head_stats(q, k, mask, backend="reference")
    assert rel_err(stats.gram, ref.gram) <= 1e-3


def test_op_under_compile_fullgraph():
    q, k, _ = _qkv(2, 12, 12, 128, 64, torch.bfloat16)
    fn = torch.compile(lambda a, b: qk_head_stats(a, b, is_causal=True).sync(), fullgraph=True)
    ref = qk_head_stats(q, k, None, True, backend="reference").sync()
    torch.testing.assert_close(fn(q, k), ref, rtol=1e-3, atol=1e-6)


def test_no_host_sync():
    q, k, v = _qkv(2, 12, 12, 128, 64, torch.bfloat16)
    mask = torch.rand(2, 1, 1, 128, device="cuda") > 0.2
    qk_head_stats(q, k, mask, is_causal=True)          # warm-up: compile the kernels
    sdpa_with_stats(q, k, v, is_causal=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        s = qk_head_stats(q, k, mask, is_causal=True)
        _, s2 = sdpa_with_stats(q, k, v, is_causal=True)
        values = (s.sync(), s2.entropy_spread())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(v.is_cuda for v in values)


@pytest.mark.parametrize("precision", ["high", "medium"])
def test_fp32_is_exact_under_a_tf32_matmul_setting(precision):
    """float32 pass 2 runs on cuBLAS (no Triton tile fits): a user's TF32 setting must not reach it."""
    q, k, _ = _qkv(2, 12, 12, 300, 64, torch.float32, seed=3)
    ref = qk_head_stats(q, k, None, True, backend="reference")
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        got = qk_head_stats(q, k, None, True)
        after = torch.get_float32_matmul_precision()
    finally:
        torch.set_float32_matmul_precision(saved)
    assert after == precision                      # the user's setting is left as it was
    assert rel_err(got.gram, ref.gram) <= TOLERANCE[torch.float32]
    assert rel_err(got.entropy_sum, ref.entropy_sum) <= TOLERANCE[torch.float32]
    assert got.invalid.item() == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
def test_rows_whose_products_cancel_are_named_or_exact_on_tensor_cores(dtype, d):
    """The in-kernel bound for 16-bit rows whose products cancel (`row_entropy_triton.CANCEL_ROUNDING`,
    c = 4) was set from float64 emulation of float32 accumulation; tensor cores align each step's terms to
    the largest and truncate, which emulation cannot show. On the device: every such row is named
    (``invalid`` > 0) or its heads' entropies, σ_l and s_l are within the 16-bit target of float64. A
    failure here means c is too small for this GPU's accumulation (benchmarks/cancelling_rows_triton.py)."""
    from fastdiag.core.kernels.qk_stats_ref import qk_stats_ref
    from fastdiag.core.stats import HeadStats
    from fastdiag.testing import cancelling_qk
    target = TOLERANCE[torch.float16]
    for size in (10.0, 30.0, 100.0, 300.0):
        for seed in (0, 1):
            q, k, scale = cancelling_qk(seed, size, d=d, dtype=dtype)
            mask = torch.ones(q.shape[0], 1, 1, k.shape[2], dtype=torch.bool)
            mask[1:, ..., -3:] = False
            want = HeadStats(*qk_stats_ref(q.double(), k.double(), mask, False, scale))
            got = qk_head_stats(q.to(DEVICE), k.to(DEVICE), mask.to(DEVICE), False, scale, backend="triton")
            if got.invalid.item() > 0:
                continue
            got = HeadStats(got.gram.cpu(), got.entropy_sum.cpu(), got.rows.cpu(), got.invalid.cpu())
            rel = ((got.entropy_sum - want.entropy_sum).abs() / want.entropy_sum.abs()).max().item()
            sigma = want.entropy_spread().item()
            assert rel <= target, (size, seed, rel)
            assert abs(got.entropy_spread().item() - sigma) <= target * max(sigma, 1e-6), (size, seed)
            assert abs(got.sync().item() - want.sync().item()) <= target * abs(want.sync().item()), (size, seed)
