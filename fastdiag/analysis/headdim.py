"""Peak σ_H after grokking against the per-head dimension d/H, with the saturating fit
σ_max = c + a(1 − e^(−b·d/H)) and bootstrap CIs."""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np
from scipy import optimize

from fastdiag.analysis.bootstrap import (FitError, as_float_array, check_n_boot, percentile_ci,
                                         require_enough_resamples, require_same_length, make_rng)
from fastdiag.analysis.results import JSONResult, optional
from fastdiag.analysis.trajectories import phase2_peak_sigma_h
from fastdiag.grokking.config import GROKKED, N_BOOT


@dataclass(frozen=True)
class SaturatingFit:
    c: float
    a: float
    b: float
    ci: dict[str, tuple[float, float]]         # keys "c", "a", "b", "plateau"
    n: int
    n_boot_ok: int

    @property
    def plateau(self) -> float:
        """The saturation level c + a, reached as x → ∞."""
        return self.c + self.a


def _saturating(x, c, a, b):
    return c + a * -np.expm1(-b * x)           # expm1: accurate when b·x is small


def _fit_saturating_once(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """Least-squares (c, a, b) with b > 0; several starting scales, best residual wins.

    The rate b is the hard parameter (its scale depends on the units of x), so we start
    from a few saturation lengths across the data range rather than trust one guess.
    """
    order = np.argsort(x)
    c0 = float(y[order[0]])
    a0 = float(y[order[-1]] - c0) or float(np.ptp(y)) or 1.0
    span = float(np.ptp(x))
    best, best_cost = None, np.inf
    for scale in (0.1, 0.3, 1.0, 3.0):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optimize.OptimizeWarning)
                warnings.simplefilter("ignore", RuntimeWarning)
                params, _ = optimize.curve_fit(
                    _saturating, x, y, p0=(c0, a0, 1.0 / (scale * span)),
                    bounds=([-np.inf, -np.inf, 0.0], [np.inf, np.inf, np.inf]), maxfev=5000,
                )
        except (RuntimeError, ValueError):
            continue
        if not np.isfinite(params).all():
            continue
        cost = float(np.sum((_saturating(x, *params) - y) ** 2))
        if cost < best_cost:
            best, best_cost = params, cost
    if best is None:
        raise FitError("saturating: the fit did not converge from any starting point")
    return tuple(float(p) for p in best)


def fit_saturating(x: Sequence[float], y: Sequence[float], n_boot: int = N_BOOT, seed: int = 0) -> SaturatingFit:
    """σ_max = c + a(1 − exp(−b·x)), b > 0, by least squares; CIs by bootstrap over points.

    Used for peak σ_H against per-head dimension d/H.  If the data never bend toward
    the plateau, a and b trade off against each other: the point estimate is still the
    least-squares one, and the (wide) bootstrap intervals show it.
    """
    x = as_float_array(x, "x")
    y = as_float_array(y, "y")
    require_same_length(x=x, y=y)
    n_boot = check_n_boot(n_boot)
    rng = make_rng(seed)
    n_distinct = len(np.unique(x))
    if len(x) < 4 or n_distinct < 3:
        raise FitError(
            "saturating: need at least 4 points at 3 or more distinct x for 3 parameters, "
            f"got {len(x)} points at {n_distinct} distinct x"
        )
    c, a, b = _fit_saturating_once(x, y)

    boot = []
    for _ in range(n_boot):
        idx = rng.integers(0, len(x), size=len(x))
        if len(np.unique(x[idx])) < 3:
            continue                           # 3 parameters need 3 distinct x
        try:
            boot.append(_fit_saturating_once(x[idx], y[idx]))
        except FitError:
            continue
    require_enough_resamples("saturating", len(boot), n_boot)
    boot = np.asarray(boot)
    ci = {
        "c": percentile_ci(boot[:, 0]),
        "a": percentile_ci(boot[:, 1]),
        "b": percentile_ci(boot[:, 2]),
        "plateau": percentile_ci(boot[:, 0] + boot[:, 1]),
    }
    return SaturatingFit(c=c, a=a, b=b, ci=ci, n=len(x), n_boot_ok=len(boot))


@dataclass(frozen=True)
class HeaddimPoint(JSONResult):
    """A grokked run: its width, heads, d/H and peak σ_H after grokking."""
    run_id: str
    d_model: int
    n_heads: int
    d_per_head: float
    seed: int | None
    peak_sigma_h: float


