"""The attributes a monitor sets on fastdiag's own attention modules (``records_head_stats``: they
compute their statistics from their own probabilities when ``record`` is set), shared by nested
monitors: each module's attributes as before any monitor are kept, and restored when the last
monitor holding it detaches."""
from __future__ import annotations

import weakref

import torch

ATTRIBUTES = ("record", "stats", "diag_backend")
# module → {"saved": its attributes before any monitor, "holders": monitor id → backend}
_SETTINGS: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def hold(module: torch.nn.Module, holder: int, backend: str) -> None:
    """Monitor ``holder`` measures ``module`` with ``backend``."""
    entry = _SETTINGS.get(module)
    if entry is None:
        entry = _SETTINGS[module] = {
            "saved": {a: getattr(module, a) for a in ATTRIBUTES if hasattr(module, a)}, "holders": {}}
    entry["holders"][holder] = backend
    if hasattr(module, "diag_backend"):
        module.diag_backend = backend


def release(modules, holder: int) -> None:
    """Monitor ``holder`` lets go of ``modules``: a monitor attached before it keeps its backend, the
    last one out restores the original attributes."""
    for module in modules:
        entry = _SETTINGS.get(module)
        if entry is None:
            continue
        entry["holders"].pop(holder, None)
        if entry["holders"]:
            if hasattr(module, "diag_backend"):
                module.diag_backend = list(entry["holders"].values())[-1]
            continue
        for attr, value in entry["saved"].items():
            setattr(module, attr, value)
        del _SETTINGS[module]
