"""A row's entropy and mass from its scores, one key tile at a time: the Q/K pass-2 kernels' row sums.

``−Σ p (s − lse)`` loses a sharp row. Its top key's ``s − lse`` should be minus the row's tiny mass off
the top, but pass 2 recomputes the scores in another accumulation order than the kernel that gave the
LSE (pass 1, or the attention op), so it is ``±ε·|s|`` instead, and the entropy — made of the
runners-up ``exp(s_j − s_top)`` — carries that error whole: σ_l was 4e-5 off float64 at a logit gap of
300, 1e-3 to 26× at 1e3–1e4 (fp32 scores, silent). Here, as on the torch path (`qk_stats_torch`), each
row is shifted by its own running maximum ``m`` (the score of its top key, so that key's term is 0
exactly), with ``rest = Σ exp2(s − m)`` over every key but one top key and ``total = Σ exp2(s − m)·(m − s)``,
both sums of non-negative terms, rescaled when a later key tile raises the maximum (as a flash forward
rescales its sum). Then, in log2 units, ``H = log2(1 + rest) + total / (1 + rest)`` and the row's mass
under the given LSE is ``exp2(m − lse₂)·(1 + rest)``: the entropy is that of the scores pass 2 computed,
and a LSE that disagrees with them shows in the mass (checked), never in H.

What float32 scores cannot give is named, never returned silently: a score of size |s| carries a rounding
error of ~2⁻²⁴·|s|, which moves a row's entropy by about that much *relative* (a sharp row's entropy is
its runners-up's ``exp(s_j − s_top)``), and the Gram by the row's mass off 1. A row whose estimated
relative error (`SCORE_ROUNDING` × the size of its relevant scores) or whose mass off 1 exceeds the
input dtype's target (1e-5 for float32 inputs, 1e-3 for 16-bit ones: README, "Exactness") is counted in
``invalid``: the layer's statistics are NaN and attach names the module (docs/attach.md, "Sharp rows").

|s| is not the size that sets a score's rounding when its products cancel: the float32 accumulation of
``Σ_d q_d k_jd`` rounds running sums as large as ``Σ_d |q_d k_jd|``, which can be 1e5× |s| (a float16 layer
so built read σ_l 1e-2 off, silent, before this). For 16-bit inputs the kernels also bound it by
Cauchy–Schwarz, ``Σ_d |q_d k_jd| ≤ ‖q_i‖‖k_j‖``: ‖q_i‖² re-read once after the key loop, max_j ‖k_j‖²
(`_key_norms2`) a running max over the K tiles the kernels load (one loop-carried register, or one per key
head), so a row's error is estimated as the larger of the |s| estimate and `CANCEL_ROUNDING` ×
`_cancel_bound` (``|qk_scale|·‖q_i‖·max_j ‖k_j‖``): no host op, no host read.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .constants import LN2, LOG2E, MASKED_SCORE, MASS_TOLERANCE

_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(LN2)
_MASKED = tl.constexpr(MASKED_SCORE)
_MASS_TOLERANCE = tl.constexpr(MASS_TOLERANCE)

# The relative error of a row's entropy per unit of score size (log2 units), estimated: measured in the
# interpreter against float64 (benchmarks/RESULTS.md, "Sharp rows on the Triton pass 2"), σ_l's error
# reached 0.9 × 2⁻²⁴ × the rows' largest |s|; twice that is the estimate.
SCORE_ROUNDING = 2 * 2.0 ** -24
_SCORE_ROUNDING = tl.constexpr(SCORE_ROUNDING)
# The exactness targets (README, "Exactness"): float32 inputs, 16-bit inputs
FP32_TARGET, HALF_TARGET = 1e-5, 1e-3
_FP32_TARGET = tl.constexpr(FP32_TARGET)
_HALF_TARGET = tl.constexpr(HALF_TARGET)
# 16-bit inputs: the relative error of a row's entropy per unit of ``|qk_scale|·‖q_i‖·max_j ‖k_j‖`` (log2
# units), estimated, for rows whose products ``q_d k_jd`` cancel (Σ_d |q_d k_jd| ≫ |s|). The products are
# exact in float32 and the dot's float32 accumulation rounds running sums bounded by Σ_d |q_d k_jd| ≤
# ‖q_i‖‖k_j‖ (Cauchy–Schwarz), not by |s|: a score's error is γ·Σ_d |q_d k_jd|, γ a few 2⁻²⁴. A score off by
# δ_j (nats) moves the entropy by at most max_j |δ_j − Σ p δ| relative (dH = −Σ p_j log p_j (δ_j − Σ p δ),
# and Σ p |log p| = H), so by 2·ln2·γ per unit here. Measured in float64 emulation of float32-accumulated
# 16-bit scores (torch's and numpy's summation orders; head dim 8–128; sharp rows of gaps 3–1e3 and score
# offsets 0–1e3, and rows whose products cancel exactly, benchmarks/cancelling_rows_triton.py): a row's
# error reached 2.3 units (γ ≈ 1.7·2⁻²⁴); c = 4 keeps 1.7× of margin (benchmarks/RESULTS.md, "Cancelling
# products"). Not measured on tensor cores (no GPU lent): their 16-column steps align to the largest term
# and truncate, at most one such rounding per step, 2·ln2·2·D/16 ≈ 11 units at D = 64 in the worst case.
# The device tests check it on the next GPU lent (`tests/test_qk_gpu.py::
# test_rows_whose_products_cancel_are_named_or_exact_on_tensor_cores`: named or within 1e-3, D 64 and 128).
# With c = 4 a row is named once ‖q_i‖·max‖k_j‖·|scale| passes ~2900 nats (16-bit target 1e-3): no
# ordinary layer comes near (a randomly initialised GPT-2-small: 4.6 at most).
CANCEL_ROUNDING = 4 * 2.0 ** -24
_CANCEL_ROUNDING = tl.constexpr(CANCEL_ROUNDING)
# Float32 inputs are scored in float64 (the batched pass 2, `qk_stats_triton`): their products are exact there
# (24 + 24 bits) and a score's error is the float64 accumulation's, at most D·2⁻⁵³·Σ_d |q_d k_jd| (worst case,
# no statistics of rounding assumed). The same two estimates with float64's unit: |s| (2·2⁻⁵³ per unit) and the
# Cauchy–Schwarz bound with 2·ln2·D·2⁻⁵³ ≤ 512·2⁻⁵³ per unit (D ≤ 256). A row is then named once |s| passes
# ~4.5e10 or ‖q_i‖·max‖k_j‖·|scale| ~1.8e8 (target 1e-5): only inputs built to cancel come near.
SCORE_ROUNDING_FP64 = 2 * 2.0 ** -53
CANCEL_ROUNDING_FP64 = 512 * 2.0 ** -53
_SCORE_ROUNDING_FP64 = tl.constexpr(SCORE_ROUNDING_FP64)
_CANCEL_ROUNDING_FP64 = tl.constexpr(CANCEL_ROUNDING_FP64)


@triton.jit
def _row_sums_start(shape: tl.constexpr, SCORES_FP64: tl.constexpr = False):
    """Running (m, rest, total) before any key: m at the masked score, so a row's first real key
    rescales whatever masked keys came before it to 0. ``SCORES_FP64`` (float32 inputs): all three float64, m
    as the scores are, and the sums so that the differences between heads of a near-uniform layer keep their
    digits (σ_H 3e-3 of entropies ~3.5 nats: float32 sums were 1.1e-5 of σ_H off, the target 1e-5)."""
    if SCORES_FP64:
        dtype = tl.float64
    else:
        dtype = tl.float32
    return tl.full(shape, _MASKED, dtype=dtype), tl.zeros(shape, dtype=dtype), tl.zeros(shape, dtype=dtype)


@triton.jit
def _row_sums_step(s, m, rest, total, AXIS: tl.constexpr):
    """One key tile of scores ``s`` (log2 units, masked keys at MASKED, keys along ``AXIS``) into the
    rows' running ``(m, rest, total)``. Returns ``exp2(s − m_new)`` for every key (the row's
    probabilities up to a per-row factor) and the new sums. Scores, m and the sums may be float64 (float32
    inputs): the scores leave only as differences, float32 (one exp2 per score in float32); the rescale of
    the sums is in the sums' type."""
    m_new = tl.maximum(m, tl.max(s, AXIS))
    x = (s - tl.expand_dims(m_new, AXIS)).to(tl.float32)      # ≤ 0, exactly 0 at the top
    e = tl.exp2(x)
    at_top = x == 0
    grew = m_new > m
    # the old sums' keys: rescaled by exp2(m − m_new) when this tile holds a higher key, the old top
    # included (then no longer the top); a tile at the maximum adds one per key tied with the top
    # beyond the one top key (at least one such key when the maximum grew)
    rise = (m_new - m).to(rest.dtype)
    alpha = tl.exp2(-rise)
    old_rest = tl.where(grew, alpha * (1.0 + rest), rest)
    old_total = tl.where(grew, alpha * (total + rise * (1.0 + rest)), total)
    ties = tl.sum(at_top.to(tl.float32), AXIS) - grew.to(tl.float32)
    rest_new = old_rest + tl.sum(tl.where(at_top, 0.0, e), AXIS) + ties
    total_new = old_total - tl.sum(e * x, AXIS)     # a masked key: 0 · −1e30 = 0
    return e, m_new, rest_new, total_new


