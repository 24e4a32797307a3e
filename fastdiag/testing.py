"""Random attention probabilities shared by tests and benchmarks: causal, with padded query rows."""
from __future__ import annotations

import torch


def random_probs(shape, dtype=torch.float32, causal=True, seed=0, device="cpu", garbage_rows=None):
    """Post-softmax probabilities ``[..., H, Tq, Tk]`` with heads of distinct sharpness.

    Each head's logits get their own temperature so head entropies differ (as in trained models),
    and ``causal`` masks keys after the query (aligned at the end when Tq != Tk).
    ``garbage_rows`` (bool ``[..., B, Tq]``) rows are overwritten with NaN / out-of-range values,
    which must be ignored when those rows are masked out.
    """
    g = torch.Generator().manual_seed(seed)
    *lead, h, tq, tk = shape
    logits = torch.randn(*shape, generator=g, dtype=torch.float64)
    temperature = torch.linspace(0.3, 3.0, h, dtype=torch.float64).view(h, 1, 1)
    logits = logits * temperature
    if causal:
        q = torch.arange(tq).view(tq, 1) + (tk - tq)
        k = torch.arange(tk).view(1, tk)
        logits = logits.masked_fill(k > q, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # rows with no visible key (Tq > Tk)
    if garbage_rows is not None:
        bad = garbage_rows.unsqueeze(-2).unsqueeze(-1).expand_as(probs)
        junk = torch.full_like(probs, float("nan"))
        junk[..., ::2] = 7.0
        probs = torch.where(bad, junk, probs)
    return probs.to(dtype).to(device)


def random_query_mask(shape, seed=0, keep=0.7, device="cpu"):
    """Bool ``shape`` (``[..., B, Tq]``) with at least one valid row per problem."""
    g = torch.Generator().manual_seed(seed + 1)
    mask = torch.rand(shape, generator=g) < keep
    flat = mask.reshape(-1, shape[-2] * shape[-1]) if len(shape) >= 2 else mask.reshape(1, -1)
    flat[:, 0] = True
    return flat.reshape(shape).to(device)
