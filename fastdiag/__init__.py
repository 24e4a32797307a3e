"""fastdiag: cheap, exact, online diagnostics of attention heads.

    stats = fastdiag.head_stats(probs)          # probs [B, H, Tq, Tk] -> HeadStats
    stats.sync(), stats.entropy_spread()         # s̄ and σ_H of the layer
    monitor = fastdiag.attach(model)             # the same, inside an existing training loop
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# The public names load on first use (PEP 562): importing them here would load torch (~1-3 s) for
# every `fastdiag --help`, and the command line must set OMP_WAIT_POLICY before torch loads OpenMP.
_EXPORTS = {"head_stats": "fastdiag.core.diagnostics", "Monitor": "fastdiag.core.monitor", "attach": "fastdiag.core.monitor",
            "HeadStats": "fastdiag.core.stats", "Summary": "fastdiag.core.stats", "summarize": "fastdiag.core.stats"}

__all__ = ["HeadStats", "Monitor", "Summary", "attach", "head_stats", "summarize", "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fastdiag' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
