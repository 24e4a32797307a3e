"""Properties of the diagnostics (the statements lean/ proves), checked numerically with hypothesis."""
import math

import torch
from hypothesis import given, settings, strategies as st

import fastdiag
from fastdiag.testing import random_probs, random_query_mask

shapes = st.tuples(st.integers(1, 4), st.integers(2, 6), st.integers(1, 9), st.integers(1, 9))
seeds = st.integers(0, 2**31 - 1)
backends = st.sampled_from(["torch", "reference"])
SETTINGS = settings(max_examples=40, deadline=None)


@SETTINGS
@given(shape=shapes, seed=seeds, split=st.integers(1, 3), backend=backends)
def test_merging_two_batches_equals_their_concatenation(shape, seed, split, backend):
    b, h, tq, tk = shape
    b2 = split
    probs = random_probs((b + b2, h, tq, tk), dtype=torch.float64, seed=seed)
    mask = random_query_mask((b + b2, tq), seed=seed)
    whole = fastdiag.head_stats(probs, mask, backend=backend)
    merged = (fastdiag.head_stats(probs[:b], mask[:b], backend=backend)
              + fastdiag.head_stats(probs[b:], mask[b:], backend=backend))
    torch.testing.assert_close(merged.gram, whole.gram, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(merged.entropy_sum, whole.entropy_sum, rtol=1e-6, atol=1e-9)
    assert torch.equal(merged.rows, whole.rows)


@SETTINGS
@given(shape=shapes, seed=seeds)
def test_sync_in_unit_interval_and_spread_bounded(shape, seed):
    b, h, tq, tk = shape
    s = fastdiag.head_stats(random_probs(shape, dtype=torch.float64, seed=seed), backend="reference")
    assert -1e-12 <= s.sync().item() <= 1 + 1e-12
    assert 0.0 <= s.entropy_spread().item() <= math.log(tk) / 2 + 1e-12
    assert 0.0 <= s.participation_ratio().item() <= 1 + 1e-12


@SETTINGS
@given(shape=shapes, seed=seeds, backend=backends)
def test_identical_heads_are_fully_synchronised_and_undifferentiated(shape, seed, backend):
    b, h, tq, tk = shape
    one_head = random_probs((b, 1, tq, tk), dtype=torch.float64, seed=seed)
    s = fastdiag.head_stats(one_head.expand(b, h, tq, tk), backend=backend)
    assert abs(s.sync().item() - 1.0) < 1e-6
    assert s.entropy_spread().item() < 1e-6


@SETTINGS
@given(n=st.integers(1, 6), tk=st.integers(1, 12), seed=seeds, backend=backends)
def test_row_entropy_between_zero_and_log_of_visible_keys(n, tk, seed, backend):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, 1, 2, 1, tk, generator=g, dtype=torch.float64) * 3
    visible = torch.rand(n, 1, 1, 1, tk, generator=g) < 0.6
    visible[..., 0] = True
    probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
    s = fastdiag.head_stats(probs, backend=backend)          # each problem is a single row per head
    row_entropy = s.entropy_sum                               # [n, 2]
    bound = visible.reshape(n, tk).sum(-1, keepdim=True).double().log()
    assert bool((row_entropy >= -1e-9).all())
    assert bool((row_entropy <= bound + 1e-9).all())


def test_single_head_sync_is_nan():
    s = fastdiag.head_stats(random_probs((2, 1, 4, 4), seed=1))
    assert torch.isnan(s.sync()).all()
    assert torch.isnan(s.spectral_gap()).all()
    assert s.entropy_spread().item() == 0.0
