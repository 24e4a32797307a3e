"""Intervals of a fraction k / n that stay honest at small n and at 0 or 1 (a normal-approximation
"binomial s.e." is zero there: 0 of 4 is not a certain 0)."""
from __future__ import annotations

import math

Z95 = 1.959963984540054


def wilson_interval(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of k successes in n trials (95 % by default): never of zero width for
    n ≥ 1, inside [0, 1]."""
    if n < 1 or not 0 <= k <= n:
        raise ValueError(f"k, n: expected 0 <= k <= n and n >= 1, got k = {k}, n = {n}")
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, min(p, centre - half)), min(1.0, max(p, centre + half))     # rounding never leaves p outside
