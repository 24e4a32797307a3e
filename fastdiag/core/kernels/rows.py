"""Which keys are masked and which query rows count: the one rule every path reads (attach's softmax,
SDPA and MultiheadAttention adapters, `fastdiag.qk`, and the float64 references). docs/attach.md,
"Padding", states it for users.

**A key is masked** where a bool mask is False (True = may attend), or where an additive mask value —
or, on a path that sees only the scores the mask was added into (a softmax the model takes), the
score — is −inf or at most `MASKED_AT`. Padding is what the masks say (and `Monitor.set_padding`),
never what a probability underflowed to: a sharp softmax gives exact zeros to real keys (float32 at a
logit gap of about 104, float16 at about 17), and a real key is not padding.

`MASKED_AT` (−1000) sits far below any real logit and above every fill masks use (−1e4: BERT's classic
mask, MarkupLM; Funnel −1e6, tutorials −1e9, XLNet −1e30 or −65500 in float16, Hugging Face
``finfo(dtype).min``, −inf), with room on both sides: a score is the mask plus ``q·k``, so a key masked
with −1e4 stays below it while its logit is under 9000, and a −1e4 fill applied before the usual
``1/√d`` scale (−1e4/√64 = −1250) still reads as masked for head sizes up to 100. On the softmax path
(scores only) the rule misreads one case: a real key whose score is at most −1000 in every row (a token
whose q·k is hugely negative everywhere), or a real row whose every score is that low — softmax is
shift-invariant, so either is ordinary attention — reads as masked, and its row is left out with no
word (found 2026-12-06: a key at −1388…−1516 in every row, 5 of 6 rows counted, σ_l 20 % off). Only a
key hidden from every row, or a row that sees no key, changes which rows count; a key below −1000 beside
a row's top score above it is 0 in float32 anyway. Telling them apart needs the mask tensor itself, which
the SDPA and MultiheadAttention paths read; where the deciding scores are finite and above
`AMBIGUOUS_ABOVE` (−5000: every fill in use but a −1e4 one scaled by 1/√d lies below it) the layer is
named (`decided_by_low_scores`), so the misreading is never silent there (docs/attach.md, "Padding").

**A query row counts** when it sees a key (one not masked) in every head, and, in self-attention
(queries and keys from the same input), when its own position is not padding: padding is a key no
query row of its sequence may see, in any head (`real_positions`). A mask that lets a position be seen
by its own row only (XLNet's padding: each padded query attends to itself) cannot be told from a real
token: `seen_only_by_itself` flags it, and attach names the layer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# A score or additive-mask value at or below this masks its key (-inf included); see the module docstring.
MASKED_AT = -1000.0
# Scores in (AMBIGUOUS_ABOVE, MASKED_AT] read as masked but may be real logits (`decided_by_low_scores`).
AMBIGUOUS_ABOVE = -5000.0


def visible(mask: torch.Tensor) -> torch.Tensor:
    """Bool, same shape: which keys a bool mask (True = may attend), an additive mask or a score tensor
    leaves visible. NaN stays visible: it must show up as NaN in the statistics."""
    if mask.dtype == torch.bool:
        return mask
    return ~(mask <= MASKED_AT)


def masked(mask: torch.Tensor) -> torch.Tensor:
    """Bool, same shape: True where `visible` is False (one comparison, not a negated negation: on the
    softmax path it runs over every score of a measured layer)."""
    if mask.dtype == torch.bool:
        return ~mask
    return mask <= MASKED_AT


def additive_mask(mask: torch.Tensor | None, dtype: torch.dtype, true_attends: bool) -> torch.Tensor | None:
    """A bool mask as an additive one in ``dtype``, 0 where a key may be attended and -inf where not
    (as F.scaled_dot_product_attention hands a bool mask to its fused ops). ``true_attends``: True
    marks keys that may be attended (SDPA's convention); False: keys masked out (torch.nn's
    ``key_padding_mask`` / MultiheadAttention's). Other masks pass through as they are."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    blocked = ~mask if true_attends else mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(blocked, float("-inf"))


def mask_as_4d(mask: torch.Tensor, lead: tuple, b: int) -> torch.Tensor:
    """A mask broadcastable to ``[*lead, H, Tq, Tk]`` as ``[B or 1, H or 1, Tq or 1, Tk or 1]``: its
    own trailing sizes are kept, and the batch dimensions are copied out only where the mask itself
    varies over them (a shared [Tq, Tk] mask under a 5-D q stays one [Tq, Tk] matrix)."""
    mask = mask.reshape((1,) * (len(lead) + 3 - mask.dim()) + tuple(mask.shape))
    own_lead, tail = tuple(mask.shape[:len(lead)]), tuple(mask.shape[len(lead):])
    if all(n == 1 for n in own_lead):
        return mask.reshape(1, *tail)
    return mask.expand(*lead, *tail).reshape(b, *tail)


def hidden_keys(mask: torch.Tensor, b: int, h: int, tq: int, tk: int) -> torch.Tensor:
    """Bool ``[B or 1, H or 1, Tq, Tk]``, True = masked, of a mask broadcastable to ``[B, H, Tq, Tk]``
    (a view where the mask broadcasts: nothing of size B·H·Tq·Tk is copied for a padding mask)."""
    four = mask_as_4d(mask.detach(), (b,), b)
    return masked(four).expand(*four.shape[:2], tq, tk)


def visible_keys(attn_mask: torch.Tensor | None, is_causal: bool, shape: tuple, device=None) -> torch.Tensor:
    """Bool ``[B, H, Tq, Tk]`` on ``device`` (default the mask's): which keys each query row of each
    head may attend to (``is_causal``: the top-left aligned causal mask too). Written out whole: the
    float64 references' view of the rule."""
    b, h, tq, tk = shape
    if device is None:
        device = attn_mask.device if attn_mask is not None else None
    seen = torch.ones(shape, dtype=torch.bool, device=device)
    if attn_mask is not None:
        seen = seen & visible(attn_mask)
    if is_causal:
        seen = seen & torch.ones(tq, tk, dtype=torch.bool, device=seen.device).tril()
    return seen


def valid_rows(mask4: torch.Tensor | None, is_causal: bool, shape: tuple,
               query_mask: torch.Tensor | None) -> torch.Tensor:
    """Bool ``[B, Tq]``: the row sees at least one key in every head, and query_mask keeps it.

    Works on the mask as given (``[B, 1, 1, Tk]`` padding masks stay that small): with
    ``is_causal``, a row sees a key iff the mask's first visible key is not in its future."""
    b, h, tq, tk = shape
    device = query_mask.device if mask4 is None else mask4.device
    ok = torch.ones(b, tq, dtype=torch.bool, device=device)
    if mask4 is not None:
        vis = visible(mask4)
        seen = vis.any(-1)                                              # [B?, H?, Tq?]
        if is_causal:
            first = vis.to(torch.uint8).argmax(-1)                       # first visible key
            seen = seen & (first <= torch.arange(tq, device=device))
        ok = seen.expand(b, h, tq).all(1)
    if query_mask is not None:
        ok = ok & query_mask
    return ok


def sees_a_key(hidden: torch.Tensor) -> torch.Tensor:
    """Bool ``[B, Tq]``: the rows that see an unmasked key in every head; ``hidden`` (True = masked)
    is ``[B, H, Tq, Tk]``, B and H possibly broadcast (size 1)."""
    return (~hidden).any(-1).all(1)


def real_positions(hidden: torch.Tensor) -> torch.Tensor:
    """Bool ``[B, T]`` for self-attention (Tq = Tk = T): False at a padding position, a key that no
    query row of its sequence may see in any head (its own query row is padding too)."""
    return ~hidden.all(-2).all(1)


def self_attention_rows(hidden: torch.Tensor) -> torch.Tensor:
    """Bool ``[B, T]``: the rows that count in self-attention, by the masks alone (`sees_a_key` and
    `real_positions`)."""
    return sees_a_key(hidden) & real_positions(hidden)


def decided_by_low_scores(scores: torch.Tensor, hidden: torch.Tensor, rows: torch.Tensor,
                          self_attention: bool) -> torch.Tensor:
    """Bool scalar (a device tensor, no sync): on a path that sees only the scores, some query row is left
    out only because of finite scores in (`AMBIGUOUS_ABOVE`, `MASKED_AT`] — where a −1e4 fill scaled by
    1/√d (−1250 at d 64) and a real logit that low (softmax is shift-invariant) give the same scores, so
    whether the row is padding cannot be told. ``hidden`` = `masked` of ``scores``, ``[B, H, Tq, Tk]``;
    ``rows`` the rows it lets count (`self_attention_rows` of it in self-attention, else `sees_a_key`)."""
    firm = hidden & ~(scores > AMBIGUOUS_ABOVE)
    return ((self_attention_rows(firm) if self_attention else sees_a_key(firm)) & ~rows).any()


def seen_only_by_itself(hidden: torch.Tensor) -> torch.Tensor:
    """Bool scalar for self-attention (``hidden`` True = masked, ``[B, H, T, T]``, B and H possibly
    broadcast): some sequence's mask is not causal (a row sees a later key) and lets a position's key
    be seen by its own row only, in every head — XLNet's padding, where each padded query still attends
    to itself, so `real_positions` cannot tell it from a real token — and is not the last key of a
    causal stretch (GIT's text after a bidirectional image prefix). A device tensor (no sync)."""
    seen = (~hidden).any(1)                                            # [B, T, T]: in some head
    t = seen.shape[-1]
    eye = torch.eye(t, dtype=torch.bool, device=seen.device)
    only_self = seen.diagonal(dim1=-2, dim2=-1) & ~(seen & ~eye).any(-2)   # [B, T] by key
    # The last key of causal attention is seen by its own row only too (GIT: a bidirectional image
    # prefix, then causal text). Padding is told from it by its neighbours: a later row sees keys but
    # not this one, or the key just before it is seen by an earlier row (bidirectional up to it).
    position = torch.arange(t, device=seen.device)
    last_row = torch.where(seen.any(-1), position, -1).amax(-1, keepdim=True)   # [B, 1]
    later = seen & torch.ones_like(eye).triu(1)                          # a row sees a later key
    seen_by_an_earlier_row = later.any(-2)                                # [B, T] by key
    before_is_bidirectional = F.pad(seen_by_an_earlier_row[..., :-1], (1, 0))
    padding_like = only_self & ((position < last_row) | before_is_bidirectional)
    return (padding_like.any(-1) & later.flatten(1).any(1)).any()
