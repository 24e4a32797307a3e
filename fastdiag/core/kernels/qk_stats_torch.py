"""Head statistics from Q and K in plain PyTorch, a chunk of query rows at a time: nothing of size
Tq × Tk is held whole. The twin of `qk_stats_triton` (same arguments, same sums), checked against the
float64 `qk_stats_ref` by the same tests."""
from __future__ import annotations

import math

import torch

from .constants import LN2, LOG2E, LOG_P_FLOOR, MASKED_SCORE, MASS_TOLERANCE, exact_fp32_matmul

CHUNK_BYTES = 64 * 2**20   # scores formed at a time
LOG2_P_FLOOR = LOG_P_FLOOR * LOG2E   # the floor of log p in log2 units (the scores' units here)
# Columns of one float32 product of the Gram: an [H, K] · [K, H] product accumulates each entry along
# K, and at H = 4 oneDNN/MKL's fp32 product lost 1e-6 at K = 4096, 3e-6 at 16384 and 2e-5 at 65536
# (relative, growing with K; this CPU, 2026-12-05). Longer chunks are cut into products of at most
# this many columns, summed in float64.
GRAM_COLUMNS = 4096


def qk_stats_torch(q4, k4, mask4, is_causal: bool, scale: float, rows_ok, lse, chunk_bytes: int, check_lse: bool):
    """HeadStats sums ``(gram [H, H], entropy_sum [H], rows, invalid)`` in float64 from ``q4 [B, H, Tq, D]``,
    ``k4 [B, Hk, Tk, D]`` (arguments as `qk_stats_triton`), scoring ``chunk_bytes`` of rows at a time
    (keys sliced to the causal bound). ``check_lse``: count rows whose mass is off (a given LSE that
    disagrees with the scores).

    Sharp rows keep their digits (σ_l within 1e-5 of float64 at logit gaps up to 1e4): the scores are
    float64 (a float32 score of size 1e3 is 6e-5 off, and a sharp row's entropy is made of
    ``exp(s_j − s_max)`` of its runners-up, which carries that error whole), each row is shifted by its
    own maximum, ``x = s − max`` (exactly 0 at the top key, so ``2^0 = 1`` exactly), and with the row's
    mass ``Σ 2^x`` summed in float64, ``L = log Σ exp x`` is ``log1p`` of the mass off the top, whole.
    The entropy is ``Σ p (L − x) = L − Σ 2^x x / Σ 2^x``, a sum of non-negative terms. ``−Σ p (s − lse)``
    cancels: its top term is the difference of two numbers of size |s| whose true value is the row's
    tiny mass off the top (3e-4 relative on σ_l with a float32 LSE). A given LSE is only checked, never
    used for p: the row maximum costs one reduction of the chunk scored here anyway. Scores are in
    log2 units (``exp2`` costs half of ``exp`` on a CPU); per-row sums are kept for all rows and the
    entropy finished once, in float64 (the difference between heads of near-uniform attention keeps
    its digits).

    Passes over a chunk of scores: the product, the row maximum, ``x``, its floor, ``2^x``, the row
    mass, ``Σ 2^x x``, p, and the Gram's float32 products of at most `GRAM_COLUMNS` columns (float64
    on CUDA, where cuBLAS lost 2e-5 to 6e-5 relative at [2, 32, 257, 128] over 66K columns).

    The CPU default, and pass 2 on a GPU where the Triton pass 2 does not fit the device's shared
    memory (float32 inputs everywhere: `qk_stats_triton`). Products are float32 or wider whatever
    the user's matmul-precision setting (`exact_fp32_matmul`)."""
    with exact_fp32_matmul():
        b, h, tq, d = q4.shape
        hk, tk = k4.shape[1], k4.shape[2]
        group = h // hk
        dev = q4.device
        # the scores: float64 for float32 inputs (see above); bf16 / fp16 ones (a 1e-3 target) keep float32
        acc = torch.float64 if q4.dtype in (torch.float32, torch.float64) else torch.float32
        # Fold the query group into the rows: each key head's K is read once, never copied per group.
        # (contiguous in one copy: a view of a fused QKV projection would be copied again by reshape)
        qg = q4.to(acc, memory_format=torch.contiguous_format, copy=True).mul_(scale * LOG2E)
        qg = qg.view(b * hk, group, tq, d)
        if group == 1:
            qg = qg.view(b * hk, tq, d)
        # (reshape: `to` returns a view of another layout as it is when the dtype is already acc's)
        kt = k4.to(acc, memory_format=torch.contiguous_format).reshape(b * hk, tk, d).transpose(-1, -2)   # [B·Hk, D, Tk]
        if mask4 is not None:   # as a bool mask, True = masked; additive: masked keys get a finite score
            mask4 = ~mask4 if mask4.dtype == torch.bool else (mask4.to(acc) * LOG2E).clamp_min_(MASKED_SCORE)
        rows = min(tq, max(1, chunk_bytes // max(1, b * h * tk * acc.itemsize)))
        if is_causal:   # the diagonal block of every chunk: key j is in row i's future iff j > i
            future = torch.ones(rows, rows, dtype=torch.bool, device=dev).triu_(1)
        # one buffer each for the chunk's scores, x = s − max (then 2^x · x) and 2^x (then p), reused
        size = b * h * rows * tk
        scores = torch.empty(size, dtype=acc, device=dev)
        x_buf = scores if acc == torch.float32 else torch.empty(size, dtype=torch.float32, device=dev)
        e_buf = torch.empty(size, dtype=torch.float32, device=dev)
        tops, masses, moments, grams = [], [], [], []
        ok = None if rows_ok is None else rows_ok[:, None, :, None]       # [B, 1, Tq, 1]
        for r0 in range(0, tq, rows):
            r1 = min(tq, r0 + rows)
            n, kb = r1 - r0, (min(tk, r1) if is_causal else tk)
            shape, stride = (b, h, n, kb), (h * n * kb, n * kb, kb, 1)
            q_rows = qg[:, r0:r1] if group == 1 else qg[:, :, r0:r1].reshape(b * hk, group * n, d)
            s = torch.bmm(q_rows, kt[..., :kb], out=scores.as_strided((b * hk, group * n, kb), (group * n * kb, kb, 1)))
            s = s.view(shape)
            if mask4 is not None:
                m = mask4[..., r0:r1, :kb] if mask4.shape[-2] > 1 else mask4[..., :kb]
                if m.dtype == torch.bool:
                    s.masked_fill_(m, MASKED_SCORE)
                else:
                    s.add_(m)
            if is_causal and r0 + 1 < kb:
                # only keys r0 + 1 .. r1 - 1 can lie in a row's future: mask that diagonal block alone
                s[..., r0:].masked_fill_(future if n == rows and kb - r0 == rows else future[:n, :kb - r0],
                                         MASKED_SCORE)
            top = torch.amax(s, -1, keepdim=True)
            x = torch.sub(s, top, out=x_buf.as_strided(shape, stride)).clamp_min_(LOG2_P_FLOOR)   # 0 at the top
            e = torch.exp2(x, out=e_buf.as_strided(shape, stride))
            if ok is not None:
                # an invalid row's maximum may be ±inf or NaN: its 2^x are zeroed (its p too, below)
                e.masked_fill_(~ok[:, :, r0:r1], 0.0)
            mass = e.sum(-1, keepdim=True, dtype=torch.float64)            # Σ 2^x, the top's 1 included
            moments.append(x.mul_(e).sum(-1))                              # Σ 2^x x (≤ 0)
            masses.append(mass)
            if check_lse:
                tops.append(top)
            inv = mass.reciprocal()
            if ok is not None:
                inv = torch.where(ok[:, :, r0:r1], inv, 0.0)
            grams.append(_gram(e.mul_(inv.to(torch.float32)), x_buf))  # e is p now
        mass = _joined(masses, 2)[..., 0]      # [B, H, Tq]
        moment = _joined(moments, 2)
        gram = _joined(grams, 0).sum(0, dtype=torch.float64)
        rest = mass - 1.0                     # the mass off the top: each tied top key counts 1
        log_mass = torch.log1p(rest)          # L = log Σ exp x (nats) = lse − max
        entropy_rows = log_mass - moment.double() * (LN2 / mass)            # Σ p (L − x), x in nats
        if ok is not None:
            entropy_rows = torch.where(ok[..., 0], entropy_rows, 0.0)
        entropy = entropy_rows.sum((0, 2))
        invalid = torch.zeros((), dtype=torch.float64, device=dev)
        if check_lse:
            top = _joined(tops, 2)[..., 0]
            off_mass = torch.exp(top.double() * LN2 + log_mass - lse.double())      # Σ exp(s − lse)
            off = ~((off_mass - 1).abs() <= MASS_TOLERANCE)                # NaN counts as off
            invalid += (off if ok is None else off & ok[..., 0]).sum(dtype=torch.float64)
        invalid += (~torch.isfinite(gram)).any().double() + (~torch.isfinite(entropy)).any().double()
        rows_total = (torch.full((), float(b * tq), dtype=torch.float64, device=dev) if rows_ok is None
                      else rows_ok.sum(dtype=torch.float64))
    return gram, entropy, rows_total, invalid


def _joined(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The chunks' per-row sums along ``dim``: a single chunk as it is (no copy)."""
    return torch.cat(parts, dim) if len(parts) > 1 else parts[0]


def _gram(p: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """Partial Grams ``[N, H, H]`` of ``p [B, H, n, kb]`` (float32) whose sum is ``Σ_b p_b p_bᵀ``: on
    CUDA one float64 product per batch entry; elsewhere float32 products of at most `GRAM_COLUMNS`
    columns (whole rows: p's rows laid side by side through ``buf``), to be summed in float64."""
    b, h, n, kb = p.shape
    if p.is_cuda or torch.compiler.is_compiling():
        # traced, the sizes may be symbolic (dynamic shapes): the product below is cut by gcd arithmetic on
        # them, which broke the graph (fullgraph=True raised in the step); one float64 product holds it
        flat = p.reshape(b, h, n * kb).double()
        return flat @ flat.transpose(-1, -2)
    per = math.gcd(n, max(1, GRAM_COLUMNS // kb))        # rows per product
    parts = n // per
    if parts == 1:
        flat = p.view(b, h, n * kb)
    else:
        flat = buf.as_strided((b, parts, h, per * kb), (parts * h * per * kb, h * per * kb, per * kb, 1))
        flat.copy_(p.view(b, h, parts, per * kb).transpose(1, 2))
        flat = flat.view(b * parts, h, per * kb)
    return torch.bmm(flat, flat.transpose(-1, -2))
