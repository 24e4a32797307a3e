"""The settings the MLP and LSTM baselines share (docs/experiments.md: 4 layers, hidden 512), and the
positive-size check every model configuration makes."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class BaselineConfig:
    vocab_size: int = 98
    seq_len: int = 3
    n_layers: int = 4
    hidden: int = 512
    d_embed: int = 128

    model: ClassVar[str] = "baseline"       # the name errors give

    def __post_init__(self) -> None:
        require_positive_ints(self, self.model)


def require_positive_ints(config, model: str) -> None:
    """Every field of the dataclass ``config`` is a positive int (bools are not), or a ValueError that
    names ``model`` and the field."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{model}: {field.name} must be a positive integer, got {value!r}")
