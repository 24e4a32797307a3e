"""Fused head statistics: one pass over the attention probabilities (Triton).

For a layer with probabilities ``P[N, B, H, Tq, Tk]`` the statistics are sums over valid query
rows ``r = (b, q)`` and keys ``k``:

    gram[n, i, j]      = sum_{r, k} P[n, r, i, k] * P[n, r, j, k]
    entropy_sum[n, h]  = sum_{r, k} -P log P          (0 log 0 = 0)

The grid is persistent (as in Liger-Kernel's RMSNorm backward and the Triton softmax tutorial):
``[P, N]`` programs, P = the programs the GPU holds at once divided among the N problems. Program p
of problem n takes the row tiles p, p + P, ... (``BLOCK_R`` consecutive rows of the flattened
(batch, query) index, *all H heads*) and walks each tile's keys in ``BLOCK_K`` steps; a step loads an
``[H, BLOCK_R * BLOCK_K]`` slab once, feeds it to ``tl.dot`` against its own transpose (the Gram
update) and takes the entropy terms from the same registers, so ``P`` is read from memory exactly
once. Heads are padded to a power of two >= 16 for the dot only: the elementwise work runs on the
quarters of the head axis that hold real heads (H = 12: three quarters of 4), split off in registers.
Per element the entropy costs one hardware log2, an FADD, an FMUL and two FMAs (relative to the row's key count, see
`head_stats_ref`), the range check one NaN-propagating max (x > 1, inf, NaN; x < 0 makes the log2
NaN). Everything accumulates in registers across the program's tiles and is reduced and stored once
per program; torch adds the per-program partials in float64: deterministic, no atomics (which the
interpreter covers poorly), nothing that depends on the values. Strides are honoured, so
transposed or sliced inputs are read in place.

Layout: kernel -> launcher (`head_stats_triton`) -> `torch.library` op (`fastdiag::head_stats`,
CUDA kernel registered, CPU falls back to the PyTorch path) so `torch.compile(fullgraph=True)` and
CUDA graphs can hold it.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .constants import MAX_REGISTERS
from .head_stats_ref import causal_keys
from .head_stats_torch import head_stats_torch

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
_TINY = tl.constexpr(2.0 ** -126)   # the smallest normal fp32
# The Gram's fp32 chain (tensor-core accumulator) covers at most this many keys of a row tile before
# it is added to the float64 sums.
GRAM_FLUSH_KEYS = 512


@triton.jit
def _log2(x, ON_GPU: tl.constexpr):
    # The hardware lg2 (MUFU.LG2) on the GPU; the interpreter has no libdevice.
    if ON_GPU:
        return libdevice.fast_log2f(x)
    else:
        return tl.log2(x)


@triton.jit
def _to_float32(x, ON_GPU: tl.constexpr):
    # bf16 -> fp32 is a 16-bit shift: one instruction per element from each packed pair (the generic
    # conversion spends a second one on the odd half)
    if ON_GPU and x.dtype == tl.bfloat16:
        return tl.inline_asm_elementwise("shl.b32 $0, $2, 16; and.b32 $1, $2, 0xFFFF0000;", "=r,=r,r", [x],
                                         dtype=tl.uint32, is_pure=True, pack=2).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def _quarters(t):
    """The four quarters of the head axis of ``t [BLOCK_H, S]``: ``[BLOCK_H // 4, S]`` each, heads
    g·BLOCK_H/4 ... for g = 0..3. A reshape and two splits of a register dimension: no data moves."""
    Q: tl.constexpr = t.shape[0] // 4
    S: tl.constexpr = t.shape[1]
    t = tl.reshape(tl.permute(tl.reshape(t, (4, Q, S)), (1, 2, 0)), (Q, S, 2, 2))
    even, odd = tl.split(t)            # quarters (0, 2) and (1, 3)
    t0, t2 = tl.split(even)
    t1, t3 = tl.split(odd)
    return t0, t1, t2, t3


@triton.jit
def _accumulate(entropy, highest, xf, ok, n_f, log2_n, inv_n, PARTIAL_KEYS: tl.constexpr, ON_GPU: tl.constexpr):
    # n x + 2^-126 (one FFMA): log2 finite at x = 0, where the term is 0 · finite; NaN for
    # x < -2^-126 / n, which makes the program's entropy non-finite, counted as a bad entry (negative
    # values closer to 0 change no sum by more than 1e-38 and are not flagged)
    log2_nx = _log2(tl.fma(xf, n_f, _TINY), ON_GPU)
    # (x - 1/n) log2 n: the difference is exact near uniform (Sterbenz), so the one rounding is relative
    # to the small result whatever an FMA does. The earlier fma(x, log2 n, -log2(n)/n) relied on the
    # FMA's single rounding; triton 3.6's interpreter rounds its product first, and σ_H of
    # near-uniform attention lost its digits there (1.36e-5 against 1e-5, test_head_stats.py).
    term = tl.fma(-xf, log2_nx, (xf - inv_n) * log2_n)
    if PARTIAL_KEYS:
        entropy += tl.where(ok, term, 0.0)
    else:
        entropy += term          # 0 in invalid rows; padded heads are not stored
    # x > 1, +inf and NaN (the NaN-propagating max keeps it); x < 0 shows as a NaN entropy
    highest = tl.maximum(highest, xf, propagate_nan=tl.PropagateNan.ALL)
    return entropy, highest


@triton.jit
def _worst(highest):
    """The largest entry of a register tile, 2 for NaN."""
    return tl.max(tl.max(tl.where(highest == highest, highest, 2.0), axis=1), axis=0)


@triton.jit
def _head_stats_kernel(
    gram_part_ptr, entropy_part_ptr, worst_part_ptr,    # outputs: [N, P, H, H], [N, P, H], [N, P]
    probs_ptr, mask_ptr, row_ref_ptr,                   # row_ref: [3, Tq] fp32 n, log2 n, 1/n per row
    H, Tq, Tk, rows_per_problem, tiles_per_problem, causal_offset,      # program grid: [P, N]
    stride_pn, stride_pb, stride_ph, stride_pq, stride_pk,
    stride_mn, stride_mb, stride_mq,
    HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, EVEN_K: tl.constexpr, GRAM_DOT: tl.constexpr,
    ON_GPU: tl.constexpr, QUARTERS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    GRAM_FLUSH_STEPS: tl.constexpr, ENTROPY: tl.constexpr = True,
):
    # Persistent: program p of a problem takes its row tiles p, p + P, p + 2P, ... and keeps its sums
    # in registers across them; one store per program at the end.
    program = tl.program_id(0)                     # rows: 32-bit arithmetic (no 64-bit division per tile)
    problem = tl.program_id(1).to(tl.int64)
    programs = tl.num_programs(0)
    PARTIAL_KEYS: tl.constexpr = CAUSAL or not EVEN_K
    head = tl.arange(0, BLOCK_H)
    # Column j of the slab is (row r, key offset kk); BLOCK_K is a power of two, so // and % are shifts.
    j = tl.arange(0, BLOCK_R * BLOCK_K)
    key_offset = j % BLOCK_K

    # Gram sums: fp32 (the tensor cores' accumulator) within a row tile, float64 across a program's
    # tiles. One fp32 chain over every tile of a program lost 1.3e-5 relative at GPT-2-small fp32 on an
    # H200 (benchmarks/RESULTS.md); a tile's chain is Tk / BLOCK_K dots long.
    # The TF32 split accumulates [hi·hiᵀ; lo·hiᵀ], twice the rows.
    GRAM_ROWS: tl.constexpr = 2 * BLOCK_H if GRAM_DOT == "tf32-split" else BLOCK_H
    gram = tl.zeros((GRAM_ROWS, BLOCK_H), dtype=tl.float32)
    gram64 = tl.zeros((GRAM_ROWS, BLOCK_H), dtype=tl.float64)
    # Register tiles, reduced once after the loop: no cross-thread reduction per iteration. The
    # elementwise work runs on the QUARTERS quarters of the head axis that hold real heads (H = 12:
    # three of four), only the dot sees the padded slab.
    Q: tl.constexpr = BLOCK_H // 4
    S: tl.constexpr = BLOCK_R * BLOCK_K
    e0 = tl.zeros((Q, S), dtype=tl.float32)
    e1 = tl.zeros((Q, S), dtype=tl.float32)
    e2 = tl.zeros((Q, S), dtype=tl.float32)
    e3 = tl.zeros((Q, S), dtype=tl.float32)
    m0 = tl.zeros((Q, S), dtype=tl.float32)
    m1 = tl.zeros((Q, S), dtype=tl.float32)
    m2 = tl.zeros((Q, S), dtype=tl.float32)
    m3 = tl.zeros((Q, S), dtype=tl.float32)
    s0 = tl.zeros((Q,), dtype=tl.float64)
    s1 = tl.zeros((Q,), dtype=tl.float64)
    s2 = tl.zeros((Q,), dtype=tl.float64)
    s3 = tl.zeros((Q,), dtype=tl.float64)
    for tile in range(program, tiles_per_problem, programs):
        row = tile * BLOCK_R + j // BLOCK_K
        b = row // Tq
        q = row % Tq
        row_ok = row < rows_per_problem
        if HAS_MASK:
            keep = tl.load(mask_ptr + problem * stride_mn + b.to(tl.int64) * stride_mb + q * stride_mq,
                           mask=row_ok, other=0)
            row_ok = row_ok & (keep != 0)

        # The row's reference key count n: its entropy is accumulated relative to log n (see
        # head_stats_ref), small terms for rows near uniform over their n keys. Keys past n are not
        # read. In log2 units, term = (x - 1/n) log2 n - x log2(n x) with 1/n and log2 n in fp32, one
        # rounding each near zero; the launcher adds n · (1/n) · log2 n back (the same fp32 values, in
        # float64) and multiplies by ln 2. Invalid rows read x = 0 and get log2 n = 1/n = 0: terms 0.
        n_f = tl.load(row_ref_ptr + q, mask=row_ok, other=1.0)[None, :]
        log2_n = tl.load(row_ref_ptr + Tq + q, mask=row_ok, other=0.0)[None, :]
        inv_n = tl.load(row_ref_ptr + 2 * Tq + q, mask=row_ok, other=0.0)[None, :]
        if CAUSAL:
            n_keys = tl.minimum(tl.maximum(q + causal_offset + 1, 0), Tk)
            key_end = tl.max(tl.where(row_ok, n_keys, 0), axis=0)
            # keys every valid row of the tile sees, in whole steps: no per-key bound up to there
            key_full = tl.minimum(tl.min(tl.where(row_ok, n_keys, Tk), axis=0) // BLOCK_K * BLOCK_K, key_end)
        else:
            n_keys = Tk
            key_end = Tk
            if EVEN_K:
                key_full = Tk
            else:
                key_full = Tk // BLOCK_K * BLOCK_K

        slab_ok = (head < H)[:, None] & row_ok[None, :]
        # 64-bit: (H - 1) · stride_ph passes 2^31 at H = 40, T = 8192 (a 32-bit product wraps)
        ptrs = (probs_ptr + problem * stride_pn + head.to(tl.int64)[:, None] * stride_ph
                + (b.to(tl.int64) * stride_pb + q.to(tl.int64) * stride_pq)[None, :] + key_offset[None, :] * stride_pk)
        # Two key ranges, one loop body each (unrolled at compile time): [0, key_full) needs only the
        # row mask; [key_full, key_end), the causal diagonal or the ragged last step, masks each key.
        # The causal loop took 22 instructions per element with the key bound on every step.
        for keyed in tl.static_range(2 if PARTIAL_KEYS else 1):
            if keyed == 1:
                start, stop = key_full, key_end
            else:
                start, stop = 0, key_full
            for k0 in range(start, stop, BLOCK_K):
                if keyed == 1:
                    ok = slab_ok & (k0 + key_offset < n_keys)[None, :]
                else:
                    ok = slab_ok
                x = tl.load(ptrs + tl.cast(k0, tl.int64) * stride_pk, mask=ok, other=0.0)   # transposed P: k0 · stride wraps
                xf = _to_float32(x, ON_GPU)
                if GRAM_DOT == "input":
                    # 16-bit products are exact in fp32; the tensor cores accumulate in fp32
                    gram += tl.dot(x, tl.trans(x))
                elif GRAM_DOT == "tf32-split":
                    # fp32 on tensor cores: hi = x with the low 13 mantissa bits cleared (exact in TF32),
                    # lo = x - hi; G = hi·hiᵀ + M + Mᵀ with M = hi·loᵀ (lo·loᵀ, ~2^-22 relative, dropped).
                    hi = (xf.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
                    lo = xf - hi
                    # One dot [hi; lo]·hiᵀ = [hi·hiᵀ; lo·hiᵀ]: two dots sharing an operand would make
                    # Triton give every warp the whole 16-row tile (4 warps: 4 times the tensor-core work)
                    stacked = tl.reshape(tl.permute(tl.join(hi, lo), (2, 0, 1)), (2 * BLOCK_H, BLOCK_R * BLOCK_K))
                    gram += tl.dot(stacked, tl.trans(hi), input_precision="tf32")
                else:
                    gram += tl.dot(xf, tl.trans(xf), input_precision="ieee")
                if (k0 // BLOCK_K) % GRAM_FLUSH_STEPS == GRAM_FLUSH_STEPS - 1:
                    # fp32 chains of at most GRAM_FLUSH_KEYS keys: 64 steps of 64 keys lost 1.0e-5 (fp32)
                    # and 1.4e-5 (bf16) relative at T = 4096 on an H200, 16 steps 3.7e-6 / 4.9e-6
                    gram64, gram = gram64 + gram.to(tl.float64), tl.zeros_like(gram)
                if ENTROPY:   # the Gram alone (Q/K pass 2 through materialised P): no elementwise work
                    x0, x1, x2, x3 = _quarters(xf)
                    ok0, ok1, ok2, ok3 = _quarters(ok)
                    e0, m0 = _accumulate(e0, m0, x0, ok0, n_f, log2_n, inv_n, keyed == 1, ON_GPU)
                    if QUARTERS > 1:
                        e1, m1 = _accumulate(e1, m1, x1, ok1, n_f, log2_n, inv_n, keyed == 1, ON_GPU)
                    if QUARTERS > 2:
                        e2, m2 = _accumulate(e2, m2, x2, ok2, n_f, log2_n, inv_n, keyed == 1, ON_GPU)
                    if QUARTERS > 3:
                        e3, m3 = _accumulate(e3, m3, x3, ok3, n_f, log2_n, inv_n, keyed == 1, ON_GPU)
        gram64, gram = gram64 + gram.to(tl.float64), tl.zeros_like(gram)
        # Each tile's entropy sums go to float64 per-head sums: terms of rows far from uniform over
        # their n keys (masked keys without the causal hint) are not small, and fp32 sums over all
        # of a program's tiles lose σ_H (6.6e-4 instead of 1.4e-4 at near-uniform causal [2,2,8,64,64])
        s0, e0 = s0 + tl.sum(e0, axis=1).to(tl.float64), tl.zeros((Q, S), dtype=tl.float32)
        if QUARTERS > 1:
            s1, e1 = s1 + tl.sum(e1, axis=1).to(tl.float64), tl.zeros((Q, S), dtype=tl.float32)
        if QUARTERS > 2:
            s2, e2 = s2 + tl.sum(e2, axis=1).to(tl.float64), tl.zeros((Q, S), dtype=tl.float32)
        if QUARTERS > 3:
            s3, e3 = s3 + tl.sum(e3, axis=1).to(tl.float64), tl.zeros((Q, S), dtype=tl.float32)

    if GRAM_DOT == "tf32-split":
        hi_hi, lo_hi = tl.split(tl.permute(tl.reshape(gram64, (2, BLOCK_H, BLOCK_H)), (1, 2, 0)))
        gram64 = hi_hi + lo_hi + tl.trans(lo_hi)
    w0 = _worst(m0)
    w1 = _worst(m1)
    w2 = _worst(m2)
    w3 = _worst(m3)
    # One number per program, > 1 when it saw a bad entry: the largest entry, 2 for NaN or a
    # non-finite entropy
    worst = tl.maximum(tl.maximum(w0, w1), tl.maximum(w2, w3))
    total = tl.sum(s0, axis=0) + tl.sum(s1, axis=0) + tl.sum(s2, axis=0) + tl.sum(s3, axis=0)
    worst = tl.where(total - total == 0, worst, 2.0)
    part = problem * programs + program.to(tl.int64)
    quarter_h = tl.arange(0, Q)
    if ENTROPY:   # the Gram alone: no entropy or range outputs (their pointers are placeholders)
        tl.store(entropy_part_ptr + part * H + quarter_h, s0, mask=quarter_h < H)
        tl.store(entropy_part_ptr + part * H + Q + quarter_h, s1, mask=Q + quarter_h < H)
        tl.store(entropy_part_ptr + part * H + 2 * Q + quarter_h, s2, mask=2 * Q + quarter_h < H)
        tl.store(entropy_part_ptr + part * H + 3 * Q + quarter_h, s3, mask=3 * Q + quarter_h < H)
    out_h = tl.arange(0, BLOCK_H)
    gram_ptrs = gram_part_ptr + part * H * H + out_h[:, None] * H + out_h[None, :]
    tl.store(gram_ptrs, gram64, mask=(out_h[:, None] < H) & (out_h[None, :] < H))
    if ENTROPY:
        tl.store(worst_part_ptr + part, worst)


# Warps: at most two of the Gram's 16x8 tensor-core tiles each (H <= 16: one warp, H <= 32: four,
# more: eight). A 16-head Gram shared by 4 warps gave every warp the whole dot (4x the tensor-core
# work and 4x the shared-memory reads of the slab): the H200 ran bf16 GPT-2-small at 19 % of copy
# bandwidth with L1/shared memory 94 % busy, and 8 warps took twice as long as 4 (benchmarks/RESULTS.md).
# The fp32 and float64 Gram accumulators then take at most 12 registers per thread.
_GRAM_TILES_PER_WARP = 2
_MAX_WARPS = 8
# Slab of about this many elements per warp: enough work per load, few enough registers for the
# slab, its two register-tile accumulators and the dot operands (checked for every generation by
# benchmarks/kernel_matrix.py).
_SLAB_PER_WARP = 1024
# Keys per step: a tile of BLOCK_R rows takes Tk / BLOCK_K steps, and the per-tile work (row data,
# pipeline start) is paid once per tile.
_MAX_BLOCK_K = 64
# One stage: the slab is loaded into registers (the elementwise work uses them there) and staged in
# shared memory only for the dot, in a swizzled buffer. Pipelined (Triton's default 3 stages) it was
# copied asynchronously into an unswizzled buffer and read back three times, by ldmatrix with every
# 8 rows in the same banks: 4.5-6.4x the conflict-free wavefronts (fastdiag.kernel_report).
NUM_STAGES = 1


def _tiles(h: int, rows: int, tk: int, element_bytes: int, causal: bool, entropy: bool = True) -> tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_R, BLOCK_K, warps) of a launch; ``entropy`` False: the Gram alone (`gram_triton`)."""
    block_h = max(16, triton.next_power_of_2(h))               # tl.dot needs >= 16
    warps = min(_MAX_WARPS, max(1, int((block_h // 16) * (block_h // 8) / _GRAM_TILES_PER_WARP)))
    slab = _SLAB_PER_WARP * warps // block_h
    if element_bytes == 4:
        slab //= 2   # fp32: the TF32 split's stacked [hi; lo] operand doubles the dot's registers
        if block_h >= 64:
            slab //= 2   # 40-64 heads in one stage: 32-40 B spilled on sm_80/86/89 under triton 3.6 at 64 keys
    if not entropy:
        # no elementwise registers: 4x the causal slab, ~48 KB in flight per SM at 32 heads (sm_90: 110
        # registers and latency-bound at 1 row x 64 keys, 0.174 ms at [1, 32, 4096]; 167 and DRAM-bound
        # at 4 rows, 0.153 ms: benchmarks/RESULTS.md)
        slab *= 2
    elif causal and element_bytes < 4:
        # 16-bit: the key-bounded loop beside the plain one spilled 8-72 B at the full slab (triton 3.6,
        # sm_80-120, one stage). fp32 (its slab already halved) does not, and at half that slab it kept
        # too few bytes in flight: 76 % of copy predicted on sm_100 under 3.6, 127 % at this one
        slab //= 2
    if tk < 64:
        slab //= 2   # short rows: many rows per slab, each column carries its row's data
    block_k = min(_MAX_BLOCK_K, max(1, triton.next_power_of_2(tk)), slab)
    block_r = max(1, min(slab // block_k, triton.next_power_of_2(rows)))
    block_r = max(block_r, triton.cdiv(16, block_k))           # slab width >= 16 for tl.dot
    return block_h, block_r, block_k, warps


def row_references(tq: int, tk: int, causal: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row: the kernel's table ``[3, Tq]`` fp32 (n, log2 n, 1/n; n = the keys the row may
    see, at least 1) and, float64 ``[Tq]``, the reference ``n · (1/n) · log2 n`` computed from those same
    fp32 values, which the kernel leaves out of each row's entropy (log2 units)."""
    n_keys = torch.full((tq,), tk, dtype=torch.float64, device=device)
    if causal:
        q = torch.arange(tq, dtype=torch.float64, device=device)
        n_keys = (q + causal_keys(tq, tk) + 1).clamp(0, tk)
    n_keys = n_keys.clamp_min(1)
    table = torch.stack([n_keys, n_keys.log2(), 1 / n_keys]).float()
    return table, n_keys * table[1].double() * table[2].double()


def _gram_dot(dtype: torch.dtype) -> str:
    if dtype in (torch.float16, torch.bfloat16) and not INTERPRETING:
        return "input"
    if dtype == torch.float32:
        return "tf32-split"       # under the interpreter too: the split's arithmetic is tested there
    return "ieee"


_INTERPRETER_PROGRAMS = 3  # few programs under the interpreter, so that each takes several tiles
_RESIDENT: dict = {}       # (device, warps, constexprs) -> programs the GPU holds at once
# Resident blocks per SM by compute capability (CUDA C programming guide, table of technical
# specifications): one-warp programs reach it before registers do. Others: 16, the smallest.
_BLOCKS_PER_SM = {80: 32, 86: 16, 87: 16, 89: 24, 90: 32, 100: 32, 103: 32, 120: 32}


def _resident_programs(device: torch.device, make_args, constexprs: dict, warps: int) -> int:
    """SMs × programs per SM (registers, shared memory and threads of the compiled kernel), as in the
    Triton softmax tutorial: a grid that is resident all at once, no tail wave. ``make_args()``: the
    kernel's arguments, built only the first time (a launch's host work is its tensor ops)."""
    if device.type != "cuda":
        return _INTERPRETER_PROGRAMS
    key = (device.index, warps, tuple(sorted(constexprs.items())))
    if key not in _RESIDENT:
        props = torch.cuda.get_device_properties(device)
        kernel = _head_stats_kernel.warmup(*make_args(), grid=(1, 1), num_warps=warps, num_stages=NUM_STAGES,
                                           maxnreg=MAX_REGISTERS, **constexprs)
        kernel._init_handles()
        threads = 32 * warps
        registers = triton.cdiv(kernel.n_regs, 8) * 8 * threads      # allocated per warp in steps of 256
        per_sm = min(props.regs_per_multiprocessor // registers, props.max_threads_per_multi_processor // threads,
                     _BLOCKS_PER_SM.get(10 * props.major + props.minor, 16))
        if kernel.metadata.shared:
            shared = getattr(props, "shared_memory_per_multiprocessor", 0) or props.shared_memory_per_block_optin
            per_sm = min(per_sm, shared // kernel.metadata.shared)
        _RESIDENT[key] = props.multi_processor_count * max(1, per_sm)
    return _RESIDENT[key]


def _launch(probs: torch.Tensor, query_mask: torch.Tensor | None, causal: bool, causal_offset: int, entropy: bool):
    """One launch of `_head_stats_kernel` over ``probs [N, B, H, Tq, Tk]``: its per-program partial sums
    (gram float64, entropy float64, worst fp32), the valid rows ``[N, B, Tq]`` and the rows' float64
    entropy references (`row_references`). ``causal``: row q sees keys ``≤ q + causal_offset``, later
    keys are not read; ``entropy`` False: the Gram alone (the other outputs are not made: no tensor op
    beyond the Gram's partial sums)."""
    n, b, h, tq, tk = probs.shape
    rows = b * tq
    block_h, block_r, block_k, warps = _tiles(h, rows, tk, probs.element_size(), causal, entropy)
    tiles = triton.cdiv(rows, block_r)
    device = probs.device
    constexprs = dict(
        HAS_MASK=query_mask is not None, CAUSAL=causal, EVEN_K=tk % block_k == 0,
        GRAM_DOT=_gram_dot(probs.dtype), ON_GPU=not INTERPRETING,
        QUARTERS=triton.cdiv(h, block_h // 4), BLOCK_H=block_h, BLOCK_R=block_r, BLOCK_K=block_k,
        GRAM_FLUSH_STEPS=max(1, GRAM_FLUSH_KEYS // block_k), ENTROPY=entropy)
    if query_mask is not None:
        valid = query_mask.expand(n, b, tq)
        mask, mask_strides = valid.view(torch.uint8), valid.stride()
    else:
        valid = None if not entropy else torch.ones(1, 1, 1, dtype=torch.bool, device=device).expand(n, b, tq)
        mask, mask_strides = probs, (0, 0, 0)   # never read
    row_table, row_reference = row_references(tq, tk, causal, device) if entropy else (probs, None)   # unread
    inputs = (probs, mask, row_table, h, tq, tk, rows, tiles, causal_offset, *probs.stride(), *mask_strides)
    programs = min(tiles, max(1, _resident_programs(device, lambda: (
        *(torch.empty(0, dtype=dtype, device=device) for dtype in (torch.float64, torch.float64, torch.float32)),
        *inputs), constexprs, warps) // n))
    gram_part = torch.empty(n, programs, h, h, dtype=torch.float64, device=device)
    if entropy:
        entropy_part = torch.empty(n, programs, h, dtype=torch.float64, device=device)
        worst_part = torch.empty(n, programs, dtype=torch.float32, device=device)   # per program: > 1 when it saw a bad entry
    else:
        entropy_part = worst_part = gram_part          # not written (ENTROPY=False)
    _head_stats_kernel[(programs, n)](gram_part, entropy_part, worst_part, *inputs, num_warps=warps, num_stages=NUM_STAGES,
                                      maxnreg=MAX_REGISTERS, **constexprs)
    return gram_part, entropy_part, worst_part, valid, row_reference


def head_stats_triton(probs: torch.Tensor, query_mask: torch.Tensor | None = None, causal: bool = False):
    """Launch the fused kernel. ``probs [N, B, H, Tq, Tk]``, ``query_mask`` bool ``[N or 1, B, Tq]``.
    ``causal``: keys after the causal diagonal are zero and are not read."""
    tq, tk = probs.shape[3:]
    gram_part, entropy_part, worst_part, valid, row_reference = _launch(probs, query_mask, causal,
                                                                        causal_keys(tq, tk), True)
    gram = gram_part.sum(1).float()
    reference = (valid.to(torch.float64) * row_reference).sum(dim=(1, 2))
    entropy_sum = (entropy_part.sum(1, dtype=torch.float64) + reference[:, None]) * math.log(2)
    invalid = (worst_part > 1).sum(1).to(torch.float32)    # programs that saw a bad entry
    valid_rows = valid.sum(dim=(1, 2)).to(torch.float32)
    return gram, entropy_sum, valid_rows, invalid


def gram_triton(probs: torch.Tensor, causal_offset: int | None = None) -> torch.Tensor:
    """The heads' Gram alone, float64 ``[N, H, H]``, of ``probs [N, B, H, Tq, Tk]`` (16-bit: the tensor
    cores' products are exact, fp32 chains of at most `GRAM_FLUSH_KEYS` keys, float64 beyond); no entropy
    and no range check: Q/K pass 2 through materialised P (`qk_probs_triton`) takes those from the scores.
    ``causal_offset``: row q holds keys ``≤ q + causal_offset`` only, later ones are not read (None: all)."""
    causal = causal_offset is not None
    return _launch(probs, None, causal, causal_offset if causal else 0, False)[0].sum(1)


# ---- torch.library op: compiled graphs and CUDA graphs hold it as one opaque node ----------------

@torch.library.custom_op("fastdiag::head_stats", mutates_args=())
def head_stats_op(probs: torch.Tensor, query_mask: torch.Tensor | None, causal: bool = False) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return head_stats_torch(probs, query_mask, causal)


@head_stats_op.register_kernel("cuda")
def _head_stats_cuda(probs, query_mask, causal=False):
    return head_stats_triton(probs, query_mask, causal)


@head_stats_op.register_fake
def _head_stats_fake(probs, query_mask, causal=False):
    n, _, h, _, _ = probs.shape
    f32 = dict(dtype=torch.float32, device=probs.device)
    return (probs.new_empty((n, h, h), **f32), probs.new_empty((n, h), dtype=torch.float64, device=probs.device),
            probs.new_empty((n,), **f32), probs.new_empty((n,), **f32))
