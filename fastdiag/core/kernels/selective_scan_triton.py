"""Mamba's selective scan and its gradient as two Triton kernels: `--arch mamba` on any CUDA machine,
with or without mamba-ssm's compiled extension.

For K independent models ("members") with rows ``r = (k, b)``, channels ``d`` and state size ``n``:

    h_t[d, n] = exp(Δ_t[d] A_k[d, n]) h_{t-1}[d, n] + Δ_t[d] u_t[d] B_t[n],   h_{-1} = 0
    y_t[d]    = Σ_n C_t[n] h_t[d, n]

Layout (channels last, the mixer's own): u, Δ, y ``[R, L, D]``; B, C ``[R, L, N]``; A ``[K, D, N]``;
R = K · rows_per_member, row r belongs to member r // rows_per_member.

Forward: one program per (row, block of channels) walks the sequence once with the ``[BLOCK_D, N]``
state in registers; nothing but y (and, when asked, h_{L-1}) is written.

Backward (the adjoint recurrence, as `fastdiag.models.mamba._SelectiveScanFn` computes it on the CPU):
one program per (member, group of rows, block of channels) takes its rows one after another; for each
it recomputes the states into its own slice of a scratch buffer ``[programs, L, BLOCK_D, N]`` (so the
memory is bounded by the programs, not by the batch), then walks back accumulating
gh_t = dLoss/dh_t. dLoss/dA sums over the program's rows in registers; it, and the dB / dC partial
sums over the channel blocks, are written per program and added by torch: deterministic, no atomics.

Only float32 (mamba-ssm computes in float32 too; float64 stays on the PyTorch scan).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .constants import MAX_REGISTERS

# Programs the backward grid aims for (several per SM on any of the targeted GPUs), by splitting each
# member's rows into groups: fewer rows per program, more partial dA sums to add.
TARGET_PROGRAMS = 1024


@triton.jit
def _scan_fwd_kernel(u_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, y_ptr, last_ptr, rows_per_member, L, D, N,
                     BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, WANT_LAST: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    k = r // rows_per_member
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    md, mn = offs_d < D, offs_n < N
    tile = offs_d[:, None] * N + offs_n[None, :]
    m2 = md[:, None] & mn[None, :]
    A = tl.load(A_ptr + k * D * N + tile, mask=m2, other=0.0)
    h = tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.float32)
    for t in range(L):
        row_t = r * L + t
        u = tl.load(u_ptr + row_t * D + offs_d, mask=md, other=0.0)
        dt = tl.load(dt_ptr + row_t * D + offs_d, mask=md, other=0.0)
        Bt = tl.load(B_ptr + row_t * N + offs_n, mask=mn, other=0.0)
        Ct = tl.load(C_ptr + row_t * N + offs_n, mask=mn, other=0.0)
        h = tl.exp(dt[:, None] * A) * h + (dt * u)[:, None] * Bt[None, :]
        tl.store(y_ptr + row_t * D + offs_d, tl.sum(h * Ct[None, :], axis=1), mask=md)
    if WANT_LAST:
        tl.store(last_ptr + r * D * N + tile, h, mask=m2)


@triton.jit
def _scan_bwd_kernel(u_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, gy_ptr, glast_ptr, scratch_ptr,
                     gu_ptr, gdt_ptr, gA_ptr, gB_ptr, gC_ptr,
                     rows_per_member, rows_per_program, R, L, D, N,
                     BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, HAS_GLAST: tl.constexpr):
    k = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1).to(tl.int64)
    d_block = tl.program_id(2)
    program = (k * tl.num_programs(1) + group) * tl.num_programs(2) + d_block
    offs_d = d_block * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    md, mn = offs_d < D, offs_n < N
    tile = offs_d[:, None] * N + offs_n[None, :]
    m2 = md[:, None] & mn[None, :]
    local = tl.arange(0, BLOCK_D)[:, None] * BLOCK_N + offs_n[None, :]      # this program's scratch tile
    scratch = scratch_ptr + program * L * BLOCK_D * BLOCK_N
    A = tl.load(A_ptr + k * D * N + tile, mask=m2, other=0.0)
    gA = tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.float32)
    for i in range(rows_per_program):
        in_member = group * rows_per_program + i
        r = k * rows_per_member + in_member
        # the last group may be short: its extra rows load zeros and store nothing
        okd = md & (offs_d * 0 + in_member < rows_per_member)
        okn = mn & (offs_n * 0 + in_member < rows_per_member)
        ok2 = okd[:, None] & okn[None, :]
        h = tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.float32)
        for t in range(L):                        # the states again, into the scratch
            row_t = r * L + t
            u = tl.load(u_ptr + row_t * D + offs_d, mask=okd, other=0.0)
            dt = tl.load(dt_ptr + row_t * D + offs_d, mask=okd, other=0.0)
            Bt = tl.load(B_ptr + row_t * N + offs_n, mask=okn, other=0.0)
            h = tl.exp(dt[:, None] * A) * h + (dt * u)[:, None] * Bt[None, :]
            tl.store(scratch + t * BLOCK_D * BLOCK_N + local, h)
        tl.debug_barrier()
        if HAS_GLAST:
            gh = tl.load(glast_ptr + r * D * N + tile, mask=ok2, other=0.0)
        else:
            gh = tl.zeros([BLOCK_D, BLOCK_N], dtype=tl.float32)
        for back in range(L):
            t = L - 1 - back
            row_t = r * L + t
            u = tl.load(u_ptr + row_t * D + offs_d, mask=okd, other=0.0)
            dt = tl.load(dt_ptr + row_t * D + offs_d, mask=okd, other=0.0)
            gy = tl.load(gy_ptr + row_t * D + offs_d, mask=okd, other=0.0)
            Bt = tl.load(B_ptr + row_t * N + offs_n, mask=okn, other=0.0)
            Ct = tl.load(C_ptr + row_t * N + offs_n, mask=okn, other=0.0)
            h = tl.load(scratch + t * BLOCK_D * BLOCK_N + local)
            # h_{t-1}: zero before the first step (the address of t = -1 is never read)
            h_prev = tl.load(scratch + (t - 1) * BLOCK_D * BLOCK_N + local, mask=local * 0 + t > 0, other=0.0)
            gh += gy[:, None] * Ct[None, :]
            tl.store(gC_ptr + (d_block * R + r) * L * N + t * N + offs_n, tl.sum(gy[:, None] * h, axis=0), mask=okn)
            tl.store(gB_ptr + (d_block * R + r) * L * N + t * N + offs_n,
                     tl.sum((dt * u)[:, None] * gh, axis=0), mask=okn)
            g_du = tl.sum(Bt[None, :] * gh, axis=1)
            gh = gh * tl.exp(dt[:, None] * A)     # flows to h_{t-1}; times h_{t-1} it is dLoss/d(Δ_t A)
            q = gh * h_prev
            tl.store(gdt_ptr + row_t * D + offs_d, tl.sum(q * A, axis=1) + g_du * u, mask=okd)
            tl.store(gu_ptr + row_t * D + offs_d, g_du * dt, mask=okd)
            gA += q * dt[:, None]
        tl.debug_barrier()                        # the next row overwrites the scratch
    tl.store(gA_ptr + (k * tl.num_programs(1) + group) * D * N + tile, gA, mask=m2)


def _blocks(d: int, n: int, most: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_N): the whole state axis, up to ``most`` channels per program. The forward holds
    one [64, 16] state (56-63 registers on sm_80-sm_120); the backward about six such tiles, so 32
    channels (107-147 registers; at 64 it took 150-188, no spill either way)."""
    return min(most, triton.next_power_of_2(d)), triton.next_power_of_2(n)


