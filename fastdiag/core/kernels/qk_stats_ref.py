"""Float64 reference for head statistics taken straight from Q and K (the masking rules of README, "The diagnostics").

Builds the full probabilities ``softmax(q kᵀ · scale + mask)`` in float64 and hands them to
`head_stats_ref`, so the Q/K kernels are checked against the same ground truth as the probability
kernels. Tests and benchmarks import this function; it is written the obvious way on purpose.

Masking semantics: the one rule of `rows` (shared by every path), plus ``is_causal`` putting a key in
the future of the query (top-left aligned). A query row counts iff it sees at least one key in every
head and ``query_mask`` (bool ``[B, Tq]``, True = valid) keeps it.
"""
from __future__ import annotations

import torch

from .head_stats_ref import head_stats_ref
from .rows import visible_keys


visible_keys_ref = visible_keys   # the rule as the references read it (tests import this name)


def qk_stats_ref(q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None = None,
                 is_causal: bool = False, scale: float | None = None,
                 query_mask: torch.Tensor | None = None):
    """``(gram [H, H], entropy_sum [H], rows, invalid)`` in float64 for q ``[B, H, Tq, D]``,
    k ``[B, Hk, Tk, D]`` (Hk divides H: query head h reads key head ``h // (H // Hk)``)."""
    b, h, tq, d = q.shape
    hk, tk = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    q64 = q.double()
    k64 = k.double().repeat_interleave(h // hk, dim=1)
    scores = (q64 @ k64.transpose(-1, -2)) * scale
    visible = visible_keys_ref(attn_mask, is_causal, (b, h, tq, tk), q.device)
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        scores = scores + attn_mask.double()
    scores = scores.masked_fill(~visible, float("-inf"))
    rows_ok = visible.any(-1).all(1)                                    # [B, Tq]
    if query_mask is not None:
        rows_ok = rows_ok & query_mask
    probs = scores.softmax(-1)                                          # NaN on fully masked rows
    gram, entropy_sum, rows, invalid = head_stats_ref(probs[None], rows_ok[None])
    return gram[0], entropy_sum[0], rows[0], invalid[0]
