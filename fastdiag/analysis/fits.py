"""The critical weight decay and the divergence above it (docs/experiments.md):

* ``fit_lambda_c``   critical weight decay: logistic fit of the per-λ grokking fraction.
* ``fit_nu``         exponent of the divergence t_grok ∝ (λ − λ_c)^(−ν) above λ_c.
"""
from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy import optimize, special

from fastdiag.analysis.bootstrap import (FitError, as_bool_array, as_float_array, check_n_boot, percentile_ci,
                                         require_enough_resamples, require_same_length, make_rng)
from fastdiag.grokking.config import N_BOOT


# Starting point for the logistic fit (docs/experiments.md, "Setup"): (log10 λ_c, k).
LOGISTIC_START = (math.log10(0.05), 5.0)

# A fitted logistic is "inside the data" if at least one distinct λ sits where the curve
# is strictly between these levels; otherwise the data are perfectly separated and only
# say "the step is somewhere in this gap", so λ_c is not determined.
TRANSITION_LEVELS = (0.01, 0.99)


@dataclass(frozen=True)
class LambdaCFit:
    lambda_c: float
    k: float                                   # slope per decade of λ
    ci: tuple[float, float]                    # 95 % bootstrap CI of lambda_c
    bins: list[tuple[float, int, float]]       # (λ, runs, fraction grokked), λ ascending
    n_boot_ok: int
    n_runs: int                                # runs used (after any λ = 0 drop)
    n_dropped_zero: int = 0


@dataclass(frozen=True)
class NuFit:
    nu: float
    amplitude: float
    ci: tuple[float, float]                    # 95 % bootstrap CI of nu
    n: int                                     # grokked runs with λ > λ_c used in the fit
    n_boot_ok: int
    joint: bool                                # True: λ_c refitted in every resample
    lambda_c: float                            # the λ_c the point estimate used


def logistic(log_lambda, log_lambda_c, k):
    # expit is the overflow-safe 1/(1+exp(−z)).
    return special.expit(k * (log_lambda - log_lambda_c))


def _grokking_bins(lambdas: np.ndarray, grokked: np.ndarray):
    """Distinct λ (ascending), runs per λ, fraction grokked per λ."""
    distinct, codes = np.unique(lambdas, return_inverse=True)
    counts = np.bincount(codes, minlength=len(distinct))
    fractions = np.bincount(codes, weights=grokked, minlength=len(distinct)) / counts
    return distinct, counts, fractions


def _check_lambda_c_data(distinct: np.ndarray, n_grokked: int, n_runs: int) -> None:
    if len(distinct) < 3 or n_grokked == 0 or n_grokked == n_runs:
        raise FitError(
            "lambda_c: need at least 3 distinct weight decays with both grokked and "
            f"non-grokked runs overall, got {len(distinct)} distinct weight decays and "
            f"{n_grokked} of {n_runs} runs grokked"
        )


def _fit_logistic_to_bins(distinct: np.ndarray, fractions: np.ndarray) -> tuple[float, float]:
    """Least-squares logistic through the per-λ fractions → (log10 λ_c, k).

    Raises FitError if the optimiser fails, returns non-finite values, or the fitted step
    falls between two λ with no data inside the transition (perfect separation).
    """
    log_lambda = np.log10(distinct)
    try:
        with warnings.catch_warnings():
            # We never use the covariance, so its "could not be estimated" warning is noise;
            # likewise overflow inside the optimiser's trial steps.
            warnings.simplefilter("ignore", optimize.OptimizeWarning)
            warnings.simplefilter("ignore", RuntimeWarning)
            params, _ = optimize.curve_fit(logistic, log_lambda, fractions, p0=LOGISTIC_START, maxfev=5000)
    except (RuntimeError, ValueError) as err:
        raise FitError(f"lambda_c: the logistic fit did not converge ({err})") from None
    log_lambda_c, k = (float(p) for p in params)
    if not (math.isfinite(log_lambda_c) and math.isfinite(k)):
        raise FitError("lambda_c: the logistic fit returned non-finite parameters")
    fitted = logistic(log_lambda, log_lambda_c, k)
    low, high = TRANSITION_LEVELS
    if not ((fitted > low) & (fitted < high)).any():
        raise FitError(
            "lambda_c: the grokking fraction jumps between two neighbouring weight decays "
            "with no weight decay inside the transition, so λ_c is not determined; "
            "add weight decays in the gap"
        )
    return log_lambda_c, k


