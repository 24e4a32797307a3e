"""Does s̄/σ_H at epoch t0 predict "groks by the horizon" or ln t_grok better than training-clock, loss
and weight-norm baselines? Seeds are split into train and test seeds; AUC/MAE with bootstrap CIs of
both models and of their paired difference on the held-out seeds (``predictive_analysis``)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
from scipy import optimize, special, stats

from fastdiag.analysis.bootstrap import (as_bool_array, as_float_array, check_n_boot, percentile_ci,
                                         require_same_length, make_rng)
from fastdiag.analysis.results import JSONResult, optional
from fastdiag.analysis.trajectories import finite
from fastdiag.grokking.config import GROKKED, N_BOOT


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


def _as_labels(y_true) -> np.ndarray:
    labels = as_bool_array(y_true, "y_true")
    if labels.all() or not labels.any():
        raise ValueError("y_true: AUC needs both classes, got only " + ("positives" if labels.all() else "negatives"))
    return labels


def auc_mann_whitney(y_true: Sequence[bool], score: Sequence[float]) -> float:
    """P(score of a random positive > score of a random negative), ties counting half.

    Via ranks: with average ranks for ties, (rank sum of positives − n₊(n₊+1)/2)/(n₊n₋)
    counts exactly the pairs won plus half the pairs tied.
    """
    labels = _as_labels(y_true)
    score = as_float_array(score, "score")
    require_same_length(y_true=labels, score=score)
    return _auc(labels, score)


def roc_curve(y_true: Sequence[bool], score: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """(false-positive rate, true-positive rate) as the threshold falls through the distinct scores,
    from (0, 0) to (1, 1); tied scores move both rates at once, so the trapezoid area under the curve
    equals `auc_mann_whitney` (ties counting half)."""
    labels = _as_labels(y_true)
    score = as_float_array(score, "score")
    require_same_length(y_true=labels, score=score)
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
    n_boot: int = N_BOOT,
    seed: int = 0,
    baseline_score: Sequence[float] | None = None,
) -> AUCResult:
    """Mann–Whitney AUC with a 95 % percentile bootstrap CI (stratified by class).

    With ``baseline_score`` the same resamples also give the baseline's AUC and the
    paired difference auc − baseline_auc with its CI: does the score add anything?
    """
    labels = _as_labels(y_true)
    score = as_float_array(score, "score")
    require_same_length(y_true=labels, score=score)
    baseline = None
    if baseline_score is not None:
        baseline = as_float_array(baseline_score, "baseline_score")
        require_same_length(y_true=labels, baseline_score=baseline)
    n_boot = check_n_boot(n_boot)
    rng = make_rng(seed)

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
        return AUCResult(auc=auc, ci=percentile_ci(boot), n_pos=n_pos, n_neg=len(labels) - n_pos)
    baseline_auc = _auc(labels, baseline)
    return AUCResult(
        auc=auc, ci=percentile_ci(boot), n_pos=n_pos, n_neg=len(labels) - n_pos,
        baseline_auc=baseline_auc, diff=auc - baseline_auc, diff_ci=percentile_ci(boot_diff),
    )


def bootstrap_mae(
    y_true: Sequence[float],
    y_pred: Sequence[float],
    n_boot: int = N_BOOT,
    seed: int = 0,
    baseline_pred: Sequence[float] | None = None,
) -> MAEResult:
    """Mean absolute error with a 95 % percentile bootstrap CI over cases.

    With ``baseline_pred`` the same resamples also give the paired difference
    mae − baseline_mae (negative: the prediction beats the baseline) and its CI.
    """
    y_true = as_float_array(y_true, "y_true")
    y_pred = as_float_array(y_pred, "y_pred")
    require_same_length(y_true=y_true, y_pred=y_pred)
    errors = np.abs(y_pred - y_true)
    baseline_errors = None
    if baseline_pred is not None:
        baseline_pred = as_float_array(baseline_pred, "baseline_pred")
        require_same_length(y_true=y_true, baseline_pred=baseline_pred)
        baseline_errors = np.abs(baseline_pred - y_true)
    n_boot = check_n_boot(n_boot)
    rng = make_rng(seed)

    idx = rng.integers(0, len(errors), size=(n_boot, len(errors)))
    boot = errors[idx].mean(axis=1)
    mae = float(errors.mean())
    if baseline_errors is None:
        return MAEResult(mae=mae, ci=percentile_ci(boot), n=len(errors))
    baseline_mae = float(baseline_errors.mean())
    boot_diff = boot - baseline_errors[idx].mean(axis=1)
    return MAEResult(
        mae=mae, ci=percentile_ci(boot), n=len(errors),
        baseline_mae=baseline_mae, diff=mae - baseline_mae, diff_ci=percentile_ci(boot_diff),
    )


BASELINE_FEATURES = ("epoch", "log_train_loss", "log_test_loss", "weight_norm",
                     "d_log_train_loss", "d_log_test_loss", "d_weight_norm")

ATTENTION_FEATURES = ("s_bar", "sigma_h", "d_s_bar", "d_sigma_h")


@dataclass(frozen=True)
class HeldOutScore(JSONResult):
    """A held-out run's "groks by the horizon" scores from the two models."""
    run_id: str
    grokked: bool
    baseline: float
    full: float


