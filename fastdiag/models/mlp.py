"""An MLP baseline for the grokking task (docs/experiments.md: 4 layers, hidden 512).

The three tokens ``[a, b, =]`` are embedded (``d_embed`` each) and concatenated, then go through
``n_layers`` hidden layers ``Linear -> ReLU`` of width ``hidden`` and a linear read-out. Output:
logits ``[B, vocab]`` (the prediction for the last position; the model has no per-position output).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass(frozen=True)
class MLPConfig:
    vocab_size: int = 98
    seq_len: int = 3
    n_layers: int = 4
    hidden: int = 512
    d_embed: int = 128

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layers", "hidden", "d_embed"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"mlp: {name} must be a positive integer, got {value!r}")


class MLP(nn.Module):
    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_embed)
        layers: list[nn.Module] = []
        width = cfg.seq_len * cfg.d_embed
        for _ in range(cfg.n_layers):
            layers += [nn.Linear(width, cfg.hidden), nn.ReLU()]
            width = cfg.hidden
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, cfg.vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        if T != self.config.seq_len:
            raise ValueError(f"mlp: expected sequences of length {self.config.seq_len}, got {T}")
        return self.head(self.body(self.tok_emb(idx).reshape(B, -1)))
