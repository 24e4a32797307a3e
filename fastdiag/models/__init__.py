"""Models for the grokking experiments (docs/experiments.md), installed as ``fastdiag.models``.

``build(arch, **config)`` builds ``transformer``, ``mlp``, ``lstm`` or ``mamba`` from the fields
of that architecture's config dataclass (the transformer also takes ``preset=``, mamba ``device=``).
Every model maps token ids ``[B, T]`` (``[a, b, =]``, T = 3) to the logits of the last position,
``[B, vocab_size]``.
"""
from __future__ import annotations

import dataclasses

import torch.nn as nn

from .lstm import LSTM, LSTMConfig
from .mamba import (MambaConfig, MambaLM, SelectiveSSM, mamba_ssm_available, mamba_ssm_missing,
                    selective_scan_fn, selective_scan_members, selective_scan_ref)
from .mlp import MLP, MLPConfig
from .transformer import PRESETS, CausalSelfAttention, Transformer, TransformerConfig

__all__ = [
    "PRESETS", "build", "attention_modules",
    "count_parameters", "Transformer", "TransformerConfig", "CausalSelfAttention", "MLP", "MLPConfig",
    "LSTM", "LSTMConfig", "MambaLM", "MambaConfig", "SelectiveSSM", "selective_scan_fn", "selective_scan_ref",
    "mamba_ssm_available", "mamba_ssm_missing", "selective_scan_members",
]

# The builders of the architectures `fastdiag.grokking.config.ARCHS` names (the torch-free vocabulary,
# the one home of the list; tests/test_models.py checks that every name there builds here).
_CONFIGS = {"transformer": TransformerConfig, "mlp": MLPConfig, "lstm": LSTMConfig, "mamba": MambaConfig}


def build(arch: str, **config) -> nn.Module:
    """Build a model: ``build("transformer", preset="canonical", vocab_size=98)``, ``build("mlp", hidden=256)``."""
    if arch not in _CONFIGS:
        raise ValueError(f"arch: unknown architecture {arch!r}; expected one of {', '.join(_CONFIGS)}")
    device = config.pop("device", None) if arch == "mamba" else None
    if arch == "transformer":
        preset = config.pop("preset", "canonical")
        if preset not in PRESETS and preset != "custom":
            raise ValueError(f"preset: unknown transformer preset {preset!r}; expected one of "
                             f"{', '.join([*PRESETS, 'custom'])}")
        base = dict(PRESETS.get(preset, PRESETS["canonical"]))
        if "d_model" in config and "d_ff" not in config:
            base["d_ff"] = 4 * config["d_model"]
        config = {**base, **config}
    cls = _CONFIGS[arch]
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(config) - known)
    if unknown:
        raise TypeError(f"{arch}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    cfg = cls(**config)
    if arch == "transformer":
        return Transformer(cfg)
    if arch == "mlp":
        return MLP(cfg)
    if arch == "lstm":
        return LSTM(cfg)
    return MambaLM(cfg, device=device)


def attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Named submodules whose class sets ``records_head_stats = True``, in model order."""
    return {name: m for name, m in model.named_modules() if getattr(type(m), "records_head_stats", False)}


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once); works on the meta device."""
    return sum(p.numel() for p in model.parameters())
