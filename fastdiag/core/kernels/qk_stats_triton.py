"""Head statistics straight from Q and K (Triton): the probabilities never reach memory.

For one attention call with ``q [B, H, Tq, D]``, ``k [B, Hk, Tk, D]`` (query head h reads key
head ``h // G``, ``G = H / Hk``), an optional mask and the causal flag, two kernels:

- **pass 1** (`_qk_lse_kernel`): the row log-sum-exp, a flash forward without V. Online max and
  sum per head and row, the max starting above the masked score so a fully masked row keeps sum 0.
  Skipped when the attention op already returned its LSE.
- **pass 2** (`_qk_stats_kernel`): with ``s`` the scores in log2 units and ``p = exp2(s − lse₂)``,
  ``gram += p pᵀ`` over the ``[heads, rows·keys]`` slab with `tl.dot`; each row's entropy and mass
  from its own running maximum (`row_entropy_triton`: exact on sharp rows whatever kernel gave the
  LSE). A valid row whose mass is not 1 ± 1e-3 counts as invalid (a wrong LSE never passes
  silently), and so does one whose float32 scores are too large to hold the dtype's target.

A program owns one batch entry, ``BLOCK_M`` query rows and a block of ``BLOCK_HK`` key heads with
their whole query groups folded into the M dimension, so each K tile is loaded once per key head.
Scores are one batched `tl.dot` ``[BLOCK_HK, G·BLOCK_M, D] × [BLOCK_HK, D, BLOCK_N]``. Key tiles
stop at the causal bound. Masked scores are a finite −1e30, never −inf, so 0·∞ cannot appear.
Pass 1 needs nothing across heads: its programs hold one key head and 128 query rows
(`lse_tile_config`). Pass 2 holds every head of its rows when they fit (`tile_config`: the key tile
shrinks to 16 and the pipeline to 1 stage first — full multi-head attention at H·D = 4096); when
they do not, the heads are split into blocks: diagonal programs hold one block (Gram block,
entropies, masses), off-diagonal programs recompute two blocks for their Gram block; each launch is
staged for the blocks it holds and takes the widest score dot that compiles without spilling on the
device (`_launch_without_spills`). Every program writes partial sums; torch adds them in float64
(deterministic, no atomics). Where every head fits one program's shared memory (H ≤ 16, D ≤ 64) and it
compiles without spilling on the device, pass 2 runs on `qk_heads_triton._qk_heads_kernel` instead: a
2-D score dot per head, no padded head scored, no 3-D operand buffers (`_heads_stats`). Elsewhere 16-bit
pass 2 materialises P in row chunks (`qk_probs_triton`: one head a program writes float16 P and takes the
rows' entropies, head_stats' kernel takes the Gram), which fits every generation at any head count; the
batched kernel then runs only where its tiles are forced (tests, gpu_check).

float32 inputs are scored in float64 by both passes (their products are exact there, and a sharp row's
entropy needs the gaps of scores as large as 1e4 to 1e-9 relative, which float32 cannot hold): pass 1
writes a float64 LSE (a given one, another kernel's float32, is only checked against it), and pass 2 is
the per-head kernel's float32 plan (`heads_config`: the heads scored one at a time, their probabilities
through an L2-resident slab into the Gram dot). On targets that compile no float64 MMA, float32 runs on
the torch path (`FLOAT32_ARCHS`).

Layout: kernels -> launcher (`qk_stats_triton`) -> `torch.library` op (`fastdiag::qk_head_stats`,
CUDA kernel registered, fake for tracing) so `torch.compile(fullgraph=True)` holds it as one node.
`fastdiag.kernel_report` compiles both kernels for any target of `device.GPUS` without a GPU, as a launch would.
"""
from __future__ import annotations

import os
import warnings

import torch
import triton
import triton.language as tl

from .constants import LN2, LOG2E, MASKED_SCORE, MASS_TOLERANCE
from .qk_heads_triton import _qk_heads_kernel
from .qk_probs_triton import PROBS_BUFFER_BYTES, probs_pass2
from .row_entropy_triton import _cancel_bound, _key_norms2, _row_results, _row_sums_start, _row_sums_step
from .qk_stats_ref import qk_stats_ref
from .qk_stats_torch import CHUNK_BYTES, qk_stats_torch
from .device import GPUS, device_limits, spill_bytes

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"

# The shared constants (`constants.py`) as the kernels read them
_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(LN2)
_MASKED = tl.constexpr(MASKED_SCORE)
_ABOVE_MASKED = tl.constexpr(MASKED_SCORE / 10)
_MASS_TOLERANCE = tl.constexpr(MASS_TOLERANCE)
# A given float32 LSE's own error, relative: 16 units of float32 rounding (the op's float32 scores and sum);
# at a score of 1e4 nats an exact op's LSE is ~1e-3 off, which MASS_TOLERANCE alone would name
_GIVEN_ROUNDING = tl.constexpr(16 * 2.0 ** -24)   # pass 1's starting max: exp2(MASKED - it) is 0
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
    """Q·Kᵀ over head-dimension columns ``d0 .. d0 + WIDTH`` (Q re-read when not held; float64 for float32
    inputs, float32 for 16-bit ones), and the keys' squared norms over those columns ``[BLOCK_HK, 1, BLOCK_N]``."""
    if Q_IN_LOOP:
        q = _load_q(q_ptr, batch, head, row, real, d0, D, stride_qb, stride_qh, stride_qm, stride_qd, WIDTH)
    d = d0 + tl.arange(0, WIDTH)
    kt_ptrs = (k_ptr + batch * stride_kb + kv_head[:, :, None] * stride_kh + d[None, :, None] * stride_kd
               + key.to(tl.int64)[None, None, :] * stride_kn)   # 64-bit: Tk · stride_kn passes 2^31 (BTHD, T ≥ 512 K)
    kt = tl.load(kt_ptrs, mask=(kv_head[:, :, None] < Hk) & (d[None, :, None] < D) & (key[None, None, :] < Tk),
                 other=0.0)
    if FP32_DOT:   # fp32 products are exact in float64, and float64 sums keep a sharp row's gaps
        q, kt_dot = q.to(tl.float64), kt.to(tl.float64)
    else:          # 16-bit products are exact in fp32
        kt_dot = kt
    # one return: the compiler rejects returns of two types even under a constexpr branch
    if q.shape[0] == 1:
        # One key head: a 2-D dot. Triton 3.6 lays a batched dot with a size-1 batch out as
        # warpsPerCTA [8, 1, 1], every warp computing the whole tile (8x the tensor-core and MUFU work,
        # 255 registers and spills); 3.9 splits it [1, 4, 2]. The 2-D dot is laid out well by both.
        s2 = tl.dot(tl.reshape(q, (q.shape[1], q.shape[2])), tl.reshape(kt_dot, (kt.shape[1], kt.shape[2])))
        s = tl.reshape(s2, (1, s2.shape[0], s2.shape[1]))
    else:
        s = tl.dot(q, kt_dot)
    return s, _key_norms2(kt, 1)


