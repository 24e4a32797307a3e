"""An LSTM baseline for the grokking task (docs/experiments.md: 4 layers, hidden 512).

Tokens are embedded (``d_embed``), run through a stacked ``nn.LSTM`` and the last position's
hidden state is read out linearly. Output: logits ``[B, vocab]`` for the last position
(``all_positions=True`` gives ``[B, T, vocab]``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass(frozen=True)
class LSTMConfig:
    vocab_size: int = 98
    seq_len: int = 3
    n_layers: int = 4
    hidden: int = 512
    d_embed: int = 128

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layers", "hidden", "d_embed"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"lstm: {name} must be a positive integer, got {value!r}")


class LSTM(nn.Module):
    def __init__(self, cfg: LSTMConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_embed)
        self.lstm = nn.LSTM(cfg.d_embed, cfg.hidden, num_layers=cfg.n_layers, batch_first=True)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size)

    def forward(self, idx: torch.Tensor, all_positions: bool = False) -> torch.Tensor:
        h, _ = self.lstm(self.tok_emb(idx))   # [B, T, hidden]
        return self.head(h) if all_positions else self.head(h[:, -1])