@dataclass(frozen=True)
class HeldOutPrediction(JSONResult):
    """A held-out grokked run's true and predicted ln t_grok."""
    run_id: str
    log_t_grok: float
    baseline: float
    full: float


@dataclass(frozen=True)
class GroksByHorizon(JSONResult):
    """Logistic regression of "groks by the horizon" on the held-out seeds: class counts, and either
    ``error`` or the AUCs (95 % CIs), their paired difference and its verdict."""
    train_positives: int
    train_negatives: int
    test_positives: int
    test_negatives: int
    error: str | None = optional()
    auc_full: float | None = optional()
    auc_full_ci: tuple[float, float] | None = optional()
    auc_baseline: float | None = optional()
    auc_baseline_ci: tuple[float, float] | None = optional()
    diff: float | None = optional()                     # auc_full − auc_baseline
    diff_ci: tuple[float, float] | None = optional()
    verdict: str | None = optional()
    test_scores: tuple[HeldOutScore, ...] | None = optional()


@dataclass(frozen=True)
class LogTGrokRegression(JSONResult):
    """Ridge regression of ln t_grok over grokked runs, scored by held-out MAE: either ``error`` or the
    MAEs (95 % CIs), their paired difference and its verdict."""
    n_train: int
    n_test: int
    error: str | None = optional()
    mae_full: float | None = optional()
    mae_full_ci: tuple[float, float] | None = optional()
    mae_baseline: float | None = optional()
    mae_baseline_ci: tuple[float, float] | None = optional()
    diff: float | None = optional()                     # mae_full − mae_baseline (negative: better)
    diff_ci: tuple[float, float] | None = optional()
    units: str | None = optional()
    verdict: str | None = optional()
    test_predictions: tuple[HeldOutPrediction, ...] | None = optional()


@dataclass(frozen=True)
class PredictiveAnalysis(JSONResult):
    """``predictive_analysis``: the settings, the cases, and either ``error`` (no seed split) or the
    split and the two held-out tests."""
    t0: float
    t0_source: str
    test_frac: float
    split_seed: int
    n_boot: int
    alpha: float
    baseline_features: tuple[str, ...]
    attention_features: tuple[str, ...]
    excluded: dict[str, int]
    n_cases: int
    error: str | None = optional()
    train_seeds: tuple[int, ...] | None = optional()
    test_seeds: tuple[int, ...] | None = optional()
    n_train: int | None = optional()
    n_test: int | None = optional()
    groks_by_horizon: GroksByHorizon | None = optional()
    log_t_grok: LogTGrokRegression | None = optional()


def _row_at(trace: Sequence[dict], epoch: float) -> dict | None:
    best = None
    for r in trace:
        if finite(r.get("epoch")) and r["epoch"] <= epoch:
            best = r
    return best


def _log(x):
    return math.log(max(x, 1e-12)) if finite(x) else None


