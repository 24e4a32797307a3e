"""σ_l and s_l of the Triton pass 2 on sharp rows against float64 of the same inputs (issue 39, 7).

    TRITON_INTERPRET=1 python benchmarks/sharp_rows_triton.py [float32|float16]

Scores of std gap / 3 (a row's top key leads its runners-up by ~gap), each row shifted by a constant of
std ``offset`` (softmax unchanged, |s| as large as the offset); B 2, H 4, T 16, D 8, full and causal.
Each Triton pass 2 (per head, its first plan; batched) with pass 1's LSE, float64's rounded to float32
("lse64") and torch's float32 one ("lse32", another kernel's accumulation order): the relative errors of
σ_l (floor 1e-6) and s_l, and ``invalid`` (> 0: the rows are named, the statistics NaN).
benchmarks/RESULTS.md, "Sharp rows on the Triton pass 2".
"""
from __future__ import annotations

import sys

import torch

from fastdiag.core.kernels import qk_stats_triton as kernels
from fastdiag.core.kernels.qk_stats_ref import qk_stats_ref
from fastdiag.core.stats import HeadStats

GAPS = (30.0, 100.0, 300.0, 1e3, 1e4)
OFFSETS = (0.0, 1e2, 1e3, 1e4)


def sharp_inputs(gap: float, offset: float, dtype: torch.dtype, seed: int, b=2, h=4, t=16, d=8):
    """q [B, H, T, D] and k with scores of std gap / 3, each row shifted by a constant of std offset."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(b, h, t, d, generator=g), torch.randn(b, h, t, d, generator=g)
    q = q * (gap / 3 / (q @ k.transpose(-1, -2) / d ** 0.5).std())
    if offset:
        c = torch.randn(b, h, 1, d, generator=g)
        k = k + c * (offset / ((q @ c.transpose(-1, -2)) / d ** 0.5).std())
    return q.to(dtype), k.to(dtype)


def errors(got: HeadStats, want: HeadStats) -> tuple[float, float, float]:
    sigma, want_sigma = got.entropy_spread().item(), want.entropy_spread().item()
    sync, want_sync = got.sync().item(), want.sync().item()
    return abs(sigma - want_sigma) / max(want_sigma, 1e-6), abs(sync - want_sync) / abs(want_sync), got.invalid.item()


def case(gap: float, offset: float, dtype: torch.dtype, causal: bool) -> dict:
    """{(path, LSE source): (σ_l error, s_l error, invalid)} for one input."""
    q, k = sharp_inputs(gap, offset, dtype, seed=0)
    t, d = q.shape[2], q.shape[3]
    scale = d ** -0.5
    want = HeadStats(*qk_stats_ref(q.double(), k.double(), is_causal=causal))
    future = torch.ones(t, t, dtype=torch.bool).triu(1) if causal else torch.zeros(t, t, dtype=torch.bool)
    s64 = ((q.double() @ k.double().transpose(-1, -2)) * scale).masked_fill(future, float("-inf"))
    s32 = ((q.float() @ k.float().transpose(-1, -2)) * scale).masked_fill(future, float("-inf"))
    tiles = kernels.tile_config(q.shape[1], k.shape[1], d, element_bytes=q.dtype.itemsize)
    out = {}
    for source, lse in (("pass1", None), ("lse64", s64.logsumexp(-1).float()), ("lse32", s32.logsumexp(-1))):
        out["heads", source] = errors(HeadStats(*kernels.qk_stats_triton(q, k, None, causal, scale, None, lse)), want)
        out["batched", source] = errors(
            HeadStats(*kernels.qk_stats_triton(q, k, None, causal, scale, None, lse, tiles=tiles)), want)
    return out


def main() -> None:
    dtype = getattr(torch, sys.argv[1]) if len(sys.argv) > 1 else torch.float32
    print("dtype", dtype)
    print(f"{'gap':>6} {'offset':>6} {'causal':>6} {'path':>8} {'lse':>6} {'sigma_err':>10} {'sync_err':>10} inv")
    for gap in GAPS:
        for offset in OFFSETS:
            if offset and offset < gap:
                continue
            for causal in (False, True):
                for (path, source), (sigma, sync, invalid) in case(gap, offset, dtype, causal).items():
                    print(f"{gap:6.0f} {offset:6.0f} {causal!s:>6} {path:>8} {source:>6} {sigma:10.2e} {sync:10.2e} "
                          f"{invalid:.0f}")


if __name__ == "__main__":
    main()
