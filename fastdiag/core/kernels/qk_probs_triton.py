"""Q/K pass 2 through materialised 16-bit probabilities, in row chunks: every generation, any head count.

Pass 2 (the row LSE given) needs, per head, the rows' entropies and, across heads, the Gram
``Σ p_h p_gᵀ``. The per-head and batched kernels (`qk_heads_triton`, `qk_stats_triton`) keep P on chip,
so one program must hold every head of its rows: at 32 heads × head dim 128 nothing fits 99 KB of shared
memory and 227 KB only in tiles that cost ≥ 0.86 ms at [1, 32, 4096, 128] (benchmarks/RESULTS.md). Here the
two halves part:

1. `_qk_probs_kernel`, a flash forward without V, one head and ``BLOCK_M`` rows a program (a plain 2-D
   loop, no state across heads): each score tile is `qk_heads_triton._head_tile` — the 16-bit dot, the
   masks, the rows' running sums of `row_entropy_triton` in float32 — and its probabilities, rounded to
   float16 exactly as the on-chip kernels round them for their Gram dot, are stored into a
   ``[B, H, rows, keys]`` buffer. The rows' entropies, masses and checks come from the running sums, never
   from the rounded P.
2. `head_stats_triton.gram_triton`: the Gram of that buffer (bandwidth-bound; causal: the keys past each
   row's diagonal are neither written nor read), float64 across chunks.

The buffer holds a chunk of rows (`probs_chunks`): at most `PROBS_BUFFER_BYTES` (one row tile more where a
single tile of every batch entry and head is larger). The chunks are fixed by the shapes, so a layer's
launches (write, Gram, per chunk) read nothing back to the host and capture in a CUDA graph.
The cost is a device copy of P (written once, read once) beside the score and exp issue of a
flash forward; no head is scored twice. float32 inputs keep their own pass 2 (fp16 P would lose their
digits).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .constants import LOG2E
from .head_stats_triton import gram_triton
from .qk_heads_triton import _head_tile
from .qk_stats_torch import CHUNK_BYTES
from .row_entropy_triton import _cancel_bound, _row_results, _row_sums_start

_LOG2E = tl.constexpr(LOG2E)
# The probabilities buffer's bound: the Q/K statistics' one memory bound (`CHUNK_BYTES`, 64 MiB, what the
# torch path's score chunks take; docs/attach.md, "Memory"), so that measuring a layer never holds more
# than that at once: a chunk of 256 rows at [1, 32, 4096, 128] (16 chunks; causal ones hold only the keys
# up to their last row), 4 at GPT-2-small's [8, 12, 1024, 64]. A chunk's two launches (a few µs each) stay
# under its traffic (~0.03 ms of copy on an H200 per 64 MiB written and read), and 64 MiB is near an
# H200's 50 MB L2, where P may be read back before it reaches DRAM (gpu_check's tune stage times 32 MB).
PROBS_BUFFER_BYTES = CHUNK_BYTES
# The write kernel's tiles: the row sums' launch of the per-head kernel (64 rows, 64 keys, 4 warps), 2 stages:
# 72 KB on sm_90 (3, Triton's default: 104 KB, over the 99 KB of sm_86/89/120). sm_90, [1, 32, 4096, 128],
# triton 3.9: 0.236 ms predicted; 128 keys 0.223 (104 KB, spills 40 B on sm_86), 128 x 128 in 8 warps 0.219
# (160 KB, 72 B spilled on sm_86): benchmarks/RESULTS.md
PROBS_TILES = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)


@triton.jit
def _qk_probs_kernel(
    probs_ptr, entropy_part_ptr, invalid_part_ptr,   # outputs: P [B, H, rows, keys] fp16; [B, tiles, H] fp32 each
    q_ptr, k_ptr, mask_ptr, lse_ptr, row_ok_ptr, k_norm_ptr,    # k_norm: [B, Hk, Tk] fp32 (`key_norms_max`)
    batch0, row_start, chunk_rows, chunk_keys, chunk_tiles, Tq, Tk, D, qk_scale, mask_threshold,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_lb, stride_lh, stride_lm,
    stride_rb, stride_rm,
    stride_pb, stride_ph, stride_pm, stride_pn,
    stride_eb, stride_et, stride_nb, stride_nh,
    GROUP: tl.constexpr, IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_ROW_OK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    local_batch = pid // chunk_tiles                      # the batch entry in the chunk's buffer
    batch = batch0 + local_batch
    tile = pid % chunk_tiles
    local = tile * BLOCK_M + tl.arange(0, BLOCK_M)        # the row in the chunk
    row = row_start + local
    in_chunk = local < chunk_rows
    d = tl.arange(0, BLOCK_D)
    # the head's bases; `_head_tile` then takes it as head 0 of 1
    q_base = q_ptr + batch * stride_qb + head * stride_qh
    k_base = k_ptr + batch * stride_kb + (head // GROUP) * stride_kh
    mask_base = mask_ptr + batch * stride_mb + head * stride_mh
    lse_base = lse_ptr + batch * stride_lb + head * stride_lh
    p_base = probs_ptr + local_batch * stride_pb + head * stride_ph + local[:, None] * stride_pm
    q_offsets = row[:, None] * stride_qm + d[None, :] * stride_qd
    q_in = in_chunk[:, None] & (d[None, :] < D)
    ok = in_chunk
    if HAS_ROW_OK:
        ok = ok & (tl.load(row_ok_ptr + batch * stride_rb + row * stride_rm, mask=in_chunk, other=0) != 0)
    lse_offsets = row * stride_lm
    m, rest, total = _row_sums_start((BLOCK_M,))
    key_end = Tk
    key_full = Tk // BLOCK_N * BLOCK_N            # keys every row of the tile sees, in whole tiles
    if IS_CAUSAL:   # later key tiles are in the future of every row of this tile
        key_end = tl.minimum(Tk, row_start + (tile + 1) * BLOCK_M)
        key_full = tl.minimum(Tk, row_start + tile * BLOCK_M) // BLOCK_N * BLOCK_N
    # two key ranges, one loop body each: [0, key_full) without the causal and length bounds (a flash
    # forward's loop; 64 of 1,290 instructions a step were those compares), then the diagonal or last tile
    for bounded in tl.static_range(2):
        if bounded == 0:
            start, stop = 0, key_full
        else:
            start, stop = key_full, key_end
        for key0 in range(start, stop, BLOCK_N):
            key = key0 + tl.arange(0, BLOCK_N)
            k_offsets = d[:, None] * stride_kd + key.to(tl.int64)[None, :] * stride_kn
            if bounded == 0:
                k_in = (d[:, None] < D) & (key[None, :] >= 0)
                visible = tl.full((BLOCK_M, BLOCK_N), 1, tl.int1)
            else:
                k_in = (d[:, None] < D) & (key[None, :] < Tk)
                visible = (key[None, :] < Tk) & (row[:, None] >= 0)
                if IS_CAUSAL:
                    visible = visible & (key[None, :] <= row[:, None])
            mask_offsets = row[:, None] * stride_mm + key[None, :] * stride_mn
            mask_in = in_chunk[:, None] & (key[None, :] < Tk)
            p, m, rest, total, _unused = _head_tile(
                0, q_base, k_base, mask_base, lse_base, q_offsets, q_in, k_offsets, k_in, mask_offsets, mask_in,
                visible, ok, lse_offsets, qk_scale, mask_threshold, m, rest, total, m, 0, 0, 0, 0,
                1, 1, MASK_KIND, False, True, BLOCK_M, BLOCK_N, False)
            # keys past the chunk's last row (causal) are not in the buffer: the row would run into the next
            tl.store(p_base + key.to(tl.int64)[None, :] * stride_pn, p,
                     mask=in_chunk[:, None] & (key[None, :] < chunk_keys))
    lse2 = tl.load(lse_base + lse_offsets, mask=ok, other=0.0) * _LOG2E
    # ‖q_i‖², re-read once here (not held across the key loop); max ‖k_j‖² over the key tiles the loop
    # read, from the keys' running maximum (`key_norms_max`): what the on-chip kernels' loop carries
    q_f = tl.load(q_base + q_offsets, mask=q_in, other=0.0).to(tl.float32)
    last_key = tl.minimum(Tk, (key_end + BLOCK_N - 1) // BLOCK_N * BLOCK_N) - 1
    k_max2 = tl.load(k_norm_ptr + batch * stride_nb + (head // GROUP) * stride_nh + tl.maximum(last_key, 0))
    bound = _cancel_bound(tl.sum(q_f * q_f, 1), k_max2, qk_scale)
    entropy, off = _row_results(m, rest, total, lse2, ok, bound, False)
    part = batch * stride_eb + (row_start // BLOCK_M + tile) * stride_et + head   # chunks start at whole tiles
    tl.store(entropy_part_ptr + part, tl.sum(entropy, 0))
    tl.store(invalid_part_ptr + part, tl.sum(off.to(tl.float32), 0))


def key_norms_max(k4: torch.Tensor) -> torch.Tensor:
    """``[B, Hk, Tk]`` float32: ``max_{j' ≤ j} ‖k_j'‖²``, the running maximum of the keys' squared norms. The
    write kernel reads the entry of the last key its loop read, the bound the on-chip kernels carry through
    their key loops (`row_entropy_triton._cancel_bound`), without ‖k_j‖² in every program's loop (a sixth of
    its instructions: each head's keys are read by every row tile)."""
    return torch.linalg.vector_norm(k4, dim=-1, dtype=torch.float32).square_().cummax(-1).values


def probs_chunks(b: int, h: int, tq: int, tk: int, causal: bool, block_m: int = PROBS_TILES["BLOCK_M"],
                 budget: int = PROBS_BUFFER_BYTES) -> list[tuple[int, int, int, int]]:
    """``[(batch0, batches, row0, rows)]``: the chunks whose float16 probabilities ``[batches, H, rows, keys]``
    (keys: ``min(Tk, row0 + rows)`` causal, else Tk) fit ``budget`` bytes — whole row tiles of ``block_m``,
    every batch entry at once where one tile of each fits, at least one tile of one entry."""
    row_bytes = h * tk * 2
    batches = max(1, min(b, budget // (row_bytes * block_m)))
    rows = max(block_m, budget // (batches * row_bytes) // block_m * block_m)
    return [(b0, min(batches, b - b0), r0, min(rows, tq - r0)) for b0 in range(0, b, batches)
            for r0 in range(0, tq, rows)]


def chunk_keys(tk: int, causal: bool, row0: int, rows: int) -> int:
    """Keys a chunk's buffer holds: causal rows see no key past the chunk's last row."""
    return min(tk, row0 + rows) if causal else tk


def probs_pass2(q4, k4, mask, mask_strides, mask_kind: int, threshold: float, is_causal: bool, scale: float,
                rows_ok, lse, budget: int = PROBS_BUFFER_BYTES):
    """``(gram [H, H] float64, entropy [H] float64, invalid partials)`` of pass 2 through materialised P.
    ``q4 [B, H, Tq, D]``, ``k4 [B, Hk, Tk, D]`` 16-bit, ``mask`` expanded to ``[B, H, Tq, Tk]`` with its
    strides and kind (`qk_stats_triton._mask_args`), ``lse [B, H, Tq]`` natural log, ``rows_ok`` bool
    ``[B, Tq]`` or None."""
    if q4.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"q4: expected float16 or bfloat16 for materialised P, got {q4.dtype}")
    b, h, tq, d = q4.shape
    hk, tk = k4.shape[1], k4.shape[2]
    block_m = PROBS_TILES["BLOCK_M"]
    tiles = triton.cdiv(tq, block_m)
    device = q4.device
    chunks = probs_chunks(b, h, tq, tk, is_causal, block_m, budget)
    largest = max(n * h * rows * chunk_keys(tk, is_causal, r0, rows) for _, n, r0, rows in chunks)
    buffer = torch.empty(largest, dtype=torch.float16, device=device)
    entropy_part = torch.empty(b, tiles, h, dtype=torch.float32, device=device)
    invalid_part = torch.empty(b, tiles, h, dtype=torch.float32, device=device)
    k_norms = key_norms_max(k4)
    mask_t = q4 if mask is None else mask                       # a missing mask is never read
    row_ok = q4 if rows_ok is None else rows_ok.view(torch.uint8)
    row_strides = (0, 0) if rows_ok is None else rows_ok.stride()
    flags = dict(GROUP=h // hk, IS_CAUSAL=bool(is_causal), MASK_KIND=mask_kind, HAS_ROW_OK=rows_ok is not None,
                 BLOCK_D=max(16, triton.next_power_of_2(d)), **PROBS_TILES)
    # every tensor whole, the chunk's batch entries and rows by index (no view per chunk: a layer's host
    # work is its few tensor ops)
    args = (q4, k4, mask_t, lse, row_ok, k_norms)
    strides = (*q4.stride(), *k4.stride(), *mask_strides, *lse.stride(), *row_strides)
    gram = None
    for b0, n, r0, rows in chunks:
        keys = chunk_keys(tk, is_causal, r0, rows)
        probs = buffer.as_strided((1, n, h, rows, keys), (0, h * rows * keys, rows * keys, keys, 1))
        chunk_tiles = triton.cdiv(rows, block_m)
        _qk_probs_kernel[(n * chunk_tiles, h)](
            probs, entropy_part, invalid_part, *args, b0, r0, rows, keys, chunk_tiles, tq, tk, d, scale * LOG2E,
            threshold, *strides, *probs.stride()[1:], entropy_part.stride(0), entropy_part.stride(1),
            k_norms.stride(0), k_norms.stride(1), **flags)
        chunk_gram = gram_triton(probs, r0 if is_causal else None)
        gram = chunk_gram if gram is None else gram + chunk_gram
    return gram[0], entropy_part.sum((0, 1), dtype=torch.float64), invalid_part