def _check(u, delta, A, B, C) -> None:
    for name, x in (("u", u), ("delta", delta), ("A", A), ("B", B), ("C", C)):
        if x.dtype != torch.float32:
            raise TypeError(f"{name}: the Triton selective scan computes in float32, got {x.dtype}")
    if u.dim() != 4 or delta.shape != u.shape:
        raise ValueError(f"u, delta: expected equal [members, batch, seqlen, dim] shapes, got {list(u.shape)}, "
                         f"{list(delta.shape)}")
    k, b, l, d = u.shape
    n = A.shape[-1]
    if A.shape != (k, d, n) or B.shape != (k, b, l, n) or C.shape != (k, b, l, n):
        raise ValueError(f"A, B, C: expected [{k}, {d}, n], [{k}, {b}, {l}, n] and [{k}, {b}, {l}, n], got "
                         f"{list(A.shape)}, {list(B.shape)}, {list(C.shape)}")


def scan_forward(u, delta, A, B, C, want_last: bool):
    """y ``[K, b, l, d]`` and h_{l-1} ``[K, b, d, n]`` (None unless ``want_last``) of the members'
    scans: u, delta ``[K, b, l, d]``, A ``[K, d, n]``, B, C ``[K, b, l, n]``, all float32."""
    _check(u, delta, A, B, C)
    k, b, l, d = u.shape
    n = A.shape[-1]
    u, delta, A, B, C = (x.contiguous() for x in (u, delta, A, B, C))
    y = torch.empty_like(u)
    last = u.new_empty(k, b, d, n) if want_last else y
    block_d, block_n = _blocks(d, n, 64)
    _scan_fwd_kernel[(k * b, triton.cdiv(d, block_d))](u, delta, A, B, C, y, last, b, l, d, n, BLOCK_D=block_d,
                                                      BLOCK_N=block_n, WANT_LAST=want_last, num_warps=4,
                                                      maxnreg=MAX_REGISTERS)
    return y, (last if want_last else None)


