"""Head statistics straight from Q and K, and the one measured SDPA call (`sdpa_with_stats`).

`F.scaled_dot_product_attention` never materialises its probabilities. `qk_head_stats` computes
the layer's `HeadStats` from Q, K and the masks without holding ``[B, H, Tq, Tk]`` either:

- pass 1, the row log-sum-exp ``lse`` of the scaled, masked scores (a flash forward without V),
  skipped when the caller already has it (the attention op computes it for its backward anyway);
- pass 2, the statistics with ``p = exp(s − lse)`` and the row entropy ``−Σ p (s − lse)``.

Backends: ``"triton"`` (two fused kernels, `fastdiag/core/kernels/qk_stats_triton.py`; the default on CUDA),
``"torch"`` (chunked over query rows, keys sliced to the causal bound; the default elsewhere) and
``"reference"`` (float64, the ground truth). Which keys are masked and which rows count: the one rule,
`fastdiag/core/kernels/rows.py` (docs/attach.md, "Padding"). Row validity is read from the masks, never from the LSE (a fully masked
row has LSE 0 on the CPU flash op and inf on CUDA).
"""
from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from fastdiag.core.diagnostics import BACKENDS, run_triton, triton_available
from fastdiag.core.kernels.qk_stats_ref import qk_stats_ref
from fastdiag.core.kernels.rows import additive_mask, mask_as_4d, valid_rows, visible  # noqa: F401 (fastdiag.qk names)
from fastdiag.core.kernels import qk_stats_cpu as native
from fastdiag.core.kernels.qk_stats_torch import CHUNK_BYTES, qk_stats_torch
from fastdiag.core.stats import HeadStats

CPU_CHUNK_BYTES = 2**20    # on CPU, chunks also stay this small: every pass over them hits the cache


# ---- inputs ----------------------------------------------------------------------------------

def _as_batched_heads(q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None,
                      query_mask: torch.Tensor | None, lse: torch.Tensor | None):
    """q ``[..., H, Tq, D]`` -> ``[B, H, Tq, D]``, k -> ``[B, Hk, Tk, D]``, the mask as a 4-D view
    broadcastable to ``[B, H, Tq, Tk]`` (size-1 dimensions kept, so row validity stays cheap)."""
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point torch.Tensor, got "
                            f"{getattr(t, 'dtype', type(t).__name__)}")
        if t.layout != torch.strided:
            raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {t.layout}")
        if t.dim() < 3:
            raise ValueError(f"{name}: expected shape [..., H, T, D] or [B, T, D], got {tuple(t.shape)}")
    if torch.is_grad_enabled():   # statistics carry no gradient (attach computes them under no_grad)
        q, k = q.detach(), k.detach()
    if q.dim() == 3:  # [B, T, D]: a single head
        q, k = q.unsqueeze(-3), k.unsqueeze(-3)
    *lead_q, h, tq, d = q.shape
    *lead_k, hk, tk, dk = k.shape
    if dk != d:
        raise ValueError(f"k: head dimension {dk} differs from q's {d}")
    if hk == 0 or h % hk:
        raise ValueError(f"k: {hk} key heads do not divide q's {h} query heads")
    if min(h, tq, tk, d) == 0:
        raise ValueError(f"q, k: every dimension must be non-empty, got {tuple(q.shape)} and {tuple(k.shape)}")
    try:
        lead = torch.broadcast_shapes(tuple(lead_q), tuple(lead_k))
    except RuntimeError:
        raise ValueError(f"k: batch dimensions {tuple(lead_k)} do not broadcast with q's {tuple(lead_q)}") from None
    b = math.prod(lead)
    if q.dim() == 4 and tuple(lead_q) == tuple(lead_k):    # as the kernels take them (no op)
        q4, k4 = q, k
    else:
        q4 = q.expand(*lead, h, tq, d).reshape(b, h, tq, d)
        k4 = k.expand(*lead, hk, tk, d).reshape(b, hk, tk, d)
    mask4 = None
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask: expected a torch.Tensor, got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise TypeError(f"attn_mask: expected a bool (True = may attend) or floating-point (additive) "
                            f"mask, got {attn_mask.dtype}")
        if attn_mask.layout != torch.strided:
            raise TypeError(f"attn_mask: expected a dense (strided) tensor, got layout {attn_mask.layout}")
        mask4 = attn_mask.detach()
        full = (*lead, h, tq, tk)
        if mask4.dim() > len(full):
            raise ValueError(f"attn_mask: {mask4.dim()} dimensions {tuple(mask4.shape)}, more than the "
                             f"{len(full)} of the scores {list(full)}")
        try:
            torch.broadcast_shapes(tuple(mask4.shape), full)
        except RuntimeError:
            raise ValueError(f"attn_mask: shape {tuple(mask4.shape)} does not broadcast to "
                             f"{list(full)}") from None
        mask4 = mask_as_4d(mask4, lead, b)
    qm = None
    if query_mask is not None:
        if not isinstance(query_mask, torch.Tensor) or query_mask.dtype != torch.bool:
            raise TypeError("query_mask: expected a bool torch.Tensor [B, Tq] (True = valid row), got "
                            f"{getattr(query_mask, 'dtype', type(query_mask).__name__)}")
        if query_mask.shape[-1] != tq or math.prod(query_mask.shape[:-1]) != b:
            raise ValueError(f"query_mask: expected shape [{b}, {tq}], got {tuple(query_mask.shape)}")
        qm = query_mask.reshape(b, tq)
    lse3 = None
    if lse is not None:
        if not isinstance(lse, torch.Tensor) or lse.numel() != b * h * tq:
            raise ValueError(f"lse: expected a tensor of shape [{b}, {h}, {tq}], got "
                             f"{tuple(getattr(lse, 'shape', ()))}")
        lse3 = lse.detach() if torch.is_grad_enabled() else lse
        if lse3.shape != (b, h, tq):
            lse3 = lse3.reshape(b, h, tq)
    return q4, k4, mask4, qm, lse3


