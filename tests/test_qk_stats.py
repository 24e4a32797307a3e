"""Head statistics straight from Q and K (fastdiag/core/qk.py) against the float64 reference.

The Triton kernels run in the interpreter here (TRITON_INTERPRET=1) and on a GPU in test_gpu.py.
Inputs live inside buffers padded with +inf, so an out-of-bounds read turns into inf/NaN and fails.
"""
import itertools
import os
import zlib

import pytest

import torch
import torch.nn.functional as F

from fastdiag.core.diagnostics import triton_available
from fastdiag.core.kernels.qk_stats_ref import qk_stats_ref
from fastdiag.qk import qk_head_stats, sdpa_with_stats, valid_rows
from fastdiag.core.stats import HeadStats
from fastdiag.testing import TOLERANCE, in_inf_padding, rel_err

# "torch" on CPU runs the native kernel (qk_stats_cpu.c); "torch-pure" the PyTorch path it falls back to
BACKENDS = ["torch", "torch-pure", "triton"]


@pytest.fixture(autouse=True)
def _pure_torch_path(request, monkeypatch):
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("backend") == "torch-pure":
        monkeypatch.setenv("FASTDIAG_NATIVE", "0")


def _check_backend(backend) -> str:
    """The backend name to pass (``torch-pure`` is ``torch`` with the native kernel off)."""
    if backend == "triton" and not (triton_available() and os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("the Triton backend on CPU tensors needs TRITON_INTERPRET=1 (CUDA: tests/test_qk_gpu.py)")
    return "torch" if backend == "torch-pure" else backend


def _mask(kind, b, h, tq, tk, gen):
    """(attn_mask, is_causal) for a mask kind; every kind has fully masked rows except causal/none."""
    if kind == "none":
        return None, False
    if kind == "causal":
        return None, True
    if kind == "bool-padding":                 # [B, 1, 1, Tk] key padding, one batch entry all padded
        m = torch.rand(b, 1, 1, tk, generator=gen) > 0.3
        m[0] = False
        return m, False
    if kind == "bool-per-head":
        m = torch.rand(b, h, tq, tk, generator=gen) > 0.4
        m[:, 1, 2] = False                     # row 2 sees nothing in head 1: left out in every head
        return m, False
    if kind == "additive-finfo-min":          # HF eager style: finfo.min, also summed to -inf
        m = torch.randn(b, 1, tq, tk, generator=gen)
        m = m.masked_fill(torch.rand(b, 1, tq, tk, generator=gen) > 0.6, torch.finfo(torch.float32).min)
        m[-1, :, 1] = torch.finfo(torch.float32).min
        m[0, :, 0, 0] = float("-inf")
        return in_inf_padding(m), False
    if kind == "additive-causal":
        m = torch.randn(1, h, tq, tk, generator=gen)
        m[..., -1, :] = float("-inf")
        return in_inf_padding(m), True
    raise AssertionError(kind)


MASKS = ["none", "causal", "bool-padding", "bool-per-head", "additive-finfo-min", "additive-causal"]
HEADS = [(4, 4), (4, 2), (4, 1)]            # MHA, GQA, MQA
SHAPES = [(2, 9, 9, 24), (1, 7, 12, 64), (2, 12, 5, 128)]   # (B, Tq, Tk, D)
CASES = list(itertools.product(MASKS, HEADS, SHAPES))


def _qk(b, h, hk, tq, tk, d, dtype, gen):
    q = torch.randn(b, h, tq, d, generator=gen).to(dtype)
    k = torch.randn(b, hk, tk, d, generator=gen).to(dtype)
    return in_inf_padding(q), in_inf_padding(k)


def _case(kind, heads, shape, dtype):
    """Fresh q, k (inside +inf padding), the mask and the causal flag of one case, seeded by the case (a
    stable seed: Python's hash() of strings changes with every process, PYTHONHASHSEED)."""
    (h, hk), (b, tq, tk, d) = heads, shape
    gen = torch.Generator().manual_seed(zlib.crc32(repr((kind, heads, shape)).encode()) % 10_000)
    q, k = _qk(b, h, hk, tq, tk, d, dtype, gen)
    mask, causal = _mask(kind, b, h, tq, tk, gen)
    return q, k, mask, causal


def _assert_close(got, ref, tol):
    assert rel_err(got.gram, ref.gram) <= tol
    # rows that see a single key have entropy exactly 0: relative to at least 1e-9 nats a row there
    rows = ref.rows.double().clamp_min(1).item()
    assert rel_err(got.entropy_sum, ref.entropy_sum, floor=1e-9 * rows) <= tol
    assert torch.equal(got.rows.double(), ref.rows.double())
    assert got.invalid.item() == 0
    if ref.rows.item() > 0:
        assert rel_err(got.sync(), ref.sync()) <= tol
        assert abs(got.entropy_spread().item() - ref.entropy_spread().item()) <= tol * max(
            1.0, ref.head_entropy().abs().max().item())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,heads,shape", CASES,
                         ids=[f"{m}-H{h}Hk{hk}-B{b}Tq{tq}Tk{tk}D{d}" for m, (h, hk), (b, tq, tk, d) in CASES])
