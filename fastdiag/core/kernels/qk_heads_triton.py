"""Q/K pass 2 with a 2-D score dot per head: every head of a layer in one program, no padded head scored.

The batched pass 2 of `qk_stats_triton` scores ``[heads, rows, keys]`` with one 3-D `tl.dot`: its heads
are padded to a power of two (12 → 16: a quarter of GPT-2's scores wasted) and, compiled by triton 3.9,
its 3-D shared operand buffers take the head axis as the swizzle's phase, so ``ldmatrix`` reads 8 rows
of one head from the same banks (benchmarks/RESULTS.md, issue 38). Here each real head is scored by
its own 2-D dot ``Q_h [BLOCK_M, D] · K_hᵀ [D, BLOCK_N]`` (the layout a flash forward gets, conflict-free
under both tritons), its probabilities and its rows' running sums (`row_entropy_triton`) are taken in
float32 while only that head is live, and the probabilities are kept as 16-bit values. The heads are stacked with `tl.join`
(a binary tree built at compile time, `_stack`): a padded head is a constant zero tile, never scored.
The stacked ``[BLOCK_H, BLOCK_M·BLOCK_N]`` slab feeds the Gram dot, as in the batched kernel.

One launch takes the Gram and the row sums (``GRAM`` and ``ROW_SUMS``) where that compiles without
spilling; otherwise two (`qk_stats_triton.heads_plans`): the Gram of all heads without the row sums
(their loop-carried ``[BLOCK_M, heads]`` running maximum, mass and entropy sums: with them the one
launch spills 16 B for sm_90 under triton 3.9, 104–464 B elsewhere), and the row sums alone in
programs of ``BLOCK_H`` heads (``program_id(1)`` picks them).

float32 inputs (``HEAD_LOOP``, `_gram_by_head`): every head scored in float64 (exact products; sharp rows'
gaps kept), which held for all heads at once spills everywhere; so the heads are scored one at a time by a
loop, their probabilities go through an L2-resident float32 slab into the Gram dot, and their rows' running
sums (float64) are picked and put back by a select. One launch; the rows' float64 sums make σ_H's digits.

`tl.join` puts the new axis last, so the stack's head axis comes out bit-reversed (`_bit_reversed`
maps it back where the sums are stored). Everything else — the masks, the LSE in log2 units, the
row sums and checks, the float64 reduction of the partial sums — is the batched kernel's
(`qk_stats_triton._qk_stats_kernel`).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .constants import LOG2E, MASKED_SCORE
from .row_entropy_triton import _cancel_bound, _key_norms2, _row_results, _row_sums_start, _row_sums_step

_LOG2E = tl.constexpr(LOG2E)
_MASKED = tl.constexpr(MASKED_SCORE)


@triton.jit
def _head_scores(h, q_base, k_base, mask_base, q_offsets, q_in, k_offsets, k_in, mask_offsets, mask_in, visible,
                 qk_scale, mask_threshold, stride_qh, stride_kh, stride_mh,
                 GROUP: tl.constexpr, MASK_KIND: tl.constexpr, FP32_DOT: tl.constexpr):
    """Head ``h``'s masked scores in log2 units on one ``[BLOCK_M, BLOCK_N]`` tile (masked keys at MASKED;
    float64 for float32 inputs) and its K tile. ``h`` may be a loop variable (`_gram_by_head`)."""
    q = tl.load(q_base + h * stride_qh + q_offsets, mask=q_in, other=0.0)
    kt = tl.load(k_base + (h // GROUP) * stride_kh + k_offsets, mask=k_in, other=0.0)
    if FP32_DOT:
        # fp32 products are exact in float64, and float64 sums keep a sharp row's gaps (1e4 nats)
        s = tl.dot(q.to(tl.float64), kt.to(tl.float64))
    else:
        s = tl.dot(q, kt)                               # 16-bit products are exact in fp32
    s = s * qk_scale
    seen = visible
    if MASK_KIND != 0:
        m_tile = tl.load(mask_base + h * stride_mh + mask_offsets, mask=mask_in, other=0)
        if MASK_KIND == 1:
            seen = seen & (m_tile != 0)
        else:
            # finite, NaN-propagating (see `qk_stats_triton._scores`)
            mf = tl.maximum(m_tile.to(tl.float32), _MASKED, propagate_nan=tl.PropagateNan.ALL)
            seen = seen & ((mf > mask_threshold) | (mf != mf))
            s = s + mf.to(s.dtype) * _LOG2E
    return tl.where(seen, s, _MASKED), kt


@triton.jit
def _head_tile(h: tl.constexpr, q_base, k_base, mask_base, lse_base, q_offsets, q_in, k_offsets, k_in,
               mask_offsets, mask_in, visible, ok, lse_offsets, qk_scale, mask_threshold, m, rest, total,
               k_norm2, stride_qh, stride_kh, stride_mh, stride_lh,
               HEADS: tl.constexpr, GROUP: tl.constexpr, MASK_KIND: tl.constexpr, FP32_DOT: tl.constexpr,
               ROW_SUMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KEY_NORMS: tl.constexpr = True):
    """Head ``h``'s probabilities on one ``[BLOCK_M, BLOCK_N]`` tile (in the Gram dot's input type) and,
    with ROW_SUMS, its rows' running sums ``(m, rest, total)`` (`row_entropy_triton`) with this tile in
    and ``k_norm2`` (``[1, 1]``: the largest ‖k_j‖² of every head's keys so far, for the
    rows' cancellation bound) raised by this tile's (KEY_NORMS False: left as it is, the caller has them);
    zeros and the sums unchanged for a padded head (``h >= HEADS``).

    A head's pointers are the batch entry's base plus one scalar per head plus offset tiles that every
    head shares (``*_offsets``, in bounds where ``*_in``): per-head pointer tiles, hoisted out of the
    key loop by the compiler, took every register (255, and spilled)."""
    if h < HEADS:
        s, kt = _head_scores(h, q_base, k_base, mask_base, q_offsets, q_in, k_offsets, k_in, mask_offsets, mask_in,
                             visible, qk_scale, mask_threshold, stride_qh, stride_kh, stride_mh, GROUP, MASK_KIND,
                             FP32_DOT)
        # a row that does not count may have LSE ±inf: 0 keeps its exponent finite, its p is 0 anyway
        lse2 = tl.load(lse_base + h * stride_lh + lse_offsets, mask=ok, other=0.0) * _LOG2E   # float64: pass 1's, float32 inputs
        if ROW_SUMS:
            # p = exp2(s − m) · exp2(m − lse₂): one exp2 per score serves the Gram and the row sums
            e, m, rest, total = _row_sums_step(s, m, rest, total, 1)
            if KEY_NORMS:
                # one running max over the program's heads: one register, an upper bound for each head
                k_norm2 = tl.maximum(k_norm2, tl.max(_key_norms2(kt, 0), 1, keep_dims=True))
            p = tl.where(ok[:, None], e * tl.exp2((m - lse2).to(tl.float32))[:, None], 0.0)   # NaN where a row does not count: 0
        else:
            p = tl.exp2(tl.where(ok[:, None], s - lse2[:, None], _MASKED).to(tl.float32))
        if FP32_DOT:
            tile = p
        else:
            tile = p.to(tl.float16)          # p in [0, 1]: fp16 keeps 11 bits, the sums stay fp32
    else:
        if FP32_DOT:
            tile = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        else:
            tile = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float16)
    return tile, m, rest, total, k_norm2


@triton.jit
def _stack(h0: tl.constexpr, WIDTH: tl.constexpr, q_base, k_base, mask_base, lse_base, q_offsets, q_in,
           k_offsets, k_in, mask_offsets, mask_in, visible, ok, lse_offsets, qk_scale, mask_threshold,
           m, rest, total, k_norm2, stride_qh, stride_kh, stride_mh, stride_lh,
           HEADS: tl.constexpr, GROUP: tl.constexpr, MASK_KIND: tl.constexpr, FP32_DOT: tl.constexpr,
           ROW_SUMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Heads ``h0 .. h0 + WIDTH`` stacked: ``[BLOCK_M, BLOCK_N, 2, …, 2]`` (log2 WIDTH axes of 2, the
    head's lowest bit first) and their running row sums ``[BLOCK_M, 2, …, 2]`` (in that stacked
    shape: split here, joined back)."""
    if WIDTH == 1:
        return _head_tile(h0, q_base, k_base, mask_base, lse_base, q_offsets, q_in, k_offsets, k_in,
                          mask_offsets, mask_in, visible, ok, lse_offsets, qk_scale, mask_threshold, m, rest,
                          total, k_norm2, stride_qh, stride_kh, stride_mh, stride_lh, HEADS, GROUP, MASK_KIND, FP32_DOT,
                          ROW_SUMS, BLOCK_M, BLOCK_N)
    else:
        m_a, m_b = tl.split(m)
        rest_a, rest_b = tl.split(rest)
        total_a, total_b = tl.split(total)
        a_tile, m_a, rest_a, total_a, k_norm2 = _stack(
            h0, WIDTH // 2, q_base, k_base, mask_base, lse_base, q_offsets, q_in, k_offsets, k_in,
            mask_offsets, mask_in, visible, ok, lse_offsets, qk_scale, mask_threshold, m_a, rest_a, total_a,
            k_norm2, stride_qh, stride_kh, stride_mh, stride_lh, HEADS, GROUP, MASK_KIND, FP32_DOT, ROW_SUMS, BLOCK_M,
            BLOCK_N)
        b_tile, m_b, rest_b, total_b, k_norm2 = _stack(
            h0 + WIDTH // 2, WIDTH // 2, q_base, k_base, mask_base, lse_base, q_offsets, q_in, k_offsets, k_in,
            mask_offsets, mask_in, visible, ok, lse_offsets, qk_scale, mask_threshold, m_b, rest_b, total_b,
            k_norm2, stride_qh, stride_kh, stride_mh, stride_lh, HEADS, GROUP, MASK_KIND, FP32_DOT, ROW_SUMS, BLOCK_M,
            BLOCK_N)
        return (tl.join(a_tile, b_tile), tl.join(m_a, m_b), tl.join(rest_a, rest_b),
                tl.join(total_a, total_b), k_norm2)


@triton.jit
def _gram_chunks(gram, slab, CHUNKS: tl.constexpr, FP32_DOT: tl.constexpr):
    """``gram + slab slabᵀ`` (batched), as CHUNKS dots over parts of the summed axis: one dot of the whole
    slab holds both operands in registers at once (64 + 64 per thread at 16 heads x 256 scores a warp)."""
    if CHUNKS == 1:
        if FP32_DOT:
            gram += tl.dot(slab, tl.permute(slab, (0, 2, 1)), input_precision="tf32x3")
        else:
            gram += tl.dot(slab, tl.permute(slab, (0, 2, 1)))
    else:
        # even and odd places of the summed axis: any split of it sums to the same Gram
        even, odd = tl.split(tl.reshape(slab, (slab.shape[0], slab.shape[1], slab.shape[2] // 2, 2)))
        gram = _gram_chunks(gram, even, CHUNKS // 2, FP32_DOT)
        gram = _gram_chunks(gram, odd, CHUNKS // 2, FP32_DOT)
    return gram


@triton.jit
def _gram_tile(gram, tiles, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_H: tl.constexpr, GRAM_CHUNKS: tl.constexpr, FP32_DOT: tl.constexpr):
    """``gram`` plus one key step's stacked tiles ``[rows, keys, places]``."""
    # [rows, keys, places] -> [SPLIT, places, rows·keys / SPLIT]: the Gram sums over rows and keys
    # alike; each of SPLIT row groups (a warp's rows of the score dot) is its own batch of the dot
    slab = tl.reshape(tl.permute(tl.reshape(tiles, (SPLIT, BLOCK_M // SPLIT, BLOCK_N, BLOCK_H)), (0, 3, 1, 2)),
                      (SPLIT, BLOCK_H, BLOCK_M // SPLIT * BLOCK_N))
    return _gram_chunks(gram, slab, GRAM_CHUNKS, FP32_DOT)

@triton.jit
def _gram_by_head(gram, m, rest, total, k_norm2, scratch, q_base, k_base, mask_base, lse_base, q_offsets, q_in,
                  k_offsets, k_in, mask_offsets, mask_in, visible, ok, lse_offsets, qk_scale, mask_threshold, stride_qh,
                  stride_kh, stride_mh, stride_lh, HEADS: tl.constexpr, GROUP: tl.constexpr, MASK_KIND: tl.constexpr,
                  ROW_SUMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
                  GRAM_COLUMNS: tl.constexpr):
    """One key step of float32 inputs (``HEAD_LOOP``): ``gram [1, BLOCK_H, BLOCK_H]`` plus its Gram and, with
    ROW_SUMS, the rows' running sums ``(m, rest, total)`` ``[BLOCK_M, BLOCK_H]`` (m float64, heads in order)
    and ``k_norm2`` (`_head_tile`'s) with it. The heads are scored in float64 one at a time by a loop, each
    head's probabilities (float32; its LSE is pass 1's float64) stored to its row of this program's
    ``scratch`` slab ``[BLOCK_H, BLOCK_M·BLOCK_N]`` (L2-resident, 64 KB at 64 heads), which the Gram dot then reads,
    `GRAM_COLUMNS` columns at a time, in TF32×3 (p keeps float32's 1e-7; the target is 1e-5). Held in registers
    instead, as `_stack` holds 16-bit tiles, the heads' float64 scores and the stacked float32 tiles took 255
    registers and spilled 64–900 B at GPT-2-small (sm_80–sm_120, triton 3.6 and 3.9); in a loop, one head's
    are live, and a head's running sums are picked from and put back in place by a select."""
    size: tl.constexpr = BLOCK_M * BLOCK_N
    here = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    place = tl.arange(0, BLOCK_H)
    for h in range(HEADS):
        s, kt = _head_scores(h, q_base, k_base, mask_base, q_offsets, q_in, k_offsets, k_in, mask_offsets, mask_in,
                             visible, qk_scale, mask_threshold, stride_qh, stride_kh, stride_mh, GROUP, MASK_KIND,
                             True)
        lse2 = tl.load(lse_base + h * stride_lh + lse_offsets, mask=ok, other=0.0) * _LOG2E
        if ROW_SUMS:
            here_h = place[None, :] == h
            m_h = tl.max(tl.where(here_h, m, float("-inf")), 1)
            e, m_h, rest_h, total_h = _row_sums_step(s, m_h, tl.sum(tl.where(here_h, rest, 0.0), 1),
                                                     tl.sum(tl.where(here_h, total, 0.0), 1), 1)
            m = tl.where(here_h, m_h[:, None], m)
            rest = tl.where(here_h, rest_h[:, None], rest)
            total = tl.where(here_h, total_h[:, None], total)
            k_norm2 = tl.maximum(k_norm2, tl.max(_key_norms2(kt, 0), 1, keep_dims=True))
            p = tl.where(ok[:, None], e * tl.exp2((m_h - lse2).to(tl.float32))[:, None], 0.0)
        else:
            p = tl.exp2(tl.where(ok[:, None], s - lse2[:, None], _MASKED).to(tl.float32))
        tl.store(scratch + h * size + here, p)
    tl.debug_barrier()    # every head's tile stored before any is read
    for c in range(0, size, GRAM_COLUMNS):     # a loop: one chunk's operands live at a time
        column = c + tl.arange(0, GRAM_COLUMNS)
        slab = tl.load(scratch + place[:, None] * size + column[None, :], mask=place[:, None] < HEADS, other=0.0)
        slab_t = tl.load(scratch + place[None, :] * size + column[:, None], mask=place[None, :] < HEADS, other=0.0)
        gram += tl.dot(slab, slab_t, input_precision="tf32x3")[None, :, :]
    tl.debug_barrier()    # read before the next key step stores
    return gram, m, rest, total, k_norm2


@triton.jit
def _full_stack(WIDTH: tl.constexpr, BLOCK_M: tl.constexpr, VALUE: tl.constexpr):
    """``VALUE`` everywhere, shaped as `_stack`'s row sums: ``[BLOCK_M, 2, …, 2]``."""
    if WIDTH == 1:
        return tl.full((BLOCK_M,), VALUE, dtype=tl.float32)
    else:
        half = _full_stack(WIDTH // 2, BLOCK_M, VALUE)
        return tl.join(half, half)


@triton.jit
def _bit_reversed(j, BITS: tl.constexpr):
    """The head at place ``j`` of a `_stack`: ``j``'s lowest BITS bits reversed."""
    out = j * 0
    for i in tl.static_range(BITS):
        out = out | (((j >> i) & 1) << (BITS - 1 - i))
    return out


@triton.jit
def _qk_heads_kernel(
    gram_part_ptr, entropy_part_ptr, invalid_part_ptr,  # outputs: [P, H, H] (pairs: [P, pairs, 2·PB, 2·PB]), [P, H], [P, head programs]
    q_ptr, k_ptr, mask_ptr, lse_ptr, row_ok_ptr, pair_ptr,
    scratch_ptr, scratch0,      # HEAD_LOOP: float32 slabs [P, BLOCK_H·BLOCK_M·BLOCK_N] from float32 element scratch0
    Tq, Tk, D, row_tiles, qk_scale, mask_threshold,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_lb, stride_lh, stride_lm,
    stride_rb, stride_rm,
    HEADS: tl.constexpr, GROUP: tl.constexpr, IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
    HAS_ROW_OK: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_BITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr,
    GRAM_CHUNKS: tl.constexpr, GRAM: tl.constexpr, ROW_SUMS: tl.constexpr, OUT_H: tl.constexpr,
    PAIR_HEADS: tl.constexpr = 0, Q_STREAM: tl.constexpr = False, HEAD_LOOP: tl.constexpr = False,
    GRAM_COLUMNS: tl.constexpr = 64,
):
    pid = tl.program_id(0).to(tl.int64)
    batch = pid // row_tiles
    row0 = (pid % row_tiles) * BLOCK_M
    row = row0 + tl.arange(0, BLOCK_M)
    gram = tl.zeros((SPLIT, BLOCK_H, BLOCK_H), dtype=tl.float32)
    # the rows' running sums (`row_entropy_triton`) stay in the stack's own shape and layout: reshaped to
    # [rows, heads] inside the loop they took a layout holding each value twice in every thread of a quad
    if HEAD_LOOP:   # [rows, heads in order]; m the float64 scores' running maximum
        m, rest, total = _row_sums_start((BLOCK_M, BLOCK_H), True)
    else:
        m = _full_stack(BLOCK_H, BLOCK_M, _MASKED)
        rest = _full_stack(BLOCK_H, BLOCK_M, 0.0)
        total = _full_stack(BLOCK_H, BLOCK_M, 0.0)
        if FP32_DOT:   # float64, as `_row_sums_start` makes them for float32 inputs
            m, rest, total = m.to(tl.float64), rest.to(tl.float64), total.to(tl.float64)
    k_norm2 = tl.zeros((1, 1), dtype=tl.float32)   # 16-bit row sums: max ‖k_j‖² so far, over the heads
    key_end = Tk
    if IS_CAUSAL:   # later key tiles are in the future of every row of this tile
        key_end = tl.minimum(Tk, row0 + BLOCK_M)
    # what every head shares: the batch entry's bases (at this program's first head), the offset tiles
    # and their bounds. The Gram needs all heads in one program (head0 = 0); the row sums alone are
    # split over program_id(1), BLOCK_H heads each (a multiple of GROUP, or one head)
    if PAIR_HEADS > 0:
        # a block pair's program: the Gram of heads I·PB .. and J·PB .. (I < J), both blocks scored here
        head0 = tl.load(pair_ptr + 2 * tl.program_id(1)).to(tl.int64) * PAIR_HEADS
        head0_j = tl.load(pair_ptr + 2 * tl.program_id(1) + 1).to(tl.int64) * PAIR_HEADS
    elif GRAM:
        head0 = 0       # a constant: an offset from program_id(1) cost the one launch its last registers
    else:
        head0 = tl.program_id(1) * BLOCK_H
    d = tl.arange(0, BLOCK_D)
    q_base = q_ptr + batch * stride_qb + head0 * stride_qh
    k_base = k_ptr + batch * stride_kb + (head0 // GROUP) * stride_kh
    mask_base = mask_ptr + batch * stride_mb + head0 * stride_mh
    lse_base = lse_ptr + batch * stride_lb + head0 * stride_lh
    q_offsets = row[:, None] * stride_qm + d[None, :] * stride_qd
    q_in = (row[:, None] < Tq) & (d[None, :] < D)
    ok = row < Tq
    if HAS_ROW_OK:
        ok = ok & (tl.load(row_ok_ptr + batch * stride_rb + row * stride_rm, mask=row < Tq, other=0) != 0)
    lse_offsets = row * stride_lm
    if PAIR_HEADS > 0:
        q_base_j = q_ptr + batch * stride_qb + head0_j * stride_qh
        k_base_j = k_ptr + batch * stride_kb + (head0_j // GROUP) * stride_kh
        mask_base_j = mask_ptr + batch * stride_mb + head0_j * stride_mh
        lse_base_j = lse_ptr + batch * stride_lb + head0_j * stride_lh
    for key0 in range(0, key_end, BLOCK_N):
        q_step = q_in
        if Q_STREAM:
            # a bound that depends on the key step keeps Q's load in the loop: held for the whole loop
            # (hoisted), every head's Q tile takes shared memory (32 heads x 64 rows x 128 bf16 = 512 KB)
            q_step = q_in & (row[:, None] * 0 + key0 < key_end)
        key = key0 + tl.arange(0, BLOCK_N)
        # 64-bit: Tk · stride_kn passes 2^31 (BTHD, T ≥ 512 K)
        k_offsets = d[:, None] * stride_kd + key.to(tl.int64)[None, :] * stride_kn
        k_in = (d[:, None] < D) & (key[None, :] < Tk)
        visible = (key[None, :] < Tk) & (row[:, None] >= 0)
        if IS_CAUSAL:
            visible = visible & (key[None, :] <= row[:, None])
        mask_offsets = row[:, None] * stride_mm + key[None, :] * stride_mn
        mask_in = (row[:, None] < Tq) & (key[None, :] < Tk)
        if HEAD_LOOP:
            gram, m, rest, total, k_norm2 = _gram_by_head(
                gram, m, rest, total, k_norm2,
                scratch_ptr.to(tl.pointer_type(tl.float32)) + scratch0 + pid * (BLOCK_H * BLOCK_M * BLOCK_N), q_base, k_base,
                mask_base, lse_base, q_offsets, q_step, k_offsets, k_in, mask_offsets, mask_in, visible, ok,
                lse_offsets, qk_scale, mask_threshold, stride_qh, stride_kh, stride_mh, stride_lh, HEADS, GROUP,
                MASK_KIND, ROW_SUMS, BLOCK_M, BLOCK_N, BLOCK_H, GRAM_COLUMNS)
        elif PAIR_HEADS > 0:
            # block I's heads then block J's: the top level of a `_stack` of 2·PB heads (the Gram alone:
            # a pair's launch takes no row sums, its running sums pass through unchanged)
            m_i, m_j = tl.split(m)
            rest_i, rest_j = tl.split(rest)
            total_i, total_j = tl.split(total)
            tiles_i, m_i, rest_i, total_i, k_norm2 = _stack(
                0, PAIR_HEADS, q_base, k_base, mask_base, lse_base, q_offsets, q_step, k_offsets, k_in,
                mask_offsets, mask_in, visible, ok, lse_offsets, qk_scale, mask_threshold, m_i, rest_i, total_i,
                k_norm2, stride_qh, stride_kh, stride_mh, stride_lh, PAIR_HEADS, GROUP, MASK_KIND, FP32_DOT, False,
                BLOCK_M, BLOCK_N)
            tiles_j, m_j, rest_j, total_j, k_norm2 = _stack(
                0, PAIR_HEADS, q_base_j, k_base_j, mask_base_j, lse_base_j, q_offsets, q_step, k_offsets, k_in,
                mask_offsets, mask_in, visible, ok, lse_offsets, qk_scale, mask_threshold, m_j, rest_j, total_j,
                k_norm2, stride_qh, stride_kh, stride_mh, stride_lh, PAIR_HEADS, GROUP, MASK_KIND, FP32_DOT, False,
                BLOCK_M, BLOCK_N)
            tiles = tl.join(tiles_i, tiles_j)
        else:
            tiles, m, rest, total, k_norm2 = _stack(
                0, BLOCK_H, q_base, k_base, mask_base, lse_base, q_offsets, q_step, k_offsets, k_in,
                mask_offsets, mask_in, visible, ok, lse_offsets, qk_scale, mask_threshold, m, rest, total,
                k_norm2, stride_qh, stride_kh, stride_mh, stride_lh, HEADS, GROUP, MASK_KIND, FP32_DOT, ROW_SUMS, BLOCK_M,
                BLOCK_N)
        if GRAM and not HEAD_LOOP:
            gram = _gram_tile(gram, tiles, SPLIT, BLOCK_M, BLOCK_N, BLOCK_H, GRAM_CHUNKS, FP32_DOT)

    place = tl.arange(0, BLOCK_H)
    if HEAD_LOOP:
        head = place                              # `_gram_by_head` places heads in order
    else:
        head = _bit_reversed(place, HEAD_BITS)
    if PAIR_HEADS > 0:
        # the pair's whole [2·PB, 2·PB] block by place in the stack (I's heads, then J's): the host takes
        # the I-J quadrant from every pair and each diagonal block from one pair holding it
        tl.store(gram_part_ptr + (pid * tl.num_programs(1) + tl.program_id(1)) * BLOCK_H * BLOCK_H
                 + head[:, None] * BLOCK_H + head[None, :], tl.sum(gram, 0))
    elif GRAM:
        # real heads only, [HEADS, HEADS]: the host sums the partials with no slice of padded heads
        tl.store(gram_part_ptr + pid * HEADS * HEADS + head[:, None] * HEADS + head[None, :], tl.sum(gram, 0),
                 mask=(head[:, None] < HEADS) & (head[None, :] < HEADS))
    if ROW_SUMS:
        counted = ok[:, None] & (head0 + head[None, :] < HEADS)
        lse2 = tl.load(lse_base + head[None, :] * stride_lh + lse_offsets[:, None], mask=counted, other=0.0) * _LOG2E
        # ‖q_i‖² per row and head, re-read once here (not held across the key loop), at each head's place
        q_norm2 = tl.zeros((BLOCK_M, BLOCK_H), dtype=tl.float32)
        for h in tl.static_range(BLOCK_H):
            real_head = (tl.full((1, 1), h, tl.int64) + head0) < HEADS   # a tensor: head0 may be 0
            q_h = tl.load(q_base + h * stride_qh + q_offsets, mask=q_in & real_head, other=0.0).to(tl.float32)
            q_norm2 = tl.where(head[None, :] == h, tl.sum(q_h * q_h, 1)[:, None], q_norm2)
        bound = _cancel_bound(q_norm2, k_norm2, qk_scale)
        entropy, off = _row_results(tl.reshape(m, (BLOCK_M, BLOCK_H)), tl.reshape(rest, (BLOCK_M, BLOCK_H)),
                                    tl.reshape(total, (BLOCK_M, BLOCK_H)), lse2, counted, bound, FP32_DOT)
        if BLOCK_H == 1:
            tl.store(entropy_part_ptr + pid * OUT_H + head0, tl.sum(tl.sum(entropy, 1), 0))
        else:
            tl.store(entropy_part_ptr + pid * OUT_H + head0 + head, tl.sum(entropy, 0), mask=head0 + head < OUT_H)
        tl.store(invalid_part_ptr + pid * tl.num_programs(1) + tl.program_id(1),
                 tl.sum(tl.sum(off.to(tl.float32), 1), 0))
