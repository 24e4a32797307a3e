"""A small decoder-only transformer for the grokking task (docs/experiments.md), nanoGPT style.

Pre-LayerNorm blocks, causal self-attention, learned positions, GELU MLP, dropout 0, untied
input and output embeddings (the untied canonical model has 818,816 parameters with vocabulary 98,
0.1 % from the paper's 0.82 M; tied it would be 806,272, 1.7 % off).

The model maps token ids ``[B, T]`` to the logits of the LAST position only, ``[B, vocab]``
(the loss of the task is on the last position; ``forward(idx, all_positions=True)`` gives
``[B, T, vocab]``).

Online diagnostics: every ``CausalSelfAttention`` has ``record`` (default False). When it is True,
the forward computes the attention probabilities explicitly, stores their sufficient statistics
``fastdiag.head_stats(P)`` in ``self.stats`` and uses the same probabilities for its output, so
the diagnostic costs no extra forward pass. When it is False the layer calls
``F.scaled_dot_product_attention`` (looked up at call time, so a wrapper installed by
``fastdiag.attach`` is seen).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastdiag.core.diagnostics import head_stats

from .norm import LayerNorm

PRESETS: dict[str, dict[str, int]] = {
    "canonical": dict(n_layers=4, n_heads=8, d_model=128, d_ff=512),   # ≈ 0.82 M parameters
    "19m": dict(n_layers=6, n_heads=8, d_model=512, d_ff=2048),        # ≈ 19 M
    "85m": dict(n_layers=12, n_heads=12, d_model=768, d_ff=3072),      # ≈ 85 M
}


@dataclass(frozen=True)
class TransformerConfig:
    vocab_size: int = 98          # p + 1 (the "=" token is p)
    seq_len: int = 3              # [a, b, =]
    n_layers: int = 4
    n_heads: int = 8
    d_model: int = 128
    d_ff: int = 512
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layers", "n_heads", "d_model", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"transformer: {name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"transformer: d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")


def _head_stats(probs: torch.Tensor, backend: str):
    return head_stats(probs, backend=backend, causal=True)   # the zoo's attention is causal: skip the masked keys


class CausalSelfAttention(nn.Module):
    records_head_stats = True  # marks the modules fastdiag.models.attention_modules returns

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.record: bool = False
        self.stats = None
        self.diag_backend: str = "auto"

    def forward(self, x: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """``[B, T, C]`` -> ``[B, T, C]``; with ``last_only`` the output of the last position alone,
        ``[B, 1, C]`` (keys and values still from every position; recorded statistics of every row)."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        if self.record:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)   # [B, H, T, T]
            self.stats = _head_stats(probs.detach(), self.diag_backend)
            y = (probs[:, :, -1:] if last_only else probs) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            if last_only:
                y = y[:, :, -1:]
        return self.proj(y.transpose(1, 2).reshape(B, y.shape[2], C))


class MLP(nn.Module):
    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, d_ff)
        self.proj = nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.ln1 = LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.n_heads)
        self.ln2 = LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg.d_model, cfg.d_ff)

    def forward(self, x: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """``[B, T, C]`` -> ``[B, T, C]``, or ``[B, C]``, the last position's, with ``last_only``: the
        rows no later layer reads skip the output projection, the second norm and the MLP."""
        if last_only:
            x = x[:, -1] + self.attn(self.ln1(x), last_only=True)[:, 0]
        else:
            x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Transformer(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # PyTorch's default initialisation: the paper does not state its initialiser. It was picked over
        # nanoGPT's N(0, 0.02), which fits far more slowly, because the paper's runs grok fast; with it
        # the canonical run fits by epoch ~30 and groks at 130-160, later than the paper's published
        # runs (README, "Reproducing the paper"), so it is one of the candidate divergences listed there.
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight

    def forward(self, idx: torch.Tensor, all_positions: bool = False) -> torch.Tensor:
        B, T = idx.shape
        if T > self.config.seq_len:
            raise ValueError(f"transformer: sequence length {T} exceeds seq_len {self.config.seq_len}")
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device))
        # The loss reads the last position only: the last block computes that row alone past its attention
        # (a third of its work; ~12 % of the canonical model's), then the final norm and the head.
        last = len(self.blocks) - 1
        for i, block in enumerate(self.blocks):
            x = block(x, last_only=not all_positions and i == last)
        return self.head(self.ln_f(x))