def test_matches_float64_reference(backend, kind, heads, shape):
    backend = _check_backend(backend)
    q, k, mask, causal = _case(kind, heads, shape, torch.float32)
    scale = 0.7 / shape[3] ** 0.5
    ref = qk_head_stats(q, k, mask, causal, scale, backend="reference")
    got = qk_head_stats(q, k, mask, causal, scale, backend=backend)
    _assert_close(got, ref, TOLERANCE[torch.float32])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_dtype_query_mask_and_default_scale(backend, dtype):
    backend = _check_backend(backend)
    gen = torch.Generator().manual_seed(5)
    q, k = _qk(3, 4, 2, 10, 10, 32, dtype, gen)
    mask, _ = _mask("bool-padding", 3, 4, 10, 10, gen)
    query_mask = torch.rand(3, 10, generator=gen) > 0.3
    ref = qk_head_stats(q, k, mask, True, backend="reference", query_mask=query_mask)
    got = qk_head_stats(q, k, mask, True, backend=backend, query_mask=query_mask)
    assert ref.rows.item() == (valid_rows(mask, True, (3, 4, 10, 10), query_mask)).sum().item()
    _assert_close(got, ref, TOLERANCE[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["none", "causal", "bool-per-head", "additive-finfo-min"])
def test_lse_from_torch_attention_op(backend, kind):
    """The LSE of aten's CPU flash op (0 on fully masked rows) gives the reference statistics."""
    backend = _check_backend(backend)
    gen = torch.Generator().manual_seed(11)
    b, h, tq, tk, d = 2, 4, 9, 9, 16
    q, k = _qk(b, h, h, tq, tk, d, torch.float32, gen)
    v = torch.randn(b, h, tk, d, generator=gen)
    mask, causal = _mask(kind, b, h, tq, tk, gen)
    float_mask = None if mask is None else (
        torch.zeros(mask.shape).masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else mask)
    _, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.contiguous(), k.contiguous(), v, 0.0, causal, attn_mask=float_mask)
    ref = qk_head_stats(q, k, mask, causal, backend="reference")
    got = qk_head_stats(q, k, mask, causal, backend=backend, lse=lse)
    _assert_close(got, ref, TOLERANCE[torch.float32])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_wrong_lse_is_counted_invalid(backend):
    backend = _check_backend(backend)
    gen = torch.Generator().manual_seed(2)
    q, k = _qk(1, 2, 2, 6, 6, 16, torch.float32, gen)
    lse = torch.logsumexp((q @ k.transpose(-1, -2)) * 16 ** -0.5, -1)
    assert qk_head_stats(q, k, backend=backend, lse=lse).invalid.item() == 0
    assert qk_head_stats(q, k, backend=backend, lse=lse + 0.5).invalid.item() > 0


def test_pass1_lse_matches_float64_logsumexp():
    _check_backend("triton")
    from fastdiag.core.kernels.qk_stats_triton import row_lse_triton

    gen = torch.Generator().manual_seed(4)
    q, k = _qk(2, 4, 2, 9, 13, 24, torch.float32, gen)
    mask, _ = _mask("bool-per-head", 2, 4, 9, 13, gen)
    lse = row_lse_triton(q, k, mask, True, 0.3)
    scores = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)) * 0.3
    scores = scores.masked_fill(~(mask & torch.ones(9, 13, dtype=torch.bool).tril()), float("-inf"))
    want = torch.logsumexp(scores, -1)
    seen = torch.isfinite(want)
    assert torch.equal(torch.isfinite(lse), seen)           # -inf exactly where a row sees nothing
    torch.testing.assert_close(lse[seen].double(), want[seen], rtol=1e-6, atol=1e-5)


def test_torch_backend_chunks_and_leading_dims():
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(2, 3, 4, 20, 16, generator=gen)           # [..., H, Tq, D] with two leading dims
    k = torch.randn(2, 3, 2, 20, 16, generator=gen)
    mask = torch.rand(2, 1, 1, 20, 20, generator=gen) > 0.2
    ref = qk_head_stats(q, k, mask, True, backend="reference")
    got = qk_head_stats(q, k, mask, True, backend="torch", chunk_bytes=2000)   # many row chunks
    _assert_close(got, ref, TOLERANCE[torch.float32])


