"""Head statistics straight from Q and K (Triton): the probabilities never reach memory.

For one attention call with ``q [B, H, Tq, D]``, ``k [B, Hk, Tk, D]`` (query head h reads key
head ``h // G``, ``G = H / Hk``), an optional mask and the causal flag, two kernels:

- **pass 1** (`_qk_lse_kernel`): the row log-sum-exp, a flash forward without V. Online max and
  sum per head and row, the max starting above the masked score so a fully masked row keeps sum 0.
  Skipped when the attention op already returned its LSE.
- **pass 2** (`_qk_stats_kernel`): with ``s`` the scores in log2 units, ``x = s − lse₂`` and
  ``p = exp2(x)``: ``entropy += p·x`` (× −ln 2 at the end, no log), ``gram += p pᵀ`` over the
  ``[heads, rows·keys]`` slab with `tl.dot`, and the row mass ``Σp`` (a valid row whose mass is
  not 1 ± 1e-3 counts as invalid: a wrong LSE never passes silently).

A program owns one batch entry, ``BLOCK_M`` query rows and a block of ``BLOCK_HK`` key heads with
their whole query groups folded into the M dimension, so each K tile is loaded once per key head.
Scores are one batched `tl.dot` ``[BLOCK_HK, G·BLOCK_M, D] × [BLOCK_HK, D, BLOCK_N]``. Key tiles
stop at the causal bound. Masked scores are a finite −1e30, never −inf, so 0·∞ cannot appear.
When all heads do not fit one program (shared memory, registers), the heads are split into blocks:
diagonal programs hold one block (Gram block, entropies, masses), off-diagonal programs recompute
two blocks for their Gram block. Every program writes partial sums; torch adds them in float64
(deterministic, no atomics).

Layout: kernels -> launcher (`qk_stats_triton`) -> `torch.library` op (`fastdiag::qk_head_stats`,
CUDA kernel registered, fake for tracing) so `torch.compile(fullgraph=True)` holds it as one node.
`compile_for_sm90` compiles both kernels for a GPU target without a GPU (the kernel report).
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from .qk_stats_ref import qk_stats_ref
from .report import ReportCase, register

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"

LOG2E = 1.4426950408889634
MASKED = -1e30          # masked score (log2 units)
MASS_TOLERANCE = 1e-3
MASK_NONE, MASK_BOOL, MASK_ADDITIVE = 0, 1, 2


@triton.jit
def _head_block(block, G, Hk, Tq, row0, BLOCK_HK: tl.constexpr, BLOCK_G: tl.constexpr,
                BLOCK_M: tl.constexpr):
    """Index tiles ``[BLOCK_HK, BLOCK_G·BLOCK_M]``: key head, query head, row, and which are real."""
    kv_head = block * BLOCK_HK + tl.arange(0, BLOCK_HK)[:, None]
    gm = tl.arange(0, BLOCK_G * BLOCK_M)[None, :]
    g = gm // BLOCK_M
    row = row0 + gm % BLOCK_M
    head = kv_head * G + g
    real = (kv_head < Hk) & (g < G) & (row < Tq)
    return kv_head, head, row, real


@triton.jit
def _load_q(q_ptr, batch, head, row, real, d0, D, stride_qb, stride_qh, stride_qm, stride_qd,
            WIDTH: tl.constexpr):
    """Q ``[BLOCK_HK, G·BLOCK_M, WIDTH]``, head-dimension columns ``d0 .. d0 + WIDTH``."""
    d = d0 + tl.arange(0, WIDTH)[None, None, :]
    ptrs = (q_ptr + batch * stride_qb + head[:, :, None] * stride_qh + row[:, :, None] * stride_qm
            + d * stride_qd)
    return tl.load(ptrs, mask=real[:, :, None] & (d < D), other=0.0)


@triton.jit
def _qk_dot(q_ptr, k_ptr, q, batch, kv_head, head, row, real, key, d0, Hk, Tk, D,
            stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
            FP32_DOT: tl.constexpr, Q_IN_LOOP: tl.constexpr, WIDTH: tl.constexpr):
    """Q·Kᵀ over head-dimension columns ``d0 .. d0 + WIDTH`` (Q re-read when not held)."""
    if Q_IN_LOOP:
        q = _load_q(q_ptr, batch, head, row, real, d0, D, stride_qb, stride_qh, stride_qm, stride_qd, WIDTH)
    d = d0 + tl.arange(0, WIDTH)
    kt_ptrs = (k_ptr + batch * stride_kb + kv_head[:, :, None] * stride_kh + d[None, :, None] * stride_kd
               + key[None, None, :] * stride_kn)
    kt = tl.load(kt_ptrs, mask=(kv_head[:, :, None] < Hk) & (d[None, :, None] < D) & (key[None, None, :] < Tk),
                 other=0.0)
    if FP32_DOT:
        return tl.dot(q, kt, input_precision="tf32x3")     # fp32 inputs keep fp32 accuracy
    return tl.dot(q, kt)                                   # 16-bit products are exact in fp32


@triton.jit
def _scores(q, q_ptr, k_ptr, mask_ptr, batch, kv_head, head, row, real, key0, Hk, Tk, D, qk_scale,
            mask_threshold, stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
            stride_mb, stride_mh, stride_mm, stride_mn,
            IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, FP32_DOT: tl.constexpr, Q_IN_LOOP: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DC: tl.constexpr):
    """Masked scores in log2 units, ``[BLOCK_HK, G·BLOCK_M, BLOCK_N]``; masked keys hold MASKED.

    ``q`` is the held Q tile, or unused when Q_IN_LOOP (then Q is read in BLOCK_DC-column chunks)."""
    key = key0 + tl.arange(0, BLOCK_N)
    s = _qk_dot(q_ptr, k_ptr, q, batch, kv_head, head, row, real, key, 0, Hk, Tk, D,
                stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
                FP32_DOT, Q_IN_LOOP, BLOCK_DC)
    for c in tl.static_range(1, BLOCK_D // BLOCK_DC):
        s += _qk_dot(q_ptr, k_ptr, q, batch, kv_head, head, row, real, key, c * BLOCK_DC, Hk, Tk, D,
                     stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
                     FP32_DOT, Q_IN_LOOP, BLOCK_DC)
    s = s * qk_scale
    key3 = key[None, None, :]
    visible = key3 < Tk
    if IS_CAUSAL:
        visible = visible & (key3 <= row[:, :, None])
    if MASK_KIND != 0:
        m_ptrs = (mask_ptr + batch * stride_mb + head[:, :, None] * stride_mh + row[:, :, None] * stride_mm
                  + key3 * stride_mn)
        m = tl.load(m_ptrs, mask=real[:, :, None] & (key3 < Tk), other=0)
        if MASK_KIND == 1:
            visible = visible & (m != 0)
        else:
            mf = tl.maximum(m.to(tl.float32), -1e30)   # finite: × log2 e cannot overflow
            visible = visible & ((mf > mask_threshold) | (mf != mf))   # NaN stays, to show up as NaN
            s = s + mf * 1.4426950408889634
    return tl.where(visible, s, -1e30)


@triton.jit
def _qk_lse_kernel(
    lse_ptr,                                             # output: [B, H, Tq] fp32, natural log
    q_ptr, k_ptr, mask_ptr,
    G, Hk, Tq, Tk, D, row_tiles, qk_scale, mask_threshold,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_lb, stride_lh, stride_lm,
    IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, FP32_DOT: tl.constexpr, Q_IN_LOOP: tl.constexpr,
    BLOCK_HK: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DC: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1).to(tl.int64)
    batch = pid // row_tiles
    row0 = (pid % row_tiles) * BLOCK_M
    kv_head, head, row, real = _head_block(block, G, Hk, Tq, row0, BLOCK_HK, BLOCK_G, BLOCK_M)
    q = q_ptr   # unused placeholder when Q is re-read every key tile
    if not Q_IN_LOOP:
        q = _load_q(q_ptr, batch, head, row, real, 0, D, stride_qb, stride_qh, stride_qm, stride_qd, BLOCK_D)
    # above MASKED: a row whose keys are all masked adds exp2(MASKED - m_i) = 0 and keeps sum 0
    m_i = tl.full((BLOCK_HK, BLOCK_G * BLOCK_M), -1e29, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_HK, BLOCK_G * BLOCK_M), dtype=tl.float32)
    key_end = Tk
    if IS_CAUSAL:   # later key tiles are in the future of every row of this tile
        key_end = tl.minimum(Tk, row0 + BLOCK_M)
    for key0 in range(0, key_end, BLOCK_N):
        s = _scores(q, q_ptr, k_ptr, mask_ptr, batch, kv_head, head, row, real, key0, Hk, Tk, D, qk_scale,
                    mask_threshold, stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn,
                    stride_kd, stride_mb, stride_mh, stride_mm, stride_mn,
                    IS_CAUSAL, MASK_KIND, FP32_DOT, Q_IN_LOOP, BLOCK_N, BLOCK_D, BLOCK_DC)
        m_new = tl.maximum(m_i, tl.max(s, 2))
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, :, None]), 2)
        m_i = m_new
    seen = l_i > 0
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(lse_ptr + batch * stride_lb + head * stride_lh + row * stride_lm, lse, mask=real)


@triton.jit
def _log2_probs(s, lse2, ok):
    """``x = log2 p = s − lse₂``; rows that do not count get x = MASKED, so p = exp2(x) = 0."""
    return tl.where(ok[:, :, None], s - lse2[:, :, None], -1e30)


@triton.jit
def _slab(p, FP32_DOT: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_G: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``[heads, rows·keys]`` view of a probability tile, in the Gram dot's input type."""
    slab = tl.reshape(p, (BLOCK_HK * BLOCK_G, BLOCK_M * BLOCK_N))
    if FP32_DOT:
        return slab
    return slab.to(tl.float16)       # p in [0, 1]: fp16 keeps 11 bits, the sums stay fp32


