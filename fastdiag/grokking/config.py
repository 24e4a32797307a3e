"""Configuration of one training run and the experiments' vocabulary (torch-free).

A run is identified by its full configuration (``RunConfig.run_id``); the task, the model zoo and the
grokking definitions are described in docs/experiments.md. Everything that names an architecture,
an operation, a regime or an intervention arm takes the name from here.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass

FLOAT32_MAX = 3.4028234663852886e38   # the parameters' dtype: optimiser steps must stay below it

# Test (train) accuracy at which a run counts as grokked (memorised): the paper's summaries do not
# state its threshold; 0.99 is the field's usual one. Runs may set their own (RunConfig.grok_threshold).
GROK_THRESHOLD = 0.99
# bootstrap resamples of every fit (analyze, plot, headdim): the percentile CIs' default
N_BOOT = 1500
ARCHS = ("transformer", "mlp", "lstm", "mamba")
OPS = ("+", "-", "*", "/")

# How a run ended: grokked (test accuracy reached the threshold), grokked then lost it for good,
# memorised only, never fit the training set with identical heads (collapse) or without (no-fit), stopped
# before it could fit (too-short), or a non-finite loss or weight norm. The rules and their thresholds:
# fastdiag/grokking/labels.py.
REGIMES = ("grok", "memorization", "collapse", "no-fit", "too-short", "anti-grok", "diverged")
GROKKED = ("grok", "anti-grok")          # reached t_grok within the horizon

# The causal interventions at the Phase-2 peak: the arms, and the per-arm metrics (the tested ones
# compared with the control by paired tests; every metric is listed in grokking/interventions.py).
ARMS = ("control", "reinit", "clip")

# Where a sweep's runs execute (fastdiag.sweep.run_sweep): local worker processes or a Ray cluster.
SWEEP_BACKENDS = ("local", "ray")

# RunConfig fields that say where and how a run executes, not what it computes: not part of run_id.
EXECUTION_FIELDS = ("device", "graphed")
# RunConfig fields newer than some stores: a stored config without them takes their defaults.
ADDED_LATER = ("graphed",)
TESTED_METRICS = ("peak_sigma_h_after", "final_test_acc")


@dataclass(frozen=True)
class RunConfig:
    arch: str = "transformer"
    preset: str = "canonical"          # transformer: canonical | 19m | 85m | custom
    n_layers: int | None = None        # None: take it from the preset / the architecture's default
    n_heads: int | None = None
    d_model: int | None = None
    d_ff: int | None = None
    op: str = "+"
    p: int = 97
    weight_decay: float = 1.0
    lr: float = 1e-3
    batch_size: int = 512
    epochs: int = 1000                 # horizon, in epochs
    seed: int = 42
    train_frac: float = 0.5
    eval_every: int = 1                # epochs
    diag_every: int = 10               # steps
    grok_threshold: float = GROK_THRESHOLD
    stop_at_grok: bool = True
    patience: int = 0                  # epochs to keep training after grokking when stop_at_grok
    device: str = "auto"
    graphed: bool = True               # CUDA: each training step one replayed CUDA graph (CPU: no effect)

    def validate(self) -> "RunConfig":
        if self.arch not in ARCHS:
            raise ValueError(f"arch: unknown architecture {self.arch!r}; expected one of {', '.join(ARCHS)}")
        if self.op not in OPS:
            raise ValueError(f"op: unknown operation {self.op!r}; expected one of {' '.join(OPS)}")
        if self.p < 2:
            raise ValueError(f"p: modulus must be >= 2, got {self.p}")
        if not 0 <= self.weight_decay < math.inf:
            raise ValueError(f"weight_decay: must be a finite number >= 0, got {self.weight_decay}")
        if not 0 < self.lr < math.inf:
            raise ValueError(f"lr: must be a finite number > 0, got {self.lr}")
        if self.lr * (10 + self.weight_decay) >= FLOAT32_MAX:   # AdamW's first step is 10·lr, decay 1 − lr·λ
            raise ValueError(f"lr: {self.lr:g} (with weight decay {self.weight_decay:g}) makes AdamW's float32 step "
                             f"overflow; it must keep lr·(10 + λ) below {FLOAT32_MAX:.3g}")
        if not 0 < self.grok_threshold <= 1:     # an accuracy; NaN would never be reached
            raise ValueError(f"grok_threshold: must be an accuracy in (0, 1], got {self.grok_threshold}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {self.batch_size}")
        if self.epochs < 1:
            raise ValueError(f"epochs: must be >= 1, got {self.epochs}")
        if not -2**63 <= self.seed < 2**63:      # what torch.manual_seed takes (not an overflow message later)
            raise ValueError(f"seed: must fit in 64 bits (|seed| < 2^63), got {self.seed}")
        if not 0.0 < self.train_frac < 1.0:
            raise ValueError(f"train_frac: must be in (0, 1), got {self.train_frac}")
        if self.eval_every < 1 or self.diag_every < 1:
            raise ValueError("eval_every and diag_every: must be >= 1")
        if self.patience < 0:
            raise ValueError(f"patience: must be >= 0, got {self.patience}")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def check_stored(cls, config) -> None:
        """Raise ValueError saying why ``config`` (read back from a store) is not a valid
        ``to_dict()``: not an object, a key missing or unknown, a value of the wrong type or invalid."""
        if not isinstance(config, dict):
            raise ValueError(f"a JSON {type(config).__name__}, not an object")
        types = _field_types()
        missing = sorted(set(types) - set(config) - set(ADDED_LATER))
        if missing:
            raise ValueError(f"missing key(s) {', '.join(missing)}")
        for key, value in config.items():
            allowed = types.get(key)
            if allowed is None:
                raise ValueError(f"unknown key {key!r}")
            if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
                raise ValueError(f"{key} is {value!r}, expected {' or '.join(t.__name__ for t in allowed)}")
        cls.from_dict(config).validate()

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"config: unknown keys {sorted(unknown)}")
        return cls(**d)

    def run_id(self) -> str:
        """Stable identity of the run: a hash of the full configuration (where and how it executes,
        `EXECUTION_FIELDS`, excluded)."""
        d = self.to_dict()
        for name in EXECUTION_FIELDS:
            d.pop(name)
        blob = json.dumps(d, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _field_types() -> dict[str, tuple[type, ...]]:
    """RunConfig field → the JSON types its value may have (read from the defaults)."""
    types = {}
    for f in dataclasses.fields(RunConfig):
        default = f.default
        if default is None:
            types[f.name] = (int, type(None))
        elif isinstance(default, bool):
            types[f.name] = (bool,)
        elif isinstance(default, float):
            types[f.name] = (int, float)
        else:
            types[f.name] = (type(default),)
    return types


def fmt_or_dash(value: float | None, spec: str = ".4f") -> str:
    """A number as the project writes it in tables and progress lines: ``format(value, spec)``, or
    "–" where there is no value (a run that never grokked has no t_grok)."""
    return "–" if value is None else format(value, spec)


# ---------------------------------------------------------------------------- checkpoint cadence
# How often a run saves its checkpoint (fastdiag/grokking/checkpoint.py); here, torch-free, so that the
# commands' --checkpoint-every option and its parsing load no torch.
CHECKPOINT_EVERY_S = 300.0      # default cadence: at most 5 minutes of a run are lost to a kill


def parse_cadence(text: str) -> tuple[float | None, int | None] | None:
    """``--checkpoint-every``: '500' → every 500 epochs, '5m' / '90s' → by wall time, 'off' → None
    (no checkpoints). Returns (every_s, every_epochs); raises ValueError naming checkpoint_every."""
    spec = str(text).strip().lower()
    if spec == "off":
        return None
    try:
        if spec.endswith(("m", "s")):
            seconds = float(spec[:-1]) * (60 if spec.endswith("m") else 1)
            if not 0 <= seconds < float("inf"):
                raise ValueError
            return seconds, None
        epochs = int(spec)
        if epochs < 1:
            raise ValueError
        return None, epochs
    except ValueError:
        raise ValueError(f"checkpoint_every: expected a number of epochs >= 1 ('500'), a time ('5m', '90s') "
                         f"or 'off', got {text!r}") from None