def lambda_c_point(lambdas: np.ndarray, grokked: np.ndarray) -> tuple[float, float]:
    """(log10 λ_c, k) from runs; the machinery shared by fit_lambda_c and joint fit_nu."""
    distinct, _, fractions = _grokking_bins(lambdas, grokked)
    _check_lambda_c_data(distinct, int(grokked.sum()), len(grokked))
    return _fit_logistic_to_bins(distinct, fractions)


def _drop_or_refuse_zero_lambdas(lambdas: np.ndarray, drop_zero: bool, name: str = "lambdas"):
    """Mask of runs to keep: λ must be > 0 for the log axis."""
    if (lambdas < 0).any():
        raise ValueError(f"{name}: weight decays must be >= 0, got {float(lambdas[lambdas < 0][0])!r}")
    is_zero = lambdas == 0
    if is_zero.any() and not drop_zero:
        raise ValueError(
            f"{name}: {int(is_zero.sum())} run(s) have weight decay 0, which cannot go on the "
            "log-λ axis of the logistic; drop them, or pass drop_zero=True"
        )
    return ~is_zero


def fit_lambda_c(
    lambdas: Sequence[float],
    grokked: Sequence[bool],
    n_boot: int = N_BOOT,
    seed: int = 0,
    *,
    drop_zero: bool = False,
) -> LambdaCFit:
    """Critical weight decay λ_c from which runs grokked (docs/experiments.md, "Setup").

    Per distinct λ the fraction of runs that grokked is fitted by least squares (each
    distinct λ weighs the same) with P(λ) = 1/(1 + exp(−k(log10 λ − log10 λ_c))),
    starting from (log10 0.05, 5).  The 95 % CI of λ_c is a percentile bootstrap over runs.

    λ = 0 runs cannot sit on the log axis: by default they are refused with a ValueError;
    with ``drop_zero=True`` they are left out and counted in ``n_dropped_zero``.
    """
    lambdas = as_float_array(lambdas, "lambdas")
    grokked = as_bool_array(grokked, "grokked")
    require_same_length(lambdas=lambdas, grokked=grokked)
    n_boot = check_n_boot(n_boot)
    rng = make_rng(seed)

    keep = _drop_or_refuse_zero_lambdas(lambdas, drop_zero)
    n_dropped_zero = int((~keep).sum())
    lambdas, grokked = lambdas[keep], grokked[keep]
    if len(lambdas) == 0:
        raise FitError("lambda_c: no runs left after dropping weight decay 0")

    distinct, counts, fractions = _grokking_bins(lambdas, grokked)
    _check_lambda_c_data(distinct, int(grokked.sum()), len(grokked))
    log_lambda_c, k = _fit_logistic_to_bins(distinct, fractions)

    # Bootstrap: resample runs, rebuild the bins from the resample, refit.
    n_runs = len(lambdas)
    _, codes = np.unique(lambdas, return_inverse=True)
    boot_log_lambda_c = []
    for _ in range(n_boot):
        idx = rng.integers(0, n_runs, size=n_runs)
        sample_counts = np.bincount(codes[idx], minlength=len(distinct))
        sample_grokked = np.bincount(codes[idx], weights=grokked[idx], minlength=len(distinct))
        present = sample_counts > 0
        n_grokked = int(sample_grokked.sum())
        if present.sum() < 3 or n_grokked in (0, n_runs):
            continue                           # degenerate resample: counted out
        try:
            boot_log_lambda_c.append(
                _fit_logistic_to_bins(distinct[present], sample_grokked[present] / sample_counts[present])[0]
            )
        except FitError:
            continue
    require_enough_resamples("lambda_c", len(boot_log_lambda_c), n_boot)
    # Percentiles commute with the monotone 10**x, so the CI is taken on the log scale.
    low, high = percentile_ci(np.asarray(boot_log_lambda_c))

    return LambdaCFit(
        lambda_c=10.0 ** log_lambda_c,
        k=k,
        ci=(10.0 ** low, 10.0 ** high),
        bins=[(float(lam), int(n), float(f)) for lam, n, f in zip(distinct, counts, fractions)],
        n_boot_ok=len(boot_log_lambda_c),
        n_runs=n_runs,
        n_dropped_zero=n_dropped_zero,
    )


def _ols_power_law(distance: np.ndarray, t_grok: np.ndarray) -> tuple[float, float] | None:
    """(ν, amplitude) from log t = log A − ν log(λ − λ_c); None if under-determined."""
    if len(distance) < 3 or len(np.unique(distance)) < 2:
        return None
    x, y = np.log(distance), np.log(t_grok)
    x_centred = x - x.mean()
    slope = float(np.dot(x_centred, y - y.mean()) / np.dot(x_centred, x_centred))
    intercept = float(y.mean() - slope * x.mean())
    return -slope, math.exp(intercept)