# ---- the public entry points ------------------------------------------------------------------

def qk_head_stats(q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None = None,
                  is_causal: bool = False, scale: float | None = None, backend: str = "auto",
                  chunk_bytes: int = CHUNK_BYTES, query_mask: torch.Tensor | None = None,
                  lse: torch.Tensor | None = None) -> HeadStats:
    """HeadStats of ``softmax(q kᵀ · scale + mask)``, as `F.scaled_dot_product_attention` defines it.

    q: ``[..., H, Tq, D]``; k: ``[..., Hk, Tk, D]`` with Hk dividing H (grouped-query attention:
    query head h reads key head ``h // (H / Hk)``). attn_mask: broadcastable to ``[..., H, Tq, Tk]``,
    bool (True = may attend) or additive float. is_causal: the top-left aligned causal mask.
    query_mask: bool ``[..., Tq]``, True = valid row. lse: the natural-log row log-sum-exp
    ``[..., H, Tq]`` of the scaled, masked scores, if the caller has it (pass 1 is skipped; a valid
    row whose probabilities then do not sum to 1 is counted in ``invalid``).
    Rows that may attend to no key in some head are left out. Nothing of size Tq × Tk is held whole.
    """
    with torch.no_grad():      # statistics carry no gradient: nothing to detach
        return _qk_head_stats(q, k, attn_mask, is_causal, scale, backend, chunk_bytes, query_mask, lse,
                              check_lse=True)


