"""The settings of the causal interventions (fastdiag/grokking/interventions.py, whose docstring says what
each does): torch-free, so that `fastdiag intervene --help`, whose options are these fields, loads no torch."""
from __future__ import annotations

import dataclasses

CLIP_SCOPES = ("all-2d", "attention")
# The Phase-2 peak is confirmed after this many epochs without a new σ_H maximum (see interventions.py's
# docstring: set from the paper's Fig. 2, a peak near epoch 1,300 falling over the next ~1,700).
PEAK_PATIENCE_EPOCHS = 500
REINIT_INITS = ("default",)


@dataclasses.dataclass(frozen=True)
class InterventionSettings:
    heads_to_reinit: int = 2                 # per attention layer
    reinit_heads: tuple = ()                 # explicit ((layer index, head), ...); overrides the draw
    reinit_init: str = "default"
    reinit_seed_offset: int = 10_000         # fresh model seeded with seed + offset
    clip: str = "all-2d"
    after_peak_epochs: int = 500
    peak_patience_epochs: int = PEAK_PATIENCE_EPOCHS   # epochs without a new σ_H maximum
    peak_patience: int | None = None         # evaluations without a new maximum, instead of epochs
    max_epochs: int = 5000                   # search horizon for grokking + the peak

    def validate(self) -> "InterventionSettings":
        if self.heads_to_reinit < 1 and not self.reinit_heads:
            raise ValueError(f"heads_to_reinit: must be >= 1, got {self.heads_to_reinit}")
        if self.reinit_init not in REINIT_INITS:
            raise ValueError(f"reinit_init: expected one of {', '.join(REINIT_INITS)}, got {self.reinit_init!r}")
        if self.clip not in CLIP_SCOPES:
            raise ValueError(f"clip: expected one of {', '.join(CLIP_SCOPES)}, got {self.clip!r}")
        if self.after_peak_epochs < 1:
            raise ValueError(f"after_peak_epochs: must be >= 1, got {self.after_peak_epochs}")
        if self.peak_patience is not None and self.peak_patience < 1:
            raise ValueError(f"peak_patience: must be >= 1, got {self.peak_patience}")
        if self.peak_patience_epochs < 1:
            raise ValueError(f"peak_patience_epochs: must be >= 1, got {self.peak_patience_epochs}")
        if self.max_epochs < 1:
            raise ValueError(f"max_epochs: must be >= 1, got {self.max_epochs}")
        return self

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["reinit_heads"] = [list(x) for x in self.reinit_heads]
        return d


def parse_heads(spec: str | None) -> tuple:
    """``"0:1,2:3"`` → ((0, 1), (2, 3)): (layer index, head index) pairs."""
    if spec is None or not str(spec).strip():
        return ()
    out = []
    for item in str(spec).split(","):
        parts = item.strip().split(":")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"reinit_heads: expected LAYER:HEAD pairs like 0:1,1:3, got {item.strip()!r}")
        out.append((int(parts[0]), int(parts[1])))
    return tuple(dict.fromkeys(out))