def test_reference_is_what_the_probabilities_give():
    """qk_stats_ref against head_stats of the probabilities F.sdpa's math defines (bool mask)."""
    import fastdiag

    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 3, 5, 8, generator=gen).double(), torch.randn(2, 3, 7, 8, generator=gen).double()
    mask = torch.rand(2, 3, 5, 7, generator=gen) > 0.3
    mask[..., 0] = True
    probs = ((q @ k.transpose(-1, -2)) * 8 ** -0.5).masked_fill(~mask, float("-inf")).softmax(-1)
    want = fastdiag.head_stats(probs, backend="reference")
    got = qk_stats_ref(q, k, mask)
    torch.testing.assert_close(got[0], want.gram)
    torch.testing.assert_close(got[1], want.entropy_sum)


# ---- sdpa_with_stats ---------------------------------------------------------------------------

SDPA_CASES = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "bool-mask": dict(mask="bool"),
    "float-mask": dict(mask="float"),
    "scale": dict(scale=0.2),
    "gqa": dict(hk=2, enable_gqa=True),
    "causal-tq-ne-tk": dict(is_causal=True, tk=13),
}


def _sdpa_inputs(case, dtype=torch.float32):
    gen = torch.Generator().manual_seed(21)
    b, h, tq, d = 2, 4, 9, 16
    hk, tk = case.get("hk", h), case.get("tk", tq)
    q = torch.randn(b, h, tq, d, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(b, hk, tk, d, generator=gen).to(dtype).requires_grad_()
    v = torch.randn(b, hk, tk, d, generator=gen).to(dtype).requires_grad_()
    mask = None
    if case.get("mask") == "bool":
        mask = torch.rand(b, 1, tq, tk, generator=gen) > 0.3
        mask[0, 0, 3] = False                               # a fully masked row
    elif case.get("mask") == "float":
        mask = torch.randn(b, h, tq, tk, generator=gen).to(dtype)
        mask[1, :, 2] = torch.finfo(dtype).min
    kwargs = dict(attn_mask=mask, is_causal=case.get("is_causal", False), scale=case.get("scale"),
                  enable_gqa=case.get("enable_gqa", False))
    return q, k, v, kwargs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", list(SDPA_CASES))
def test_sdpa_with_stats_is_bit_identical_to_sdpa(name, dtype):
    q, k, v, kwargs = _sdpa_inputs(SDPA_CASES[name], dtype)
    want = F.scaled_dot_product_attention(q, k, v, **kwargs)
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
    got, stats = sdpa_with_stats(q, k, v, **kwargs)
    got_grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    assert torch.equal(got, want) or (torch.isnan(want).any() and torch.equal(got.isnan(), want.isnan()))
    for g, w in zip(got_grads, want_grads):
        assert torch.equal(g, w)
    ref = qk_head_stats(q, k, kwargs["attn_mask"], kwargs["is_causal"], kwargs["scale"], backend="reference")
    _assert_close(stats, ref, TOLERANCE[dtype])


def test_sdpa_with_stats_falls_back_for_dropout_and_3d():
    q, k, v, kwargs = _sdpa_inputs(SDPA_CASES["causal"])
    torch.manual_seed(0)
    want = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, **kwargs)
    torch.manual_seed(0)
    got, stats = sdpa_with_stats(q, k, v, dropout_p=0.3, **kwargs)
    assert torch.equal(got, want)
    ref = qk_head_stats(q, k, None, True, backend="reference")      # statistics without dropout
    _assert_close(stats, ref, TOLERANCE[torch.float32])
    q3, k3, v3 = q[:, 0], k[:, 0], v[:, 0]                         # [B, T, D]
    got3, stats3 = sdpa_with_stats(q3, k3, v3, is_causal=True)
    assert torch.equal(got3, F.scaled_dot_product_attention(q3, k3, v3, is_causal=True))
    assert stats3.num_heads == 1


def test_sdpa_with_stats_query_mask_and_reference_backend():
    q, k, v, kwargs = _sdpa_inputs(SDPA_CASES["bool-mask"])
    query_mask = torch.ones(2, 9, dtype=torch.bool)
    query_mask[1, 4:] = False
    _, stats = sdpa_with_stats(q, k, v, **kwargs, query_mask=query_mask)
    _, ref = sdpa_with_stats(q, k, v, **kwargs, query_mask=query_mask, backend="reference")
    _assert_close(stats, ref, TOLERANCE[torch.float32])


def test_sdpa_with_stats_under_compile_fullgraph():
    """Traced by dynamo without a graph break (attach compiles models that call it)."""
    q, k, v, kwargs = _sdpa_inputs(SDPA_CASES["bool-mask"])
    q, k, v = q.detach(), k.detach(), v.detach()
    fn = torch.compile(lambda a, b, c, m: sdpa_with_stats(a, b, c, m), fullgraph=True)
    out, stats = fn(q, k, v, kwargs["attn_mask"])
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, kwargs["attn_mask"]))
    _assert_close(stats, qk_head_stats(q, k, kwargs["attn_mask"], backend="reference"), TOLERANCE[torch.float32])


