"""Fused head statistics: one pass over the attention probabilities (Triton).

For a layer with probabilities ``P[N, B, H, Tq, Tk]`` the statistics are sums over valid query
rows ``r = (b, q)`` and keys ``k``:

    gram[n, i, j]      = sum_{r, k} P[n, r, i, k] * P[n, r, j, k]
    entropy_sum[n, h]  = sum_{r, k} -P log P          (0 log 0 = 0)

A program owns one problem ``n`` and a tile of ``BLOCK_R`` consecutive rows of the flattened
(batch, query) index, with *all H heads* of that tile in registers. It walks the key axis in
``BLOCK_K`` steps; each step loads an ``[H, BLOCK_R * BLOCK_K]`` slab once, feeds it to ``tl.dot``
against its own transpose (the Gram update) and takes the entropy terms from the same registers,
so ``P`` is read from memory exactly once. Per element the entropy costs one hardware log2 and a few
FMAs (relative to the row's key count, see `head_stats_ref`) and the range check one FFMA
(``x - x²`` is negative exactly outside [0, 1], NaN for NaN and ±inf) and a NaN-propagating min;
both accumulate in register tiles reduced once per program. Each program writes its partial sums to a scratch
buffer and torch adds the partials: deterministic, no atomics (which the interpreter covers
poorly), nothing that depends on the values. Strides are honoured, so transposed or sliced
inputs are read in place.

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

from .head_stats_ref import causal_keys, head_stats_torch
from .report import ReportCase, register

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _log2(x, FAST_LOG2: tl.constexpr):
    # The hardware lg2 (MUFU.LG2) on the GPU; the interpreter has no libdevice.
    if FAST_LOG2:
        return libdevice.fast_log2f(x)
    else:
        return tl.log2(x)


@triton.jit
def _head_stats_kernel(
    gram_part_ptr, entropy_part_ptr, lowest_part_ptr,   # outputs: [P, H, H], [P, H], [P]
    probs_ptr, mask_ptr, row_ref_ptr,                   # row_ref: [3, Tq] fp32 n, 1/n, log2 n per query row
    H, Tq, Tk, rows_per_problem, tiles_per_problem, causal_offset,
    stride_pn, stride_pb, stride_ph, stride_pq, stride_pk,
    stride_mn, stride_mb, stride_mq,
    HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, EVEN_K: tl.constexpr, GRAM_DOT: tl.constexpr,
    FAST_LOG2: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    problem = pid // tiles_per_problem
    tile = pid % tiles_per_problem

    # Column j of the slab is (row r, key offset kk); BLOCK_K is a power of two, so // and % are shifts.
    j = tl.arange(0, BLOCK_R * BLOCK_K)
    row = tile * BLOCK_R + j // BLOCK_K
    key_offset = j % BLOCK_K
    b = row // Tq
    q = row % Tq
    row_ok = row < rows_per_problem
    if HAS_MASK:
        keep = tl.load(mask_ptr + problem * stride_mn + b * stride_mb + q * stride_mq, mask=row_ok, other=0)
        row_ok = row_ok & (keep != 0)

    # The row's reference key count n: its entropy is accumulated as h - log n (see head_stats_ref),
    # small terms for rows near uniform over their n keys. Keys past n are not read. In log2 units:
    # term = (p - 1/n) log2 n - p log2(n p); the launcher adds n (1/n) log2 n back (same fp32 values)
    # and multiplies by ln 2 in float64.
    n_f = tl.load(row_ref_ptr + q)[None, :]
    inv_n = tl.load(row_ref_ptr + Tq + q)[None, :]
    log2_n = tl.load(row_ref_ptr + 2 * Tq + q)[None, :]
    if CAUSAL:
        n_keys = tl.minimum(tl.maximum(q + causal_offset + 1, 0), Tk)
        key_end = tl.max(tl.where(row_ok, n_keys, 0), axis=0)
    else:
        n_keys = Tk
        key_end = Tk

    head = tl.arange(0, BLOCK_H)
    slab_ok = (head < H)[:, None] & row_ok[None, :]
    ptrs = (probs_ptr + problem * stride_pn
            + head[:, None] * stride_ph + (b * stride_pb + q * stride_pq)[None, :] + key_offset[None, :] * stride_pk)

    gram = tl.zeros((BLOCK_H, BLOCK_H), dtype=tl.float32)
    cross = tl.zeros((BLOCK_H, BLOCK_H), dtype=tl.float32)   # hi·loᵀ of the TF32 split
    # Register tiles, reduced once after the loop: no cross-thread reduction per iteration.
    entropy = tl.zeros((BLOCK_H, BLOCK_R * BLOCK_K), dtype=tl.float32)
    lowest = tl.zeros((BLOCK_H, BLOCK_R * BLOCK_K), dtype=tl.float32)
    for k0 in range(0, key_end, BLOCK_K):
        if EVEN_K and not CAUSAL:
            ok = slab_ok
        else:
            ok = slab_ok & (k0 + key_offset < n_keys)[None, :]
        x = tl.load(ptrs + k0 * stride_pk, mask=ok, other=0.0)
        xf = x.to(tl.float32)
        if GRAM_DOT == "input":
            # 16-bit products are exact in fp32; the tensor cores accumulate in fp32
            gram += tl.dot(x, tl.trans(x))
        elif GRAM_DOT == "tf32-split":
            # fp32 on tensor cores: hi = x with the low 13 mantissa bits cleared (exact in TF32),
            # lo = x - hi; G = hi·hiᵀ + M + Mᵀ with M = hi·loᵀ (lo·loᵀ, ~2^-22 relative, dropped).
            hi = (xf.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
            lo = xf - hi
            gram += tl.dot(hi, tl.trans(hi), input_precision="tf32")
            cross += tl.dot(hi, tl.trans(lo), input_precision="tf32")
        else:
            gram += tl.dot(xf, tl.trans(xf), input_precision="ieee")
        term = (xf - inv_n) * log2_n - xf * _log2(tl.maximum(xf * n_f, 1e-30), FAST_LOG2)
        if EVEN_K and not CAUSAL:
            entropy += term          # rows and heads out of range are dropped once, after the loop
        else:
            entropy += tl.where(ok, term, 0.0)
        # x - x² < 0 exactly when x is outside [0, 1]; NaN for NaN and ±inf, kept by the NaN-propagating min
        lowest = tl.minimum(lowest, xf - xf * xf, propagate_nan=tl.PropagateNan.ALL)

    gram += cross + tl.trans(cross)
    entropy = tl.sum(tl.where(slab_ok, entropy, 0.0), axis=1)
    lowest = tl.min(tl.min(tl.where(lowest == lowest, lowest, -1.0), axis=1), axis=0)   # NaN -> -1 first
    out_h = tl.arange(0, BLOCK_H)
    gram_ptrs = gram_part_ptr + pid * H * H + out_h[:, None] * H + out_h[None, :]
    tl.store(gram_ptrs, gram, mask=(out_h[:, None] < H) & (out_h[None, :] < H))
    tl.store(entropy_part_ptr + pid * H + out_h, entropy, mask=out_h < H)
    tl.store(lowest_part_ptr + pid, lowest)


# Slab of about this many elements per program: enough work per load, few enough registers for the
# slab, its two register-tile accumulators and the dot operands (checked: `fastdiag bench --kernel-report`).
_SLAB_ELEMENTS = 4096


def _block_sizes(h: int, rows: int, tk: int, element_bytes: int) -> tuple[int, int, int]:
    block_h = max(16, triton.next_power_of_2(h))               # tl.dot needs >= 16
    slab = _SLAB_ELEMENTS // block_h
    if element_bytes == 4 and tk < 64:
        slab //= 2   # short fp32 rows: per-column row data and the TF32 split's tiles spill at 256 columns
    block_k = min(256, max(1, triton.next_power_of_2(tk)), slab)
    block_r = max(1, min(slab // block_k, triton.next_power_of_2(rows)))
    block_r = max(block_r, triton.cdiv(16, block_k))           # slab width >= 16 for tl.dot
    return block_h, block_r, block_k


def row_references(tq: int, tk: int, causal: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row: the kernel's table ``[3, Tq]`` fp32 (n, 1/n, log2 n; n = the keys the row may
    see, at least 1) and, float64 ``[Tq]``, the reference ``n · (1/n) · log2 n`` computed from those
    same fp32 values, which the kernel leaves out of each row's entropy (log2 units)."""
    n_keys = torch.full((tq,), tk, dtype=torch.float64, device=device)
    if causal:
        q = torch.arange(tq, dtype=torch.float64, device=device)
        n_keys = (q + causal_keys(tq, tk) + 1).clamp(0, tk)
    n_keys = n_keys.clamp_min(1)
    table = torch.stack([n_keys, 1 / n_keys, n_keys.log2()]).float()
    return table, n_keys * table[1].double() * table[2].double()


