"""Q/K pass 2 through materialised 16-bit P in row chunks (`qk_probs_triton`) against the float64 reference.

Interpreted (TRITON_INTERPRET=1) on fresh random inputs inside +inf padding (an out-of-bounds read turns
into inf/NaN), the LSE from pass 1; a small buffer bound forces several chunks (and batch chunks)."""
import pytest
import torch

from fastdiag.core.stats import HeadStats
from fastdiag.qk import qk_head_stats, valid_rows
from fastdiag.testing import TOLERANCE, rel_err

from tests.test_qk_stats import _assert_close, _case, _check_backend, _qk

# (mask kind, (H, Hk), (B, Tq, Tk, D), buffer bytes): GQA / MQA, odd T (not a multiple of the 64-row tile),
# head dims 72 / 80 / 128 read as 128 columns, every mask kind; buffers of one, several and per-batch chunks
CASES = [
    ("causal", (4, 2), (2, 67, 67, 72), 1 << 30),
    ("causal", (3, 1), (1, 150, 150, 16), 3 * 150 * 2 * 64),          # 3 chunks of one row tile
    ("additive-causal", (4, 4), (1, 70, 41, 80), 1 << 30),
    ("bool-padding", (4, 1), (3, 9, 17, 128), 4 * 17 * 2 * 64),       # one batch entry a chunk
    ("bool-per-head", (3, 3), (1, 33, 20, 8), 1 << 30),
    ("additive-finfo-min", (2, 2), (2, 20, 21, 24), 1 << 30),
]


def _stats(q, k, mask, causal, scale, lse, budget):
    from fastdiag.core.kernels import qk_stats_triton as kernels

    b, h, tq, _ = q.shape
    rows_ok = None if mask is None else valid_rows(mask, causal, (b, h, tq, k.shape[2]), None)
    return HeadStats(*kernels._probs_stats(q, k, mask, causal, scale, rows_ok, lse, budget))


@pytest.mark.parametrize("kind,heads,shape,budget", CASES,
                         ids=[f"{m}-H{h}Hk{hk}-B{b}Tq{tq}Tk{tk}D{d}-{n}B" for m, (h, hk), (b, tq, tk, d), n in CASES])
def test_materialised_p_matches_float64_reference(kind, heads, shape, budget):
    """Gram, entropies, rows against float64 (fp16 inputs, 1e-3); a wrong LSE is counted invalid."""
    _check_backend("triton")
    from fastdiag.core.kernels import qk_stats_triton as kernels

    q, k, mask, causal = _case(kind, heads, shape, torch.float16)
    scale = 0.8 / shape[3] ** 0.5
    ref = qk_head_stats(q, k, mask, causal, scale, backend="reference")
    lse = kernels.row_lse_triton(q, k, mask, causal, scale)
    _assert_close(_stats(q, k, mask, causal, scale, lse, budget), ref, TOLERANCE[torch.float16])
    assert _stats(q, k, mask, causal, scale, lse + 0.01, budget).invalid.item() > 0


def test_chunks_cover_every_row_once_within_the_buffer():
    """`probs_chunks`: whole row tiles, each (batch, row) in one chunk, the buffer bound kept where one
    tile of every batch entry and head fits it."""
    from fastdiag.core.kernels.qk_probs_triton import chunk_keys, probs_chunks

    for b, h, t, causal, budget in [(1, 32, 4096, True, 256 << 20), (8, 12, 1024, True, 256 << 20),
                                    (8, 32, 8192, False, 256 << 20), (3, 4, 150, True, 4 * 150 * 2 * 64)]:
        chunks = probs_chunks(b, h, t, t, causal, 64, budget)
        seen = torch.zeros(b, t, dtype=torch.int64)
        for b0, n, r0, rows in chunks:
            assert r0 % 64 == 0 and (rows % 64 == 0 or r0 + rows == t)
            assert n * h * rows * chunk_keys(t, causal, r0, rows) * 2 <= budget
            seen[b0:b0 + n, r0:r0 + rows] += 1
        assert torch.equal(seen, torch.ones_like(seen))
    assert len(probs_chunks(1, 32, 4096, 4096, True)) == 16       # [1, 32, 4096, 128]: 256 rows a chunk (64 MiB)


def test_gram_from_16_bit_p_is_as_exact_as_the_on_chip_kernels():
    """The Gram through the materialised fp16 P against float64, beside the per-head kernel's (which
    rounds p to fp16 for its Gram dot too): no worse than 1.5x it, at shapes both take."""
    _check_backend("triton")
    from fastdiag.core.kernels import qk_stats_triton as kernels

    gen = torch.Generator().manual_seed(38)
    b, h, t, d = 1, 4, 67, 32
    q, k = _qk(b, h, h, t, t, d, torch.float16, gen)
    scale = 1.5 / d ** 0.5
    ref = qk_head_stats(q, k, None, True, scale, backend="reference")
    lse = kernels.row_lse_triton(q, k, None, True, scale)
    on_chip = HeadStats(*kernels._heads_stats(q, k, None, True, scale, None, lse, None, 1))
    materialised = _stats(q, k, None, True, scale, lse, 1 << 30)
    assert rel_err(materialised.gram, ref.gram) <= 1.5 * rel_err(on_chip.gram, ref.gram)