def test_bad_inputs_raise_naming_the_argument():
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 3, 5, 8)
    with pytest.raises(ValueError, match="k:"):
        qk_head_stats(q, k)
    with pytest.raises(TypeError, match="query_mask"):
        qk_head_stats(q, q, query_mask=torch.ones(1, 5))
    with pytest.raises(ValueError, match="attn_mask"):
        qk_head_stats(q, q, torch.ones(2, 5, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="backend"):
        qk_head_stats(q, q, backend="cuda")
    with pytest.raises(ValueError, match="lse"):
        qk_head_stats(q, q, lse=torch.zeros(3))


def _kernel_stats(q, k, mask, causal, scale, tiles=None):
    """HeadStats of the Triton launcher called directly (to force its tiles)."""
    from fastdiag.core.kernels.qk_stats_triton import qk_stats_triton

    rows_ok = None if mask is None else valid_rows(mask, causal, (*q.shape[:3], k.shape[2]), None)
    return HeadStats(*qk_stats_triton(q, k, mask, causal, scale, rows_ok, tiles=tiles))


@pytest.mark.parametrize("h,hk", [(32, 32), (48, 24)])
def test_heads_split_into_blocks(h, hk):
    """More heads than one program holds (forced by a small score budget): diagonal and off-diagonal
    Gram blocks, padded heads."""
    _check_backend("triton")
    from fastdiag.core.kernels.qk_stats_triton import tile_config

    tiles = tile_config(h, hk, 16, budget=2048)
    assert hk > tiles["BLOCK_HK"]                             # really split
    gen = torch.Generator().manual_seed(h)
    q, k = _qk(1, h, hk, 5, 6, 16, torch.float32, gen)
    mask, _ = _mask("bool-per-head", 1, h, 5, 6, gen)
    ref = qk_head_stats(q, k, mask, True, 0.25, backend="reference")
    _assert_close(_kernel_stats(q, k, mask, True, 0.25, tiles), ref, TOLERANCE[torch.float32])


LLAMA_7B_CASES = [("bool-per-head", torch.float32), ("additive-causal", torch.float32), ("causal", torch.float16)]


@pytest.mark.parametrize("kind,dtype", LLAMA_7B_CASES, ids=[f"{k}-{str(d)[6:]}" for k, d in LLAMA_7B_CASES])
def test_full_multi_head_attention_at_llama_7b_heads(kind, dtype):
    """H = Hk = 32, D = 128 (Llama-7B's heads, few rows): pass 2 holds all 32 heads with 16-key tiles
    in one program, D in two dot chunks; pass 1 runs one head per program. Two row and key tiles."""
    _check_backend("triton")
    from fastdiag.core.kernels.qk_stats_triton import lse_tile_config, tile_config

    tiles = tile_config(32, 32, 128)
    assert (tiles["BLOCK_HK"], tiles["BLOCK_N"], tiles["num_stages"]) == (32, 16, 1)
    assert lse_tile_config(32, 32, 128)["BLOCK_HK"] == 1
    gen = torch.Generator().manual_seed(7)
    b, tq, tk = 2, 20, 23
    q, k = _qk(b, 32, 32, tq, tk, 128, dtype, gen)
    mask, causal = _mask(kind, b, 32, tq, tk, gen)
    ref = qk_head_stats(q, k, mask, causal, 0.06, backend="reference")
    _assert_close(_kernel_stats(q, k, mask, causal, 0.06, tiles), ref, TOLERANCE[dtype])


# ---- the sm_90 compile report ------------------------------------------------------------------

SM90_SHARED_LIMIT = 227 * 1024


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["gpt2-small", "llama-7b", "llama-3-8b"])
def test_sm90_compile_has_no_spills_and_fits_shared_memory(shape):
    """Both passes compiled for sm_90 as a launch would, in a subprocess: under TRITON_INTERPRET=1
    kernels cannot be compiled."""
    import json
    import subprocess
    import sys

    from fastdiag.kernel_report import tools_missing

    if tools_missing():
        pytest.skip(f"sm_90 compile report needs the CUDA tools of the triton wheel: {tools_missing()}")
    code = ("import json; from fastdiag.kernel_report.cases import REPORT_SHAPES, qk_report as kernel_report; "
            f"print(json.dumps([r.row() for r in kernel_report({{{shape!r}: REPORT_SHAPES[{shape!r}]}})]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    # pass 2 may be two launches (the per-head kernel's Gram, then its row sums; materialised P's write, then
    # its Gram): every launch is checked
    kernels = {r["kernel"] for r in rows}
    assert "qk_lse" in kernels and kernels - {"qk_lse"} in ({"qk_stats"}, {"qk_probs", "qk_probs gram"}), kernels
    assert len(rows) <= 3
    for r in rows:
        assert r["spill_bytes"] == 0, r
        assert r["shared_bytes"] <= SM90_SHARED_LIMIT, r


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_and_double_dtypes(backend):
    backend = _check_backend(backend)
    gen = torch.Generator().manual_seed(9)
    q, k = _qk(1, 2, 2, 7, 7, 16, torch.float32, gen)
    ref = qk_head_stats(q, k, is_causal=True, backend="reference")
    _assert_close(qk_head_stats(q.double(), k.double(), is_causal=True, backend=backend), ref, 1e-5)
    ref16 = qk_head_stats(q, k.half(), is_causal=True, backend="reference")
    _assert_close(qk_head_stats(q, k.half(), is_causal=True, backend=backend), ref16, 1e-5)


def test_torch_path_products_are_float32_whatever_the_matmul_setting():
    """`torch.set_float32_matmul_precision("high")` (TF32 on CUDA) or "medium" (bf16 in oneDNN) is a
    common training setting: inside the torch path the products are float32, and the user's setting
    comes back unchanged."""
    from fastdiag.core.kernels.constants import exact_fp32_matmul

    saved = torch.get_float32_matmul_precision()
    gen = torch.Generator().manual_seed(11)
    q, k = _qk(2, 4, 2, 40, 40, 32, torch.float32, gen)
    ref = qk_head_stats(q, k, is_causal=True, backend="reference")
    try:
        for setting in ("high", "medium"):
            torch.set_float32_matmul_precision(setting)
            with exact_fp32_matmul():
                inside = (torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision)
            assert inside == ("ieee", "ieee")
            assert torch.get_float32_matmul_precision() == setting
            _assert_close(qk_head_stats(q, k, is_causal=True, backend="torch"), ref, TOLERANCE[torch.float32])
            assert torch.get_float32_matmul_precision() == setting
    finally:
        torch.set_float32_matmul_precision(saved)


def test_a_shared_mask_is_not_copied_per_batch_entry():
    """A [Tq, Tk] mask shared by a 5-D q [2, 4, H, T, D] stays one [Tq, Tk] matrix (it was copied for
    every batch entry: 277 MiB against 17 MiB at T = 1024 in the fault review), and the statistics
    are those of the float64 reference."""
    from fastdiag.core.qk import _as_batched_heads

    gen = torch.Generator().manual_seed(21)
    q = torch.randn(2, 4, 3, 12, 8, generator=gen)
    mask = torch.rand(12, 12, generator=gen) > 0.3
    mask[:, 0] = True
    _, _, mask4, _, _ = _as_batched_heads(q, q, mask, None, None)
    assert mask4.shape == (1, 1, 12, 12) and mask4.numel() == 144
    assert mask4.untyped_storage().nbytes() == mask.untyped_storage().nbytes()   # a view, no copy
    ref = qk_head_stats(q.reshape(8, 3, 12, 8), q.reshape(8, 3, 12, 8), mask, backend="reference")
    _assert_close(qk_head_stats(q, q, mask, backend="torch"), ref, TOLERANCE[torch.float32])


def test_fp32_sigma_h_within_1e_5_of_itself_at_a_small_spread():
    """fp32 Q/K whose heads share most of their queries and keys: σ_H ≈ 1e-3 nats, and each fp32 route
    gives it within 1e-5 *relative to σ_H* (not to the entropies, ~1000x larger): the Triton passes
    1 + 2 (interpreted; sm_80 / sm_90 run them), and the Triton pass 1 LSE with the chunked PyTorch pass 2
    (where no float32 per-head plan applies: more than 64 heads or head dim > 128). Inputs inside +inf
    padding (an out-of-bounds read would show)."""
    _check_backend("triton")
    from fastdiag.core.kernels import qk_stats_torch as torch_path
    from fastdiag.core.kernels import qk_stats_triton as triton_path

    g = torch.Generator().manual_seed(11)
    b, h, t, d = 1, 12, 96, 64
    shared = torch.randn(b, 1, t, d, generator=g)
    q, k = ((shared + 1.5 * torch.randn(b, h, t, d, generator=g)) * 0.3 for _ in range(2))
    ref = qk_head_stats(q.double(), k.double(), is_causal=True, backend="reference")
    sigma = ref.entropy_spread().item()
    assert 3e-4 < sigma < 1e-2, sigma
    q, k = in_inf_padding(q), in_inf_padding(k)
    fused = qk_head_stats(q, k, is_causal=True, backend="triton")
    lse = triton_path.row_lse_triton(q, k, None, True, d ** -0.5)
    gpu_route = HeadStats(*torch_path.qk_stats_torch(q, k, None, True, d ** -0.5, None, lse, torch_path.CHUNK_BYTES,
                                                     check_lse=True))
    for got in (fused, gpu_route):
        assert got.invalid.item() == 0
        assert abs(got.entropy_spread().item() - sigma) <= 1e-5 * sigma


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_torch_path_takes_q_and_k_as_views_of_a_fused_projection(dtype):
    """Q and K as head-split views of one QKV projection ([B, T, 3, H, D] transposed): the torch path's
    copies to its score dtype must not assume a layout (float64 ones are not copied by a dtype cast)."""
    gen = torch.Generator().manual_seed(11)
    qkv = torch.randn(2, 9, 3, 4, 8, generator=gen, dtype=dtype)
    q, k = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2)
    want = HeadStats(*qk_stats_ref(q.double(), k.double(), is_causal=True))
    got = qk_head_stats(q, k, is_causal=True, backend="torch")
    assert rel_err(got.gram, want.gram) <= 1e-5
    assert rel_err(got.entropy_sum, want.entropy_sum) <= 1e-5


