"""The numbers every head-statistics kernel shares (Triton kernels read them as ``tl.constexpr``, the
torch paths as floats): one home, so the fused kernels and their torch twins cannot drift apart."""
from __future__ import annotations

import contextlib

import torch

LOG2E = 1.4426950408889634     # log2(e): scores go to log2 units for exp2 / log2
LN2 = 0.6931471805599453       # ln(2): log2 units back to nats
# A masked key's score: finite, so 0 · MASKED_SCORE is 0 where 0 · −inf would be NaN, and far below
# any real score (exp of it underflows to exactly 0).
MASKED_SCORE = -1e30
# A valid row's probabilities must sum to 1 ± this, or the row is counted invalid (a wrong LSE, NaN).
MASS_TOLERANCE = 1e-3
# torch paths: log p is floored here. p < e^-40 = 4e-18 then reads 4e-18, which moves no statistic by
# more than ~1e-13 relative, and keeps every p, p·log p and p_i·p_j a normal float: on x86, exp of
# -1e30 and products that underflow run 3-8x slower (measured, 1 thread).
LOG_P_FLOOR = -40.0
# Every launch asks ptxas for up to 255 registers per thread (Triton's ``maxnreg``). Without the cap
# ptxas picks a lower one of its own for some targets and spills under it: head_stats fp32 at
# [32 heads, 4096] on sm_120 got 128 registers and spilled 24 B; with it, 144 registers and no spill.
MAX_REGISTERS = 255


@contextlib.contextmanager
def exact_fp32_matmul():
    """float32 matrix products computed in float32 inside: `torch.set_float32_matmul_precision("high")`
    (TF32 on CUDA, ~1e-3 relative) or ``"medium"`` (bf16 inside oneDNN on CPUs that have it) is a
    common training setting, and would silently cost the statistics three decimal digits."""
    if torch.compiler.is_compiling():    # global flags cannot be switched inside a traced graph
        yield
        return
    # the per-backend switches (torch >= 2.9): the legacy global getter raises once they are mixed
    switches = [b for b in (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul)
                if hasattr(b, "fp32_precision")]
    saved = [b.fp32_precision for b in switches]
    legacy = None if switches else torch.get_float32_matmul_precision()
    for b in switches:
        b.fp32_precision = "ieee"
    if legacy is not None:
        torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        for b, value in zip(switches, saved):
            b.fp32_precision = value
        if legacy is not None:
            torch.set_float32_matmul_precision(legacy)