def head_stats_triton(probs: torch.Tensor, query_mask: torch.Tensor | None = None, causal: bool = False):
    """Launch the fused kernel. ``probs [N, B, H, Tq, Tk]``, ``query_mask`` bool ``[N or 1, B, Tq]``.
    ``causal``: keys after the causal diagonal are zero and are not read."""
    n, b, h, tq, tk = probs.shape
    rows = b * tq
    block_h, block_r, block_k = _block_sizes(h, rows, tk, probs.element_size())
    tiles = triton.cdiv(rows, block_r)
    programs = n * tiles
    device = probs.device
    gram_part = torch.empty(programs, h, h, dtype=torch.float32, device=device)
    entropy_part = torch.empty(programs, h, dtype=torch.float32, device=device)
    lowest_part = torch.empty(programs, dtype=torch.float32, device=device)   # min of x - x², NaN -> -1
    if query_mask is not None:
        valid = query_mask.expand(n, b, tq)
        mask, mask_strides = valid.view(torch.uint8), valid.stride()
    else:
        valid = torch.ones(1, 1, 1, dtype=torch.bool, device=device).expand(n, b, tq)
        mask, mask_strides = probs, (0, 0, 0)   # never read
    if probs.dtype in (torch.float16, torch.bfloat16) and not INTERPRETING:
        gram_dot = "input"
    elif probs.dtype == torch.float32:
        gram_dot = "tf32-split"       # under the interpreter too: the split's arithmetic is tested there
    else:
        gram_dot = "ieee"
    row_table, row_reference = row_references(tq, tk, causal, device)
    _head_stats_kernel[(programs,)](
        gram_part, entropy_part, lowest_part,
        probs, mask, row_table,
        h, tq, tk, rows, tiles, causal_keys(tq, tk),
        *probs.stride(), *mask_strides,
        HAS_MASK=query_mask is not None, CAUSAL=causal, EVEN_K=tk % block_k == 0,
        GRAM_DOT=gram_dot, FAST_LOG2=not INTERPRETING,
        BLOCK_H=block_h, BLOCK_R=block_r, BLOCK_K=block_k,
    )
    gram = gram_part.view(n, tiles, h, h).sum(1, dtype=torch.float64).float()
    reference = (valid.to(torch.float64) * row_reference).sum(dim=(1, 2))
    entropy_sum = (entropy_part.view(n, tiles, h).sum(1, dtype=torch.float64) + reference[:, None]) * math.log(2)
    invalid = (lowest_part.view(n, tiles) < 0).sum(1).to(torch.float32)   # programs that saw a bad entry
    valid_rows = valid.sum(dim=(1, 2)).to(torch.float32)
    return gram, entropy_sum, valid_rows, invalid


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


# ---- the kernel report (`fastdiag bench --kernel-report`): this launcher at the benchmark shapes --

def _report_cases(shapes: dict) -> list[ReportCase]:
    cases = []
    for shape, (n, b, h, t) in shapes.items():
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            def launch(dims=(n, b, h, t, t), dtype=dtype):
                head_stats_triton(torch.empty(dims, dtype=dtype))    # captured, never run: P is not read

            def elements_per_iteration(constexprs, h=h):
                return h * constexprs["BLOCK_R"] * constexprs["BLOCK_K"]

            cases.append(ReportCase("head_stats", shape, str(dtype).replace("torch.", ""),
                                    dtype.itemsize, launch, elements_per_iteration))
    return cases


register("head_stats", _report_cases)