def fit_nu(
    lambdas: Sequence[float],
    t_grok: Sequence[float | None],
    lambda_c: float,
    n_boot: int = N_BOOT,
    seed: int = 0,
    joint: bool = False,
    grokked: Sequence[bool] | None = None,
) -> NuFit:
    """Exponent ν of t_grok = amplitude · (λ − λ_c)^(−ν) (docs/experiments.md, "Setup").

    Ordinary least squares of log t_grok on log(λ − λ_c) over grokked runs (t_grok finite;
    NaN/None marks a run that did not grok) with λ > λ_c; slope = −ν.  λ_c is held fixed
    for the point estimate.  The CI is a percentile bootstrap over all runs (the same
    resampled indices in both modes, so the two CIs differ only by λ_c's refit).

    ``joint=True``: each resample also refits λ_c from the grokked flags (``grokked``
    required, one per run, agreeing with which t_grok are finite) with fit_lambda_c's
    point-estimate machinery, so the CI carries λ_c's uncertainty.  λ = 0 runs are left
    out of that refit (they cannot go on its log axis; they never count for ν anyway).
    """
    lambdas = as_float_array(lambdas, "lambdas")
    t_grok = as_float_array(t_grok, "t_grok", allow_nan=True)
    require_same_length(lambdas=lambdas, t_grok=t_grok)
    if (lambdas < 0).any():
        raise ValueError(f"lambdas: weight decays must be >= 0, got {float(lambdas[lambdas < 0][0])!r}")
    is_number = isinstance(lambda_c, numbers.Real) and not isinstance(lambda_c, bool)
    if not (is_number and math.isfinite(lambda_c) and lambda_c >= 0):
        raise ValueError(f"lambda_c: expected a finite number >= 0, got {lambda_c!r}")
    did_grok = np.isfinite(t_grok)
    non_positive = did_grok & (t_grok <= 0)
    if non_positive.any():
        raise ValueError(f"t_grok: grokking times must be > 0 (log scale), got {float(t_grok[non_positive][0])!r}")
    if not isinstance(joint, bool):
        raise TypeError(f"joint: expected a bool, got {type(joint).__name__}")
    if grokked is not None:
        grokked = as_bool_array(grokked, "grokked")
        require_same_length(lambdas=lambdas, grokked=grokked)
        if (grokked != did_grok).any():
            i = int(np.flatnonzero(grokked != did_grok)[0])
            raise ValueError(
                f"grokked: disagrees with t_grok at index {i} (grokked={bool(grokked[i])}, "
                f"t_grok={float(t_grok[i])!r}); a run grokked iff its t_grok is finite"
            )
    elif joint:
        raise ValueError("grokked: required when joint=True (λ_c is refitted from all runs' grokked flags)")
    n_boot = check_n_boot(n_boot)
    rng = make_rng(seed)

    usable = did_grok & (lambdas > lambda_c)
    point = _ols_power_law(lambdas[usable] - lambda_c, t_grok[usable])
    if point is None:
        raise FitError(
            "nu: need at least 3 grokked runs with λ > λ_c spanning at least 2 distinct "
            f"λ − λ_c values, got {int(usable.sum())} runs at "
            f"{len(np.unique(lambdas[usable]))} distinct λ (λ_c = {lambda_c:g})"
        )
    nu, amplitude = point

    n_runs = len(lambdas)
    positive = lambdas > 0
    boot_nu = []
    for _ in range(n_boot):
        idx = rng.integers(0, n_runs, size=n_runs)
        lam, t = lambdas[idx], t_grok[idx]
        lambda_c_sample = lambda_c
        if joint:
            on_log_axis = positive[idx]
            try:
                lambda_c_sample = 10.0 ** lambda_c_point(lam[on_log_axis], did_grok[idx][on_log_axis])[0]
            except FitError:
                continue                       # λ_c not determined in this resample
        ok = did_grok[idx] & (lam > lambda_c_sample)
        sample = _ols_power_law(lam[ok] - lambda_c_sample, t[ok])
        if sample is not None:
            boot_nu.append(sample[0])
    require_enough_resamples("nu", len(boot_nu), n_boot)

    return NuFit(
        nu=nu,
        amplitude=amplitude,
        ci=percentile_ci(np.asarray(boot_nu)),
        n=int(usable.sum()),
        n_boot_ok=len(boot_nu),
        joint=joint,
        lambda_c=float(lambda_c),
    )