@triton.jit
def _scores(q, q_ptr, k_ptr, mask_ptr, batch, kv_head, head, row, real, key0, Hk, Tk, D, qk_scale,
            mask_threshold, stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
            stride_mb, stride_mh, stride_mm, stride_mn,
            IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, FP32_DOT: tl.constexpr, Q_IN_LOOP: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DC: tl.constexpr):
    """Masked scores in log2 units, ``[BLOCK_HK, G·BLOCK_M, BLOCK_N]``; masked keys hold MASKED. And the
    tile's largest squared key norm per key head ``[BLOCK_HK, 1, 1]`` (masked keys included: an upper
    bound), for the rows' cancellation bound (`row_entropy_triton._cancel_bound`; dead code elsewhere).

    ``q`` is the held Q tile, or unused when Q_IN_LOOP (then Q is read in BLOCK_DC-column chunks)."""
    key = key0 + tl.arange(0, BLOCK_N)
    s, k_norms2 = _qk_dot(q_ptr, k_ptr, q, batch, kv_head, head, row, real, key, 0, Hk, Tk, D,
                stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
                FP32_DOT, Q_IN_LOOP, BLOCK_DC)
    for c in tl.static_range(1, BLOCK_D // BLOCK_DC):
        s_c, k_norms2_c = _qk_dot(q_ptr, k_ptr, q, batch, kv_head, head, row, real, key, c * BLOCK_DC, Hk, Tk, D,
                                  stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn,
                                  stride_kd, FP32_DOT, Q_IN_LOOP, BLOCK_DC)
        s += s_c
        k_norms2 += k_norms2_c
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
            s = s + mf.to(s.dtype) * _LOG2E
    return tl.where(visible, s, _MASKED), tl.max(k_norms2, 2, keep_dims=True)


@triton.jit
def _qk_lse_kernel(
    lse_ptr,                                             # output: [B, H, Tq] natural log (fp64 for fp32 inputs)
    q_ptr, k_ptr, mask_ptr,
    G, Hk, Tq, Tk, D, row_tiles, qk_scale, mask_threshold,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_lb, stride_lh, stride_lm,
    given_ptr, stride_gb, stride_gh, stride_gm,          # HAS_GIVEN: a natural-log LSE to check, [B, H, Tq]
    IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, FP32_DOT: tl.constexpr, Q_IN_LOOP: tl.constexpr,
    BLOCK_HK: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DC: tl.constexpr, HAS_GIVEN: tl.constexpr = False,
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
    if FP32_DOT:   # float64 scores: the maximum too (only differences from it go to float32)
        m_i = tl.full((BLOCK_HK, BLOCK_G * BLOCK_M), _ABOVE_MASKED, dtype=tl.float64)
    else:
        m_i = tl.full((BLOCK_HK, BLOCK_G * BLOCK_M), _ABOVE_MASKED, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_HK, BLOCK_G * BLOCK_M), dtype=tl.float32)
    key_end = Tk
    if IS_CAUSAL:   # later key tiles are in the future of every row of this tile
        key_end = tl.minimum(Tk, row0 + BLOCK_M)
    for key0 in range(0, key_end, BLOCK_N):
        s, _k_norm2 = _scores(q, q_ptr, k_ptr, mask_ptr, batch, kv_head, head, row, real, key0, Hk, Tk, D, qk_scale,
                    mask_threshold, stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn,
                    stride_kd, stride_mb, stride_mh, stride_mm, stride_mn,
                    IS_CAUSAL, MASK_KIND, FP32_DOT, Q_IN_LOOP, BLOCK_N, BLOCK_D, BLOCK_DC)
        m_new = tl.maximum(m_i, tl.max(s, 2))
        l_i = l_i * tl.exp2((m_i - m_new).to(tl.float32)) + tl.sum(tl.exp2((s - m_new[:, :, None]).to(tl.float32)), 2)
        m_i = m_new
    seen = l_i > 0
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * _LN2, float("-inf"))
    if HAS_GIVEN:
        # another kernel's LSE (the attention op's, float32) that disagrees with these scores: a row whose mass
        # under it is off 1 by more than MASS_TOLERANCE, beyond the float32 rounding of an LSE of its size,
        # stores NaN, which pass 2 counts invalid
        given = tl.load(given_ptr + batch * stride_gb + head * stride_gh + row * stride_gm, mask=real, other=0.0)
        agrees = tl.abs(lse - given) <= _MASS_TOLERANCE + _GIVEN_ROUNDING * tl.abs(lse)   # NaN disagrees
        lse = tl.where(seen & (agrees == 0), float("nan"), lse)
    tl.store(lse_ptr + batch * stride_lb + head * stride_lh + row * stride_lm, lse, mask=real)


