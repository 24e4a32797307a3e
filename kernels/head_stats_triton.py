"""Fused head statistics: one pass over the attention probabilities (Triton).

For a layer with probabilities ``P[N, B, H, Tq, Tk]`` the statistics are sums over valid query
rows ``r = (b, q)`` and keys ``k``:

    gram[n, i, j]      = sum_{r, k} P[n, r, i, k] * P[n, r, j, k]
    entropy_sum[n, h]  = sum_{r, k} -P log P          (0 log 0 = 0)

A program owns one problem ``n`` and a tile of ``BLOCK_R`` consecutive rows of the flattened
(batch, query) index, with *all H heads* of that tile in registers. It walks the key axis in
``BLOCK_K`` steps; each step loads an ``[H, BLOCK_R * BLOCK_K]`` slab once, feeds it to ``tl.dot``
against its own transpose (the Gram update) and takes the entropy terms from the same registers,
so ``P`` is read from memory exactly once. Each program writes its partial sums to a scratch
buffer and torch adds the partials: deterministic, no atomics (which the interpreter covers
poorly), nothing that depends on the values. Strides are honoured, so transposed or sliced
inputs are read in place.

Layout: kernel -> launcher (`head_stats_triton`) -> `torch.library` op (`fastdiag::head_stats`,
CUDA kernel registered, CPU falls back to the PyTorch path) so `torch.compile(fullgraph=True)` and
CUDA graphs can hold it.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .head_stats_ref import head_stats_torch

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _head_stats_kernel(
    gram_part_ptr, entropy_part_ptr, invalid_part_ptr,   # outputs: [P, H, H], [P, H], [P]
    probs_ptr, mask_ptr,
    H, Tq, Tk, rows_per_problem, tiles_per_problem,
    stride_pn, stride_pb, stride_ph, stride_pq, stride_pk,
    stride_mn, stride_mb, stride_mq,
    HAS_MASK: tl.constexpr, DOT_IN_INPUT_DTYPE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
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

    head = tl.arange(0, BLOCK_H)
    head_ok = head < H
    ptrs = (probs_ptr + problem * stride_pn
            + head[:, None] * stride_ph + (b * stride_pb + q * stride_pq)[None, :])

    gram = tl.zeros((BLOCK_H, BLOCK_H), dtype=tl.float32)
    entropy = tl.zeros((BLOCK_H,), dtype=tl.float32)
    invalid = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k0 in range(0, Tk, BLOCK_K):
        key = k0 + key_offset
        ok = head_ok[:, None] & (row_ok & (key < Tk))[None, :]
        x = tl.load(ptrs + key[None, :] * stride_pk, mask=ok, other=0.0)
        xf = x.to(tl.float32)
        if DOT_IN_INPUT_DTYPE:
            # 16-bit products are exact in fp32; the tensor cores accumulate in fp32
            gram += tl.dot(x, tl.trans(x))
        else:
            gram += tl.dot(xf, tl.trans(xf), input_precision="ieee")
        entropy += tl.sum(tl.where(xf > 0, -xf * tl.log(tl.where(xf > 0, xf, 1.0)), 0.0), axis=1)
        # NaN fails both comparisons, so it counts as out of range too
        invalid += tl.sum(tl.where((xf >= 0) & (xf <= 1), 0.0, 1.0), axis=1)

    out_h = tl.arange(0, BLOCK_H)
    gram_ptrs = gram_part_ptr + pid * H * H + out_h[:, None] * H + out_h[None, :]
    tl.store(gram_ptrs, gram, mask=(out_h[:, None] < H) & (out_h[None, :] < H))
    tl.store(entropy_part_ptr + pid * H + out_h, entropy, mask=out_h < H)
    tl.store(invalid_part_ptr + pid, tl.sum(invalid, axis=0))


# Slab of about this many elements per program: enough work per load, few enough registers.
_SLAB_ELEMENTS = 8192


def _block_sizes(h: int, rows: int, tk: int) -> tuple[int, int, int]:
    block_h = max(16, triton.next_power_of_2(h))               # tl.dot needs >= 16
    block_k = min(64, max(1, triton.next_power_of_2(tk)))
    slab = max(16, _SLAB_ELEMENTS // block_h)
    block_r = max(1, min(slab // block_k, triton.next_power_of_2(rows)))
    block_r = max(block_r, triton.cdiv(16, block_k))           # slab width >= 16 for tl.dot
    return block_h, block_r, block_k


def head_stats_triton(probs: torch.Tensor, query_mask: torch.Tensor | None = None):
    """Launch the fused kernel. ``probs [N, B, H, Tq, Tk]``, ``query_mask`` bool ``[N or 1, B, Tq]``."""
    n, b, h, tq, tk = probs.shape
    rows = b * tq
    block_h, block_r, block_k = _block_sizes(h, rows, tk)
    tiles = triton.cdiv(rows, block_r)
    programs = n * tiles
    device = probs.device
    gram_part = torch.empty(programs, h, h, dtype=torch.float32, device=device)
    entropy_part = torch.empty(programs, h, dtype=torch.float32, device=device)
    invalid_part = torch.empty(programs, dtype=torch.float32, device=device)
    if query_mask is not None:
        mask = query_mask.expand(n, b, tq).view(torch.uint8)
        mask_strides = mask.stride()
        valid_rows = query_mask.expand(n, b, tq).sum(dim=(1, 2)).to(torch.float32)
    else:
        mask, mask_strides = probs, (0, 0, 0)   # never read
        valid_rows = torch.full((n,), float(rows), dtype=torch.float32, device=device)
    dot_in_input_dtype = probs.dtype in (torch.float16, torch.bfloat16) and not INTERPRETING
    _head_stats_kernel[(programs,)](
        gram_part, entropy_part, invalid_part,
        probs, mask,
        h, tq, tk, rows, tiles,
        *probs.stride(), *mask_strides,
        HAS_MASK=query_mask is not None, DOT_IN_INPUT_DTYPE=dot_in_input_dtype,
        BLOCK_H=block_h, BLOCK_R=block_r, BLOCK_K=block_k,
    )
    gram = gram_part.view(n, tiles, h, h).sum(1)
    entropy_sum = entropy_part.view(n, tiles, h).sum(1)
    invalid = invalid_part.view(n, tiles).sum(1)
    return gram, entropy_sum, valid_rows, invalid


# ---- torch.library op: compiled graphs and CUDA graphs hold it as one opaque node ----------------

@torch.library.custom_op("fastdiag::head_stats", mutates_args=())
def head_stats_op(probs: torch.Tensor, query_mask: torch.Tensor | None) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return head_stats_torch(probs, query_mask)


@head_stats_op.register_kernel("cuda")
def _head_stats_cuda(probs, query_mask):
    return head_stats_triton(probs, query_mask)


@head_stats_op.register_fake
def _head_stats_fake(probs, query_mask):
    n, _, h, _, _ = probs.shape
    f32 = dict(dtype=torch.float32, device=probs.device)
    return (probs.new_empty((n, h, h), **f32), probs.new_empty((n, h), **f32),
            probs.new_empty((n,), **f32), probs.new_empty((n,), **f32))
