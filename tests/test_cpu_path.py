"""The chunked CPU path (`head_stats_torch`) against the float64 reference, chunk boundaries included.

Small chunk budgets force every branch on small inputs: rows split across chunks, causal-sized chunks
re-split when the keys after the diagonal are not zero, chunks with and without zero keys, the
keys-major layout of short rows, and the `torch.bmm` Gram where oneDNN's is missing."""
import itertools
import sys

import pytest
import torch

from fastdiag.core.kernels.head_stats_ref import head_stats_ref
from fastdiag.core.kernels.head_stats_torch import head_stats_torch
from fastdiag.testing import TOLERANCE, random_probs, random_query_mask, rel_err

torch_path_module = sys.modules["fastdiag.core.kernels.head_stats_torch"]
SHAPES = [(1, 2, 3, 37, 37), (2, 1, 5, 29, 61), (1, 3, 4, 50, 7), (3, 4, 8, 3, 3), (1, 1, 2, 1, 1)]


def _assert_close(got, ref, tol):
    gram, entropy, rows, invalid = got
    assert rel_err(gram, ref[0]) <= tol
    assert rel_err(entropy, ref[1]) <= tol
    assert torch.equal(rows.double(), ref[2]) and torch.equal(invalid > 0, ref[3] > 0)


@pytest.mark.parametrize("budget", [400, 3000, 1 << 18])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_chunked_pass_matches_reference(monkeypatch, budget, dtype):
    monkeypatch.setitem(torch_path_module._CHUNK_ELEMENTS, "cpu", budget)
    for seed, (shape, causal, masked) in enumerate(itertools.product(SHAPES, [True, False], [True, False])):
        n, b, h, tq, tk = shape
        mask = random_query_mask((n, b, tq), seed=seed) if masked else None
        garbage = ~mask if masked else None
        probs = random_probs(shape, dtype=dtype, causal=causal, seed=seed, garbage_rows=garbage)
        ref = head_stats_ref(probs, mask)
        for hint in (False, True) if causal else (False,):
            _assert_close(head_stats_torch(probs, mask, hint), ref, TOLERANCE[dtype])


@pytest.mark.parametrize("budget", [500, 1 << 18])
def test_causal_hint_changes_nothing(monkeypatch, budget):
    """Without the hint the keys after the diagonal are read once, found zero and skipped: the same
    chunks are computed, so the results are bit for bit those with the hint (padded rows here hold
    zeros after the diagonal too; with garbage there the check fails and only the rounding differs)."""
    monkeypatch.setitem(torch_path_module._CHUNK_ELEMENTS, "cpu", budget)
    for seed, shape in enumerate([(1, 2, 3, 64, 64), (2, 1, 4, 20, 45), (1, 1, 3, 45, 20)]):
        mask = random_query_mask((shape[0], shape[1], shape[3]), seed=seed)
        probs = random_probs(shape, seed=seed)
        plain, hinted = head_stats_torch(probs, mask), head_stats_torch(probs, mask, causal=True)
        for a, b in zip(plain, hinted):
            assert torch.equal(a, b)


def test_gram_without_onednn(monkeypatch):
    monkeypatch.setattr(torch_path_module, "_LINEAR", None)
    monkeypatch.setitem(torch_path_module._CHUNK_ELEMENTS, "cpu", 2000)
    probs = random_probs((1, 2, 4, 40, 40), seed=3)
    _assert_close(head_stats_torch(probs), head_stats_ref(probs), 1e-5)


def test_sharp_rows_with_tiny_probabilities():
    """n p below 2⁻²⁵ rounds z = n p − 1 to −1: the floor keeps the log finite and the result exact."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 2, 3, 40, 300, generator=g, dtype=torch.float64) * 30
    probs = torch.softmax(logits, -1).float()
    assert 0 < probs[probs > 0].min() < 2 ** -25 / 300
    ref = head_stats_ref(probs)
    got = head_stats_torch(probs)
    assert torch.isfinite(got[1]).all()
    _assert_close(got, ref, 1e-5)


@pytest.mark.parametrize("bad", [float("nan"), -1e-3, 1.5, float("inf")])
def test_out_of_range_entry_is_flagged(bad):
    probs = random_probs((2, 1, 3, 30, 30), seed=4, causal=False)
    probs[1, 0, 2, 17, 5] = bad
    assert head_stats_torch(probs)[3].tolist() == [0.0, 1.0]