@triton.jit
def _log2_probs(s, lse2, ok):
    """``x = log2 p = s − lse₂`` (float32, from float64 scores too); rows that do not count get x = MASKED,
    so p = exp2(x) = 0."""
    return tl.where(ok[:, :, None], s - lse2[:, :, None], _MASKED).to(tl.float32)


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
def _head_side(block, q_ptr, lse_ptr, row_ok_ptr, batch, row0, G, Hk, Tq, D,
               stride_qb, stride_qh, stride_qm, stride_qd, stride_lb, stride_lh, stride_lm, stride_rb, stride_rm,
               HAS_ROW_OK: tl.constexpr, Q_IN_LOOP: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_G: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """One head block of a pass-2 program (its own, or the other of an off-diagonal pair): key heads,
    query heads, rows, which rows are real and which count, the held Q tile (``q_ptr`` as a
    placeholder when Q is re-read every key tile) and the rows' LSE in log2 units."""
    kv, head, row, real = _head_block(block, G, Hk, Tq, row0, BLOCK_HK, BLOCK_G, BLOCK_M)
    ok = real
    if HAS_ROW_OK:
        ok = ok & (tl.load(row_ok_ptr + batch * stride_rb + row * stride_rm, mask=row < Tq, other=0) != 0)
    q = q_ptr
    if not Q_IN_LOOP:
        q = _load_q(q_ptr, batch, head, row, real, 0, D, stride_qb, stride_qh, stride_qm, stride_qd, BLOCK_D)
    # a row that does not count may have LSE ±inf: 0 keeps its exponent finite, its p is 0 anyway
    lse = tl.load(lse_ptr + batch * stride_lb + head * stride_lh + row * stride_lm, mask=ok, other=0.0)
    return kv, head, row, real, ok, q, tl.where(ok, lse * _LOG2E, 0.0)


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
    kv_i, head_i, row, real_i, ok_i, q_i, lse2_i = _head_side(
        block_i, q_ptr, lse_ptr, row_ok_ptr, batch, row0, G, Hk, Tq, D, stride_qb, stride_qh, stride_qm, stride_qd,
        stride_lb, stride_lh, stride_lm, stride_rb, stride_rm, HAS_ROW_OK, Q_IN_LOOP, BLOCK_HK, BLOCK_G, BLOCK_M, BLOCK_D)
    if not DIAGONAL:
        block_j = tl.load(block_j_ptr + pair).to(tl.int64)
        kv_j, head_j, _row_j, real_j, ok_j, q_j, lse2_j = _head_side(
            block_j, q_ptr, lse_ptr, row_ok_ptr, batch, row0, G, Hk, Tq, D, stride_qb, stride_qh, stride_qm,
            stride_qd, stride_lb, stride_lh, stride_lm, stride_rb, stride_rm, HAS_ROW_OK, Q_IN_LOOP, BLOCK_HK,
            BLOCK_G, BLOCK_M, BLOCK_D)

    gram = tl.zeros((BLOCK_HK * BLOCK_G, BLOCK_HK * BLOCK_G), dtype=tl.float32)
    m, rest, total = _row_sums_start((BLOCK_HK, BLOCK_G * BLOCK_M), FP32_DOT)   # the rows' running sums
    k_norm2 = tl.zeros((BLOCK_HK, 1, 1), dtype=tl.float32)   # max ‖k_j‖² so far, per key head
    key_end = Tk
    if IS_CAUSAL:   # later key tiles are in the future of every row of this tile
        key_end = tl.minimum(Tk, row0 + BLOCK_M)
    for key0 in range(0, key_end, BLOCK_N):
        s_i, k_norm2_tile = _scores(q_i, q_ptr, k_ptr, mask_ptr, batch, kv_i, head_i, row, real_i, key0, Hk, Tk, D, qk_scale,
                      mask_threshold, stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn,
                      stride_kd, stride_mb, stride_mh, stride_mm, stride_mn,
                      IS_CAUSAL, MASK_KIND, FP32_DOT, Q_IN_LOOP, BLOCK_N, BLOCK_D, BLOCK_DC)
        if DIAGONAL:
            # p = exp2(s − m) · exp2(m − lse₂): one exp2 per score serves the Gram and the row sums
            e_i, m, rest, total = _row_sums_step(s_i, m, rest, total, 2)
            k_norm2 = tl.maximum(k_norm2, k_norm2_tile)
            p_i = tl.where(ok_i[:, :, None], e_i * tl.exp2((m - lse2_i).to(tl.float32))[:, :, None], 0.0)
        else:
            p_i = tl.exp2(_log2_probs(s_i, lse2_i, ok_i))
        slab_i = _slab(p_i, FP32_DOT, BLOCK_HK, BLOCK_G, BLOCK_M, BLOCK_N)
        if DIAGONAL:
            slab_j = slab_i
        else:
            s_j, _k_norm2_j = _scores(q_j, q_ptr, k_ptr, mask_ptr, batch, kv_j, head_j, row, real_j, key0, Hk, Tk, D,
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
        # ‖q_i‖² re-read once here (Q is L2-resident), not held across the key loop; 16 columns at a time
        # (unrolled: a loop here would be what the kernel report takes for the hot loop)
        q_norm2 = tl.zeros((BLOCK_HK, BLOCK_G * BLOCK_M), dtype=tl.float32)
        for c in tl.static_range(BLOCK_D // 16):
            q_c = _load_q(q_ptr, batch, head_i, row, real_i, c * 16, D, stride_qb, stride_qh, stride_qm,
                          stride_qd, 16).to(tl.float32)
            q_norm2 += tl.sum(q_c * q_c, 2)
        bound = _cancel_bound(q_norm2, tl.reshape(k_norm2, (BLOCK_HK, 1)), qk_scale)
        entropy, off = _row_results(m, rest, total, lse2_i, ok_i, bound, FP32_DOT)
        tl.store(entropy_part_ptr + part * bh + out, tl.sum(tl.reshape(entropy, (bh, BLOCK_M)), 1))
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
# launcher reads the device's own opt-in limit (`device.device_limits`): 163 KB on an A100, 99 KB on
# sm_86 / sm_89 / sm_120.
SHARED_LIMIT = GPUS[90]["shared_bytes"]


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
    cfg["num_stages"] = _stages(cfg, element_bytes, shared_limit, blocks_held=1)
    cfg_shared = _shared_bytes(cfg, cfg["num_stages"], element_bytes, 1)
    if block_hk < hk:
        off = off_diagonal_config(cfg, element_bytes, shared_limit)
        cfg_shared = max(cfg_shared, _shared_bytes(off, off["num_stages"], element_bytes, 2))
    return cfg, cfg_shared


def _stages(cfg: dict, element_bytes: int, shared_limit: int, blocks_held: int) -> int:
    """2 (loads of the next key tile in flight, by async copies that bypass registers) where they fit
    ``shared_limit``, else 1."""
    return 2 if _shared_bytes(cfg, 2, element_bytes, blocks_held) <= shared_limit else 1


def off_diagonal_config(cfg: dict, element_bytes: int, shared_limit: int = SHARED_LIMIT) -> dict:
    """The off-diagonal programs' tiles: those of the diagonal ``cfg``, staged for the two head blocks
    they hold. (Llama-7B under an additive mask, sm_90: the diagonal 2 stages at 144 KB, 167 registers;
    the off-diagonal 1 stage, since 2 take 280 KB.)"""
    return dict(cfg, num_stages=_stages(cfg, element_bytes, shared_limit, blocks_held=2))


def dot_width_candidates(cfg: dict) -> list[dict]:
    """``cfg`` and the same tiles with narrower score dots, down to 16 columns: what a launch falls
    back to where ``cfg`` spills registers. At one stage a dot's loads pass through registers, and
    which width spills is the compiler's call: Llama-7B's off-diagonal programs under an additive mask
    spilled at 64 and 32 columns and not at 16 under triton 3.9 on sm_90, at 16 and not at 32 or 64
    under 3.6."""
    widths = [cfg["BLOCK_DC"]]
    while widths[-1] > 16:
        widths.append(widths[-1] // 2)
    return [dict(cfg, BLOCK_DC=w, Q_IN_LOOP=cfg["Q_IN_LOOP"] or w < cfg["BLOCK_D"]) for w in widths]


def lse_tile_config(h: int, hk: int, d: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Pass 1's blocks: one key head (its query group folded into M) and 128 query rows per program,
    as a flash forward does. Pass 1 needs nothing across heads, and this layout takes fewer
    instructions per score than pass 2's head blocks at every report shape (`fastdiag.kernel_report`)."""
    block_g = triton.next_power_of_2(h // hk)
    block_d = max(16, triton.next_power_of_2(d))
    # float32 (float64 dots): 64 columns a dot; 64 rows (128 spilled 96 B at Llama-7B for sm_90, triton 3.9)
    block_dc = min(block_d, _DOT_COLUMNS if dtype == torch.float32 else 2 * _DOT_COLUMNS)
    rows = 64 if dtype == torch.float32 else 128
    return dict(BLOCK_HK=1, BLOCK_G=block_g, BLOCK_M=max(1, rows // block_g), BLOCK_N=64, BLOCK_D=block_d,
                BLOCK_DC=block_dc, Q_IN_LOOP=block_dc < block_d, num_warps=NUM_WARPS, num_stages=2)


def lse_tile_candidates(cfg: dict, dtype: torch.dtype) -> list[dict]:
    """Pass 1's tiles and, for float32 inputs, smaller ones a launch falls back to where they spill
    (`_launch_without_spills`; the same rows, which the launch's grid is made for): 32 keys a step, then 32
    columns a dot. Llama-7B's spilled 204 B at 64 keys for sm_80 under triton 3.6 (196 B at 32 columns), none
    at 32 keys."""
    if dtype != torch.float32:
        return [cfg]
    return [cfg, dict(cfg, BLOCK_N=32), dict(cfg, BLOCK_N=32, BLOCK_DC=min(32, cfg["BLOCK_DC"]),
                                             Q_IN_LOOP=cfg["Q_IN_LOOP"] or cfg["BLOCK_DC"] > 32)]


def pass2_configs(h: int, hk: int, d: int, dtype: torch.dtype, shared_limit: int | None,
                  explicit_mask: bool = False) -> list[dict]:
    """The batched pass 2's tiles to try, preferred first, on a target with ``shared_limit`` bytes of shared
    memory per block (None: no limit applies — CPU, the interpreter). Empty: no tile fits, and pass 2 runs
    on `qk_stats_torch` (cuBLAS; the Triton LSE of pass 1 still saves a pass).

    Empty for float32 inputs on every device, the interpreter included, so that it runs what a GPU runs:
    their pass 2 is the per-head kernel's float32 plan (`heads_config`, `_float32_heads_plans`: float64
    scores one head at a time), or the torch path where that does not apply. The batched kernel scores them
    in float64 too (exact: `tests/test_qk_cancelling.py` forces it), but its 3-D float64 score dots never fit
    a GPU: at GPT-2-small for sm_90, 196 KB and 688 B spilled at the smallest tiles (16 heads x 16 rows x 16
    keys), 393 KB and 16.9 KB spilled at the preferred ones (triton 3.9, benchmarks/RESULTS.md, "float32
    pass 2"). 16-bit tiles are chosen by the estimate `_shared_bytes` (checked
    against the compiled metadata); a launch that still exceeds the device tries the next.
    ``explicit_mask`` (bool or additive): the mask tile's registers come on top, so the key tile starts
    at 16 (at 32, GPT-2-small spilled 8 B / 12 B on sm_90 under an additive / bool mask and the 4k
    context 7.9 / 7.1 KB on sm_80, triton 3.9)."""
    element_bytes = dtype.itemsize
    tiles = ((_SCORE_BUDGET, 32), (_SCORE_BUDGET // 2, 32), (_SCORE_BUDGET // 4, 16), (_SCORE_BUDGET // 8, 16))
    if explicit_mask:
        tiles = ((_SCORE_BUDGET // 2, 16), (_SCORE_BUDGET // 4, 16), (_SCORE_BUDGET // 8, 16))
    if dtype == torch.float32:
        return []
    if shared_limit is None:
        budget, block_n = tiles[0]
        return [tile_config(h, hk, d, budget, block_n, element_bytes=element_bytes)]
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


# Launch-invariant device tensors and configurations, per (shapes, tiles, device): built once, so a
# launch's host work is the launch and the few ops that reduce its partial sums (`_stats`).
_GATHERS: dict = {}


def _gathers(h: int, hk: int, cfg: dict, blocks: int, device) -> tuple[tuple, torch.Tensor, torch.Tensor]:
    """(block ids int32 (rows i and j of the diagonal blocks, then of the i < j pairs); ``take`` indices ``[H, H]`` of
    each head pair's Gram entry in the pairs' summed blocks ``[pairs, BH, BH]`` (the lower triangle
    read transposed from the upper); ``take`` indices ``[H]`` of each head's entropy in ``[blocks · BH]``)."""
    key = (h, hk, tuple(sorted(cfg.items())), blocks, device)
    found = _GATHERS.get(key)
    if found is None:     # built with device ops: no host-to-device copy, so nothing a graph capture refuses
        bh = cfg["BLOCK_HK"] * cfg["BLOCK_G"]
        i32 = dict(dtype=torch.int32, device=device)
        diagonal = torch.arange(blocks, **i32)
        upper = torch.triu_indices(blocks, blocks, 1, **i32)
        ids = (diagonal, diagonal.clone(), upper[0].contiguous(), upper[1].contiguous())
        pos = _head_index(h, hk, cfg, device)
        bi, ri = pos[:, None] // bh, pos[:, None] % bh            # [H, 1]: the row head's block and place
        bj, rj = pos[None, :] // bh, pos[None, :] % bh            # [1, H]: the column head's
        lower = bi > bj                                           # only i <= j blocks exist: read the transpose
        bi, bj, ri, rj = torch.where(lower, bj, bi), torch.where(lower, bi, bj), torch.where(lower, rj, ri), \
            torch.where(lower, ri, rj)
        # the pair's number: diagonal blocks 0..blocks-1, then (i, j), i < j, row by row
        off = blocks + bi * blocks - bi * (bi + 1) // 2 + (bj - bi - 1)
        number = torch.where(bi == bj, bi, off)
        found = _GATHERS[key] = (ids, (number * bh * bh + ri * bh + rj).contiguous(), pos)
    return found


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


def _row_lse(q4, k4, mask4, is_causal, scale, given=None, spare_rows=0):
    """Pass 1: the natural-log row LSE, float64 for float32 inputs (scored in float64: a float32 LSE of a
    score of 1e4 is 6e-4 off, and pass 2's p carries it whole), float32 for 16-bit ones. ``given``
    (another kernel's LSE, [B, H, Tq]): checked here, NaN where it disagrees (pass 2 counts the row).
    ``spare_rows``: batch rows allocated past B and left unwritten, ``[B + spare_rows, H, Tq]`` (pass 2's
    float32 scratch: `float32_scratch_rows`)."""
    b, h, tq, d = q4.shape
    cfg = lse_tile_config(h, k4.shape[1], d, q4.dtype)
    grid, mask, args, constexprs = _shared_args(q4, k4, mask4, is_causal, scale, cfg)
    dtype = torch.float64 if q4.dtype == torch.float32 else torch.float32
    lse = torch.empty(b + spare_rows, h, tq, dtype=dtype, device=q4.device)
    checked = (lse, (0, 0, 0)) if given is None else (given, given.stride())
    candidates = lse_tile_candidates(cfg, q4.dtype)
    if len(candidates) == 1:
        _qk_lse_kernel[grid](lse, q4, k4, mask, *args, *lse.stride(), checked[0], *checked[1],
                             HAS_GIVEN=given is not None, **constexprs)
        return lse
    flags = {k: v for k, v in constexprs.items() if k not in cfg}
    limits = device_limits(q4.device)
    _launch_without_spills(grid, (lse, q4, k4, mask, *args, *lse.stride(), checked[0], *checked[1]),
                           dict(flags, HAS_GIVEN=given is not None), candidates, limits and limits["arch"],
                           kernel=_qk_lse_kernel)
    return lse


# (target arch, dtype, constexprs of the first candidate) -> the candidate a launch uses (`_launch_without_spills`)
_UNSPILLED: dict = {}


def _launch_without_spills(grid, args: tuple, flags: dict, candidates: list[dict], arch: int | None,
                           kernel=_qk_stats_kernel) -> None:
    """Launch ``kernel`` (pass 2's batched kernel, or pass 1) with the first of ``candidates`` (tile constexprs)
    that compiles without spilling registers on this device (``arch``; None: no GPU), the last where all
    spill. The choice is kept per kernel, target, dtype and constexprs (the compiler's specialisation on
    alignment is not in the key)."""
    key = (kernel.fn.__name__, arch, args[1].dtype, args[3].dtype, tuple(sorted({**flags, **candidates[0]}.items())))
    chosen = _UNSPILLED.get(key)
    if chosen is None:
        chosen = candidates[-1]
        for cfg in candidates[:-1]:
            if not spill_bytes(kernel, grid, args, {**flags, **cfg}):    # 0, or None: no GPU
                chosen = cfg
                break
        _UNSPILLED[key] = chosen
    kernel[grid](*args, **flags, **chosen)


def _stats(q4, k4, mask4, is_causal, scale, rows_ok, lse, cfg, limits=None):
    """Pass 2 with tiles ``cfg`` on a device of ``limits`` (`device.device_limits`; None: no GPU)."""
    b, h, tq, d = q4.shape
    hk = k4.shape[1]
    device = q4.device
    (programs, blocks), mask, args, constexprs = _shared_args(q4, k4, mask4, is_causal, scale, cfg)
    (block_i, block_j, off_i, off_j), gram_index, entropy_index = _gathers(h, hk, cfg, blocks, device)
    bh = cfg["BLOCK_HK"] * cfg["BLOCK_G"]
    gram_part = torch.empty(programs, blocks, bh, bh, dtype=torch.float32, device=device)
    entropy_part = torch.empty(programs, blocks, bh, dtype=torch.float64 if q4.dtype == torch.float32 else torch.float32,
                               device=device)     # float32 inputs: float64 row sums (`_row_sums_start`)
    invalid_part = torch.empty(programs, blocks, dtype=torch.float32, device=device)
    row_ok = q4 if rows_ok is None else rows_ok.view(torch.uint8)
    row_strides = (0, 0) if rows_ok is None else rows_ok.stride()
    tail = (*args, *lse.stride(), *row_strides)
    flags = {k: v for k, v in constexprs.items() if k not in cfg}
    arch = limits and limits["arch"]
    _launch_without_spills((programs, blocks), (
        gram_part, entropy_part, invalid_part, q4, k4, mask, lse, row_ok, block_i, block_j, *tail),
        dict(flags, DIAGONAL=True, HAS_ROW_OK=rows_ok is not None), dot_width_candidates(cfg), arch)
    gram_blocks = gram_part.sum(0, dtype=torch.float64)             # [pairs, BH, BH]
    if blocks > 1:
        # off-diagonal Gram blocks: their own grid and partials, no entropy or mass
        gram_off_part = torch.empty(programs, off_i.numel(), bh, bh, dtype=torch.float32, device=device)
        off = off_diagonal_config(cfg, q4.dtype.itemsize, limits["shared_bytes"] if limits else SHARED_LIMIT)
        _launch_without_spills((programs, off_i.numel()), (
            gram_off_part, entropy_part, invalid_part, q4, k4, mask, lse, row_ok, off_i, off_j, *tail),
            dict(flags, DIAGONAL=False, HAS_ROW_OK=rows_ok is not None), dot_width_candidates(off), arch)
        gram_blocks = torch.cat([gram_blocks, gram_off_part.sum(0, dtype=torch.float64)])
    gram = torch.take(gram_blocks, gram_index)                                          # [H, H]
    entropy = torch.take(entropy_part.sum(0, dtype=torch.float64), entropy_index)     # [H]
    return _head_stats_sums(gram, entropy, invalid_part, b * tq, rows_ok)


def _head_stats_sums(gram, entropy, invalid_part, rows_total: int, rows_ok):
    """``(gram, entropy, rows, invalid)`` from the reduced sums and the kernels' invalid partials: a
    NaN anywhere makes the statistics invalid (x ≠ x). An infinite sum needs an infinite p in a counted
    row, whose mass the kernel already counts in invalid_part."""
    total = gram.sum() + entropy.sum()
    invalid = invalid_part.sum(dtype=torch.float64) + total.ne(total)
    rows = (torch.full((), float(rows_total), dtype=torch.float64, device=gram.device) if rows_ok is None
            else rows_ok.sum(dtype=torch.float64))
    return gram, entropy, rows, invalid


# ---- pass 2 with a 2-D score dot per head (`qk_heads_triton`) --------------------------------------

# Heads one program of `_qk_heads_kernel` holds: all of a layer's (its Gram is one block). More heads,
# or a wider head dim, take the head-pair plan (`heads_plans`).
HEADS_KERNEL_MAX_HEADS = 16
# Head dims it takes: Q of every head is held in shared memory (16 x 64 rows x 64 bf16 = 128 KB).
HEADS_KERNEL_MAX_HEAD_DIM = 64
# Heads per block of the head-pair plan: a pair's program stacks 2 blocks, the Gram dot's 16 heads.
PAIR_HEADS = 8
# float32 inputs (`HEAD_LOOP`): heads and head dims of one program (its Gram dot [BLOCK_H, BLOCK_H]); more run
# on the torch path
FP32_MAX_HEADS = 64
FP32_MAX_HEAD_DIM = 128


def heads_config(h: int, hk: int, d: int, element_bytes: int = 2) -> dict | None:
    """`_qk_heads_kernel`'s tiles for H query heads, Hk key heads, head dim d; None where it does not
    apply (more heads or a wider head dim than it holds, and no head-pair plan: H not a multiple of
    `PAIR_HEADS`, or a query group wider than a block). 64 rows x 16 keys per head and key step, 4 warps
    (one warpgroup: each warp's 16 rows are its own batch of the Gram dot), the Gram dot in 4 parts
    (one dot of a warp's 16 x 256 slab held 128 registers of operands): compiled for sm_90 by triton
    3.9, 255 registers, no spill, ~100 KB of shared memory, 1.0x the conflict-free wavefronts
    (benchmarks/RESULTS.md, issue 38). ``PAIRS``: the heads do not fit one program (`heads_plans`).

    float32 inputs (``element_bytes`` 4): ``HEAD_LOOP``, every head of the rows in one program, scored in
    float64 one head at a time (`qk_heads_triton._gram_by_head`), up to `FP32_MAX_HEADS` heads of
    `FP32_MAX_HEAD_DIM`; the tiles are `heads_plans`'."""
    group = h // hk
    if element_bytes == 4:
        if h > FP32_MAX_HEADS or d > FP32_MAX_HEAD_DIM:
            return None
        return dict(HEADS=h, GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(h)), HEAD_BITS=0, BLOCK_M=64,
                    BLOCK_N=16, BLOCK_D=max(16, triton.next_power_of_2(d)), SPLIT=1, GRAM_CHUNKS=1, num_warps=4,
                    num_stages=1, PAIRS=False, HEAD_LOOP=True)
    pairs = h > HEADS_KERNEL_MAX_HEADS or d > HEADS_KERNEL_MAX_HEAD_DIM
    if pairs and (h % PAIR_HEADS or h < 2 * PAIR_HEADS or PAIR_HEADS % group):
        return None
    block_h = 2 * PAIR_HEADS if pairs else max(16, triton.next_power_of_2(h))
    return dict(HEADS=h, GROUP=group, BLOCK_H=block_h, HEAD_BITS=block_h.bit_length() - 1, BLOCK_M=64,
                BLOCK_N=16, BLOCK_D=max(16, triton.next_power_of_2(d)), SPLIT=4, GRAM_CHUNKS=4, num_warps=4,
                num_stages=1, PAIRS=pairs)


def heads_plans(cfg: dict) -> list[list[dict]]:
    """The ways to run `_qk_heads_kernel` with tiles ``cfg``, in order of preference, each a list of
    launches' constexprs (``HEAD_PROGRAMS``: the launch's second grid axis): one launch of the Gram and
    the row sums; or the Gram alone plus the row sums in programs of one head (a second scoring of every
    head, 64 keys a step, without the Gram's loop-carried row sums: triton 3.6, and 3.9 with the three
    running sums of `row_entropy_triton`, spill the one launch for sm_90 and compile these two clean,
    benchmarks/RESULTS.md); or that with the Gram
    in 8 warps; or plan 1 or 2 with 32 rows a program (Q of 12 heads x 32 rows x 64 bf16 = 48 KB: the
    plans for 99 KB of shared memory, sm_86/89/120; triton 3.9 compiles 4 warps clean for sm_120, 8 for
    sm_86/89). The launcher takes the first plan that fits the device's shared memory and whose launches
    compile without spilling.

    ``cfg["PAIRS"]`` (more than 16 heads, or head dim > 64): one plan, the Gram in programs of two blocks
    of `PAIR_HEADS` heads (I < J; every head scored in blocks - 1 programs: 3x at 32 heads) with Q
    re-read every key step (``Q_STREAM``: held, 16 heads x 64 rows x 128 bf16 take 256 KB), plus the row
    sums. It compiles clean nowhere (triton 3.9, [1, 32, 4096, 128]: 904–1,336 B spilled at 4 or 8 warps,
    32 or 64 rows, on sm_80 and sm_90; predicted 2.2–4 ms at sm_90 against the batched kernel's 0.86 under
    triton 3.6 and 3.26 under 3.9), so the launcher never probes it (a probe compiles for tens of seconds): only gpu_check's tune stage, or a
    test, forces it (benchmarks/RESULTS.md, issue 38)."""
    pairs = cfg.get("PAIRS", False)
    cfg = {k: v for k, v in cfg.items() if k != "PAIRS"}
    if cfg.get("HEAD_LOOP"):
        return _float32_heads_plans(cfg)
    row_sums = dict(cfg, BLOCK_H=1, HEAD_BITS=0, BLOCK_N=64, SPLIT=1, GRAM_CHUNKS=1, GRAM=False, ROW_SUMS=True,
                    HEAD_PROGRAMS=cfg["HEADS"], OUT_H=cfg["HEADS"])
    if pairs:
        blocks = cfg["HEADS"] // PAIR_HEADS
        gram = dict(cfg, GRAM=True, ROW_SUMS=False, HEAD_PROGRAMS=blocks * (blocks - 1) // 2, OUT_H=cfg["HEADS"],
                    PAIR_HEADS=PAIR_HEADS, Q_STREAM=True)
        return [[gram, row_sums]]
    whole = dict(cfg, GRAM=True, HEAD_PROGRAMS=1, OUT_H=cfg["HEADS"])
    # 8 warps: two per 16 rows of the score dot; twice the Gram's shared-memory wavefronts per score, but
    # sm_80 and sm_100 compile it without spilling under both tritons where 4 warps spill 8–72 B
    return [[dict(whole, ROW_SUMS=True)], [dict(whole, ROW_SUMS=False), row_sums],
            [dict(whole, ROW_SUMS=False, num_warps=8), row_sums],
            [dict(whole, ROW_SUMS=False, BLOCK_M=32, SPLIT=2), row_sums],
            [dict(whole, ROW_SUMS=False, num_warps=8, BLOCK_M=32, SPLIT=2), row_sums]]


# float32 plans: (Gram programs' rows; the row sums' (rows, keys)), preferred first. The Gram's rows set how often
# each K tile is read (once per 64 rows), the row sums' tiles their registers (one head, float64 scores)
_FP32_GRAM_ROWS = (64, 32, 16)
_FP32_ROW_SUM_TILES = ((64, 32), (32, 32), (32, 16), (16, 16))


def float32_scratch_rows(b: int, h: int, tq: int, cfg: dict) -> int:
    """Batch rows of pass 1's float64 LSE ``[B + rows, H, Tq]`` past B that hold the float32 plans' scratch
    slabs (`_heads_launches`): one allocation for both, one host op fewer per measured layer (issue 37: ≤ 16).
    ``B·cdiv(Tq, 64)·64·BLOCK_H·BLOCK_N`` float32 elements: enough at any of `_FP32_GRAM_ROWS`."""
    need = b * triton.cdiv(tq, max(_FP32_GRAM_ROWS)) * max(_FP32_GRAM_ROWS) * cfg["BLOCK_H"] * cfg["BLOCK_N"]
    return triton.cdiv(need, 2 * h * tq)


def _float32_heads_plans(cfg: dict) -> list[list[dict]]:
    """float32 inputs, ``HEAD_LOOP`` (heads scored in float64 one at a time, their probabilities through an
    L2-resident scratch slab into a TF32×3 dot of `GRAM_COLUMNS` columns at a time, `qk_heads_triton._gram_by_head`):
    one launch of the Gram and the row sums, `_FP32_GRAM_ROWS` rows a program; or the Gram alone, then the row
    sums in programs of one head, Q re-read every key step (every head scored a third time), each pair of
    `_FP32_GRAM_ROWS` × `_FP32_ROW_SUM_TILES`. Largest first: the launcher takes the first plan that compiles
    without spilling on the device (`_heads_stats`). Held in registers for all heads, as 16-bit tiles are,
    the float64 scores spilled everywhere (255 registers; benchmarks/RESULTS.md, "float32 pass 2")."""
    heads = cfg["HEADS"]
    base = {k: v for k, v in cfg.items() if k != "HEAD_LOOP"}
    gram = dict(base, GRAM=True, ROW_SUMS=False, HEAD_LOOP=True, GRAM_COLUMNS=32, HEAD_PROGRAMS=1, OUT_H=heads)
    row_sums = dict(base, BLOCK_H=1, HEAD_BITS=0, GRAM=False, ROW_SUMS=True, Q_STREAM=True, HEAD_PROGRAMS=heads,
                    OUT_H=heads)
    one_launch = [[dict(gram, ROW_SUMS=True, BLOCK_M=m)] for m in _FP32_GRAM_ROWS]
    return one_launch + [[dict(gram, BLOCK_M=m), dict(row_sums, BLOCK_M=rm, BLOCK_N=rn)]
                         for m in _FP32_GRAM_ROWS for rm, rn in _FP32_ROW_SUM_TILES]


def heads_shared_bytes(cfg: dict, element_bytes: int) -> int:
    """Shared memory of `_qk_heads_kernel` as sm_90 compiles it: every real head's Q tile (held for the
    whole key loop; staged one head at a time where re-read every key step) and 4 KB of K tile and Gram
    staging (GPT-2-small bf16: 96 + 4 = 100 KB, compiled)."""
    held = 1 if cfg.get("Q_STREAM") or cfg.get("HEAD_LOOP") or not cfg.get("GRAM", True) else \
        min(cfg["HEADS"], cfg["BLOCK_H"])
    return held * cfg["BLOCK_M"] * cfg["BLOCK_D"] * element_bytes + 4096


# (blocks, device) -> the block pairs (i < j, row by row) of a head-pair plan; (H, PB, device) -> each
# head pair's Gram entry in the pairs' summed blocks: built once, with device ops (graph-capture safe)
_PAIRS: dict = {}


def _head_pairs(blocks: int, device) -> torch.Tensor:
    """int32 ``[pairs, 2]``: head blocks (i, j), i < j, row by row: one program of a pair plan each."""
    key = (blocks, device)
    if key not in _PAIRS:
        _PAIRS[key] = torch.triu_indices(blocks, blocks, 1, dtype=torch.int32, device=device).t().contiguous()
    return _PAIRS[key]


def _pair_gram_index(h: int, pair_heads: int, device) -> torch.Tensor:
    """``take`` indices ``[H, H]`` of each head pair's Gram entry in the pairs' summed blocks
    ``[pairs, 2·PB, 2·PB]`` (places: block i's heads, then block j's). Heads of one block are read
    from the pair of their block and the next (the last block: the previous)."""
    key = (h, pair_heads, device)
    if key not in _PAIRS:
        blocks, width = h // pair_heads, 2 * pair_heads
        head = torch.arange(h, device=device)
        blk, place = head // pair_heads, head % pair_heads
        a, b = blk[:, None], blk[None, :]
        # the pair: (min, max) of two different blocks; one block with its neighbour
        i = torch.where(a == b, torch.clamp(a, max=blocks - 2), torch.minimum(a, b))
        j = torch.where(a == b, i + 1, torch.maximum(a, b))
        number = i * blocks - i * (i + 1) // 2 + (j - i - 1)
        row = torch.where(a == i, place[:, None], pair_heads + place[:, None])
        col = torch.where(b == i, place[None, :], pair_heads + place[None, :])
        _PAIRS[key] = (number * width * width + row * width + col).contiguous()
    return _PAIRS[key]


def _heads_launches(q4, k4, mask4, is_causal, scale, rows_ok, lse, plan):
    """[(grid, arguments, constexprs)] of ``plan``'s `_qk_heads_kernel` launches and their outputs
    (gram [P, H, H], entropy [P, H], invalid [P, HEAD_PROGRAMS] partial sums: real heads only)."""
    b, h, tq, d = q4.shape
    tk = k4.shape[2]
    mask, mask_strides, mask_kind, threshold = _mask_args(mask4, (b, h, tq, tk))
    gram, row_sums = plan[0], plan[-1]
    programs = [b * triton.cdiv(tq, cfg["BLOCK_M"]) for cfg in (gram, row_sums)]   # each launch its own row tiles
    f32 = dict(dtype=torch.float32, device=q4.device)
    pair_heads = gram.get("PAIR_HEADS", 0)
    pairs = q4 if not pair_heads else _head_pairs(h // pair_heads, q4.device)    # unread without pairs
    gram_shape = (h, h) if not pair_heads else (pairs.shape[0], 2 * pair_heads, 2 * pair_heads)
    # float32 inputs: the entropies' partial sums in float64 (the kernels' row sums are; see `_row_sums_start`)
    entropy_dtype = torch.float64 if q4.dtype == torch.float32 else torch.float32
    outputs = (torch.empty(programs[0], *gram_shape, **f32),
               torch.empty(programs[1], h, dtype=entropy_dtype, device=q4.device),
               torch.empty(programs[1], row_sums["HEAD_PROGRAMS"], **f32))
    row_ok = q4 if rows_ok is None else rows_ok.view(torch.uint8)
    row_strides = (0, 0) if rows_ok is None else rows_ok.stride()
    # HEAD_LOOP (float32): each program's probabilities of every head for one key step, [P, BLOCK_H·M·N] float32,
    # in the spare rows pass 1 left after the LSE (`float32_scratch_rows`), or allocated here where it left none
    scratch, scratch0 = q4, 0
    if gram.get("HEAD_LOOP"):
        scratch, scratch0 = lse, b * h * tq * lse.element_size() // 4
        if lse.numel() * lse.element_size() // 4 < scratch0 + programs[0] * gram["BLOCK_H"] * gram["BLOCK_M"] * gram["BLOCK_N"]:
            scratch, scratch0 = torch.empty(programs[0], gram["BLOCK_H"] * gram["BLOCK_M"] * gram["BLOCK_N"], **f32), 0
    launches = []
    for cfg in plan:
        row_tiles = triton.cdiv(tq, cfg["BLOCK_M"])
        args = (*outputs, q4, k4, q4 if mask is None else mask, lse, row_ok, pairs, scratch, scratch0, tq, tk, d, row_tiles,
                scale * LOG2E, threshold, *q4.stride(), *k4.stride(), *mask_strides, *lse.stride(), *row_strides)
        flags = dict(IS_CAUSAL=bool(is_causal), MASK_KIND=mask_kind, HAS_ROW_OK=rows_ok is not None,
                     FP32_DOT=q4.dtype == torch.float32, **cfg)
        launches.append(((b * row_tiles, flags.pop("HEAD_PROGRAMS")), args, flags))
    return launches, outputs


# (target arch, shapes, flags) -> whether `_qk_heads_kernel` compiles there without spilling
_HEADS_UNSPILLED: dict = {}


def _unspilled(launch, arch) -> bool:
    """Whether one `_qk_heads_kernel` launch compiles for ``arch`` without spilling (cached)."""
    grid, args, flags = launch
    q4 = args[3]
    key = (arch, q4.dtype, q4.shape[3], grid[1], tuple(sorted(flags.items())))
    fits = _HEADS_UNSPILLED.get(key)
    if fits is None:
        try:
            fits = spill_bytes(_qk_heads_kernel, grid, args, flags) == 0
        except (triton.runtime.errors.OutOfResources, RuntimeError):
            # RuntimeError: a compiler pass failed (triton 3.6's TMEM layout pass on sm_100 fails the
            # one-head row sums); the batched kernel or another plan computes the same sums
            fits = False
        _HEADS_UNSPILLED[key] = fits
    return fits


# (arch, dtype, H, Hk, head dim, causal, mask kind, row mask) -> the index of the first plan of
# `heads_plans` that compiles there without spilling, or None: chosen at the first launch, so later ones
# allocate only the chosen plan's partial sums and build no rejected plan's launches
_HEADS_CHOICE: dict = {}
# (H, Hk, head dim, element bytes) -> (tiles, plans): pure functions of the shape, built once
_HEADS_PLANS: dict = {}


def _heads_stats(q4, k4, mask4, is_causal, scale, rows_ok, lse, limits, plan=None):
    """Pass 2 on `_qk_heads_kernel`, or None where it does not apply: no plan for these heads
    (`heads_config`), or on this device every plan (`heads_plans`) exceeds shared memory or spills registers
    (16-bit pass 2 then materialises P; float32 runs on the torch path).
    ``plan`` (an index into `heads_plans`) replaces the choice (tests run each plan)."""
    b, h, tq, d = q4.shape
    shape_key = (h, k4.shape[1], d, q4.dtype.itemsize)
    if shape_key not in _HEADS_PLANS:
        cfg = heads_config(*shape_key)
        _HEADS_PLANS[shape_key] = (cfg, None if cfg is None else heads_plans(cfg))
    cfg, plans = _HEADS_PLANS[shape_key]
    if cfg is None or (plan is None and cfg["PAIRS"]):
        return None     # the head pairs run only when asked for (`heads_plans`: they spill everywhere)
    if plan is None and limits is not None:
        key = (limits["arch"], q4.dtype, *shape_key[:3], bool(is_causal),
               None if mask4 is None else mask4.dtype == torch.bool, rows_ok is not None)
        if key not in _HEADS_CHOICE:
            _HEADS_CHOICE[key] = next(
                (i for i, candidate in enumerate(plans)
                 if all(heads_shared_bytes(x, q4.dtype.itemsize) <= limits["shared_bytes"] for x in candidate)
                 and all(_unspilled(x, limits["arch"])
                         for x in _heads_launches(q4, k4, mask4, is_causal, scale, rows_ok, lse, candidate)[0])),
                None)
        plan = _HEADS_CHOICE[key]
        if plan is None:
            return None
    launches, (gram_part, entropy_part, invalid_part) = _heads_launches(
        q4, k4, mask4, is_causal, scale, rows_ok, lse, plans[plan or 0])
    for grid, args, flags in launches:
        _qk_heads_kernel[grid](*args, **flags)
    gram = gram_part.sum(0, dtype=torch.float64)
    pair_heads = launches[0][2].get("PAIR_HEADS", 0)
    if pair_heads:
        gram = torch.take(gram, _pair_gram_index(h, pair_heads, q4.device))
    return _head_stats_sums(gram, entropy_part.sum(0, dtype=torch.float64), invalid_part, b * tq, rows_ok)


# Targets where 16-bit pass 2 through materialised P is predicted faster than the per-head kernel too
# (GPT-2-small, bf16 causal, triton 3.9 / 3.6: sm_80 0.149 / 0.148 ms against 0.266 / 0.283, sm_86 0.49 / 0.49
# against 0.54 / 0.57, sm_90 0.073 / 0.072 against 0.106 / 0.105, sm_100 0.052 / 0.054 against 0.111 / 0.120;
# not on sm_89, 0.29 against 0.21 / 0.22, nor sm_120, 0.165 against 0.100 / 0.106: benchmarks/RESULTS.md)
PROBS_FIRST_ARCHS = (80, 86, 90, 100)


def _probs_stats(q4, k4, mask4, is_causal, scale, rows_ok, lse, budget: int = PROBS_BUFFER_BYTES):
    """Pass 2 through materialised 16-bit P in row chunks of at most ``budget`` bytes (`qk_probs_triton`)."""
    b, h, tq, _ = q4.shape
    mask, mask_strides, mask_kind, threshold = _mask_args(mask4, (b, h, tq, k4.shape[2]))
    gram, entropy, invalid_part = probs_pass2(q4, k4, mask, mask_strides, mask_kind, threshold, is_causal, scale,
                                              rows_ok, lse, budget)
    return _head_stats_sums(gram, entropy, invalid_part, b * tq, rows_ok)


def qk_stats_triton(q4, k4, mask4, is_causal: bool, scale: float, rows_ok=None, lse=None, tiles=None):
    """HeadStats sums ``(gram [H, H], entropy_sum [H], rows, invalid)`` in float64.

    q4 ``[B, H, Tq, D]``, k4 ``[B, Hk, Tk, D]``, mask4 broadcastable to ``[B, H, Tq, Tk]`` (bool,
    True = may attend, or additive), rows_ok bool ``[B, Tq]`` (None: every row counts), lse the
    natural-log row LSE ``[B, H, Tq]`` or None (pass 1 computes it). Pass 2's tiles that exceed the
    device's shared memory fall back to smaller ones; ``tiles`` (a `tile_config`) replaces that
    choice, without fallback (tests force head blocks with it at small shapes).

    float32 inputs: pass 1 always runs (float64 scores, a float64 LSE: `_row_lse`; pass 2 needs that precision)
    and a given LSE (the attention op's, float32) is only checked against it."""
    q4, k4 = _dot_inputs(q4, k4)
    limits = device_limits(q4.device)
    shared = limits and limits["shared_bytes"]
    spare_rows = 0
    if lse is None or q4.dtype == torch.float32:
        if not pass1_fits(q4.dtype, shared, limits and limits["arch"]):
            return qk_stats_torch(q4, k4, mask4, is_causal, scale, rows_ok, lse, CHUNK_BYTES,
                                  check_lse=lse is not None)
        float32_heads = q4.dtype == torch.float32 and tiles is None and heads_config(
            q4.shape[1], k4.shape[1], q4.shape[3], 4)
        if float32_heads:   # pass 2's scratch in the LSE's allocation
            spare_rows = float32_scratch_rows(q4.shape[0], q4.shape[1], q4.shape[2], float32_heads)
        try:
            lse = _row_lse(q4, k4, mask4, is_causal, scale, given=lse, spare_rows=spare_rows)
        except triton.runtime.errors.OutOfResources as e:
            _warn_torch_path(q4, e)
            return qk_stats_torch(q4, k4, mask4, is_causal, scale, rows_ok, lse, CHUNK_BYTES,
                                  check_lse=lse is not None)
    if tiles is not None:
        return _stats(q4, k4, mask4, is_causal, scale, rows_ok, lse, tiles, limits)
    half = q4.dtype in (torch.float16, torch.bfloat16)
    if half and limits is not None and limits["arch"] in PROBS_FIRST_ARCHS:
        return _probs_stats(q4, k4, mask4, is_causal, scale, rows_ok, lse)
    by_head = _heads_stats(q4, k4, mask4, is_causal, scale, rows_ok, lse, limits)
    if by_head is not None:
        return by_head
    if half:
        # 16-bit where the per-head kernel does not run: materialised P, one head a program, fits every
        # generation; predicted 0.39 ms at [1, 32, 4096, 128] on sm_90 where the batched kernel takes
        # 3.8 (triton 3.9) / 0.86 (3.6), and the only Triton pass 2 on sm_80/86/89/120 there (benchmarks/RESULTS.md)
        return _probs_stats(q4, k4, mask4, is_causal, scale, rows_ok, lse)
    # float32 where no per-head plan runs (the batched kernel's float64 dots fit no GPU: `pass2_configs`):
    # the same sums in PyTorch, the LSE checked against the scores
    return qk_stats_torch(q4, k4, mask4, is_causal, scale, rows_ok, lse[:q4.shape[0]] if spare_rows else lse,
                          CHUNK_BYTES, check_lse=True)


_WARNED: set = set()


def _warn_torch_path(q4, error) -> None:
    """Once per shape: a tile the estimate let through did not fit the device after all."""
    key = (q4.device, q4.dtype, q4.shape[1], q4.shape[3])
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"qk_head_stats: a Triton tile exceeded this GPU's shared memory ({error}); trying "
                      "smaller tiles, then the chunked PyTorch path (same sums, slower)", RuntimeWarning,
                      stacklevel=3)


# Targets whose float32 Q/K run in Triton: both passes score in float64 (`tl.dot` on float64 operands), which
# Triton compiles to the float64 MMA (mma.sync f64) for sm_80 and sm_90, and for sm_100 under triton 3.9 (3.6
# fails to compile a float64 dot there: "PassManager::run failed"). For sm_86 / sm_89 / sm_120 it emits an FMA
# loop (those GPUs run float64 at 1/64 rate) whose pass 1 spills 680 B to 56 KB at GPT-2-small and Llama-7B:
# the torch path runs there (benchmarks/RESULTS.md, "float32 pass 2").
FLOAT32_ARCHS = (80, 90) + ((100,) if tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 9) else ())


def pass1_fits(dtype: torch.dtype, shared_limit: int | None, arch: int | None = None) -> bool:
    """Whether pass 1 runs in Triton on a target with ``shared_limit`` bytes per block (None: no limit
    applies — CPU, the interpreter) of architecture ``arch`` (as 90 for sm_90). Where not, the whole Q/K
    computation runs on `qk_stats_torch` (cuBLAS; float64 scores for float32 inputs): float32 inputs off
    `FLOAT32_ARCHS`."""
    return shared_limit is None or dtype != torch.float32 or arch in FLOAT32_ARCHS


def row_lse_triton(q4, k4, mask4, is_causal: bool, scale: float) -> torch.Tensor:
    """Pass 1 alone: the natural-log row LSE ``[B, H, Tq]`` (-inf where a row sees no key)."""
    q4, k4 = _dot_inputs(q4, k4)
    return _row_lse(q4, k4, mask4, is_causal, scale)


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