@dataclass(frozen=True)
class HeaddimBin(JSONResult):
    """The runs at one d/H: count, mean, median, sample std (None for one run), the (d, H) pairs."""
    d_per_head: float
    n: int
    mean: float
    median: float
    std: float | None
    configs: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class HeaddimFit(JSONResult):
    """The saturating fit σ_max = c + a(1 − exp(−b·d/H)) with 95 % bootstrap CIs, or ``error``."""
    error: str | None = optional()
    c: float | None = optional()
    a: float | None = optional()
    b: float | None = optional()
    plateau: float | None = optional()
    ci: dict[str, tuple[float, float]] | None = optional()    # keys "c", "a", "b", "plateau"
    n: int | None = optional()
    n_boot_ok: int | None = optional()
    n_boot: int | None = optional()


@dataclass(frozen=True)
class HeaddimAnalysis(JSONResult):
    """``headdim_analysis``: the points, the per-d/H summaries and the fit."""
    n_points: int
    n_skipped: int                      # did not grok, or no σ_H after t_grok
    n_single_head: int                  # σ_H of one head is 0 by definition: left out
    points: tuple[HeaddimPoint, ...]
    bins: tuple[HeaddimBin, ...]
    fit: HeaddimFit


HEADDIM_EXCLUDE = ("seed", "device", "n_heads", "d_model", "d_ff", "preset")


def headdim_sets(runs: Iterable[dict], heads_width: Callable[[dict], tuple[int, int] | None],
                 min_distinct: int = 3) -> list[tuple[dict, list[dict]]]:
    """Transformer runs that differ only in seed, width and heads, with at least ``min_distinct``
    distinct d/H: the per-head-dimension experiments in a store, as (shared config, runs).
    ``heads_width(config)`` gives a run's (d_model, n_heads), None if it has no attention heads
    (`fastdiag.grokking.build.heads_width`: the model zoo's presets live with the models)."""
    groups: dict[tuple, tuple[dict, list]] = {}
    for run in runs:
        cfg = run["config"]
        if heads_width(cfg) is None:
            continue
        shared = {k: v for k, v in cfg.items() if k not in HEADDIM_EXCLUDE}
        key = tuple(sorted((k, repr(v)) for k, v in shared.items()))
        groups.setdefault(key, (shared, []))[1].append(run)
    out = []
    for shared, members in groups.values():
        ratios = {d / h for d, h in (heads_width(r["config"]) for r in members)}
        if len(ratios) >= min_distinct:
            out.append((shared, members))
    return out


def headdim_analysis(runs: Sequence[dict], traces: dict[str, list[dict]],
                     heads_width: Callable[[dict], tuple[int, int] | None], n_boot: int = N_BOOT,
                     seed: int = 0) -> HeaddimAnalysis:
    """Phase-2 peak σ_H (``phase2_peak_sigma_h``) against d/H over grokked runs; per-d/H summaries and
    the saturating fit σ_max = c + a(1 − exp(−b·d/H)) with bootstrap CIs (``{"error": why}`` if it
    cannot be made)."""
    points = []
    skipped = single_head = 0
    for run in runs:
        dh = heads_width(run["config"])
        if dh is not None and dh[1] < 2:     # σ_H over one head is 0 by definition, not a measurement
            single_head += 1
            continue
        result = run.get("result") or {}
        peak = phase2_peak_sigma_h(traces.get(run["run_id"], []), result.get("t_grok_epoch")) \
            if result.get("regime") in GROKKED else None
        if dh is None or peak is None:
            skipped += 1
            continue
        d, h = dh
        points.append(HeaddimPoint(run["run_id"], d, h, d / h, run["config"].get("seed"), peak))
    by_x: dict[float, list[float]] = {}
    for p in points:
        by_x.setdefault(p.d_per_head, []).append(p.peak_sigma_h)
    bins = tuple(HeaddimBin(d_per_head=x, n=len(v), mean=float(np.mean(v)), median=float(np.median(v)),
                            std=float(np.std(v, ddof=1)) if len(v) > 1 else None,
                            configs=tuple(sorted({(p.d_model, p.n_heads) for p in points if p.d_per_head == x})))
                 for x, v in sorted(by_x.items()))
    try:
        sat = fit_saturating([p.d_per_head for p in points], [p.peak_sigma_h for p in points], n_boot=n_boot, seed=seed)
        fit = HeaddimFit(c=sat.c, a=sat.a, b=sat.b, plateau=sat.plateau, ci=dict(sat.ci), n=sat.n,
                         n_boot_ok=sat.n_boot_ok, n_boot=n_boot)
    except (FitError, ValueError) as exc:
        fit = HeaddimFit(error=str(exc))
    return HeaddimAnalysis(n_points=len(points), n_skipped=skipped, n_single_head=single_head, points=tuple(points),
                           bins=bins, fit=fit)