def features_at(trace: Sequence[dict], t0: float) -> dict | None:
    """What is known at epoch ``t0``: the last evaluation at or before t0 and the change since the
    last evaluation at or before t0/2. Baselines: the epoch (training clock), log train/test loss and
    weight norm and their changes; attention: s̄, σ_H and their changes. None when a value is missing."""
    now, before = _row_at(trace, t0), _row_at(trace, t0 / 2)
    if now is None:
        return None
    if before is None or before is now:
        before = next((r for r in trace if finite(r.get("epoch"))), now)
    f = {"epoch": float(now["epoch"]),
         "log_train_loss": _log(now.get("train_loss")), "log_test_loss": _log(now.get("test_loss")),
         "weight_norm": now.get("weight_norm"), "s_bar": now.get("s_bar"), "sigma_h": now.get("sigma_h")}
    prev = {"log_train_loss": _log(before.get("train_loss")), "log_test_loss": _log(before.get("test_loss")),
            "weight_norm": before.get("weight_norm"), "s_bar": before.get("s_bar"),
            "sigma_h": before.get("sigma_h")}
    for k, v in prev.items():
        f["d_" + k] = f[k] - v if finite(f[k]) and finite(v) else None
    if not all(finite(f[k]) for k in BASELINE_FEATURES + ATTENTION_FEATURES):
        return None
    return f


def _standardise(train: np.ndarray, test: np.ndarray):
    mean, std = train.mean(axis=0), train.std(axis=0)
    keep = std > 1e-12                          # constant columns (e.g. the epoch at a fixed t0) carry nothing
    return (train[:, keep] - mean[keep]) / std[keep], (test[:, keep] - mean[keep]) / std[keep]


def fit_logistic(x: np.ndarray, y: np.ndarray, alpha: float = 1.0) -> tuple[np.ndarray, float]:
    """L2-penalised logistic regression (penalty alpha/2·|w|², intercept free) by L-BFGS."""
    y = np.asarray(y, float)
    n, k = x.shape

    def loss(theta):
        w, b = theta[:k], theta[k]
        z = x @ w + b
        # log(1 + e^z) − y z, stably
        nll = np.sum(np.logaddexp(0.0, z) - y * z)
        p = special.expit(z)
        grad_w = x.T @ (p - y) + alpha * w
        grad_b = np.sum(p - y)
        return nll + 0.5 * alpha * w @ w, np.append(grad_w, grad_b)

    res = optimize.minimize(loss, np.zeros(k + 1), jac=True, method="L-BFGS-B")
    return res.x[:k], float(res.x[k])


def fit_ridge(x: np.ndarray, y: np.ndarray, alpha: float = 1.0) -> tuple[np.ndarray, float]:
    """Ridge regression (penalty alpha·|w|², intercept free) on standardised features."""
    k = x.shape[1]
    ym = float(np.mean(y))
    w = np.linalg.solve(x.T @ x + alpha * np.eye(k), x.T @ (y - ym)) if k else np.zeros(0)
    return w, ym


def split_seeds(seeds: Iterable[int], test_frac: float = 0.5, split_seed: int = 0) -> tuple[list[int], list[int]]:
    distinct = sorted(set(int(s) for s in seeds))
    if len(distinct) < 2:
        raise ValueError(f"predict: need runs of at least 2 seeds to split train/test seeds, got {len(distinct)}")
    rng = np.random.default_rng(split_seed)
    order = [distinct[i] for i in rng.permutation(len(distinct))]
    n_test = min(len(distinct) - 1, max(1, int(round(test_frac * len(distinct)))))
    return sorted(order[n_test:]), sorted(order[:n_test])


def seed_list(seeds: Sequence[int]) -> str:
    """Seeds as ``fastdiag analyze`` and the predict figure both print them: [0, 3, 5]."""
    return "[" + ", ".join(str(int(s)) for s in seeds) + "]"


TOO_SMALL = "cannot be judged: the sample is too small (every bootstrap resample gave the same difference)"


def _verdict(diff_ci: tuple[float, float], better_if_positive: bool) -> str:
    lo, hi = diff_ci
    if hi - lo <= 1e-12 * max(1.0, abs(lo)):
        # A zero-width interval is no certainty: the resamples cannot vary (e.g. one grokked and one
        # non-grokked test run: the class-stratified resample is always that pair)
        return TOO_SMALL
    if lo <= 0 <= hi:
        return "adds no measurable value"
    gain = lo > 0 if better_if_positive else hi < 0
    return "adds measurable value" if gain else "is measurably worse than the baselines alone"