@pytest.mark.parametrize("gap", [30.0, 300.0, 1e3, 3e3, 1e4])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_sharp_rows_keep_sigma_within_1e5_of_float64(gap, is_causal, backend):
    """Logit gaps up to 1e4 (float32 softmax underflows at 104): the re-derived σ_l and s_l stay within
    1e-5 of float64 of the same Q and K, with our own pass 1 and with the SDPA op's LSE (issue 39, 7). The
    Triton kernels score float32 inputs in float64, as the torch path does (issue 37)."""
    backend = _check_backend(backend)
    gen = torch.Generator().manual_seed(int(gap) + is_causal)
    q, k = torch.randn(2, 4, 16, 8, generator=gen), torch.randn(2, 4, 16, 8, generator=gen)
    q = q * (gap / 3 / (q @ k.transpose(-1, -2) / 8 ** 0.5).std())
    want = HeadStats(*qk_stats_ref(q.double(), k.double(), is_causal=is_causal))
    _, from_op_lse = sdpa_with_stats(q, k, k, is_causal=is_causal, backend=backend)
    for got in (qk_head_stats(q, k, is_causal=is_causal, backend=backend), from_op_lse):
        sigma, want_sigma = got.entropy_spread().item(), want.entropy_spread().item()
        assert abs(sigma - want_sigma) <= 1e-5 * max(want_sigma, 1e-6)
        assert abs(got.sync().item() - want.sync().item()) <= 1e-5 * abs(want.sync().item())
        assert rel_err(got.entropy_sum, want.entropy_sum, floor=1e-9) <= 1e-5