def _qk_head_stats(q, k, attn_mask, is_causal, scale, backend, chunk_bytes, query_mask, lse,
                   check_lse: bool) -> HeadStats:
    """`qk_head_stats`; ``check_lse=False`` when the LSE comes from the attention op of the same
    call (it cannot disagree with these scores; the torch backend then saves a pass)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    if not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes: expected a positive int, got {chunk_bytes!r}")
    q4, k4, mask4, qm, lse3 = _as_batched_heads(q, k, attn_mask, query_mask, lse)
    b, h, tq, d = q4.shape
    if torch.compiler.is_compiling():
        # traced: the scale may be symbolic (dynamic shapes), and float() or isfinite() on it broke the graph
        # inside the measured pass, where dynamo's fallback then raised in the user's step (HF GPT-2 / Llama
        # sdpa, torch.compile(dynamic=True)); it is checked on eager calls
        scale = d ** -0.5 if scale is None else scale
    else:
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
            raise TypeError(f"scale: expected a number or None, got {type(scale).__name__} {scale!r}")
        scale = d ** -0.5 if scale is None else float(scale)
        if not math.isfinite(scale):
            raise ValueError(f"scale: expected a finite number or None, got {scale!r}")
    if backend == "auto":
        backend = "triton" if q4.is_cuda and triton_available() else "torch"
    if backend == "reference":
        return HeadStats(*qk_stats_ref(q4, k4, mask4, is_causal, scale, qm))
    # None: every row is valid (no mask and no query_mask: with is_causal each row sees key 0)
    rows_ok = None if mask4 is None and qm is None else valid_rows(mask4, is_causal, (b, h, tq, k4.shape[2]), qm)
    if backend == "torch":
        if native.usable(q4, k4, mask4):
            return HeadStats(*native.qk_stats_cpu(q4, k4, mask4, is_causal, scale, rows_ok, lse3,
                                                  check_lse and lse3 is not None))
        if q4.device.type == "cpu":
            chunk_bytes = min(chunk_bytes, CPU_CHUNK_BYTES)
        return HeadStats(*qk_stats_torch(q4, k4, mask4, is_causal, scale, rows_ok, lse3, chunk_bytes,
                                       check_lse and lse3 is not None))
    return HeadStats(*run_triton("qk_stats_triton", "qk_stats_op", "qk_stats_triton", q4, k4, mask4, is_causal, scale,
                                 rows_ok, lse3))


def sdpa_with_stats(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                    is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False, *,
                    query_mask: torch.Tensor | None = None, backend: str = "auto",
                    chunk_bytes: int = CHUNK_BYTES,
                    packed_query_heads: int | None = None) -> tuple[torch.Tensor, HeadStats]:
    """``(F.scaled_dot_product_attention(...), HeadStats of its probabilities)``.

    The output and its gradients are bit-identical to `F.scaled_dot_product_attention` with the
    same arguments. Where that call is trivially equivalent to an attention op that also returns
    the row log-sum-exp (the backend `torch._fused_sdp_choice` names), that op runs and its LSE
    replaces our pass 1; otherwise F.scaled_dot_product_attention runs and pass 1 is ours.
    The statistics are those of the probabilities without dropout. ``packed_query_heads`` (H): the
    call holds one query token's H heads as ``[B, H / G, G, D]`` rows (`unpack_query_heads`).
    """
    out, lse = _attention_with_lse(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if backend == "reference":
        lse = None
    if packed_query_heads:
        query, attn_mask, lse = unpack_query_heads(query, attn_mask, lse, packed_query_heads)
    with torch.no_grad():      # statistics carry no gradient: nothing to detach
        stats = _qk_head_stats(query, key, attn_mask, is_causal, scale, backend, chunk_bytes, query_mask, lse,
                               check_lse=False)
    return out, stats


def unpack_query_heads(query: torch.Tensor, attn_mask: torch.Tensor | None, lse: torch.Tensor | None,
                       heads: int):
    """One query token's ``heads`` heads packed as ``[B, Hkv, G, D]`` rows (Hugging Face's
    grouped-query decode) back to ``[B, H, 1, D]``; a mask ``[B, Hkv, G, Tk]`` to ``[B, H, 1, Tk]``
    (one with a single row broadcasts as it is) and the LSE to ``[B, H, 1]``."""
    b, hk, g, d = query.shape
    query = query.reshape(b, heads, 1, d)
    if attn_mask is not None and attn_mask.dim() >= 3 and attn_mask.shape[-2] != 1:
        attn_mask = attn_mask.reshape(*attn_mask.shape[:-3], heads, 1, attn_mask.shape[-1])
    if lse is not None:
        lse = lse.reshape(b, heads, 1)
    return query, attn_mask, lse


def _attention_with_lse(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """The attention output exactly as F.sdpa computes it, and the op's natural-log LSE or None."""
    dense_4d = all(isinstance(t, torch.Tensor) and t.dim() == 4 and t.layout == torch.strided
                   and not t.is_nested for t in (query, key, value))
    # Under torch.compile the call stays F.sdpa (what the compiled model itself would run; dynamo
    # cannot trace the backend choice), and pass 1 is ours.
    if dense_4d and dropout_p == 0.0 and not torch.compiler.is_compiling():
        choice = SDPBackend(torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal,
                                                    scale=scale, enable_gqa=enable_gqa))
        if query.device.type == "cpu" and choice == SDPBackend.FLASH_ATTENTION:
            # What F.sdpa runs on CPU (bit-identical output and gradients, tests/test_qk_stats.py).
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal,
                attn_mask=additive_mask(attn_mask, query.dtype, true_attends=True), scale=scale)
            # Its LSE is float32 only for float32 inputs: with bf16/fp16 ones it was 6e-5 off float64 of
            # the same scores (torch 2.13), which put the Gram 1e-4 off; our own LSE costs no extra pass
            # on the CPU path (a logsumexp of the chunk it scores anyway).
            return out, (lse if query.dtype in (torch.float32, torch.float64) else None)
        # CUDA: only the plainest calls, where F.sdpa pads nothing and converts no mask
        # (tests/test_gpu.py checks the output is bit-identical on a GPU).
        plain = (query.is_cuda and attn_mask is None and query.shape[1] == key.shape[1]
                 and query.shape[-1] % 8 == 0 and value.shape[-1] % 8 == 0)
        if plain and choice == SDPBackend.FLASH_ATTENTION:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale)[:2]
            return out, lse
        if plain and choice == SDPBackend.CUDNN_ATTENTION:
            # torch 2.11 picks cuDNN on an H200; its output equals F.sdpa's bit for bit and its fp32 LSE
            # [B, H, Tq, 1] is within 1e-6 of pass 1's (benchmarks/RESULTS.md, 2026-12-04)
            out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
                query, key, value, None, True, dropout_p, is_causal, False, scale=scale)[:2]
            return out, lse.reshape(query.shape[:-1])
        if plain and choice == SDPBackend.EFFICIENT_ATTENTION:
            out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, None, True, dropout_p, is_causal, scale=scale)[:2]
            return out, lse[..., :query.shape[-2]]   # Tq may be padded to a multiple of 32
    out = F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                         enable_gqa=enable_gqa)
    return out, None