def _default_t0(done: Sequence[dict]) -> tuple[float, str]:
    """The median memorisation epoch of the runs, else 10 % of the shortest horizon."""
    t_mems = [r["result"]["t_mem_epoch"] for r in done if finite(r["result"].get("t_mem_epoch"))]
    if t_mems:
        return float(np.median(t_mems)), "median t_mem"
    horizons = [r["config"]["epochs"] for r in done]
    return (0.1 * min(horizons) if horizons else 1.0), "10% of the shortest horizon"


def _cases(done: Sequence[dict], traces: dict[str, list[dict]], t0: float) -> tuple[list[dict], dict[str, int]]:
    """The runs that can be predicted at ``t0`` (horizon beyond it, not grokked by it, readouts at it),
    as {run_id, seed, grokked, log_t_grok, features}, and how many were left out for each reason."""
    cases = []
    excluded = {"horizon not beyond t0": 0, "grokked by t0": 0, "no s̄/σ_H or loss at t0": 0}
    for run in done:
        res, cfg = run["result"], run["config"]
        if cfg["epochs"] <= t0:
            excluded["horizon not beyond t0"] += 1
            continue
        if finite(res.get("t_grok_epoch")) and res["t_grok_epoch"] <= t0:
            excluded["grokked by t0"] += 1
            continue
        f = features_at(traces.get(run["run_id"], []), t0)
        if f is None:
            excluded["no s̄/σ_H or loss at t0"] += 1
            continue
        grokked = res.get("regime") in GROKKED
        cases.append({"run_id": run["run_id"], "seed": int(cfg["seed"]), "grokked": grokked,
                      "log_t_grok": math.log(res["t_grok_epoch"]) if grokked and finite(res.get("t_grok_epoch"))
                      else None, "features": f})
    return cases, excluded


def _matrix(cases: Sequence[dict], names: Sequence[str]) -> np.ndarray:
    return np.array([[c["features"][n] for n in names] for c in cases], float).reshape(len(cases), len(names))


def _fitted_on_train(fit, train: list[dict], y_train: np.ndarray, test: list[dict], alpha: float) -> dict:
    """Test-set outputs of ``fit`` trained on the baselines alone ("baseline") and on baselines +
    attention readouts ("full"), features standardised on the train cases."""
    out = {}
    for name, names in (("baseline", BASELINE_FEATURES), ("full", BASELINE_FEATURES + ATTENTION_FEATURES)):
        xtr, xte = _standardise(_matrix(train, names), _matrix(test, names))
        w, b = fit(xtr, y_train, alpha)
        out[name] = xte @ w + b
    return out


def _groks_by_horizon(train: list[dict], test: list[dict], alpha: float, n_boot: int, seed: int) -> GroksByHorizon:
    """Logistic regression of "groks by the horizon", scored by held-out AUC."""
    y_train = np.array([c["grokked"] for c in train], bool)
    y_test = np.array([c["grokked"] for c in test], bool)
    counts = dict(train_positives=int(y_train.sum()), train_negatives=int((~y_train).sum()),
                  test_positives=int(y_test.sum()), test_negatives=int((~y_test).sum()))
    if y_train.all() or not y_train.any():
        return GroksByHorizon(**counts, error="groks-by-horizon: the train seeds hold only one class; nothing to learn")
    if y_test.all() or not y_test.any():
        return GroksByHorizon(**counts, error="groks-by-horizon: the test seeds hold only one class; AUC undefined")
    scores = _fitted_on_train(fit_logistic, train, y_train.astype(float), test, alpha)
    res = bootstrap_auc(y_test, scores["full"], n_boot=n_boot, seed=seed, baseline_score=scores["baseline"])
    base = bootstrap_auc(y_test, scores["baseline"], n_boot=n_boot, seed=seed)
    return GroksByHorizon(
        **counts, auc_full=res.auc, auc_full_ci=res.ci, auc_baseline=res.baseline_auc, auc_baseline_ci=base.ci,
        diff=res.diff, diff_ci=res.diff_ci, verdict=_verdict(res.diff_ci, better_if_positive=True),
        test_scores=tuple(HeldOutScore(c["run_id"], bool(y), float(sb), float(sf))
                          for c, y, sb, sf in zip(test, y_test, scores["baseline"], scores["full"])))