# (mask kind, (H, Hk), (B, Tq, Tk, D), dtype): the per-head pass 2 — padded heads (12 and 6 in 16), GQA,
# MQA, two row tiles, odd key counts, every mask kind
PER_HEAD_CASES = [
    ("additive-causal", (12, 4), (1, 66, 41, 40), torch.float32),
    ("bool-per-head", (6, 6), (1, 65, 33, 64), torch.float32),
    ("causal", (16, 1), (1, 67, 67, 24), torch.float16),
    ("bool-padding", (2, 1), (2, 9, 17, 16), torch.float32),
    ("additive-finfo-min", (3, 3), (2, 20, 21, 8), torch.float32),
]


@pytest.mark.parametrize("plan", [0, 1, 3], ids=["one-launch", "gram-then-row-sums", "gram-32-rows"])
@pytest.mark.parametrize("kind,heads,shape,dtype", PER_HEAD_CASES,
                         ids=[f"{m}-H{h}Hk{hk}-B{b}Tq{tq}Tk{tk}D{d}-{str(t)[6:]}"
                              for m, (h, hk), (b, tq, tk, d), t in PER_HEAD_CASES])
def test_per_head_pass2_matches_float64_reference(kind, heads, shape, dtype, plan):
    """`_qk_heads_kernel` (a 2-D score dot per head, heads stacked for the Gram, padded heads never
    scored) against float64 on fresh random inputs inside +inf padding, with its own LSE from pass 1;
    each plan of `heads_plans` (one launch, or the Gram and the per-head row sums apart; plan 2 differs
    from 1 only in warps, which the interpreter does not model; plan 3 holds 32 rows, two Gram batches, plan 4
    is plan 3 in 8 warps)."""
    _check_per_head_plan(kind, heads, shape, dtype, plan)


