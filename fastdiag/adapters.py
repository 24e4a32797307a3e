"""How `fastdiag.attach` finds attention in a model and turns one call into `HeadStats`.

Four kinds of attention, one adapter each:

- **zoo** (`fastdiag.models`): modules whose class sets ``records_head_stats = True``. The monitor
  sets ``module.record = True`` for a measured pass and reads ``module.stats`` afterwards; the
  module itself computes its probabilities (no extra work).
- **MHA** (`torch.nn.MultiheadAttention`, and so `nn.Transformer*Layer`): a forward pre-hook
  re-projects Q and K from the call's inputs with the module's own weights and reproduces its masks
  (`attn_mask`, `key_padding_mask`, `bias_k`, `add_zero_attn`), whatever `need_weights` says.
- **HF** (`transformers` ``*Attention`` modules): their modeling file's ``eager_attention_forward``
  is wrapped (it receives Q, K, the additive mask and the scaling); the "sdpa" implementation ends
  in `F.scaled_dot_product_attention` and is caught by the next adapter.
- **SDPA**: `torch.nn.functional.scaled_dot_product_attention` is replaced by a wrapper that calls
  the original unchanged and, while an attached model is in a measured pass, computes the
  statistics from Q, K, the mask, `is_causal` and `scale` as eager attention would.

Q/K adapters go through `qk_head_stats`, which builds the probabilities a chunk of query rows at a
time, so the full ``[B, H, Tq, Tk]`` tensor is never held; HeadStats of the chunks add exactly.
"""
from __future__ import annotations

import inspect
import sys

import torch
import torch.nn.functional as F

from fastdiag.diagnostics import head_stats
from fastdiag.stats import HeadStats

CHUNK_BYTES = 64 * 2**20  # probabilities built at a time per attention call (the scores, in fp32)


# ---- the shared Q/K path ------------------------------------------------------------------------

