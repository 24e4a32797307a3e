"""An LSTM baseline for the grokking task (docs/experiments.md: 4 layers, hidden 512).

Tokens are embedded (``d_embed``), run through a stacked ``nn.LSTM`` and the last position's
hidden state is read out linearly. Output: logits ``[B, vocab]`` for the last position
(``all_positions=True`` gives ``[B, T, vocab]``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn

from .baseline import BaselineConfig


@dataclass(frozen=True)
class LSTMConfig(BaselineConfig):
    model: ClassVar[str] = "lstm"


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