def _check_per_head_plan(kind, heads, shape, dtype, plan):
    """`_qk_heads_kernel`'s plan ``plan`` against float64 (fresh inputs inside +inf padding, the LSE of
    pass 1), and a wrong LSE counted invalid."""
    _check_backend("triton")
    from fastdiag.core.kernels import qk_stats_triton as kernels

    (h, hk), (b, tq, tk, d) = heads, shape
    q, k, mask, causal = _case(kind, heads, shape, dtype)
    scale = 0.8 / d ** 0.5
    ref = qk_head_stats(q, k, mask, causal, scale, backend="reference")
    rows_ok = None if mask is None else valid_rows(mask, causal, (b, h, tq, tk), None)
    lse = kernels.row_lse_triton(q, k, mask, causal, scale)
    got = kernels._heads_stats(q, k, mask, causal, scale, rows_ok, lse, None, plan)
    assert got is not None, "the per-head kernel applies at these shapes"
    _assert_close(HeadStats(*got), ref, TOLERANCE[dtype])
    wrong = kernels._heads_stats(q, k, mask, causal, scale, rows_ok, lse + 0.01, None, plan)   # a wrong LSE shows
    assert HeadStats(*wrong).invalid.item() > 0


# (mask kind, (H, Hk), (B, Tq, Tk, D), dtype): the head-pair plan — three blocks of 8 (each block's own Gram
# from its pair with the next, the last's from the previous), GQA groups inside a block, head dim 72 read
# as 128 columns, every mask kind
PAIR_CASES = [
    ("causal", (24, 6), (1, 67, 67, 24), torch.float16),
    ("additive-causal", (16, 16), (1, 40, 41, 72), torch.float32),
    ("bool-padding", (16, 2), (2, 9, 17, 80), torch.float32),
    ("bool-per-head", (24, 24), (1, 33, 20, 8), torch.float32),
]


@pytest.mark.parametrize("kind,heads,shape,dtype", PAIR_CASES,
                         ids=[f"{m}-H{h}Hk{hk}-B{b}Tq{tq}Tk{tk}D{d}-{str(t)[6:]}"
                              for m, (h, hk), (b, tq, tk, d), t in PAIR_CASES])
def test_head_pair_plan_matches_float64_reference(kind, heads, shape, dtype):
    """`_qk_heads_kernel` in programs of two head blocks (more than 16 heads or head dim > 64: the Gram
    assembled from the pairs' blocks, Q re-read every key step, the row sums apart) against float64 on
    fresh random inputs inside +inf padding; a wrong LSE counted invalid."""
    _check_backend("triton")
    from fastdiag.core.kernels import qk_stats_triton as kernels

    cfg = kernels.heads_config(*heads, shape[3])
    assert cfg is not None and cfg["PAIRS"], "these shapes take the head-pair plan"
    _check_per_head_plan(kind, heads, shape, dtype, 0)


def _sharp_qk(gap, offset, dtype, gen, b=1, h=4, t=16, d=8):
    """Scores of std gap / 3 (a row's top key leads its runners-up by ~gap), each row shifted by a
    constant of std ``offset`` (k + c: softmax unchanged, |s| as large as the offset)."""
    q, k = torch.randn(b, h, t, d, generator=gen), torch.randn(b, h, t, d, generator=gen)
    q = q * (gap / 3 / (q @ k.transpose(-1, -2) / d ** 0.5).std())
    if offset:
        c = torch.randn(b, h, 1, d, generator=gen)
        k = k + c * (offset / (q @ c.transpose(-1, -2) / d ** 0.5).std())
    return q.to(dtype), k.to(dtype)


