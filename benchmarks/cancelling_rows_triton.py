"""16-bit Q/K rows whose products cancel, on the Triton pass 2, against float64 of the same inputs (issue 39).

    TRITON_INTERPRET=1 python benchmarks/cancelling_rows_triton.py [--emulate]

Kernels: `fastdiag.testing.cancelling_qk` (fp16, B 2, H 4, T 16, D 64; runners-up whose products cancel
exactly, Σ_d |q_d k_d| ~ 48·size² against |s| < 10 nats; each row's top key exact, so the mass check is
blind), with a key-padding mask, each Triton pass 2 (per head plans 0 and 1, batched) with pass 1's LSE:
the largest relative error of a head's entropy sum and of σ_l, and ``invalid`` (> 0: named, NaN).

``--emulate``: the constant of `row_entropy_triton.CANCEL_ROUNDING`: float64 emulation of float32-accumulated
fp16 scores (torch's and numpy's summation orders), the largest relative error of a row's entropy in units
of ``2⁻²⁴·|scale|·log2 e·‖q_i‖·max_j ‖k_j‖``, per head dim, over sharp rows (gaps 3–1e3, offsets 0–1e3) and
cancelling rows. benchmarks/RESULTS.md, "Cancelling products on the Triton pass 2".
"""
from __future__ import annotations

import math
import sys

import numpy as np
import torch

from fastdiag.testing import cancelling_qk, row_entropy

SIZES = (10.0, 30.0, 100.0, 300.0)


def kernels_table() -> None:
    from fastdiag.core.kernels import qk_stats_triton as kernels
    from fastdiag.core.kernels.qk_stats_ref import qk_stats_ref
    from fastdiag.core.stats import HeadStats

    print(f"{'size':>5} {'seed':>4} {'path':>12} {'E_h err':>9} {'sigma err':>9} invalid")
    for size in SIZES:
        for seed in (0, 1):
            q, k, scale = cancelling_qk(seed, size)
            mask = torch.ones(q.shape[0], 1, 1, k.shape[2], dtype=torch.bool)
            mask[1:, ..., -3:] = False
            want = HeadStats(*qk_stats_ref(q.double(), k.double(), mask, False, scale))
            lse = kernels.row_lse_triton(q, k, mask, False, scale)
            runs = {f"heads plan {p}": kernels._heads_stats(q, k, mask, False, scale, None, lse, None, p) for p in (0, 1)}
            runs["batched"] = kernels._stats(q, k, mask, False, scale, None, lse, kernels.tile_config(4, 4, 64))
            for path, sums in runs.items():
                got = HeadStats(*sums)
                e_h = ((got.entropy_sum - want.entropy_sum).abs() / want.entropy_sum.abs()).max().item()
                sigma = want.entropy_spread().item()
                err = abs(got.entropy_spread().item() - sigma) / sigma
                print(f"{size:5.0f} {seed:4d} {path:>12} {e_h:9.2e} {err:9.2e} {got.invalid.item():.0f}")


def _worst_units(q, k, scale) -> float:
    """Largest row entropy error of float32-accumulated scores, in units of 2⁻²⁴·|scale|·log2e·‖q‖·max‖k‖."""
    s64 = (q.double() @ k.double().transpose(-1, -2)) * scale
    h64 = row_entropy(s64)
    unit = 2.0 ** -24 * abs(scale) * math.log2(math.e) * q.double().norm(dim=-1) * \
        k.double().norm(dim=-1).amax(-1, keepdim=True)
    worst = 0.0
    for s32 in ((q.float() @ k.float().transpose(-1, -2)).double(),
                torch.from_numpy(np.matmul(q.float().numpy(), np.swapaxes(k.float().numpy(), -1, -2))).double()):
        rel = (row_entropy(s32 * scale) - h64).abs() / h64.clamp_min(1e-300)
        keep = h64 > 1e-30
        worst = max(worst, (rel[keep] / unit[keep]).max().item())
    return worst


def emulation_table() -> None:
    print(f"{'D':>4} {'sharp':>7} {'cancelling':>10}   (largest row error / unit)")
    for d in (8, 16, 32, 64, 128):
        sharp = cancel = 0.0
        for seed in range(4):
            for gap in (3.0, 10.0, 30.0, 100.0, 300.0, 1e3):
                for offset in (0.0, 1e2, 1e3):
                    g = torch.Generator().manual_seed(seed * 7919 + int(gap + offset))
                    q, k = torch.randn(2, 4, 32, d, generator=g), torch.randn(2, 4, 32, d, generator=g)
                    q = q * (gap / 3 / (q @ k.transpose(-1, -2) / d ** 0.5).std())
                    if offset:
                        c = torch.randn(2, 4, 1, d, generator=g)
                        k = k + c * (offset / (q @ c.transpose(-1, -2) / d ** 0.5).std())
                    sharp = max(sharp, _worst_units(q.half(), k.half(), d ** -0.5))
            if d >= 32:
                for size in (10.0, 100.0, 300.0):
                    cancel = max(cancel, _worst_units(*cancelling_qk(seed, size, d=d)))
        print(f"{d:4d} {sharp:7.2f} {cancel:10.2f}", flush=True)


if __name__ == "__main__":
    emulation_table() if "--emulate" in sys.argv else kernels_table()
