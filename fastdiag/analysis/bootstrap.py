"""Input checks and the percentile bootstrap shared by every fit.

Conventions (every module of ``fastdiag.analysis``):

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

import numpy as np


CI_LEVEL = 0.95

# Below this share of converged resamples the percentile interval is not trusted (see
# the module docstring).
MIN_CONVERGED_FRACTION = 0.5


class FitError(ValueError):
    """Too little (or too degenerate) data for the requested fit; the message says which and why."""


def as_float_array(values, name: str, *, allow_nan: bool = False) -> np.ndarray:
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


def as_bool_array(values, name: str) -> np.ndarray:
    """A 1-D bool array from bools or 0/1 numbers; anything else is refused."""
    array = as_float_array(values, name)
    if not np.isin(array, (0.0, 1.0)).all():
        raise ValueError(f"{name}: expected booleans (or 0/1), got {float(array[~np.isin(array, (0.0, 1.0))][0])!r}")
    return array.astype(bool)


def require_same_length(**arrays: np.ndarray) -> None:
    lengths = {name: len(a) for name, a in arrays.items()}
    if len(set(lengths.values())) > 1:
        described = ", ".join(f"{name} has {n}" for name, n in lengths.items())
        raise ValueError(f"length mismatch: {described}")


def check_n_boot(n_boot) -> int:
    if isinstance(n_boot, bool) or not isinstance(n_boot, numbers.Integral) or n_boot < 1:
        raise ValueError(f"n_boot: expected a positive integer, got {n_boot!r}")
    return int(n_boot)


def make_rng(seed) -> np.random.Generator:
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ValueError(f"seed: expected a non-negative integer, got {seed!r}")
    return np.random.default_rng(int(seed))


def percentile_ci(samples: np.ndarray, level: float = CI_LEVEL) -> tuple[float, float]:
    tail = 100.0 * (1.0 - level) / 2.0
    low, high = np.percentile(samples, [tail, 100.0 - tail])
    return float(low), float(high)


def require_enough_resamples(fit: str, n_ok: int, n_boot: int) -> None:
    needed = max(2, math.ceil(MIN_CONVERGED_FRACTION * n_boot))
    if n_ok < needed:
        raise FitError(
            f"{fit}: only {n_ok} of {n_boot} bootstrap resamples gave a valid fit "
            f"(need at least {needed}); the data are too sparse for a confidence interval"
        )
