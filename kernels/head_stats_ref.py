"""Pure-PyTorch head statistics: the float64 reference and the fast vectorised CPU path.

Both take ``probs [N, B, H, Tq, Tk]`` and an optional bool ``query_mask [N, B, Tq]`` (True = valid
row) and return the four sums of `fastdiag.HeadStats` as a tuple
``(gram [N, H, H], entropy_sum [N, H], rows [N], invalid [N])``. Tests and benchmarks import these
same functions, so the ground truth never drifts between them.
"""
from __future__ import annotations

import torch


def _valid_rows(probs: torch.Tensor, query_mask: torch.Tensor | None) -> torch.Tensor:
    n, b, _, tq, _ = probs.shape
    if query_mask is None:
        return torch.ones(n, b, tq, dtype=torch.bool, device=probs.device)
    return query_mask.expand(n, b, tq)


def head_stats_ref(probs: torch.Tensor, query_mask: torch.Tensor | None = None,
                   acc_dtype: torch.dtype = torch.float64):
    """SPEC §3 written the obvious way: flatten each head over (batch, rows, keys), Gram, entropies."""
    n, b, h, tq, tk = probs.shape
    valid = _valid_rows(probs, query_mask)
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


_SMALL_ROWS = 4096


def head_stats_torch(probs: torch.Tensor, query_mask: torch.Tensor | None = None):
    """Fast path: float32 accumulation, Gram by matmul, entropy and range check in two more passes."""
    n, b, h, tq, tk = probs.shape
    x = probs if probs.dtype in (torch.float32, torch.float64) else probs.float()
    if query_mask is not None:
        # where, not multiply: a padded row may hold NaN (softmax of an all-masked row)
        keep = query_mask.expand(n, b, tq)[:, :, None, :, None]
        x = torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))
    flat = x.reshape(n, b, h, tq * tk)
    if b > 1 and tq * tk < _SMALL_ROWS:
        # Tiny per-batch blocks (grokking: T = 3) starve a batched matmul; one head-major copy is cheaper.
        heads = flat.transpose(1, 2).reshape(n, h, b * tq * tk)
        gram = heads @ heads.transpose(-1, -2)
    else:
        gram = torch.matmul(flat, flat.transpose(-1, -2)).sum(1)       # no head-major copy
    entropy_sum = torch.special.entr(flat).sum(dim=(1, 3))              # [N, H]
    lo, hi = torch.aminmax(x.reshape(n, -1), dim=-1)                    # NaN propagates
    invalid = (~((lo >= 0) & (hi <= 1))).to(torch.float32)
    rows = _valid_rows(probs, query_mask).sum(dim=(1, 2)).to(torch.float32)
    return gram.float(), entropy_sum.float(), rows, invalid
