"""fastdiag: cheap, exact, online diagnostics of attention heads.

    stats = fastdiag.head_stats(probs)          # probs [B, H, Tq, Tk] -> HeadStats
    stats.sync(), stats.entropy_spread()         # s̄ and σ_H of the layer
    monitor = fastdiag.attach(model)             # the same, inside an existing training loop
"""
from fastdiag.diagnostics import head_stats
from fastdiag.monitor import Monitor, attach
from fastdiag.stats import HeadStats, Summary, summarize

__version__ = "0.1.0"

__all__ = ["HeadStats", "Monitor", "Summary", "attach", "head_stats", "summarize", "__version__"]

