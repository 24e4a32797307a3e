"""Head statistics from Q and K in plain PyTorch, a chunk of query rows at a time: nothing of size
Tq × Tk is held whole. The twin of `qk_stats_triton` (same arguments, same sums), checked against the
float64 `qk_stats_ref` by the same tests."""
from __future__ import annotations

import torch

from .constants import LOG_P_FLOOR, MASKED_SCORE, MASS_TOLERANCE, exact_fp32_matmul

CHUNK_BYTES = 64 * 2**20   # scores formed at a time (fp32)


def qk_stats_torch(q4, k4, mask4, is_causal: bool, scale: float, rows_ok, lse, chunk_bytes: int, check_lse: bool):
    """HeadStats sums ``(gram [H, H], entropy_sum [H], rows, invalid)`` in float64 from ``q4 [B, H, Tq, D]``,
    ``k4 [B, Hk, Tk, D]`` (arguments as `qk_stats_triton`), scoring ``chunk_bytes`` of rows at a time
    (keys sliced to the causal bound). ``check_lse``: count rows whose mass is off (a given LSE that
    disagrees with the scores).

    Sharp rows keep their digits (σ_l within 1e-5 of float64 at logit gaps up to 1e4): the scores are
    float64 (a float32 score of size 1e3 is 6e-5 off, and a sharp row's entropy is made of
    ``exp(s_j − s_max)`` of its runners-up, which carries that error whole), each row is shifted by its
    own maximum, ``x = s − max`` (exactly 0 at the top key), and with ``L = log Σ exp x`` taken as
    ``log1p`` of the sum over the other keys the entropy is ``Σ p (L − x)``, a sum of non-negative
    terms. ``−Σ p (s − lse)`` cancels: its top term is the difference of two numbers of size |s| whose
    true value is the row's tiny mass off the top (3e-4 relative on σ_l with a float32 LSE). A given
    LSE is only checked, never used for p: the row maximum costs one reduction of the chunk scored here anyway.

    The CPU default, and pass 2 on a GPU where the Triton pass 2 does not fit the device's shared
    memory (float32 inputs everywhere: `qk_stats_triton`). Products are float32 or wider whatever
    the user's matmul-precision setting (`exact_fp32_matmul`)."""
    with exact_fp32_matmul():
        b, h, tq, d = q4.shape
        hk, tk = k4.shape[1], k4.shape[2]
        group = h // hk
        # the scores: float64 for float32 inputs (see above); bf16 / fp16 ones (a 1e-3 target) keep float32
        acc = torch.float64 if q4.dtype in (torch.float32, torch.float64) else torch.float32
        # Fold the query group into the rows: each key head's K is read once, never copied per group.
        qg = (q4.to(acc) * scale).reshape(b, hk, group, tq, d)
        kt = k4.to(acc).transpose(-1, -2)                                  # [B, Hk, D, Tk]
        gram = torch.zeros(h, h, dtype=torch.float64, device=q4.device)
        entropy = torch.zeros(h, dtype=torch.float64, device=q4.device)
        invalid = torch.zeros((), dtype=torch.float64, device=q4.device)
        if mask4 is not None and mask4.dtype != torch.bool:
            mask4 = mask4.to(acc).clamp_min(MASKED_SCORE)                   # masked keys: a finite score
        rows = min(tq, max(1, chunk_bytes // max(1, b * h * tk * acc.itemsize)))
        if is_causal:   # the diagonal block of every chunk: key j is in row i's future iff j > i
            future = torch.ones(rows, rows, dtype=torch.bool, device=q4.device).triu_(1)
        for r0 in range(0, tq, rows):
            r1 = min(tq, r0 + rows)
            n, kb = r1 - r0, (min(tk, r1) if is_causal else tk)
            s = (qg[..., r0:r1, :].reshape(b, hk, group * n, d) @ kt[..., :kb]).view(b, h, n, kb)
            if mask4 is not None:
                m = mask4[..., r0:r1, :kb] if mask4.shape[-2] > 1 else mask4[..., :kb]
                if m.dtype == torch.bool:
                    s = s.masked_fill_(~m, MASKED_SCORE)
                else:
                    s = s.add_(m)
            if is_causal and r0 + 1 < kb:
                # only keys r0 + 1 .. r1 - 1 can lie in a row's future: mask that diagonal block alone
                s[..., r0:].masked_fill_(future[:n, :kb - r0], MASKED_SCORE)
            top = s.amax(-1)                                               # [B, H, rows], float64
            ok = None if rows_ok is None else rows_ok[:, None, r0:r1]    # [B, 1, rows]
            if ok is not None:
                # an invalid row's maximum may be ±inf or NaN: finite keeps x finite, p is zeroed below
                top = torch.where(ok, top, top.nan_to_num(0.0, 0.0, 0.0))
            x = s.sub_(top[..., None]).to(torch.float32).clamp_min_(LOG_P_FLOOR)   # s − max: 0 at the top
            e = torch.exp(x)
            at_top = x == 0
            # Σ exp x over all keys but one top key (ties are 1 each): the row's mass off its top, whole
            # (≥ 0 on a valid row, which has a top key; an invalid row's, clamped, keeps L finite)
            rest = (torch.where(at_top, 0.0, e).sum(-1) + (at_top.sum(-1) - 1)).clamp_min_(0.0)
            log_mass = torch.log1p(rest)                                   # L = log Σ exp x = lse − max
            p = e.div_((rest + 1)[..., None])
            if ok is not None:
                p = p.masked_fill_(~ok[..., None], 0.0)
            entropy += torch.linalg.vecdot(p, x.neg_().add_(log_mass[..., None])).sum((0, 2), dtype=torch.float64)
            if check_lse:
                mass = torch.exp(top + log_mass.double() - lse[..., r0:r1].double())   # Σ exp(s − lse)
                off = ~((mass - 1).abs() <= MASS_TOLERANCE)                # NaN counts as off
                invalid += (off if ok is None else off & ok).sum(dtype=torch.float64)
            # float64 products: one fp32 dot over a chunk's n·kb columns lost 2e-5 to 6e-5 relative at
            # [2, 32, 257, 128] on an H200 (cuBLAS, TF32 off), over the 1e-5 target
            flat = p.view(b, h, n * kb).double()
            gram += (flat @ flat.transpose(-1, -2)).sum(0)
        invalid += (~torch.isfinite(gram)).any().double() + (~torch.isfinite(entropy)).any().double()
        rows_total = (torch.full((), float(b * tq), dtype=torch.float64, device=q4.device) if rows_ok is None
                      else rows_ok.sum(dtype=torch.float64))
    return gram, entropy, rows_total, invalid
