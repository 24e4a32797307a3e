"""The regions of the regime diagram along λ, read from the runs: memorisation below λ_c,
developmental from λ_c, collapse from the first λ above every grokking λ where at least half of the
runs collapsed. The figure (`fastdiag.plots.sweep.regime_diagram`) only draws them."""
from __future__ import annotations

import math
from typing import Iterable

GROKKED_REGIMES = ("grok", "anti-grok")


def regime_counts(runs: Iterable[dict]) -> dict[float, dict[str, int]]:
    """λ → regime → number of finished runs, for λ > 0 (a log axis has no λ = 0)."""
    counts: dict[float, dict[str, int]] = {}
    for run in runs:
        lam, regime = float(run["config"]["weight_decay"]), run["result"].get("regime")
        if lam > 0 and regime is not None:
            counts.setdefault(lam, {}).setdefault(regime, 0)
            counts[lam][regime] += 1
    return counts


def collapse_edge(counts: dict[float, dict[str, int]]) -> float | None:
    """Where the collapse region begins: the geometric midpoint between the first λ above every
    grokking λ at which at least half of the runs collapsed and the largest λ below it (the top
    grokking λ at least); None without grokking runs or without such a λ."""
    grok_lams = [lam for lam, c in counts.items() if sum(c.get(r, 0) for r in GROKKED_REGIMES) > 0]
    if not grok_lams:
        return None
    top_grok = max(grok_lams)
    collapse_lams = [lam for lam, c in counts.items() if lam > top_grok and c.get("collapse", 0) * 2 >= sum(c.values())]
    if not collapse_lams:
        return None
    first = min(collapse_lams)
    return math.sqrt(max(lam for lam in counts if lam < first) * first)


def regime_regions(counts: dict[float, dict[str, int]], lambda_c: float | None, lo: float,
                   hi: float) -> list[tuple[str, float, float]]:
    """(name, λ from, λ to) of the non-empty regions within [lo, hi]."""
    edge = collapse_edge(counts)
    regions = []
    if lambda_c is not None and lo < lambda_c:
        regions.append(("memorization", lo, min(lambda_c, hi)))
    if lambda_c is not None:
        regions.append(("developmental", max(lambda_c, lo), edge or hi))
    if edge is not None:
        regions.append(("collapse", edge, hi))
    return [(name, x0, x1) for name, x0, x1 in regions if x1 > x0]
