"""Statistics for the weight-decay (grokking) experiments: pure numpy/scipy, no torch.

What lives here (SPEC §5):

* ``fit_lambda_c``   critical weight decay: logistic fit of the per-λ grokking fraction.
* ``fit_nu``         exponent of the divergence t_grok ∝ (λ − λ_c)^(−ν) above λ_c.
* ``regime_table``, ``median_t_grok``   per-λ summaries for tables.
* ``fit_saturating`` σ_max = c + a(1 − exp(−b·x)), e.g. peak σ_H against d/H.
* ``paired_tests``, ``holm_bonferroni``   intervention experiments (paired seeds).
* ``bootstrap_auc``, ``bootstrap_mae``    does an attention readout predict anything?

Conventions:

* Every confidence interval is a 95 % percentile bootstrap over runs (the run is the
  experimental unit), drawn from a seeded ``numpy.random.Generator`` so results repeat.
* A resample whose fit fails, does not converge or is degenerate is *counted out*
  (see ``n_boot_ok``), never patched with a made-up value.  If fewer than half of the
  resamples survive, the survivors are a biased subset and their interval would look
  tighter than the truth, so the fit raises ``FitError`` instead of reporting it.
* Too little data for a fit raises ``FitError`` (a ``ValueError``) naming the fit and
  the reason; malformed input raises ``ValueError``/``TypeError`` naming the argument.
"""
from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy import optimize, special, stats

__all__ = [
    "FitError",
    "REGIMES",
    "LambdaCFit",
    "NuFit",
    "SaturatingFit",
    "PairedTests",
    "AUCResult",
    "MAEResult",
    "fit_lambda_c",
    "fit_nu",
    "regime_table",
    "median_t_grok",
    "fit_saturating",
    "paired_tests",
    "holm_bonferroni",
    "auc_mann_whitney",
    "roc_curve",
    "bootstrap_auc",
    "bootstrap_mae",
]

REGIMES = ("grok", "memorization", "collapse", "anti-grok", "diverged")

CI_LEVEL = 0.95
# Below this share of converged resamples the percentile interval is not trusted (see
# the module docstring).
MIN_CONVERGED_FRACTION = 0.5
# SPEC §5 starting point for the logistic fit: (log10 λ_c, k).
LOGISTIC_START = (math.log10(0.05), 5.0)
# A fitted logistic is "inside the data" if at least one distinct λ sits where the curve
# is strictly between these levels; otherwise the data are perfectly separated and only
# say "the step is somewhere in this gap", so λ_c is not determined.
TRANSITION_LEVELS = (0.01, 0.99)


class FitError(ValueError):
    """Too little (or too degenerate) data for the requested fit; the message says which and why."""


# --------------------------------------------------------------------------- results


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


@dataclass(frozen=True)
class PairedTests:
    mean_diff: float                           # mean of (treated − control)
    t_statistic: float
    t_pvalue: float
    wilcoxon_statistic: float
    wilcoxon_pvalue: float
    cohens_d: float                            # mean diff / std of diffs (ddof 1)
    n: int


@dataclass(frozen=True)
class AUCResult:
    auc: float
    ci: tuple[float, float]
    n_pos: int
    n_neg: int
    baseline_auc: float | None = None          # set when a baseline score was given
    diff: float | None = None                  # auc − baseline_auc
    diff_ci: tuple[float, float] | None = None


@dataclass(frozen=True)
class MAEResult:
    mae: float
    ci: tuple[float, float]
    n: int
    baseline_mae: float | None = None
    diff: float | None = None                  # mae − baseline_mae (negative: better)
    diff_ci: tuple[float, float] | None = None


# --------------------------------------------------------------------- input checking