def qk_head_stats(q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None = None,
                  is_causal: bool = False, scale: float | None = None, backend: str = "auto",
                  chunk_bytes: int = CHUNK_BYTES) -> HeadStats:
    """HeadStats of ``softmax(q kᵀ · scale + mask)``, as `F.scaled_dot_product_attention` defines it.

    q: ``[..., H, Tq, D]``; k: ``[..., Hk, Tk, D]`` with Hk dividing H (grouped-query attention:
    query head h reads key head ``h // (H / Hk)``). attn_mask: broadcastable to ``[..., H, Tq, Tk]``,
    bool (True = may attend) or additive float. is_causal: the top-left aligned causal mask.
    Query rows that may attend to no key at all are left out (their softmax is undefined).
    The probabilities are formed ``chunk_bytes`` at a time over query rows and never held whole.
    """
    q, k = q.detach(), k.detach()
    if q.dim() == 3:  # [B, T, D]: a single head
        q, k = q.unsqueeze(-3), k.unsqueeze(-3)
    *lead_q, h, tq, d = q.shape
    *lead_k, hk, tk, _ = k.shape
    if h % hk:
        raise ValueError(f"attention: {h} query heads is not a multiple of {hk} key heads")
    lead = torch.broadcast_shapes(tuple(lead_q), tuple(lead_k))
    acc = torch.promote_types(q.dtype, torch.float32)
    q = q.expand(*lead, h, tq, d).reshape(-1, hk, h // hk, tq, d).to(acc)
    k = k.expand(*lead, hk, tk, d).reshape(-1, hk, 1, tk, d).to(acc).transpose(-1, -2)
    b = q.shape[0]
    scale = d ** -0.5 if scale is None else scale
    mask = None
    if attn_mask is not None:
        mask = attn_mask.detach().expand(*lead, h, tq, tk)
    rows = max(1, chunk_bytes // max(1, b * h * tk * torch.finfo(acc).bits // 8))
    total = None
    for r0 in range(0, tq, rows):
        r1 = min(tq, r0 + rows)
        scores = torch.matmul(q[..., r0:r1, :], k).reshape(b, h, r1 - r0, tk) * scale
        if is_causal:
            future = (torch.arange(r0, r1, device=q.device)[:, None]
                      < torch.arange(tk, device=q.device)[None, :])
            scores = scores.masked_fill(future, float("-inf"))
        query_mask = None
        if mask is not None:
            m = mask[..., r0:r1, :].reshape(b, h, r1 - r0, tk)
            if m.dtype == torch.bool:
                visible = m
                scores = scores.masked_fill(~m, float("-inf"))
            else:
                visible = m != float("-inf")
                scores = scores + m.to(acc)
            if is_causal:
                visible = visible & ~future
            query_mask = visible.any(-1).all(1)  # [B, rows]: the row sees some key in every head
        chunk = head_stats(scores.softmax(-1), query_mask, backend=backend)
        total = chunk if total is None else total + chunk
    return total


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A bool "True = masked out" mask (torch.nn convention) as an additive float mask."""
    if mask is None or mask.dtype != torch.bool:
        return None if mask is None else mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))


# ---- torch.nn.MultiheadAttention ----------------------------------------------------------------

_MHA_ARGS = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask",
             "average_attn_weights", "is_causal")


def mha_head_stats(module: torch.nn.MultiheadAttention, args: tuple, kwargs: dict,
                   backend: str = "auto", chunk_bytes: int = CHUNK_BYTES) -> HeadStats:
    """The statistics `module(*args, **kwargs)` computes in its softmax, from Q and K re-projected."""
    call = dict(zip(_MHA_ARGS, args), **kwargs)
    query, key = call["query"].detach(), call["key"].detach()
    kpm, attn_mask, is_causal = call.get("key_padding_mask"), call.get("attn_mask"), call.get("is_causal", False)
    if query.dim() == 2:  # unbatched [T, E]
        query, key = query.unsqueeze(1), key.unsqueeze(1)
        kpm = None if kpm is None else kpm.unsqueeze(0)
    elif module.batch_first:
        query, key = query.transpose(0, 1), key.transpose(0, 1)
    tq, n, e = query.shape
    heads, hd = module.num_heads, module.head_dim
    if module._qkv_same_embed_dim:
        wq, wk = module.in_proj_weight[:e], module.in_proj_weight[e:2 * e]
    else:
        wq, wk = module.q_proj_weight, module.k_proj_weight
    bias = module.in_proj_bias
    bq, bk = (None, None) if bias is None else (bias[:e], bias[e:2 * e])
    q = F.linear(query, wq.detach(), None if bq is None else bq.detach())
    k = F.linear(key, wk.detach(), None if bk is None else bk.detach())
    extra = 0
    if module.bias_k is not None:
        k = torch.cat([k, module.bias_k.detach().expand(1, n, e)])
        extra += 1
    q = q.reshape(tq, n, heads, hd).permute(1, 2, 0, 3)       # [N, H, Tq, hd]
    k = k.reshape(-1, n, heads, hd).permute(1, 2, 0, 3)       # [N, H, Tk, hd]
    if module.add_zero_attn:
        k = torch.cat([k, k.new_zeros(n, heads, 1, hd)], dim=2)
        extra += 1
    tk = k.shape[2]
    mask = _additive(attn_mask, q.dtype)
    if mask is None and is_causal:  # torch itself refuses this; keep the meaning of the hint
        mask = _additive(torch.ones(tq, tk - extra, dtype=torch.bool, device=q.device).triu(1), q.dtype)
    if mask is not None:
        mask = mask.reshape(n, heads, tq, -1) if mask.dim() == 3 else mask.reshape(1, 1, tq, -1)
    kpm = _additive(kpm, q.dtype)
    if kpm is not None:
        kpm = kpm.reshape(n, 1, 1, -1)
        mask = kpm if mask is None else mask + kpm
    if mask is not None and extra:
        mask = F.pad(mask, (0, extra))
    return qk_head_stats(q, k, mask, backend=backend, chunk_bytes=chunk_bytes)


# ---- patched functions: F.scaled_dot_product_attention and HF eager attention ------------------

class _Patch:
    """Replace ``owner.<name>`` by ``make(original)`` while at least one monitor needs it."""

    def __init__(self, owner, name: str, make):
        self.owner, self.name, self.make = owner, name, make
        self.users: list = []   # monitors; the wrappers read this list
        self.original = None

    def add(self, monitor) -> None:
        if not self.users:
            self.original = getattr(self.owner, self.name)
            setattr(self.owner, self.name, self.make(self.original, self.users))
        self.users.append(monitor)

    def remove(self, monitor) -> None:
        self.users.remove(monitor)
        if not self.users:
            setattr(self.owner, self.name, self.original)


def _make_sdpa(original, users):
    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                     is_causal=False, scale=None, enable_gqa=False):
        out = original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                       is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        for monitor in users:
            if monitor._measuring:
                monitor._on_qk(query, key, attn_mask, is_causal, scale)
        return out

    scaled_dot_product_attention.__doc__ = original.__doc__
    scaled_dot_product_attention.__wrapped__ = original
    return scaled_dot_product_attention


def _make_hf_eager(original, users):
    def eager_attention_forward(module, query, key, value, attention_mask, *args, **kwargs):
        out = original(module, query, key, value, attention_mask, *args, **kwargs)
        scaling = kwargs.get("scaling", args[0] if args else None)
        for monitor in users:
            if monitor._measuring:
                mask = None if attention_mask is None else attention_mask[..., :key.shape[-2]]
                monitor._on_qk(query, key, mask, False, scaling)
        return out

    eager_attention_forward.__wrapped__ = original
    return eager_attention_forward


SDPA_PATCH = _Patch(F, "scaled_dot_product_attention", _make_sdpa)
_HF_PATCHES: dict[str, _Patch] = {}


def hf_eager_patch(module_name: str) -> _Patch | None:
    """The patch for ``eager_attention_forward`` of a transformers modeling file, if it has one."""
    namespace = sys.modules.get(module_name)
    if namespace is None or not callable(getattr(namespace, "eager_attention_forward", None)):
        return None
    if module_name not in _HF_PATCHES:
        _HF_PATCHES[module_name] = _Patch(namespace, "eager_attention_forward", _make_hf_eager)
    return _HF_PATCHES[module_name]


# ---- detection --------------------------------------------------------------------------------

def is_zoo(module) -> bool:
    return bool(getattr(type(module), "records_head_stats", False))


def is_mha(module) -> bool:
    return isinstance(module, torch.nn.MultiheadAttention)


def is_hf_attention(module) -> bool:
    cls = type(module)
    return cls.__module__.startswith("transformers.") and cls.__name__.endswith("Attention")


def is_torch_builtin(module) -> bool:
    return type(module).__module__.startswith("torch.nn.modules")


_SOURCE_MENTIONS: dict[str, bool] = {}


def source_calls_sdpa(module) -> bool:
    """Whether the file defining the module's class mentions ``scaled_dot_product_attention``."""
    name = type(module).__module__
    if name not in _SOURCE_MENTIONS:
        try:
            text = inspect.getsource(sys.modules[name])
        except (KeyError, OSError, TypeError):
            text = ""
        _SOURCE_MENTIONS[name] = "scaled_dot_product_attention" in text
    return _SOURCE_MENTIONS[name]
