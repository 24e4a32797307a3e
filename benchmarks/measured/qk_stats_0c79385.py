"""The Q/K kernels and launcher measured on the H200 (benchmarks/RESULTS.md, run 4): ``git show 0c79385:fastdiag/core/kernels/qk_stats_triton.py``
with its torch.library op and report section left out and its imports made absolute, nothing else changed.

benchmarks/predict_measured.py recompiles these launches to set the kernel report's prediction beside
what the GPU measured. Not part of the package: never launched on data.
"""
from __future__ import annotations

import os
import warnings

import torch
import triton
import triton.language as tl

from fastdiag.core.kernels.constants import LN2, LOG2E, MASKED_SCORE, MASS_TOLERANCE
from fastdiag.core.kernels.qk_stats_ref import qk_stats_ref
from fastdiag.core.kernels.qk_stats_torch import CHUNK_BYTES, qk_stats_torch
from fastdiag.core.kernels.device import GPUS, device_limits

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"

# The shared constants (`constants.py`) as the kernels read them
_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(LN2)
_MASKED = tl.constexpr(MASKED_SCORE)
_ABOVE_MASKED = tl.constexpr(MASKED_SCORE / 10)   # pass 1's starting max: exp2(MASKED - it) is 0
_MASS_TOLERANCE = tl.constexpr(MASS_TOLERANCE)
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
               + key.to(tl.int64)[None, None, :] * stride_kn)   # 64-bit: Tk · stride_kn passes 2^31 (BTHD, T ≥ 512 K)
    kt = tl.load(kt_ptrs, mask=(kv_head[:, :, None] < Hk) & (d[None, :, None] < D) & (key[None, None, :] < Tk),
                 other=0.0)
    if q.shape[0] == 1:
        # One key head: a 2-D dot. Triton 3.6 lays a batched dot with a size-1 batch out as
        # warpsPerCTA [8, 1, 1], every warp computing the whole tile (8x the tensor-core and MUFU work,
        # 255 registers and spills); 3.9 splits it [1, 4, 2]. The 2-D dot is laid out well by both.
        q2 = tl.reshape(q, (q.shape[1], q.shape[2]))
        kt2 = tl.reshape(kt, (kt.shape[1], kt.shape[2]))
        if FP32_DOT:
            s2 = tl.dot(q2, kt2, input_precision="tf32x3")
        else:
            s2 = tl.dot(q2, kt2)
        return tl.reshape(s2, (1, s2.shape[0], s2.shape[1]))
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
            # finite: × log2 e cannot overflow; NaN-propagating (max.NaN.f32): a plain max.f32 drops a
            # NaN entry, which would then count as masked instead of showing up as NaN
            mf = tl.maximum(m.to(tl.float32), _MASKED, propagate_nan=tl.PropagateNan.ALL)
            visible = visible & ((mf > mask_threshold) | (mf != mf))   # NaN stays, to show up as NaN
            s = s + mf * _LOG2E
    return tl.where(visible, s, _MASKED)


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
    m_i = tl.full((BLOCK_HK, BLOCK_G * BLOCK_M), _ABOVE_MASKED, dtype=tl.float32)
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
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * _LN2, float("-inf"))
    tl.store(lse_ptr + batch * stride_lb + head * stride_lh + row * stride_lm, lse, mask=real)


@triton.jit
def _log2_probs(s, lse2, ok):
    """``x = log2 p = s − lse₂``; rows that do not count get x = MASKED, so p = exp2(x) = 0."""
    return tl.where(ok[:, :, None], s - lse2[:, :, None], _MASKED)