def _as_float_array(values, name: str, *, allow_nan: bool = False) -> np.ndarray:
    """A non-empty 1-D float array; None entries become NaN when allow_nan."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise TypeError(f"{name}: expected a sequence of numbers, got {type(values).__name__}")
    if allow_nan:
        values = [np.nan if v is None else v for v in values]
    try:
        array = np.asarray(values, dtype=float)
    except (TypeError, ValueError) as err:
        raise TypeError(f"{name}: expected a sequence of numbers ({err})") from None
    if array.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence, got shape {array.shape}")
    if array.size == 0:
        raise ValueError(f"{name}: expected at least one value, got an empty sequence")
    bad = np.isinf(array) if allow_nan else ~np.isfinite(array)
    if bad.any():
        allowed = "finite numbers, or NaN/None" if allow_nan else "finite numbers"
        first = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{name}: expected {allowed}, got {float(array[first])!r} at index {first}")
    return array


def _as_bool_array(values, name: str) -> np.ndarray:
    """A 1-D bool array from bools or 0/1 numbers; anything else is refused."""
    array = _as_float_array(values, name)
    if not np.isin(array, (0.0, 1.0)).all():
        raise ValueError(f"{name}: expected booleans (or 0/1), got {float(array[~np.isin(array, (0.0, 1.0))][0])!r}")
    return array.astype(bool)


def _require_same_length(**arrays: np.ndarray) -> None:
    lengths = {name: len(a) for name, a in arrays.items()}
    if len(set(lengths.values())) > 1:
        described = ", ".join(f"{name} has {n}" for name, n in lengths.items())
        raise ValueError(f"length mismatch: {described}")


def _check_n_boot(n_boot) -> int:
    if isinstance(n_boot, bool) or not isinstance(n_boot, numbers.Integral) or n_boot < 1:
        raise ValueError(f"n_boot: expected a positive integer, got {n_boot!r}")
    return int(n_boot)


def _rng(seed) -> np.random.Generator:
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ValueError(f"seed: expected a non-negative integer, got {seed!r}")
    return np.random.default_rng(int(seed))


# ------------------------------------------------------------------ bootstrap helpers


def _percentile_ci(samples: np.ndarray, level: float = CI_LEVEL) -> tuple[float, float]:
    tail = 100.0 * (1.0 - level) / 2.0
    low, high = np.percentile(samples, [tail, 100.0 - tail])
    return float(low), float(high)


def _require_enough_resamples(fit: str, n_ok: int, n_boot: int) -> None:
    needed = max(2, math.ceil(MIN_CONVERGED_FRACTION * n_boot))
    if n_ok < needed:
        raise FitError(
            f"{fit}: only {n_ok} of {n_boot} bootstrap resamples gave a valid fit "
            f"(need at least {needed}); the data are too sparse for a confidence interval"
        )


# ------------------------------------------------------------------------- λ_c (§5)


def _logistic(log_lambda, log_lambda_c, k):
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
            params, _ = optimize.curve_fit(_logistic, log_lambda, fractions, p0=LOGISTIC_START, maxfev=5000)
    except (RuntimeError, ValueError) as err:
        raise FitError(f"lambda_c: the logistic fit did not converge ({err})") from None
    log_lambda_c, k = (float(p) for p in params)
    if not (math.isfinite(log_lambda_c) and math.isfinite(k)):
        raise FitError("lambda_c: the logistic fit returned non-finite parameters")
    fitted = _logistic(log_lambda, log_lambda_c, k)
    low, high = TRANSITION_LEVELS
    if not ((fitted > low) & (fitted < high)).any():
        raise FitError(
            "lambda_c: the grokking fraction jumps between two neighbouring weight decays "
            "with no weight decay inside the transition, so λ_c is not determined; "
            "add weight decays in the gap"
        )
    return log_lambda_c, k


def _lambda_c_point(lambdas: np.ndarray, grokked: np.ndarray) -> tuple[float, float]:
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
    n_boot: int = 1500,
    seed: int = 0,
    *,
    drop_zero: bool = False,
) -> LambdaCFit:
    """Critical weight decay λ_c from which runs grokked (SPEC §5).

    Per distinct λ the fraction of runs that grokked is fitted by least squares (each
    distinct λ weighs the same, as in the SPEC) with P(λ) = 1/(1 + exp(−k(log10 λ − log10 λ_c))),
    starting from (log10 0.05, 5).  The 95 % CI of λ_c is a percentile bootstrap over runs.

    λ = 0 runs cannot sit on the log axis: by default they are refused with a ValueError;
    with ``drop_zero=True`` they are left out and counted in ``n_dropped_zero``.
    """
    lambdas = _as_float_array(lambdas, "lambdas")
    grokked = _as_bool_array(grokked, "grokked")
    _require_same_length(lambdas=lambdas, grokked=grokked)
    n_boot = _check_n_boot(n_boot)
    rng = _rng(seed)

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
    _require_enough_resamples("lambda_c", len(boot_log_lambda_c), n_boot)
    # Percentiles commute with the monotone 10**x, so the CI is taken on the log scale.
    low, high = _percentile_ci(np.asarray(boot_log_lambda_c))

    return LambdaCFit(
        lambda_c=10.0 ** log_lambda_c,
        k=k,
        ci=(10.0 ** low, 10.0 ** high),
        bins=[(float(lam), int(n), float(f)) for lam, n, f in zip(distinct, counts, fractions)],
        n_boot_ok=len(boot_log_lambda_c),
        n_runs=n_runs,
        n_dropped_zero=n_dropped_zero,
    )


# --------------------------------------------------------------------------- ν (§5)


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
    n_boot: int = 1500,
    seed: int = 0,
    joint: bool = False,
    grokked: Sequence[bool] | None = None,
) -> NuFit:
    """Exponent ν of t_grok = amplitude · (λ − λ_c)^(−ν) (SPEC §5).

    Ordinary least squares of log t_grok on log(λ − λ_c) over grokked runs (t_grok finite;
    NaN/None marks a run that did not grok) with λ > λ_c; slope = −ν.  λ_c is held fixed
    for the point estimate.  The CI is a percentile bootstrap over all runs (the same
    resampled indices in both modes, so the two CIs differ only by λ_c's refit).

    ``joint=True``: each resample also refits λ_c from the grokked flags (``grokked``
    required, one per run, agreeing with which t_grok are finite) with fit_lambda_c's
    point-estimate machinery, so the CI carries λ_c's uncertainty.  λ = 0 runs are left
    out of that refit (they cannot go on its log axis; they never count for ν anyway).
    """
    lambdas = _as_float_array(lambdas, "lambdas")
    t_grok = _as_float_array(t_grok, "t_grok", allow_nan=True)
    _require_same_length(lambdas=lambdas, t_grok=t_grok)
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
        grokked = _as_bool_array(grokked, "grokked")
        _require_same_length(lambdas=lambdas, grokked=grokked)
        if (grokked != did_grok).any():
            i = int(np.flatnonzero(grokked != did_grok)[0])
            raise ValueError(
                f"grokked: disagrees with t_grok at index {i} (grokked={bool(grokked[i])}, "
                f"t_grok={float(t_grok[i])!r}); a run grokked iff its t_grok is finite"
            )
    elif joint:
        raise ValueError("grokked: required when joint=True (λ_c is refitted from all runs' grokked flags)")
    n_boot = _check_n_boot(n_boot)
    rng = _rng(seed)

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
                lambda_c_sample = 10.0 ** _lambda_c_point(lam[on_log_axis], did_grok[idx][on_log_axis])[0]
            except FitError:
                continue                       # λ_c not determined in this resample
        ok = did_grok[idx] & (lam > lambda_c_sample)
        sample = _ols_power_law(lam[ok] - lambda_c_sample, t[ok])
        if sample is not None:
            boot_nu.append(sample[0])
    _require_enough_resamples("nu", len(boot_nu), n_boot)

    return NuFit(
        nu=nu,
        amplitude=amplitude,
        ci=_percentile_ci(np.asarray(boot_nu)),
        n=int(usable.sum()),
        n_boot_ok=len(boot_nu),
        joint=joint,
        lambda_c=float(lambda_c),
    )


# ------------------------------------------------------------------- per-λ summaries


def regime_table(lambdas: Sequence[float], regimes: Sequence[str]) -> dict[float, dict[str, int]]:
    """λ (ascending) → {regime: count} for every regime in REGIMES, zeros included."""
    lambdas = _as_float_array(lambdas, "lambdas")
    if isinstance(regimes, (str, bytes)) or not hasattr(regimes, "__len__"):
        raise TypeError(f"regimes: expected a sequence of regime names, got {type(regimes).__name__}")
    regimes = list(regimes)
    _require_same_length(lambdas=lambdas, regimes=regimes)
    unknown = sorted({repr(r) for r in regimes if r not in REGIMES})
    if unknown:
        raise ValueError(f"regimes: unknown regime(s) {', '.join(unknown)}; expected one of {REGIMES}")
    table = {float(lam): dict.fromkeys(REGIMES, 0) for lam in np.unique(lambdas)}
    for lam, regime in zip(lambdas, regimes):
        table[float(lam)][regime] += 1
    return table


def median_t_grok(lambdas: Sequence[float], t_grok: Sequence[float | None]) -> dict[float, float | None]:
    """λ (ascending) → median t_grok over its grokked runs (finite t_grok), None if none grokked."""
    lambdas = _as_float_array(lambdas, "lambdas")
    t_grok = _as_float_array(t_grok, "t_grok", allow_nan=True)
    _require_same_length(lambdas=lambdas, t_grok=t_grok)
    medians: dict[float, float | None] = {}
    for lam in np.unique(lambdas):
        times = t_grok[(lambdas == lam) & np.isfinite(t_grok)]
        medians[float(lam)] = float(np.median(times)) if times.size else None
    return medians


# ------------------------------------------------------------------ saturating curve


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


def fit_saturating(x: Sequence[float], y: Sequence[float], n_boot: int = 1500, seed: int = 0) -> SaturatingFit:
    """σ_max = c + a(1 − exp(−b·x)), b > 0, by least squares; CIs by bootstrap over points.

    Used for peak σ_H against per-head dimension d/H.  If the data never bend toward
    the plateau, a and b trade off against each other: the point estimate is still the
    least-squares one, and the (wide) bootstrap intervals show it.
    """
    x = _as_float_array(x, "x")
    y = _as_float_array(y, "y")
    _require_same_length(x=x, y=y)
    n_boot = _check_n_boot(n_boot)
    rng = _rng(seed)
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
    _require_enough_resamples("saturating", len(boot), n_boot)
    boot = np.asarray(boot)
    ci = {
        "c": _percentile_ci(boot[:, 0]),
        "a": _percentile_ci(boot[:, 1]),
        "b": _percentile_ci(boot[:, 2]),
        "plateau": _percentile_ci(boot[:, 0] + boot[:, 1]),
    }
    return SaturatingFit(c=c, a=a, b=b, ci=ci, n=len(x), n_boot_ok=len(boot))


# ------------------------------------------------------------ paired interventions


def paired_tests(control: Sequence[float], treated: Sequence[float]) -> PairedTests:
    """Paired comparison of treated vs control (same seeds): differences are treated − control."""
    control = _as_float_array(control, "control")
    treated = _as_float_array(treated, "treated")
    _require_same_length(control=control, treated=treated)
    diffs = treated - control
    if len(diffs) < 2:
        raise ValueError(f"control/treated: need at least 2 pairs, got {len(diffs)}")
    spread = float(np.std(diffs, ddof=1))
    if spread == 0.0:
        # t, Wilcoxon and Cohen's d all divide by the spread of the differences.
        raise ValueError(
            f"control/treated: every paired difference equals {float(diffs[0])!r}, so the paired "
            "tests and Cohen's d are undefined"
        )
    t_result = stats.ttest_rel(treated, control)
    w_result = stats.wilcoxon(treated, control)
    return PairedTests(
        mean_diff=float(diffs.mean()),
        t_statistic=float(t_result.statistic),
        t_pvalue=float(t_result.pvalue),
        wilcoxon_statistic=float(w_result.statistic),
        wilcoxon_pvalue=float(w_result.pvalue),
        cohens_d=float(diffs.mean() / spread),
        n=len(diffs),
    )


def holm_bonferroni(pvalues: Sequence[float]) -> np.ndarray:
    """Holm step-down adjusted p-values, in the input order.

    Sorted ascending, the i-th (0-based) of m p-values is multiplied by (m − i); a running
    maximum keeps the adjusted values monotone (a smaller raw p can never end up with a
    larger adjusted p), and they are capped at 1.
    """
    p = _as_float_array(pvalues, "pvalues")
    if ((p < 0) | (p > 1)).any():
        raise ValueError(f"pvalues: expected values in [0, 1], got {float(p[(p < 0) | (p > 1)][0])!r}")
    m = len(p)
    order = np.argsort(p, kind="stable")
    stepped = np.maximum.accumulate((m - np.arange(m)) * p[order])
    adjusted = np.empty(m)
    adjusted[order] = np.minimum(stepped, 1.0)
    return adjusted


# ------------------------------------------------------------- predictive value


def _as_labels(y_true) -> np.ndarray:
    labels = _as_bool_array(y_true, "y_true")
    if labels.all() or not labels.any():
        raise ValueError("y_true: AUC needs both classes, got only " + ("positives" if labels.all() else "negatives"))
    return labels


def auc_mann_whitney(y_true: Sequence[bool], score: Sequence[float]) -> float:
    """P(score of a random positive > score of a random negative), ties counting half.

    Via ranks: with average ranks for ties, (rank sum of positives − n₊(n₊+1)/2)/(n₊n₋)
    counts exactly the pairs won plus half the pairs tied.
    """
    labels = _as_labels(y_true)
    score = _as_float_array(score, "score")
    _require_same_length(y_true=labels, score=score)
    return _auc(labels, score)


def roc_curve(y_true: Sequence[bool], score: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """(false-positive rate, true-positive rate) as the threshold falls through the distinct scores,
    from (0, 0) to (1, 1); tied scores move both rates at once, so the trapezoid area under the curve
    equals `auc_mann_whitney` (ties counting half)."""
    labels = _as_labels(y_true)
    score = _as_float_array(score, "score")
    _require_same_length(y_true=labels, score=score)
    order = np.argsort(-score, kind="stable")
    s, y = score[order], labels[order]
    last_of_tie = np.r_[np.flatnonzero(np.diff(s)), len(s) - 1]
    tp, fp = np.cumsum(y)[last_of_tie], np.cumsum(~y)[last_of_tie]
    return np.r_[0.0, fp / fp[-1]], np.r_[0.0, tp / tp[-1]]


def _auc(labels: np.ndarray, score: np.ndarray) -> float:
    n_pos = int(labels.sum())
    n_neg = len(labels) - n_pos
    ranks = stats.rankdata(score)
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def _stratified_indices(rng: np.random.Generator, labels: np.ndarray) -> np.ndarray:
    # Resampling positives and negatives separately keeps both classes in every resample
    # (a one-class resample has no AUC), so no resample is lost.
    pos, neg = np.flatnonzero(labels), np.flatnonzero(~labels)
    return np.concatenate([rng.choice(pos, size=len(pos)), rng.choice(neg, size=len(neg))])


def bootstrap_auc(
    y_true: Sequence[bool],
    score: Sequence[float],
    n_boot: int = 1500,
    seed: int = 0,
    baseline_score: Sequence[float] | None = None,
) -> AUCResult:
    """Mann–Whitney AUC with a 95 % percentile bootstrap CI (stratified by class).

    With ``baseline_score`` the same resamples also give the baseline's AUC and the
    paired difference auc − baseline_auc with its CI: does the score add anything?
    """
    labels = _as_labels(y_true)
    score = _as_float_array(score, "score")
    _require_same_length(y_true=labels, score=score)
    baseline = None
    if baseline_score is not None:
        baseline = _as_float_array(baseline_score, "baseline_score")
        _require_same_length(y_true=labels, baseline_score=baseline)
    n_boot = _check_n_boot(n_boot)
    rng = _rng(seed)

    boot = np.empty(n_boot)
    boot_diff = np.empty(n_boot)
    for i in range(n_boot):
        idx = _stratified_indices(rng, labels)
        boot[i] = _auc(labels[idx], score[idx])
        if baseline is not None:
            boot_diff[i] = boot[i] - _auc(labels[idx], baseline[idx])

    auc = _auc(labels, score)
    n_pos = int(labels.sum())
    if baseline is None:
        return AUCResult(auc=auc, ci=_percentile_ci(boot), n_pos=n_pos, n_neg=len(labels) - n_pos)
    baseline_auc = _auc(labels, baseline)
    return AUCResult(
        auc=auc, ci=_percentile_ci(boot), n_pos=n_pos, n_neg=len(labels) - n_pos,
        baseline_auc=baseline_auc, diff=auc - baseline_auc, diff_ci=_percentile_ci(boot_diff),
    )


def bootstrap_mae(
    y_true: Sequence[float],
    y_pred: Sequence[float],
    n_boot: int = 1500,
    seed: int = 0,
    baseline_pred: Sequence[float] | None = None,
) -> MAEResult:
    """Mean absolute error with a 95 % percentile bootstrap CI over cases.

    With ``baseline_pred`` the same resamples also give the paired difference
    mae − baseline_mae (negative: the prediction beats the baseline) and its CI.
    """
    y_true = _as_float_array(y_true, "y_true")
    y_pred = _as_float_array(y_pred, "y_pred")
    _require_same_length(y_true=y_true, y_pred=y_pred)
    errors = np.abs(y_pred - y_true)
    baseline_errors = None
    if baseline_pred is not None:
        baseline_pred = _as_float_array(baseline_pred, "baseline_pred")
        _require_same_length(y_true=y_true, baseline_pred=baseline_pred)
        baseline_errors = np.abs(baseline_pred - y_true)
    n_boot = _check_n_boot(n_boot)
    rng = _rng(seed)

    idx = rng.integers(0, len(errors), size=(n_boot, len(errors)))
    boot = errors[idx].mean(axis=1)
    mae = float(errors.mean())
    if baseline_errors is None:
        return MAEResult(mae=mae, ci=_percentile_ci(boot), n=len(errors))
    baseline_mae = float(baseline_errors.mean())
    boot_diff = boot - baseline_errors[idx].mean(axis=1)
    return MAEResult(
        mae=mae, ci=_percentile_ci(boot), n=len(errors),
        baseline_mae=baseline_mae, diff=mae - baseline_mae, diff_ci=_percentile_ci(boot_diff),
    )
