"""Pure-PyTorch head statistics: the float64 reference (the fast chunked CPU path, written with the
same sums, is `head_stats_torch.py`).

Both take ``probs [N, B, H, Tq, Tk]`` and an optional bool ``query_mask [N, B, Tq]`` (True = valid
row) and return the four sums of `fastdiag.HeadStats` as a tuple
``(gram [N, H, H], entropy_sum [N, H] float64, rows [N], invalid [N])``. Tests and benchmarks import
these same functions, so the ground truth never drifts between them.

Precision (README, "The diagnostics": the exactness targets). Near-uniform attention makes every row entropy ≈ log(keys) while the heads
differ by ~1e-5 of that, so float32 sums of ``-p log p`` lose σ_H. Each row's entropy is therefore
taken relative to ``c = log n`` for a per-row key count ``n``:

    h = -Σ p log p = c·Σp − Σ p log(n p)

``Σ p log(n p)`` is small for a row near uniform over its n keys (it is the KL divergence to uniform
plus ``c(Σp − 1)``), so float32 keeps its digits; ``c·Σp`` and every sum over rows are float64.
"""
from __future__ import annotations

import torch


def row_validity(probs: torch.Tensor, query_mask: torch.Tensor | None) -> torch.Tensor:
    n, b, _, tq, _ = probs.shape
    if query_mask is None:
        return torch.ones(n, b, tq, dtype=torch.bool, device=probs.device)
    return query_mask.expand(n, b, tq)


def causal_keys(tq: int, tk: int) -> int:
    """Offset of the causal diagonal: query row q may see keys ``k <= q + offset`` (aligned at the end)."""
    return tk - tq


def head_stats_ref(probs: torch.Tensor, query_mask: torch.Tensor | None = None,
                   acc_dtype: torch.dtype = torch.float64):
    """The definitions (README, "The diagnostics") written the obvious way: flatten each head over (batch, rows, keys), Gram, entropies."""
    n, b, h, tq, tk = probs.shape
    valid = row_validity(probs, query_mask)
    p = probs.to(acc_dtype)
    p = torch.where(valid[:, :, None, :, None], p, torch.zeros((), dtype=acc_dtype, device=p.device))
    heads = p.permute(0, 2, 1, 3, 4).reshape(n, h, b * tq * tk)
    gram = heads @ heads.transpose(-1, -2)
    row_entropy = -torch.special.xlogy(p, p).sum(-1)                  # [N, B, H, Tq]
    entropy_sum = row_entropy.sum(dim=(1, 3))
    rows = valid.sum(dim=(1, 2)).to(acc_dtype)
    in_range = (p >= 0) & (p <= 1)                                     # False for NaN
    invalid = (~in_range).sum(dim=(1, 2, 3, 4)).to(acc_dtype)
    return gram, entropy_sum, rows, invalid