def _log_t_grok(train: list[dict], test: list[dict], alpha: float, n_boot: int, seed: int) -> LogTGrokRegression:
    """Ridge regression of ln t_grok over the grokked runs, scored by held-out MAE."""
    tr = [c for c in train if c["log_t_grok"] is not None]
    te = [c for c in test if c["log_t_grok"] is not None]
    if len(tr) < 3 or len(te) < 2:
        return LogTGrokRegression(n_train=len(tr), n_test=len(te), error="ln t_grok: need ≥ 3 grokked train runs "
                                  f"and ≥ 2 grokked test runs, got {len(tr)} and {len(te)}")
    ytr = np.array([c["log_t_grok"] for c in tr])
    yte = np.array([c["log_t_grok"] for c in te])
    preds = _fitted_on_train(fit_ridge, tr, ytr, te, alpha)
    res = bootstrap_mae(yte, preds["full"], n_boot=n_boot, seed=seed, baseline_pred=preds["baseline"])
    base = bootstrap_mae(yte, preds["baseline"], n_boot=n_boot, seed=seed)
    return LogTGrokRegression(
        n_train=len(tr), n_test=len(te), mae_full=res.mae, mae_full_ci=res.ci, mae_baseline=res.baseline_mae,
        mae_baseline_ci=base.ci, diff=res.diff, diff_ci=res.diff_ci, units="ln(epochs)",
        verdict=_verdict(res.diff_ci, better_if_positive=False),
        test_predictions=tuple(HeldOutPrediction(c["run_id"], float(y), float(pb), float(pf))
                               for c, y, pb, pf in zip(te, yte, preds["baseline"], preds["full"])))


def predictive_analysis(runs: Sequence[dict], traces: dict[str, list[dict]], t0: float | None = None,
                        test_frac: float = 0.5, split_seed: int = 0, n_boot: int = N_BOOT, seed: int = 0,
                        alpha: float = 1.0) -> PredictiveAnalysis:
    """Held-out test of the attention readouts' predictive value (see the module docstring).

    Cases: done runs with s̄/σ_H, a horizon beyond ``t0`` and not yet grokked at ``t0``. Seeds are
    split (``split_seed``) into train and test seeds; every run of a seed is on one side. Models:
    L2-logistic regression for "groks by the horizon" and ridge regression of ln t_grok (grokked runs),
    each on the baselines alone and on baselines + attention features, fitted on the train seeds,
    scored on the test seeds: AUC (``bootstrap_auc``) and MAE of ln t_grok
    (``bootstrap_mae``), with 95 % bootstrap CIs of both and of the paired difference.
    ``t0`` defaults to the median memorisation epoch of the runs (10 % of the shortest horizon if
    none memorised)."""
    done = [r for r in runs if r.get("result")]
    t0, t0_source = _default_t0(done) if t0 is None else (t0, "given")
    cases, excluded = _cases(done, traces, t0)
    settings = dict(t0=t0, t0_source=t0_source, test_frac=test_frac, split_seed=split_seed, n_boot=n_boot,
                    alpha=alpha, baseline_features=BASELINE_FEATURES, attention_features=ATTENTION_FEATURES,
                    excluded=excluded, n_cases=len(cases))
    try:
        train_seeds, test_seeds = split_seeds([c["seed"] for c in cases], test_frac, split_seed)
    except ValueError as exc:
        return PredictiveAnalysis(**settings, error=str(exc))
    train = [c for c in cases if c["seed"] in train_seeds]
    test = [c for c in cases if c["seed"] in test_seeds]
    return PredictiveAnalysis(**settings, train_seeds=tuple(train_seeds), test_seeds=tuple(test_seeds),
                              n_train=len(train), n_test=len(test),
                              groks_by_horizon=_groks_by_horizon(train, test, alpha, n_boot, seed),
                              log_t_grok=_log_t_grok(train, test, alpha, n_boot, seed))