# (logit gap, score offset): exact below ~58 nats for float32 inputs, ~5800 for 16-bit ones (and ‖q‖·max‖k‖
# ·|scale| below ~2900); named beyond
SHARP_CASES = [(30.0, 0.0), (300.0, 0.0), (1e3, 0.0), (1e4, 0.0), (30.0, 1e3), (30.0, 1e4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("gap,offset", SHARP_CASES, ids=[f"gap{g:g}-offset{o:g}" for g, o in SHARP_CASES])
def test_triton_sharp_rows_exact_or_named(gap, offset, dtype):
    """Both Triton pass 2 kernels (per head, each plan; batched) on sharp rows, with pass 1's LSE and with a
    given one (float64's rounded, and torch's float32 one — another kernel's): σ_l and s_l within the
    dtype's target of float64 of the same inputs, or the rows counted invalid (the layer is NaN and attach
    names it). Never silently off: before, the entropy was −Σ p (s − lse) and gap 1e4 read 26x σ_l with
    nothing counted (issue 39, 7). The entropy no longer depends on where the LSE came from."""
    _check_backend("triton")
    from fastdiag.core.kernels import qk_stats_triton as kernels

    gen = torch.Generator().manual_seed(int(gap + offset))
    q, k = _sharp_qk(gap, offset, dtype, gen)
    scale = q.shape[-1] ** -0.5
    want = HeadStats(*qk_stats_ref(q.double(), k.double()))
    s64 = (q.double() @ k.double().transpose(-1, -2)) * scale
    given = {"pass 1": kernels.row_lse_triton(q, k, None, False, scale), "float64": s64.logsumexp(-1).float(),
             "torch fp32": ((q.float() @ k.float().transpose(-1, -2)) * scale).logsumexp(-1)}
    target = TOLERANCE[dtype]
    exact = {}
    for source, lse in given.items():
        runs = {f"heads plan {plan}": kernels._heads_stats(q, k, None, False, scale, None, lse, None, plan)
                for plan in (0, 1)}
        runs["batched"] = kernels._stats(q, k, None, False, scale, None, lse, kernels.tile_config(4, 4, 8))
        for path, sums in runs.items():
            got = HeadStats(*sums)
            if got.invalid.item() > 0:
                assert got.entropy_spread().isnan() and got.sync().isnan()        # named: NaN, never a number
                continue
            sigma = want.entropy_spread().item()
            assert abs(got.entropy_spread().item() - sigma) <= target * max(sigma, 1e-6), (source, path)
            assert abs(got.sync().item() - want.sync().item()) <= target * abs(want.sync().item()), (source, path)
            exact[source, path] = got.entropy_sum
    # 16-bit: |s| below ~5800 nats and ‖q‖·max‖k‖·|scale| below ~2900 (the products' cancellation bound,
    # `row_entropy_triton.CANCEL_ROUNDING`): offset 1e3 passes the second (d 8: ‖q‖‖k‖ ~ 3|s|) and is named
    if max(gap, offset) <= 30 or (dtype == torch.float16 and offset == 0 and gap <= 1e3):
        assert len(exact) == 9, "rows of this size keep the target: nothing is to be named"
    for (source, path), entropy in exact.items():   # H is of pass 2's own scores, whatever LSE came in
        if (source, path) != ("pass 1", path) and ("pass 1", path) in exact:
            assert rel_err(entropy, exact["pass 1", path]) <= 1e-6


# ---- float32 Q/K on the Triton backend: float64 scores, the per-head kernel's float32 plans (issue 37) ----

# (mask kind, (H, Hk), (B, Tq, Tk, D)): rows not a multiple of any tile (64, 32, 16: the smallest plan takes
# 37 rows in three), GQA and MQA, head dims
# 72 and 80 (read as 128 columns), padded heads (12 and 6 in 16), every mask kind
FP32_CASES = [
    ("causal", (12, 12), (1, 37, 37, 64)),
    ("additive-causal", (8, 2), (1, 37, 41, 72)),
    ("bool-padding", (4, 1), (2, 17, 33, 80)),
    ("bool-per-head", (6, 6), (1, 20, 19, 16)),
    ("additive-finfo-min", (3, 3), (2, 20, 21, 8)),
]


@pytest.mark.parametrize("kind,heads,shape", FP32_CASES,
                         ids=[f"{m}-H{h}Hk{hk}-B{b}Tq{tq}Tk{tk}D{d}" for m, (h, hk), (b, tq, tk, d) in FP32_CASES])
def test_float32_triton_passes_match_float64(kind, heads, shape):
    """float32 Q/K through the Triton backend (pass 1's float64 LSE, then the per-head kernel's float32 plans:
    the first and the smallest tiles) against float64 on fresh random inputs inside +inf padding, within the
    float32 target; the attention op's float32 LSE given: exact (only checked), and a wrong one counted."""
    _check_backend("triton")
    from fastdiag.core.kernels import qk_stats_triton as kernels

    (h, hk), (b, tq, tk, d) = heads, shape
    gen = torch.Generator().manual_seed(zlib.crc32(repr(("fp32", kind, heads, shape)).encode()) % 10_000)
    q, k = _qk(b, h, hk, tq, tk, d, torch.float32, gen)
    mask, causal = _mask(kind, b, h, tq, tk, gen)
    scale = 0.8 / d ** 0.5
    ref = qk_head_stats(q, k, mask, causal, scale, backend="reference")
    target = TOLERANCE[torch.float32]
    _assert_close(qk_head_stats(q, k, mask, causal, scale, backend="triton"), ref, target)
    rows_ok = None if mask is None else valid_rows(mask, causal, (b, h, tq, tk), None)
    lse = kernels.row_lse_triton(q, k, mask, causal, scale)
    assert lse.dtype == torch.float64
    plans = kernels.heads_plans(kernels.heads_config(h, hk, d, 4))
    assert all(launches[0]["HEAD_LOOP"] for launches in plans)
    for plan in (0, len(plans) - 1):
        _assert_close(HeadStats(*kernels._heads_stats(q, k, mask, causal, scale, rows_ok, lse, None, plan)), ref, target)
    given = lse.float()       # as the attention op gives it: float32
    _assert_close(qk_head_stats(q, k, mask, causal, scale, backend="triton", lse=given), ref, target)
    wrong = qk_head_stats(q, k, mask, causal, scale, backend="triton", lse=given + 0.01)
    assert wrong.invalid.item() > 0 and wrong.sync().isnan()