def scan_backward(u, delta, A, B, C, grad_y, grad_last=None):
    """Gradients (u, delta, A, B, C) of the scan for the output gradient ``grad_y`` ``[K, b, l, d]``
    and, when given, ``grad_last`` ``[K, b, d, n]``."""
    _check(u, delta, A, B, C)
    k, b, l, d = u.shape
    n = A.shape[-1]
    u, delta, A, B, C, grad_y = (x.contiguous() for x in (u, delta, A, B, C, grad_y))
    block_d, block_n = _blocks(d, n, 32)
    d_blocks = triton.cdiv(d, block_d)
    rows_per_program = min(b, max(1, math.ceil(b * k * d_blocks / TARGET_PROGRAMS)))   # within one member
    groups = triton.cdiv(b, rows_per_program)
    scratch = u.new_empty(k * groups * d_blocks, l, block_d, block_n)
    g_u, g_delta = torch.empty_like(u), torch.empty_like(u)
    g_A = u.new_empty(k, groups, d, n)
    g_B, g_C = u.new_empty(d_blocks, k, b, l, n), u.new_empty(d_blocks, k, b, l, n)
    glast = grad_last.contiguous() if grad_last is not None else u
    _scan_bwd_kernel[(k, groups, d_blocks)](u, delta, A, B, C, grad_y, glast, scratch, g_u, g_delta, g_A, g_B, g_C,
                                            b, rows_per_program, k * b, l, d, n, BLOCK_D=block_d, BLOCK_N=block_n,
                                            HAS_GLAST=grad_last is not None, num_warps=4, maxnreg=MAX_REGISTERS)
    return g_u, g_delta, g_A.sum(1), g_B.sum(0), g_C.sum(0)


class TritonSelectiveScan(torch.autograd.Function):
    """`scan_forward` with `scan_backward` as its gradient; the interface of
    ``fastdiag.models.mamba._SelectiveScanFn`` (u, delta, A, B, C, want_last) -> (y, last or None)."""

    @staticmethod
    def forward(ctx, u, delta, A, B, C, want_last: bool):
        y, last = scan_forward(u, delta, A, B, C, want_last)
        ctx.save_for_backward(u, delta, A, B, C)
        return y, last

    @staticmethod
    def backward(ctx, grad_y, grad_last):
        return (*scan_backward(*ctx.saved_tensors, grad_y, grad_last), None)