@triton.jit
def _key_norms2(kt, AXIS: tl.constexpr):
    """‖k_j‖² of every key of a K tile (its head-dimension columns along ``AXIS``, kept as a size-1 axis);
    the kernels keep a running max over their key tiles for the rows' cancellation bound (`_cancel_bound`)."""
    k = kt.to(tl.float32)
    return tl.sum(k * k, AXIS, keep_dims=True)


@triton.jit
def _cancel_bound(q_norm2, k_norm_max2, qk_scale):
    """``|qk_scale|·‖q_i‖·max_j ‖k_j‖`` (log2 units): by Cauchy–Schwarz, at least Σ_d |q_d k_jd|·|qk_scale|
    for every key j of the row, the size that sets a score's float32 accumulation error."""
    return tl.abs(qk_scale) * tl.sqrt(q_norm2) * tl.sqrt(k_norm_max2)


@triton.jit
def _row_results(m, rest, total, lse2, ok, bound, FP32_DOT: tl.constexpr):
    """Per row: its entropy in nats (0 where the row does not count) and whether it counts as invalid:
    its mass under the LSE off 1 by more than MASS_TOLERANCE (a wrong LSE, NaN), or, for a row that
    counts, more error than the dtype's target allows (scores too large for it, or products that cancel:
    ``bound`` from `_cancel_bound`; unread for float32 inputs scored in float32, the per-head kernel's).
    ``m`` float64: the scores were float64 (float32 inputs), so is ``lse2``, and float64's rounding applies."""
    mass_in_row = 1.0 + rest
    # log2(1 + rest) to full precision for a tiny rest: log2(u) · rest / (u − 1) with u = 1 + rest rounded
    log_mass = tl.where(mass_in_row == 1.0, rest * _LOG2E,
                        tl.log2(mass_in_row) * (rest / tl.where(mass_in_row == 1.0, 1.0, mass_in_row - 1.0)))
    entropy = (log_mass + total / mass_in_row) * _LN2
    mass = tl.exp2((m - lse2).to(tl.float32)) * mass_in_row
    if FP32_DOT:
        target = _FP32_TARGET
    else:
        target = _HALF_TARGET
    # the size of the scores the entropy is made of: the top key's and the others' (at their mean gap)
    gap = tl.where(rest > 0, total / tl.where(rest > 0, rest, 1.0), 0.0)
    size = tl.maximum(tl.abs(m), tl.abs(m - gap))
    drift = tl.abs(mass - 1.0)
    wrong = (drift <= _MASS_TOLERANCE) == 0                               # NaN counts as wrong
    if m.dtype == tl.float64:
        imprecise = (_SCORE_ROUNDING_FP64 * size > target) | (drift > target)
        imprecise = imprecise | (_CANCEL_ROUNDING_FP64 * bound > target)
    else:
        imprecise = (_SCORE_ROUNDING * size > target) | (drift > target)
        if not FP32_DOT:
            imprecise = imprecise | (_CANCEL_ROUNDING * bound > target)
    return tl.where(ok, entropy, 0.0), ok & (wrong | imprecise)
