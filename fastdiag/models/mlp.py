"""An MLP baseline for the grokking task (docs/experiments.md: 4 layers, hidden 512).

The three tokens ``[a, b, =]`` are embedded (``d_embed`` each) and concatenated, then go through
``n_layers`` hidden layers ``Linear -> ReLU`` of width ``hidden`` and a linear read-out. Output:
logits ``[B, vocab]`` (the prediction for the last position; the model has no per-position output).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn

from .baseline import BaselineConfig


@dataclass(frozen=True)
class MLPConfig(BaselineConfig):
    model: ClassVar[str] = "mlp"


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