@triton.jit
def _slab(p, FP32_DOT: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_G: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``[heads, rows·keys]`` view of a probability tile, in the Gram dot's input type."""
    slab = tl.reshape(p, (BLOCK_HK * BLOCK_G, BLOCK_M * BLOCK_N))
    # one return: the compiler rejects returns of two types even under a constexpr branch (fp32 pass 2
    # did not compile at all; the interpreter never saw it)
    if not FP32_DOT:
        slab = slab.to(tl.float16)   # p in [0, 1]: fp16 keeps 11 bits, the sums stay fp32
    return slab


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
    lse2_i = tl.where(ok_i, tl.load(lse_ptrs_i, mask=ok_i, other=0.0) * _LOG2E, 0.0)
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
        lse2_j = tl.where(ok_j, tl.load(lse_ptrs_j, mask=ok_j, other=0.0) * _LOG2E, 0.0)

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
        entropy = tl.sum(tl.reshape(plogp, (bh, BLOCK_M)), 1) * -_LN2
        tl.store(entropy_part_ptr + part * bh + out, entropy)
        off = ok_i & ((tl.abs(mass - 1.0) <= _MASS_TOLERANCE) == 0)     # NaN counts as off
        tl.store(invalid_part_ptr + part, tl.sum(tl.sum(off.to(tl.float32), 1), 0))


# ---- launcher -------------------------------------------------------------------------------

# Score elements held per program: enough work per K load, few enough registers.
_SCORE_BUDGET = 8192
# A Q tile larger than this (elements) is re-read every key tile instead of held in registers
# (sm_90 compiles at 8 warps: larger held tiles spill).
_HELD_Q_ELEMENTS = 16384
NUM_WARPS = 8
# Head-dimension columns per score dot: wider batched operands spill at sm_90 (D = 128 is two dots).
_DOT_COLUMNS = 64
# Shared memory per block where no device says (CPU, interpreter): sm_90's 227 KB. On a GPU the
# launcher reads the device's own opt-in limit (`report.device_limits`): 163 KB on an A100, 99 KB on
# sm_86 / sm_89 / sm_120.
SHARED_LIMIT = 227 * 1024


def _shared_bytes(cfg: dict, num_stages: int, element_bytes: int, blocks_held: int) -> int:
    """Shared memory of pass 2 as sm_90 compiles it (checked against the compiled metadata): the Q
    tile is hoisted out of the key loop, pipelining (2 stages) keeps every D chunk of the K tile in
    flight at once where 1 stage reuses one chunk's buffer, the Gram slab is staged for its dot; an
    off-diagonal program holds two head blocks."""
    rows = cfg["BLOCK_HK"] * cfg["BLOCK_G"] * cfg["BLOCK_M"]
    k_columns = cfg["BLOCK_D"] if num_stages > 1 else cfg["BLOCK_DC"]
    slab = rows * cfg["BLOCK_N"] * (4 if element_bytes == 4 else 2)
    per_block = (rows * cfg["BLOCK_D"] + cfg["BLOCK_HK"] * k_columns * cfg["BLOCK_N"]) * element_bytes + slab
    return blocks_held * per_block


def tile_config(h: int, hk: int, d: int, budget: int = _SCORE_BUDGET, block_n: int = 32,
                element_bytes: int = 2, shared_limit: int = SHARED_LIMIT) -> dict:
    """Pass 2's tiles (see `_tile_config_and_shared`)."""
    return _tile_config_and_shared(h, hk, d, budget, block_n, element_bytes, shared_limit)[0]


def _tile_config_and_shared(h: int, hk: int, d: int, budget: int = _SCORE_BUDGET, block_n: int = 32,
                            element_bytes: int = 2, shared_limit: int = SHARED_LIMIT) -> tuple[dict, int]:
    """Pass 2's blocks for H query heads, Hk key heads, head dim d, inputs of element_bytes.
    Every `tl.dot` dimension is >= 16. The key tile shrinks before the heads split into blocks (a
    split makes the off-diagonal programs recompute scores); 1 stage where 2 exceed ``shared_limit``."""
    block_g = triton.next_power_of_2(h // hk)
    block_d = max(16, triton.next_power_of_2(d))
    block_hk = max(triton.next_power_of_2(hk), triton.cdiv(16, block_g))   # Gram dot: >= 16 heads
    block_m = max(1, 16 // block_g)                                         # score dot: G·M >= 16
    while block_hk * block_g * block_m * block_n > budget and block_n > 16:
        block_n //= 2
    while block_hk * block_g * block_m * block_n > budget and block_hk * block_g > 16:
        block_hk //= 2
    while block_hk * block_g * 2 * block_m * block_n <= budget and block_m < 64:
        block_m *= 2
    block_dc = min(block_d, _DOT_COLUMNS)
    q_in_loop = block_dc < block_d or block_hk * block_g * block_m * block_d > _HELD_Q_ELEMENTS
    cfg = dict(BLOCK_HK=block_hk, BLOCK_G=block_g, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
               BLOCK_DC=block_dc, Q_IN_LOOP=q_in_loop, num_warps=NUM_WARPS)
    blocks_held = 1 if block_hk >= hk else 2
    cfg["num_stages"] = 2 if _shared_bytes(cfg, 2, element_bytes, blocks_held) <= shared_limit else 1
    cfg_shared = _shared_bytes(cfg, cfg["num_stages"], element_bytes, blocks_held)
    return cfg, cfg_shared


def lse_tile_config(h: int, hk: int, d: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Pass 1's blocks: one key head (its query group folded into M) and 128 query rows per program,
    as a flash forward does. Pass 1 needs nothing across heads, and this layout takes fewer
    instructions per score than pass 2's head blocks at every report shape (``kernel_report``)."""
    block_g = triton.next_power_of_2(h // hk)
    block_d = max(16, triton.next_power_of_2(d))
    # float32 (TF32×3) dots of 128 columns spilled 444–556 B at head dim 128 on sm_100; 64 do not
    block_dc = min(block_d, _DOT_COLUMNS if dtype == torch.float32 else 2 * _DOT_COLUMNS)
    return dict(BLOCK_HK=1, BLOCK_G=block_g, BLOCK_M=max(1, 128 // block_g), BLOCK_N=64, BLOCK_D=block_d,
                BLOCK_DC=block_dc, Q_IN_LOOP=block_dc < block_d, num_warps=NUM_WARPS, num_stages=2)


def pass2_configs(h: int, hk: int, d: int, dtype: torch.dtype, shared_limit: int | None,
                  additive_mask: bool = False) -> list[dict]:
    """Pass 2's tiles to try, preferred first, on a target with ``shared_limit`` bytes of shared memory
    per block (None: no limit applies — CPU, the interpreter). Empty: no tile fits, and pass 2 runs
    on `qk_stats_torch` (cuBLAS in full float32; the Triton LSE of pass 1 still saves a pass).

    float32 inputs never fit a GPU: the TF32×3 dots hold three copies of every operand, 256–640 KB at
    the smallest tiles at GPT-2-small and Llama-7B (compiled for sm_90, benchmarks/RESULTS.md), where
    the largest GPU allows 227 KB. 16-bit tiles are chosen by the estimate `_shared_bytes` (checked
    against the compiled metadata); a launch that still exceeds the device tries the next.
    ``additive_mask``: the mask tile's registers come on top, so the key tile starts at 16 (at 32,
    GPT-2-small spilled 8 B on sm_90 and the 4k context 7.9 KB on sm_80, triton 3.9)."""
    element_bytes = torch.empty((), dtype=dtype).element_size()
    tiles = ((_SCORE_BUDGET, 32), (_SCORE_BUDGET // 2, 32), (_SCORE_BUDGET // 4, 16), (_SCORE_BUDGET // 8, 16))
    if additive_mask:
        tiles = ((_SCORE_BUDGET // 2, 16), (_SCORE_BUDGET // 4, 16), (_SCORE_BUDGET // 8, 16))
    if shared_limit is None:
        budget, block_n = tiles[0]
        return [tile_config(h, hk, d, budget, block_n, element_bytes=element_bytes)]
    if dtype == torch.float32:
        return []
    fits = []
    for budget, block_n in tiles:
        c, shared = _tile_config_and_shared(h, hk, d, budget, block_n, element_bytes, shared_limit)
        if shared <= shared_limit and c not in fits:
            fits.append(c)
    return fits


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


def _dot_inputs(q4, k4):
    """One dot input type for both (before the strides are read)."""
    if q4.dtype != k4.dtype or q4.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return q4.float(), k4.float()
    return q4, k4


def _shared_args(q4, k4, mask4, is_causal, scale, cfg):
    """(grid, mask tensor, leading scalar and stride arguments, constexprs) common to both kernels."""
    b, h, tq, d = q4.shape
    hk, tk = k4.shape[1], k4.shape[2]
    mask, mask_strides, mask_kind, threshold = _mask_args(mask4, (b, h, tq, tk))
    row_tiles = triton.cdiv(tq, cfg["BLOCK_M"])
    args = (h // hk, hk, tq, tk, d, row_tiles, scale * LOG2E, threshold,
            *q4.stride(), *k4.stride(), *mask_strides)
    constexprs = dict(IS_CAUSAL=bool(is_causal), MASK_KIND=mask_kind, FP32_DOT=q4.dtype == torch.float32, **cfg)
    grid = (b * row_tiles, triton.cdiv(hk, cfg["BLOCK_HK"]))
    return grid, q4 if mask is None else mask, args, constexprs   # a missing mask is never read


def _row_lse(q4, k4, mask4, is_causal, scale):
    b, h, tq, d = q4.shape
    cfg = lse_tile_config(h, k4.shape[1], d, q4.dtype)
    grid, mask, args, constexprs = _shared_args(q4, k4, mask4, is_causal, scale, cfg)
    lse = torch.empty(b, h, tq, dtype=torch.float32, device=q4.device)
    _qk_lse_kernel[grid](lse, q4, k4, mask, *args, *lse.stride(), **constexprs)
    return lse


def _stats(q4, k4, mask4, is_causal, scale, rows_ok, lse, cfg):
    b, h, tq, d = q4.shape
    hk = k4.shape[1]
    device = q4.device
    (programs, blocks), mask, args, constexprs = _shared_args(q4, k4, mask4, is_causal, scale, cfg)
    pairs = [(i, i) for i in range(blocks)] + [(i, j) for i in range(blocks) for j in range(i + 1, blocks)]
    # built on the device (no host-to-device copy, so no sync): diagonal blocks, then i < j pairs
    diagonal = torch.arange(blocks, dtype=torch.int32, device=device)
    off = torch.triu_indices(blocks, blocks, 1, dtype=torch.int32, device=device)
    block_ids = torch.stack([torch.cat([diagonal, off[0]]), torch.cat([diagonal, off[1]])])
    bh = cfg["BLOCK_HK"] * cfg["BLOCK_G"]
    gram_part = torch.empty(programs, blocks, bh, bh, dtype=torch.float32, device=device)
    entropy_part = torch.empty(programs, blocks, bh, dtype=torch.float32, device=device)
    invalid_part = torch.empty(programs, blocks, dtype=torch.float32, device=device)
    row_ok = q4 if rows_ok is None else rows_ok.view(torch.uint8)
    row_strides = (0, 0) if rows_ok is None else rows_ok.stride()
    tail = (*args, *lse.stride(), *row_strides)
    _qk_stats_kernel[(programs, blocks)](
        gram_part, entropy_part, invalid_part, q4, k4, mask, lse, row_ok, block_ids[0], block_ids[1],
        *tail, DIAGONAL=True, HAS_ROW_OK=rows_ok is not None, **constexprs)
    if blocks > 1:
        # off-diagonal Gram blocks: their own grid and partials, no entropy or mass
        gram_off_part = torch.empty(programs, len(pairs) - blocks, bh, bh, dtype=torch.float32, device=device)
        _qk_stats_kernel[(programs, len(pairs) - blocks)](
            gram_off_part, entropy_part, invalid_part, q4, k4, mask, lse, row_ok,
            block_ids[0, blocks:], block_ids[1, blocks:],
            *tail, DIAGONAL=False, HAS_ROW_OK=rows_ok is not None, **constexprs)
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


def qk_stats_triton(q4, k4, mask4, is_causal: bool, scale: float, rows_ok=None, lse=None, tiles=None):
    """HeadStats sums ``(gram [H, H], entropy_sum [H], rows, invalid)`` in float64.

    q4 ``[B, H, Tq, D]``, k4 ``[B, Hk, Tk, D]``, mask4 broadcastable to ``[B, H, Tq, Tk]`` (bool,
    True = may attend, or additive), rows_ok bool ``[B, Tq]`` (None: every row counts), lse the
    natural-log row LSE ``[B, H, Tq]`` or None (pass 1 computes it). Pass 2's tiles that exceed the
    device's shared memory fall back to smaller ones; ``tiles`` (a `tile_config`) replaces that
    choice, without fallback (tests force head blocks with it at small shapes)."""
    q4, k4 = _dot_inputs(q4, k4)
    limits = device_limits(q4.device)
    shared = limits and limits["shared_bytes"]
    if lse is None:
        if not pass1_fits(q4.dtype, shared):
            return qk_stats_torch(q4, k4, mask4, is_causal, scale, rows_ok, None, CHUNK_BYTES, check_lse=False)
        try:
            lse = _row_lse(q4, k4, mask4, is_causal, scale)
        except triton.runtime.errors.OutOfResources as e:
            _warn_torch_pass2(q4, e)
            return qk_stats_torch(q4, k4, mask4, is_causal, scale, rows_ok, None, CHUNK_BYTES, check_lse=False)
    if tiles is not None:
        return _stats(q4, k4, mask4, is_causal, scale, rows_ok, lse, tiles)
    additive = mask4 is not None and mask4.dtype != torch.bool
    for cfg in pass2_configs(q4.shape[1], k4.shape[1], q4.shape[3], q4.dtype, shared, additive):
        try:
            return _stats(q4, k4, mask4, is_causal, scale, rows_ok, lse, cfg)
        except triton.runtime.errors.OutOfResources as e:
            _warn_torch_pass2(q4, e)
    # no tile fits this device: the same sums in PyTorch, the LSE checked against the scores
    return qk_stats_torch(q4, k4, mask4, is_causal, scale, rows_ok, lse, CHUNK_BYTES, check_lse=True)


_WARNED: set = set()


def _warn_torch_pass2(q4, error) -> None:
    """Once per shape: a tile the estimate let through did not fit the device after all."""
    key = (q4.device, q4.dtype, q4.shape[1], q4.shape[3])
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"qk_head_stats: a Triton tile exceeded this GPU's shared memory ({error}); trying "
                      "smaller tiles, then the chunked PyTorch path (same sums, slower)", RuntimeWarning,
                      stacklevel=3)


# float32 pass 1 (TF32×3 scores) needs the 227 KB of sm_90 / sm_100: compiled for sm_86 (99 KB) it
# spills 180 B (GPT-2-small) to 11 KB (Llama-7B, additive mask) and takes 80–192 KB at 128 × 64 tiles,
# and still spills at 64 × 32 for head dim 128 (triton 3.6, benchmarks/RESULTS.md).
PASS1_FP32_SHARED = 227 * 1024


def pass1_fits(dtype: torch.dtype, shared_limit: int | None) -> bool:
    """Whether pass 1 runs in Triton on a target with ``shared_limit`` bytes per block (None: no limit
    applies). Where not, the whole Q/K computation runs on `qk_stats_torch` (cuBLAS, full float32)."""
    return shared_limit is None or dtype != torch.float32 or shared_limit >= PASS1_FP32_SHARED


def row_lse_triton(q4, k4, mask4, is_causal: bool, scale: float) -> torch.Tensor:
    """Pass 1 alone: the natural-log row LSE ``[B, H, Tq]`` (-inf where a row sees no key)."""
    q4, k4 = _dot_inputs(q4, k4)
    return _row_lse(q4, k4, mask4, is_causal, scale)