@triton.jit
def _qk_stats_kernel(
    gram_part_ptr, entropy_part_ptr, invalid_part_ptr,  # outputs: [P, blocks, BH, BH], [P, blocks, BH], [P, blocks]
    q_ptr, k_ptr, mask_ptr, lse_ptr, row_ok_ptr, block_i_ptr, block_j_ptr,
    G, Hk, Tq, Tk, D, row_tiles, qk_scale, mask_threshold,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_lb, stride_lh, stride_lm,
    stride_rb, stride_rm,
    DIAGONAL: tl.constexpr, IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_ROW_OK: tl.constexpr,
    FP32_DOT: tl.constexpr, Q_IN_LOOP: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DC: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    pair = tl.program_id(1).to(tl.int64)
    batch = pid // row_tiles
    row0 = (pid % row_tiles) * BLOCK_M
    block_i = tl.load(block_i_ptr + pair).to(tl.int64)
    kv_i, head_i, row, real_i = _head_block(block_i, G, Hk, Tq, row0, BLOCK_HK, BLOCK_G, BLOCK_M)
    ok_i = real_i
    if HAS_ROW_OK:
        ok_i = ok_i & (tl.load(row_ok_ptr + batch * stride_rb + row * stride_rm, mask=row < Tq, other=0) != 0)
    q_i = q_ptr   # unused placeholder when Q is re-read every key tile
    if not Q_IN_LOOP:
        q_i = _load_q(q_ptr, batch, head_i, row, real_i, 0, D, stride_qb, stride_qh, stride_qm, stride_qd, BLOCK_D)
    lse_ptrs_i = lse_ptr + batch * stride_lb + head_i * stride_lh + row * stride_lm
    # a row that does not count may have LSE ±inf: 0 keeps its exponent finite, its p is 0 anyway
    lse2_i = tl.where(ok_i, tl.load(lse_ptrs_i, mask=ok_i, other=0.0) * 1.4426950408889634, 0.0)
    if not DIAGONAL:
        block_j = tl.load(block_j_ptr + pair).to(tl.int64)
        kv_j, head_j, _row_j, real_j = _head_block(block_j, G, Hk, Tq, row0, BLOCK_HK, BLOCK_G, BLOCK_M)
        ok_j = real_j
        if HAS_ROW_OK:
            ok_j = ok_j & (tl.load(row_ok_ptr + batch * stride_rb + row * stride_rm, mask=row < Tq, other=0) != 0)
        q_j = q_ptr
        if not Q_IN_LOOP:
            q_j = _load_q(q_ptr, batch, head_j, row, real_j, 0, D, stride_qb, stride_qh, stride_qm, stride_qd,
                          BLOCK_D)
        lse_ptrs_j = lse_ptr + batch * stride_lb + head_j * stride_lh + row * stride_lm
        lse2_j = tl.where(ok_j, tl.load(lse_ptrs_j, mask=ok_j, other=0.0) * 1.4426950408889634, 0.0)

    gram = tl.zeros((BLOCK_HK * BLOCK_G, BLOCK_HK * BLOCK_G), dtype=tl.float32)
    plogp = tl.zeros((BLOCK_HK, BLOCK_G * BLOCK_M), dtype=tl.float32)
    mass = tl.zeros((BLOCK_HK, BLOCK_G * BLOCK_M), dtype=tl.float32)
    key_end = Tk
    if IS_CAUSAL:   # later key tiles are in the future of every row of this tile
        key_end = tl.minimum(Tk, row0 + BLOCK_M)
    for key0 in range(0, key_end, BLOCK_N):
        s_i = _scores(q_i, q_ptr, k_ptr, mask_ptr, batch, kv_i, head_i, row, real_i, key0, Hk, Tk, D, qk_scale,
                      mask_threshold, stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn,
                      stride_kd, stride_mb, stride_mh, stride_mm, stride_mn,
                      IS_CAUSAL, MASK_KIND, FP32_DOT, Q_IN_LOOP, BLOCK_N, BLOCK_D, BLOCK_DC)
        x_i = _log2_probs(s_i, lse2_i, ok_i)
        p_i = tl.exp2(x_i)
        slab_i = _slab(p_i, FP32_DOT, BLOCK_HK, BLOCK_G, BLOCK_M, BLOCK_N)
        if DIAGONAL:
            plogp += tl.sum(p_i * x_i, 2)
            mass += tl.sum(p_i, 2)
            slab_j = slab_i
        else:
            s_j = _scores(q_j, q_ptr, k_ptr, mask_ptr, batch, kv_j, head_j, row, real_j, key0, Hk, Tk, D,
                          qk_scale, mask_threshold, stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh,
                          stride_kn, stride_kd, stride_mb, stride_mh, stride_mm, stride_mn,
                          IS_CAUSAL, MASK_KIND, FP32_DOT, Q_IN_LOOP, BLOCK_N, BLOCK_D, BLOCK_DC)
            p_j = tl.exp2(_log2_probs(s_j, lse2_j, ok_j))
            slab_j = _slab(p_j, FP32_DOT, BLOCK_HK, BLOCK_G, BLOCK_M, BLOCK_N)
        if FP32_DOT:
            gram += tl.dot(slab_i, tl.trans(slab_j), input_precision="tf32x3")
        else:
            gram += tl.dot(slab_i, tl.trans(slab_j))

    bh: tl.constexpr = BLOCK_HK * BLOCK_G
    out = tl.arange(0, BLOCK_HK * BLOCK_G)
    part = pid * tl.num_programs(1) + pair
    tl.store(gram_part_ptr + part * bh * bh + out[:, None] * bh + out[None, :], gram)
    if DIAGONAL:
        # p·x is p log2 p: nats = −ln 2 × the sum
        entropy = tl.sum(tl.reshape(plogp, (bh, BLOCK_M)), 1) * -0.6931471805599453
        tl.store(entropy_part_ptr + part * bh + out, entropy)
        off = ok_i & ((tl.abs(mass - 1.0) <= 1e-3) == 0)     # NaN counts as off
        tl.store(invalid_part_ptr + part, tl.sum(tl.sum(off.to(tl.float32), 1), 0))


# ---- launcher -------------------------------------------------------------------------------

# Score elements held per program: enough work per K load, few enough registers.
_SCORE_BUDGET = 8192
# A Q tile larger than this (elements) is re-read every key tile instead of held in registers
# (sm_90 compiles at 8 warps: larger held tiles spill).
_HELD_Q_ELEMENTS = 16384
NUM_WARPS = 8
NUM_STAGES = 2
# Head-dimension columns per score dot: wider batched operands spill at sm_90 (D = 128 is two dots).
_DOT_COLUMNS = 64


def tile_config(h: int, hk: int, d: int, budget: int = _SCORE_BUDGET, block_n: int = 32) -> dict:
    """Block sizes for H query heads, Hk key heads, head dim d. Every `tl.dot` dimension is >= 16."""
    block_g = triton.next_power_of_2(h // hk)
    block_d = max(16, triton.next_power_of_2(d))
    block_hk = max(triton.next_power_of_2(hk), triton.cdiv(16, block_g))   # Gram dot: >= 16 heads
    block_m = max(1, 16 // block_g)                                         # score dot: G·M >= 16
    while block_hk * block_g * block_m * block_n > budget and block_hk * block_g > 16:
        block_hk //= 2
    while block_hk * block_g * 2 * block_m * block_n <= budget and block_m < 64:
        block_m *= 2
    block_dc = min(block_d, _DOT_COLUMNS)
    q_in_loop = block_dc < block_d or block_hk * block_g * block_m * block_d > _HELD_Q_ELEMENTS
    return dict(BLOCK_HK=block_hk, BLOCK_G=block_g, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
                BLOCK_DC=block_dc, Q_IN_LOOP=q_in_loop)


def _fallback_configs(h: int, hk: int, d: int) -> list[dict]:
    """From the preferred tiles to the smallest: tried in order when one exceeds shared memory."""
    configs = []
    for budget, block_n in ((_SCORE_BUDGET, 32), (_SCORE_BUDGET // 2, 32), (_SCORE_BUDGET // 4, 16),
                            (_SCORE_BUDGET // 8, 16)):
        c = tile_config(h, hk, d, budget, block_n)
        if c not in configs:
            configs.append(c)
    return configs


def _mask_args(mask4, shape):
    """(tensor, strides, kind, threshold) for the kernels: bool as uint8, strides 0 where broadcast."""
    if mask4 is None:
        return None, (0, 0, 0, 0), MASK_NONE, 0.0
    m = mask4.expand(*shape)
    if m.dtype == torch.bool:
        return m.view(torch.uint8), m.stride(), MASK_BOOL, 0.0
    return m, m.stride(), MASK_ADDITIVE, torch.finfo(m.dtype).min / 2


def _head_index(h: int, hk: int, cfg: dict, device) -> torch.Tensor:
    """Position of each query head in the padded, blocked layout of the partial sums."""
    group = h // hk
    head = torch.arange(h, device=device)
    kv, g = head // group, head % group
    bh = cfg["BLOCK_HK"] * cfg["BLOCK_G"]
    return (kv // cfg["BLOCK_HK"]) * bh + (kv % cfg["BLOCK_HK"]) * cfg["BLOCK_G"] + g


def _launch(q4, k4, mask4, is_causal, scale, rows_ok, lse, cfg, lse_only=False):
    if q4.dtype != k4.dtype or q4.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        q4, k4 = q4.float(), k4.float()    # one dot input type (before the strides are read)
    b, h, tq, d = q4.shape
    hk, tk = k4.shape[1], k4.shape[2]
    device = q4.device
    blocks = triton.cdiv(hk, cfg["BLOCK_HK"])
    row_tiles = triton.cdiv(tq, cfg["BLOCK_M"])
    mask, mask_strides, mask_kind, threshold = _mask_args(mask4, (b, h, tq, tk))
    common = dict(IS_CAUSAL=bool(is_causal), MASK_KIND=mask_kind,
                  FP32_DOT=q4.dtype == torch.float32, num_warps=NUM_WARPS,
                  num_stages=NUM_STAGES, **cfg)
    args = (h // hk, hk, tq, tk, d, row_tiles, scale * LOG2E, threshold,
            *q4.stride(), *k4.stride(), *mask_strides)
    if mask is None:
        mask = q4   # never read
    if lse is None:
        lse = torch.empty(b, h, tq, dtype=torch.float32, device=device)
        _qk_lse_kernel[(b * row_tiles, blocks)](lse, q4, k4, mask, *args, *lse.stride(), **common)
    if lse_only:
        return lse
    pairs = [(i, i) for i in range(blocks)] + [(i, j) for i in range(blocks) for j in range(i + 1, blocks)]
    # built on the device (no host-to-device copy, so no sync): diagonal blocks, then i < j pairs
    diagonal = torch.arange(blocks, dtype=torch.int32, device=device)
    off = torch.triu_indices(blocks, blocks, 1, dtype=torch.int32, device=device)
    block_ids = torch.stack([torch.cat([diagonal, off[0]]), torch.cat([diagonal, off[1]])])
    bh = cfg["BLOCK_HK"] * cfg["BLOCK_G"]
    programs = b * row_tiles
    gram_part = torch.empty(programs, blocks, bh, bh, dtype=torch.float32, device=device)
    entropy_part = torch.empty(programs, blocks, bh, dtype=torch.float32, device=device)
    invalid_part = torch.empty(programs, blocks, dtype=torch.float32, device=device)
    row_ok = q4 if rows_ok is None else rows_ok.view(torch.uint8)
    row_strides = (0, 0) if rows_ok is None else rows_ok.stride()
    tail = (*args, *lse.stride(), *row_strides)
    _qk_stats_kernel[(programs, blocks)](
        gram_part, entropy_part, invalid_part, q4, k4, mask, lse, row_ok, block_ids[0], block_ids[1],
        *tail, DIAGONAL=True, HAS_ROW_OK=rows_ok is not None, **common)
    if blocks > 1:
        # off-diagonal Gram blocks: their own grid and partials, no entropy or mass
        gram_off_part = torch.empty(programs, len(pairs) - blocks, bh, bh, dtype=torch.float32, device=device)
        _qk_stats_kernel[(programs, len(pairs) - blocks)](
            gram_off_part, entropy_part, invalid_part, q4, k4, mask, lse, row_ok,
            block_ids[0, blocks:], block_ids[1, blocks:],
            *tail, DIAGONAL=False, HAS_ROW_OK=rows_ok is not None, **common)
    gram_blocks = gram_part.sum(0, dtype=torch.float64)             # [pairs, BH, BH]
    if blocks > 1:
        gram_blocks = torch.cat([gram_blocks, gram_off_part.sum(0, dtype=torch.float64)])
    full = torch.zeros(blocks * bh, blocks * bh, dtype=torch.float64, device=device)
    for n, (i, j) in enumerate(pairs):
        full[i * bh:(i + 1) * bh, j * bh:(j + 1) * bh] = gram_blocks[n]
        if i != j:
            full[j * bh:(j + 1) * bh, i * bh:(i + 1) * bh] = gram_blocks[n].T
    pos = _head_index(h, hk, cfg, device)
    gram = full[pos][:, pos]
    entropy = entropy_part.sum(0, dtype=torch.float64).reshape(-1)[pos]
    invalid = invalid_part.sum(dtype=torch.float64)
    invalid = invalid + (~torch.isfinite(gram)).any() + (~torch.isfinite(entropy)).any()
    rows = (torch.full((), float(b * tq), dtype=torch.float64, device=device) if rows_ok is None
            else rows_ok.sum(dtype=torch.float64))
    return gram, entropy, rows, invalid.to(torch.float64)


def qk_stats_triton(q4, k4, mask4, is_causal: bool, scale: float, rows_ok=None, lse=None):
    """HeadStats sums ``(gram [H, H], entropy_sum [H], rows, invalid)`` in float64.

    q4 ``[B, H, Tq, D]``, k4 ``[B, Hk, Tk, D]``, mask4 broadcastable to ``[B, H, Tq, Tk]`` (bool,
    True = may attend, or additive), rows_ok bool ``[B, Tq]`` (None: every row counts), lse the
    natural-log row LSE ``[B, H, Tq]`` or None (pass 1 computes it). Tiles that exceed the
    device's shared memory fall back to smaller ones."""
    return _with_fallback(q4, k4, mask4, is_causal, scale, rows_ok, lse)


def row_lse_triton(q4, k4, mask4, is_causal: bool, scale: float) -> torch.Tensor:
    """Pass 1 alone: the natural-log row LSE ``[B, H, Tq]`` (-inf where a row sees no key)."""
    return _with_fallback(q4, k4, mask4, is_causal, scale, None, None, lse_only=True)


def _with_fallback(*args, **kwargs):
    q4, k4 = args[0], args[1]
    configs = _fallback_configs(q4.shape[1], k4.shape[1], q4.shape[3])
    for n, cfg in enumerate(configs):
        try:
            return _launch(*args, cfg=cfg, **kwargs)
        except triton.runtime.errors.OutOfResources:
            if n == len(configs) - 1:
                raise


# ---- torch.library op: compiled graphs and CUDA graphs hold it as one opaque node ----------------

@torch.library.custom_op("fastdiag::qk_head_stats", mutates_args=())
def qk_stats_op(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, is_causal: bool, scale: float,
                rows_ok: torch.Tensor | None, lse: torch.Tensor | None) -> tuple[
                    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # off CUDA: the float64 reference (row validity as given; the LSE is not needed)
    gram, entropy, rows, invalid = qk_stats_ref(q, k, mask, is_causal, scale, rows_ok)
    return gram, entropy, rows, invalid


@qk_stats_op.register_kernel("cuda")
def _qk_stats_cuda(q, k, mask, is_causal, scale, rows_ok, lse):
    return qk_stats_triton(q, k, mask, is_causal, scale, rows_ok, lse)


@qk_stats_op.register_fake
def _qk_stats_fake(q, k, mask, is_causal, scale, rows_ok, lse):
    h = q.shape[1]
    f64 = dict(dtype=torch.float64, device=q.device)
    return q.new_empty((h, h), **f64), q.new_empty((h,), **f64), q.new_empty((), **f64), q.new_empty((), **f64)


# ---- the sm_90 compile report ------------------------------------------------------------------

# Shapes of the kernel report: (H, Hk, D, T).
REPORT_SHAPES = {
    "gpt2-small": (12, 12, 64, 1024),
    "llama-7b": (32, 32, 128, 4096),
    "llama-3-8b": (32, 8, 128, 8192),
}


def compile_for_sm90(h: int, hk: int, d: int, dtype: torch.dtype = torch.bfloat16, is_causal: bool = True,
                     mask_kind: int = MASK_NONE, num_warps: int = NUM_WARPS, cfg: dict | None = None) -> dict:
    """Compile pass 1 and pass 2 (diagonal, and off-diagonal when the heads split into blocks) for
    sm_90 without a GPU, with the tiles the launcher would pick first. Returns name -> compiled kernel
    (``n_regs``, ``n_spills``, ``metadata.shared``), plus "config"."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if INTERPRETING:
        raise ValueError("compile_for_sm90: kernels cannot be compiled under TRITON_INTERPRET=1; unset it")
    cfg = cfg or tile_config(h, hk, d)
    blocks = triton.cdiv(hk, cfg["BLOCK_HK"])
    elem = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}[dtype]
    mask_type = {MASK_NONE: elem, MASK_BOOL: "*u8", MASK_ADDITIVE: elem}[mask_kind]
    scalars = {"G": "i32", "Hk": "i32", "Tq": "i32", "Tk": "i32", "D": "i32", "row_tiles": "i32",
               "qk_scale": "fp32", "mask_threshold": "fp32"}
    strides = [f"stride_{t}{a}" for t, axes in (("q", "bhmd"), ("k", "bhnd"), ("m", "bhmn"), ("l", "bhm"))
               for a in axes]
    common = dict(IS_CAUSAL=is_causal, MASK_KIND=mask_kind, FP32_DOT=dtype == torch.float32, **cfg)
    target = GPUTarget("cuda", 90, 32)
    options = dict(num_warps=num_warps, num_stages=NUM_STAGES)

    lse_sig = {"lse_ptr": "*fp32", "q_ptr": elem, "k_ptr": elem, "mask_ptr": mask_type, **scalars,
               **{s: "i64" for s in strides}}
    def build(fn, signature, constexprs):
        signature = {**signature, **{name: "constexpr" for name in constexprs}}
        return triton.compile(ASTSource(fn, signature, constexprs), target=target, options=options)

    kernels = {"config": cfg, "lse": build(_qk_lse_kernel, lse_sig, common)}
    stats_sig = {"gram_part_ptr": "*fp32", "entropy_part_ptr": "*fp32", "invalid_part_ptr": "*fp32",
                 "q_ptr": elem, "k_ptr": elem, "mask_ptr": mask_type, "lse_ptr": "*fp32",
                 "row_ok_ptr": "*u8", "block_i_ptr": "*i32", "block_j_ptr": "*i32", **scalars,
                 **{s: "i64" for s in strides}, "stride_rb": "i64", "stride_rm": "i64"}
    for name, diagonal in (("stats_diagonal", True), ("stats_off_diagonal", False))[:1 + (blocks > 1)]:
        kernels[name] = build(_qk_stats_kernel, stats_sig, dict(DIAGONAL=diagonal, HAS_ROW_OK=True, **common))
    return kernels


def ptxas_usage(kernel) -> dict:
    """Registers and spill bytes of a compiled kernel: ``ptxas -v`` with the ptxas and the flags
    Triton's own compile used (so the numbers are those of the cubin it built)."""
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    arch = kernel.metadata.target.arch
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        fmad = [] if kernel.metadata.enable_fp_fusion else ["--fmad=false"]
        log = subprocess.run([get_ptxas(arch).path, "-lineinfo", *fmad, "-v", "--regAllocOptLevel=2",
                              f"--gpu-name=sm_{arch}a", ptx, "-o",
                              os.path.join(tmp, "kernel.cubin")], capture_output=True, text=True, check=True).stderr
    number = lambda pattern: int(re.search(pattern, log).group(1))  # noqa: E731
    return dict(n_regs=number(r"Used (\d+) registers"),
                n_spills=number(r"(\d+) bytes spill stores") + number(r"(\d+) bytes spill loads"),
                stack_bytes=number(r"(\d+) bytes stack frame"))


def kernel_report(shapes: dict = REPORT_SHAPES) -> list[dict]:
    """One row per (shape, kernel): registers, spills, shared memory bytes, tiles."""
    rows = []
    for shape, (h, hk, d, _t) in shapes.items():
        compiled = compile_for_sm90(h, hk, d)
        cfg = compiled.pop("config")
        for name, kernel in compiled.items():
            rows.append(dict(shape=shape, kernel=f"qk_{name}", **ptxas_usage(kernel),
                             shared_bytes=kernel.metadata.shared, blocks=math.ceil(hk / cfg["BLOCK_HK"]), **cfg))
    return rows


# ---- the kernel report (`fastdiag bench --kernel-report`): these launchers at the benchmark shapes --

# Head dims of the models behind the benchmark shapes.
_BENCH_HEAD_DIM = {"gpt2-small": 64, "long-context": 128}


def _report_cases(shapes: dict) -> list[ReportCase]:
    """Pass 1 and pass 2, bf16, causal, at the benchmark shapes. An "element" is one score (one query
    row, key and head), so the ceiling reads: how fast these kernels cover the probabilities compared
    with the probabilities kernel streaming a materialised bf16 P at copy bandwidth. Shapes too short
    for a key loop (the grokking task's T = 3, whose zoo model never calls SDPA) are left out."""
    cases = []
    for shape, (_n, b, h, t) in shapes.items():
        if t < 256:
            continue
        d = _BENCH_HEAD_DIM.get(shape, 64)
        q = torch.empty(b, h, t, d, dtype=torch.bfloat16)

        def pass1(q=q):
            row_lse_triton(q, q, None, True, q.shape[-1] ** -0.5)    # captured, never run

        def pass2(q=q):
            lse = torch.empty(q.shape[:3], dtype=torch.float32)      # a given LSE: pass 2 launches first
            qk_stats_triton(q, q, None, True, q.shape[-1] ** -0.5, lse=lse)

        def scores_per_iteration(constexprs):
            return constexprs["BLOCK_HK"] * constexprs["BLOCK_G"] * constexprs["BLOCK_M"] * constexprs["BLOCK_N"]

        cases += [ReportCase("qk_lse", shape, "bfloat16", 2, pass1, scores_per_iteration),
                  ReportCase("qk_stats", shape, "bfloat16", 2, pass2, scores_per_iteration)]
    return cases


register("qk_stats", _report_cases)
