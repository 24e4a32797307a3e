"""The native CPU kernel for the Q/K statistics (fastdiag/core/kernels/qk_stats_cpu.c) against the
float64 reference, where its own code paths split: odd sizes around its register tiles (6 query rows,
16 keys, 8 lanes), threads, rows scored again in float64, non-finite inputs, and its fallback.
The shared cases (every mask kind, GQA, LSE checks) run through `backend="torch"` in test_qk_stats.py.
Inputs live inside buffers padded with +inf: an out-of-bounds read turns into inf/NaN and fails."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fastdiag.core.kernels import qk_stats_cpu as native
from fastdiag.core.kernels.qk_stats_ref import qk_stats_ref
from fastdiag.core.kernels.qk_stats_torch import CHUNK_BYTES, qk_stats_torch
from fastdiag.core.kernels.rows import valid_rows
from fastdiag.core.stats import HeadStats
from fastdiag.testing import in_inf_padding, rel_err

pytestmark = pytest.mark.skipif(native.unavailable_reason() is not None,
                                reason=f"native kernel unavailable: {native.unavailable_reason()}")


def _close(got: HeadStats, want: HeadStats, tol: float = 1e-5) -> None:
    assert got.invalid.item() == 0
    assert torch.equal(got.rows.double(), want.rows.double())
    assert rel_err(got.gram, want.gram) <= tol
    assert rel_err(got.entropy_sum, want.entropy_sum, floor=1e-9 * max(1.0, want.rows.item())) <= tol
    if want.rows.item() > 0:
        assert abs(got.entropy_spread().item() - want.entropy_spread().item()) <= tol * max(
            1e-3, want.entropy_spread().item())


# (B, H, Hk, Tq, Tk, D): Tq around the 6-row tile, Tk around the 16-key panel and 8-float lanes,
# D below, at and past a lane multiple, GQA and MQA, Tq ≠ Tk both ways
SHAPES = [(1, 1, 1, 1, 1, 1), (1, 2, 1, 3, 2, 3), (2, 3, 3, 5, 7, 7), (1, 4, 2, 6, 16, 8), (3, 2, 1, 13, 17, 13),
          (1, 6, 3, 7, 33, 64), (2, 4, 4, 40, 25, 130), (1, 2, 2, 70, 70, 16)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"B{b}H{h}Hk{hk}Tq{tq}Tk{tk}D{d}" for b, h, hk, tq, tk, d in SHAPES])
def test_odd_shapes_match_float64(shape, causal):
    b, h, hk, tq, tk, d = shape
    gen = torch.Generator().manual_seed(sum(shape) + causal)
    q = in_inf_padding(torch.randn(b, h, tq, d, generator=gen))
    k = in_inf_padding(torch.randn(b, hk, tk, d, generator=gen))
    query_mask = torch.rand(b, tq, generator=gen) > 0.25
    want = HeadStats(*qk_stats_ref(q.double(), k.double(), None, causal, 0.9 / d ** 0.5, query_mask))
    rows_ok = valid_rows(None, causal, (b, h, tq, tk), query_mask)
    got = HeadStats(*native.qk_stats_cpu(q, k, None, causal, 0.9 / d ** 0.5, rows_ok, None, False))
    _close(got, want)


def test_long_near_uniform_rows_keep_a_tiny_entropy_spread():
    """Rows of 1,100 keys (many of the kernel's 64-key float32 blocks, summed in float64 across blocks)
    with near-uniform probabilities: σ_H 5e-6. Summed in float32 along the whole row, σ_H came out
    3.3e-9 off; with the blocks 1e-10 (float64 sums throughout: 6e-11)."""
    gen = torch.Generator().manual_seed(11)
    q = in_inf_padding(0.02 * torch.randn(1, 6, 40, 32, generator=gen))
    k = in_inf_padding(torch.randn(1, 6, 1100, 32, generator=gen))
    want = HeadStats(*qk_stats_ref(q.double(), k.double(), None, False, 32 ** -0.5, None))
    got = HeadStats(*native.qk_stats_cpu(q, k, None, False, 32 ** -0.5, None, None, False))
    _close(got, want)
    assert want.entropy_spread().item() < 1e-4
    assert abs(got.entropy_spread().item() - want.entropy_spread().item()) <= 2e-9


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_threads_give_the_same_statistics(threads):
    """Each thread sums its own rows; the partial sums are added in thread order. Any thread count
    gives the reference statistics; the same count gives the same bits twice."""
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 4, 50, 32, generator=gen), torch.randn(2, 4, 50, 32, generator=gen)
    mask = torch.rand(2, 1, 50, 50, generator=gen) > 0.2
    mask[..., 0] = True
    want = HeadStats(*qk_stats_ref(q.double(), k.double(), mask, False, 32 ** -0.5, None))
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        first = native._launch(q, k, mask, False, 32 ** -0.5, None, None, False)
        again = native._launch(q, k, mask, False, 32 ** -0.5, None, None, False)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(first, again)
    _close(HeadStats(*native.qk_stats_cpu(q, k, mask, False, 32 ** -0.5, None, None, False)), want)


def test_rows_float32_cannot_hold_are_scored_again_in_float64():
    """A sharp row (scores ~1e3 log2 units) is past the float32 bound and is scored again in float64
    (counted in the launch's last entry); ordinary attention is not. Both match float64."""
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 2, 20, 16, generator=gen), torch.randn(1, 2, 20, 16, generator=gen)
    plain = native._launch(q, k, None, True, 0.25, None, None, False)
    assert plain[-1].item() == 0
    sharp_q = q * 300
    sharp = native._launch(sharp_q, k, None, True, 0.25, None, None, False)
    assert sharp[-1].item() == 2 * 20                                   # every (row, head)
    want = HeadStats(*qk_stats_ref(sharp_q.double(), k.double(), None, True, 0.25, None))
    got = HeadStats(*native.qk_stats_cpu(sharp_q, k, None, True, 0.25, None, None, False))
    assert rel_err(got.entropy_sum, want.entropy_sum, floor=1e-12) <= 1e-5
    assert rel_err(got.gram, want.gram) <= 1e-5


@pytest.mark.parametrize("bad", ["nan-q", "inf-k", "nan-mask"])
def test_non_finite_inputs_are_counted_invalid(bad):
    """A NaN or inf in a valid row is never hidden by the floor of x or the row maximum: invalid > 0,
    as on the torch path."""
    gen = torch.Generator().manual_seed(7)
    q, k = torch.randn(1, 2, 9, 8, generator=gen), torch.randn(1, 2, 9, 8, generator=gen)
    mask = torch.zeros(1, 1, 9, 9)
    if bad == "nan-q":
        q[0, 1, 4, 3] = float("nan")
    elif bad == "inf-k":
        k[0, 0, 2, 5] = float("inf")
    else:
        mask[0, 0, 3, 6] = float("nan")
    got = native.qk_stats_cpu(q, k, mask, False, 0.3, None, None, False)
    pure = qk_stats_torch(q, k, mask, False, 0.3, None, None, CHUNK_BYTES, False)
    assert got[3].item() > 0 and pure[3].item() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_inputs_and_float_masks(dtype):
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(2, 4, 11, 24, generator=gen).to(dtype)
    k = torch.randn(2, 2, 11, 24, generator=gen).to(dtype)
    mask = (torch.randn(2, 1, 11, 11, generator=gen) * 2).to(dtype)
    want = HeadStats(*qk_stats_ref(q.double(), k.double(), mask.double(), True, 0.2, None))
    _close(HeadStats(*native.qk_stats_cpu(q, k, mask, True, 0.2, None, None, False)), want)
    double_mask = HeadStats(*native.qk_stats_cpu(q, k, mask.double(), True, 0.2, None, None, False))
    _close(double_mask, want)


def test_without_a_compiler_the_torch_path_runs_and_says_so(tmp_path):
    """No C compiler (CC points nowhere, an empty cache): one RuntimeWarning says why, and the
    statistics come from the (equally exact) torch path."""
    script = textwrap.dedent("""
        import warnings, torch
        from fastdiag.qk import qk_head_stats
        from fastdiag.core.kernels import qk_stats_cpu as native
        q = torch.randn(1, 2, 8, 8); k = torch.randn(1, 2, 8, 8)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = qk_head_stats(q, k, is_causal=True, backend="torch")
        ref = qk_head_stats(q, k, is_causal=True, backend="reference")
        assert native.unavailable_reason() is not None
        assert [str(w.message) for w in seen if "native CPU kernel" in str(w.message)], seen
        assert torch.allclose(got.gram, ref.gram, rtol=1e-5) and torch.allclose(got.entropy_sum, ref.entropy_sum, rtol=1e-5)
        print("fallback ok")
    """)
    env = {**os.environ, "CC": str(tmp_path / "no-such-compiler"), "FASTDIAG_CACHE": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "fallback ok" in out.stdout


def test_switched_off_by_the_environment(monkeypatch):
    q = torch.randn(1, 2, 4, 8)
    assert native.usable(q, q, None)
    assert not native.usable(q.double(), q.double(), None)       # float64 inputs: the torch path
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    assert not native.usable(q, q, None)


def test_an_empty_batch_gives_empty_sums():
    q = torch.randn(0, 3, 5, 8)
    got = HeadStats(*native.qk_stats_cpu(q, q, None, True, 0.3, None, None, False))
    want = HeadStats(*qk_stats_ref(q.double(), q.double(), None, True, 0.3, None))
    assert torch.equal(got.gram, want.gram) and torch.equal(got.entropy_sum, want.entropy_sum)
    assert got.rows.item() == 0 and got.invalid.item() == 0
