"""Pure-PyTorch head statistics: the float64 reference and the fast chunked CPU path.

Both take ``probs [N, B, H, Tq, Tk]`` and an optional bool ``query_mask [N, B, Tq]`` (True = valid
row) and return the four sums of `fastdiag.HeadStats` as a tuple
``(gram [N, H, H], entropy_sum [N, H] float64, rows [N], invalid [N])``. Tests and benchmarks import
these same functions, so the ground truth never drifts between them.

Precision (SPEC §3). Near-uniform attention makes every row entropy ≈ log(keys) while the heads
differ by ~1e-5 of that, so float32 sums of ``-p log p`` lose σ_H. Each row's entropy is therefore
taken relative to ``c = log n`` for a per-row key count ``n``:

    h = -Σ p log p = c·Σp − Σ p log(n p)

``Σ p log(n p)`` is small for a row near uniform over its n keys (it is the KL divergence to uniform
plus ``c(Σp − 1)``), so float32 keeps its digits; ``c·Σp`` and every sum over rows are float64.
"""
from __future__ import annotations

import math

import torch


def _valid_rows(probs: torch.Tensor, query_mask: torch.Tensor | None) -> torch.Tensor:
    n, b, _, tq, _ = probs.shape
    if query_mask is None:
        return torch.ones(n, b, tq, dtype=torch.bool, device=probs.device)
    return query_mask.expand(n, b, tq)


def causal_keys(tq: int, tk: int) -> int:
    """Offset of the causal diagonal: query row q may see keys ``k <= q + offset`` (aligned at the end)."""
    return tk - tq


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


# Rows per chunk: about this many elements, so a chunk's passes run from the L2 cache (CPU). On a
# GPU (the torch backend there is a fallback) one chunk is the whole problem.
_CHUNK_ELEMENTS = {"cpu": 1 << 18}
_TINY = 1e-30   # log(n p + tiny): finite at p = 0, where the term is 0 · finite = 0
_SHORT_ROW_KEYS = 32


def _chunk_sums(x: torch.Tensor, keep: torch.Tensor | None, xb: torch.Tensor, wb: torch.Tensor):
    """Sums of one chunk ``x [P, G, H, R, K]`` (P problems, G groups of R rows each): Gram [P, H, H]
    (float32), entropy [P, H] (float64), min and max [P]. ``keep [P, G, R]``: valid rows; the others
    are zeroed (they may hold NaN). ``xb``, ``wb``: reusable buffers of at least x's size (fresh large
    allocations page-fault on every chunk)."""
    p, _, h = x.shape[:3]
    wb = wb[:x.numel()].view(x.shape)
    if keep is None and x.dtype == xb.dtype:
        xb = x                                                         # read in place
    else:
        xb = xb[:x.numel()].view(x.shape).copy_(x)
        if keep is not None:
            xb.masked_fill_(~keep[:, :, None, :, None], 0.0)           # not multiply: padded rows may hold NaN
    heads = xb.transpose(1, 2).reshape(p, h, -1)                       # a view when G = 1
    gram = torch.bmm(heads, heads.transpose(1, 2))
    lo, hi = torch.stack([torch.stack(torch.aminmax(xb[i])) for i in range(p)]).unbind(1)   # NaN propagates
    # Per-row reference: n = the row's non-zero keys (masked keys are exact zeros after softmax).
    if x.shape[-1] <= _SHORT_ROW_KEYS:
        # Short rows (grokking: T = 3): float64 costs little here and needs no per-row reference.
        x64 = xb.double()
        plogp = x64.clamp_min(_TINY).log_().mul_(x64)                      # p log p, 0 at p = 0
        return gram, -plogp.transpose(1, 2).reshape(p, h, -1).sum(-1), lo, hi
    ones = torch.ones(x.shape[-1], dtype=xb.dtype, device=xb.device)   # row sums as matvecs: fast for any K
    nonzero = torch.sign(xb, out=wb)
    keys = (nonzero @ ones).unsqueeze(-1)                              # [P, G, H, R, 1]
    # Σp − 1 = Σ (p − 1/n) over the non-zero keys: small terms, exact enough in float32
    inv = keys.clamp_min(1).reciprocal()
    excess = torch.sub(xb, nonzero.mul_(inv), out=wb) @ ones              # (broadcast addcmul is slow)
    log_np = torch.mul(xb, keys, out=wb).add_(_TINY).log_()
    kl = log_np.mul_(xb) @ ones                                        # Σ p log(n p), small
    c = keys.squeeze(-1).clamp_min(1).double().log()
    entropy = (c * (1 + excess.double()) - kl.double()).sum((1, 3))    # [P, H]
    return gram, entropy, lo, hi


def _chunks(n: int, b: int, tq: int, chunk_rows: int):
    """(problems, batch entries, query rows) slices covering ``[N, B, Tq]`` in cache-sized chunks:
    several whole problems, several whole batch entries of one problem, or rows of one entry."""
    if chunk_rows >= b * tq:                                            # grokking: T = 3
        step = chunk_rows // (b * tq)
        return [(slice(i, i + step), slice(0, b), slice(0, tq)) for i in range(0, n, step)]
    if chunk_rows >= tq:
        step = chunk_rows // tq
        return [(slice(i, i + 1), slice(j, j + step), slice(0, tq)) for i in range(n) for j in range(0, b, step)]
    return [(slice(i, i + 1), slice(j, j + 1), slice(q0, q0 + chunk_rows))
            for i in range(n) for j in range(b) for q0 in range(0, tq, chunk_rows)]


def head_stats_torch(probs: torch.Tensor, query_mask: torch.Tensor | None = None, causal: bool = False):
    """Fast path: one chunked pass (rows that fit the cache: Gram, entropy and range check), float64
    final sums. ``causal``: keys after the causal diagonal are zero and are not read."""
    n, b, h, tq, tk = probs.shape
    device = probs.device
    valid = _valid_rows(probs, query_mask)
    budget = _CHUNK_ELEMENTS.get(device.type, probs.numel())
    chunk_rows = max(1, budget // (h * tk))
    offset = causal_keys(tq, tk)
    work_dtype = torch.float64 if probs.dtype == torch.float64 else torch.float32
    work = [torch.empty(min(probs.numel(), max(chunk_rows, b * tq) * h * tk), dtype=work_dtype, device=device)
            for _ in range(2)]
    f64 = dict(dtype=torch.float64, device=device)
    gram, entropy = torch.zeros(n, h, h, **f64), torch.zeros(n, h, **f64)
    lo, hi = torch.full((n,), math.inf, **f64), torch.full((n,), -math.inf, **f64)
    for problems, batch, rows in _chunks(n, b, tq, chunk_rows):
        keys = tk
        if causal:
            keys = max(0, min(tk, min(rows.stop, tq) + offset))           # the last row's visible keys
            if keys == 0:
                continue                                                # rows that see no key
        keep = None if query_mask is None else valid[problems, batch, rows]
        g, e, c_lo, c_hi = _chunk_sums(probs[problems, batch, :, rows, :keys], keep, *work)
        gram[problems] += g
        entropy[problems] += e
        lo[problems] = torch.minimum(lo[problems], c_lo)
        hi[problems] = torch.maximum(hi[problems], c_hi)
    invalid = (~((lo >= 0) & (hi <= 1))).to(torch.float32)             # NaN fails both
    rows = valid.sum(dim=(1, 2)).to(torch.float32)
    return gram.float(), entropy, rows, invalid
