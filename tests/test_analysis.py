"""Tests for fastdiag.analysis: known-answer fits on synthetic runs, hand-computed statistics,
and refusal of degenerate input."""
from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
from scipy import optimize, special, stats

from fastdiag.analysis.bootstrap import FitError
from fastdiag.analysis.fits import fit_lambda_c, fit_nu
from fastdiag.analysis.groups import median_t_grok, regime_table
from fastdiag.analysis.headdim import fit_saturating
from fastdiag.analysis.paired import holm_bonferroni, paired_tests
from fastdiag.analysis.predict import auc_mann_whitney, bootstrap_auc, bootstrap_mae, roc_curve
from fastdiag.grokking.config import REGIMES

N_BOOT = 250
TRUE_LAMBDA_C = 0.02
TRUE_K = 4.0
TRUE_NU = 0.75


def synthetic_runs(seed: int = 0):
    """8 log-spaced weight decays × 40 seeds.

    grokked ~ Bernoulli(logistic(λ; λ_c = 0.02, k = 4)); a grokked run above λ_c has
    t_grok = 1000 (λ − λ_c)^(−0.75) × log-normal noise (σ = 0.2).  The few runs that grok
    below λ_c get a late, λ-independent time: the power law says nothing there, and the
    fits must ignore them.  The grid keeps its nearest λ (0.026) clear of λ_c, so the
    divergence is sampled but not dominated by one point.
    """
    rng = np.random.default_rng(seed)
    lambdas = np.repeat(np.logspace(-3, math.log10(0.3), 8), 40)
    p_grok = special.expit(TRUE_K * (np.log10(lambdas) - math.log10(TRUE_LAMBDA_C)))
    grokked = rng.random(lambdas.size) < p_grok
    distance = np.where(lambdas > TRUE_LAMBDA_C, lambdas - TRUE_LAMBDA_C, 0.005)
    t_grok = 1000.0 * distance ** (-TRUE_NU) * np.exp(rng.normal(0.0, 0.2, lambdas.size))
    return lambdas, grokked, np.where(grokked, t_grok, np.nan)


@pytest.fixture(scope="module")
def runs():
    return synthetic_runs(seed=0)


@pytest.fixture(scope="module")
def lambda_c_fit(runs):
    lambdas, grokked, _ = runs
    return fit_lambda_c(lambdas, grokked, n_boot=N_BOOT, seed=0)


# ------------------------------------------------------------------------------ λ_c


def test_lambda_c_recovers_known_value(lambda_c_fit):
    fit = lambda_c_fit
    assert fit.ci[0] < TRUE_LAMBDA_C < fit.ci[1]
    assert fit.ci[0] < fit.lambda_c < fit.ci[1]
    assert abs(math.log10(fit.lambda_c / TRUE_LAMBDA_C)) < 0.1       # within 0.1 decade
    assert 2.5 < fit.k < 6.0
    assert fit.n_runs == 320
    assert fit.n_boot_ok >= 0.9 * N_BOOT


def test_lambda_c_bins_and_point_estimate_follow_the_spec(runs, lambda_c_fit):
    lambdas, grokked, _ = runs
    bins = lambda_c_fit.bins
    assert [b[0] for b in bins] == sorted(set(lambdas.tolist()))
    assert all(n == 40 for _, n, _ in bins)
    for lam, n, fraction in bins:
        assert fraction == pytest.approx(grokked[lambdas == lam].mean())
    # docs/experiments.md "Setup": unweighted least squares of the fractions, start (log10 0.05, 5).
    x = np.log10([b[0] for b in bins])
    y = np.array([b[2] for b in bins])
    params, _ = optimize.curve_fit(
        lambda x, lc, k: special.expit(k * (x - lc)), x, y, p0=(math.log10(0.05), 5.0)
    )
    assert lambda_c_fit.lambda_c == pytest.approx(10 ** params[0], rel=1e-6)
    assert lambda_c_fit.k == pytest.approx(params[1], rel=1e-6)


def test_lambda_c_is_reproducible_with_a_seed(runs, lambda_c_fit):
    lambdas, grokked, _ = runs
    again = fit_lambda_c(lambdas, grokked, n_boot=N_BOOT, seed=0)
    assert again == lambda_c_fit
    other = fit_lambda_c(lambdas, grokked, n_boot=N_BOOT, seed=1)
    assert other.lambda_c == lambda_c_fit.lambda_c and other.ci != lambda_c_fit.ci


@pytest.mark.parametrize(
    "lambdas, grokked, expected",
    [
        ([0.01, 0.01, 0.1, 0.1], [0, 1, 0, 1], "at least 3 distinct weight decays.*got 2 distinct"),
        ([0.01, 0.1, 1.0], [1, 1, 1], "both grokked and non-grokked.*3 of 3 runs grokked"),
        ([0.01, 0.1, 1.0], [0, 0, 0], "both grokked and non-grokked.*0 of 3 runs grokked"),
    ],
)
def test_lambda_c_refuses_too_little_data(lambdas, grokked, expected):
    with pytest.raises(FitError, match=expected) as info:
        fit_lambda_c(lambdas, grokked, n_boot=10)
    assert str(info.value).startswith("lambda_c:")


def test_lambda_c_refuses_perfectly_separated_data():
    lambdas = np.repeat([0.001, 0.01, 0.1, 1.0], 10)
    with pytest.raises(FitError, match="not determined"):
        fit_lambda_c(lambdas, lambdas >= 0.1, n_boot=10)


@pytest.mark.parametrize(
    "lambdas, grokked, error, expected",
    [
        ([0.01, 0.1], [0, 1, 1], ValueError, "length mismatch: lambdas has 2, grokked has 3"),
        ([0.01, np.nan, 1.0], [0, 1, 1], ValueError, "lambdas: expected finite numbers"),
        ([0.01, np.inf, 1.0], [0, 1, 1], ValueError, "lambdas: expected finite numbers"),
        ([0.01, -0.1, 1.0], [0, 1, 1], ValueError, "lambdas: weight decays must be >= 0"),
        ([0.01, 0.1, 1.0], [0, 2, 1], ValueError, "grokked: expected booleans"),
        ([], [], ValueError, "lambdas: expected at least one value"),
        ("0.1", [1], TypeError, "lambdas: expected a sequence of numbers"),
        ([0.01, "x", 1.0], [0, 1, 1], TypeError, "lambdas: expected a sequence of numbers"),
    ],
)
def test_lambda_c_refuses_malformed_input(lambdas, grokked, error, expected):
    with pytest.raises(error, match=expected):
        fit_lambda_c(lambdas, grokked, n_boot=10)


def test_lambda_c_zero_weight_decay_refused_unless_dropped(runs):
    lambdas, grokked, _ = runs
    with_zero = np.concatenate([np.zeros(5), lambdas])
    grokked_zero = np.concatenate([np.zeros(5, dtype=bool), grokked])
    with pytest.raises(ValueError, match="weight decay 0.*drop_zero=True"):
        fit_lambda_c(with_zero, grokked_zero, n_boot=10)
    dropped = fit_lambda_c(with_zero, grokked_zero, n_boot=50, drop_zero=True)
    plain = fit_lambda_c(lambdas, grokked, n_boot=50)
    assert dropped.n_dropped_zero == 5 and dropped.n_runs == plain.n_runs
    assert dropped.lambda_c == plain.lambda_c


@pytest.mark.parametrize("n_boot", [0, -5, 2.5, True])
def test_bad_n_boot_refused(runs, n_boot):
    lambdas, grokked, _ = runs
    with pytest.raises(ValueError, match="n_boot: expected a positive integer"):
        fit_lambda_c(lambdas, grokked, n_boot=n_boot)


def test_bad_seed_refused(runs):
    lambdas, grokked, _ = runs
    with pytest.raises(ValueError, match="seed: expected a non-negative integer"):
        fit_lambda_c(lambdas, grokked, n_boot=10, seed=-1)


# -------------------------------------------------------------------------------- ν


def test_nu_recovers_known_exponent_with_true_lambda_c(runs):
    lambdas, _, t_grok = runs
    fit = fit_nu(lambdas, t_grok, TRUE_LAMBDA_C, n_boot=N_BOOT, seed=0)
    assert fit.ci[0] < TRUE_NU < fit.ci[1]
    assert fit.nu == pytest.approx(TRUE_NU, abs=0.05)
    assert fit.amplitude == pytest.approx(1000.0, rel=0.25)
    above = np.isfinite(t_grok) & (lambdas > TRUE_LAMBDA_C)
    assert fit.n == int(above.sum()) and not fit.joint


def test_nu_point_estimate_is_ols_slope(runs):
    lambdas, _, t_grok = runs
    use = np.isfinite(t_grok) & (lambdas > TRUE_LAMBDA_C)
    slope, intercept = np.polyfit(np.log(lambdas[use] - TRUE_LAMBDA_C), np.log(t_grok[use]), 1)
    fit = fit_nu(lambdas, t_grok, TRUE_LAMBDA_C, n_boot=20)
    assert fit.nu == pytest.approx(-slope, rel=1e-10)
    assert fit.amplitude == pytest.approx(math.exp(intercept), rel=1e-10)


def test_nu_accepts_none_for_runs_that_did_not_grok(runs):
    lambdas, _, t_grok = runs
    as_list = [None if math.isnan(t) else float(t) for t in t_grok]
    assert fit_nu(lambdas, as_list, TRUE_LAMBDA_C, n_boot=20) == fit_nu(lambdas, t_grok, TRUE_LAMBDA_C, n_boot=20)


def test_joint_nu_ci_carries_lambda_c_uncertainty(runs, lambda_c_fit):
    """With λ_c estimated, holding it fixed gives a CI that is too narrow (here it misses
    the true ν); refitting λ_c in every resample widens it to cover the truth.

    Wider is not a theorem (a resample's λ_c also changes which runs are usable, and
    percentiles of finite bootstraps are noisy), but ν is steeply sensitive to λ_c through
    log(λ − λ_c), and on this fixture the joint CI is several times wider."""
    lambdas, grokked, t_grok = runs
    lambda_c = lambda_c_fit.lambda_c
    fixed = fit_nu(lambdas, t_grok, lambda_c, n_boot=N_BOOT, seed=0)
    joint = fit_nu(lambdas, t_grok, lambda_c, n_boot=N_BOOT, seed=0, joint=True, grokked=grokked)
    assert joint.joint and joint.nu == fixed.nu                 # same point estimate
    assert not fixed.ci[0] < TRUE_NU < fixed.ci[1]
    width = lambda ci: ci[1] - ci[0]
    assert width(joint.ci) >= width(fixed.ci)
    assert joint.ci[0] < TRUE_NU < joint.ci[1]
    assert joint.n_boot_ok >= 0.9 * N_BOOT


def test_nu_refuses_too_few_usable_runs():
    # Only 2 grokked runs above λ_c.
    with pytest.raises(FitError, match=r"^nu: need at least 3 grokked runs.*got 2 runs"):
        fit_nu([0.01, 0.1, 0.2, 0.3], [50.0, 10.0, 5.0, None], lambda_c=0.05, n_boot=10)


def test_nu_refuses_a_single_distinct_distance():
    with pytest.raises(FitError, match=r"2 distinct.*got 4 runs at 1 distinct"):
        fit_nu([0.1] * 4, [10.0, 11.0, 9.0, 10.5], lambda_c=0.05, n_boot=10)


@pytest.mark.parametrize(
    "kwargs, error, expected",
    [
        (dict(lambda_c=-0.1), ValueError, "lambda_c: expected a finite number >= 0"),
        (dict(lambda_c=float("nan")), ValueError, "lambda_c: expected a finite number >= 0"),
        (dict(joint=True), ValueError, "grokked: required when joint=True"),
        (dict(joint=True, grokked=[1, 1, 1, 1, 1]), ValueError, "grokked: disagrees with t_grok at index 4"),
        (dict(t_grok=[10.0, 5.0, -1.0, 2.0, None]), ValueError, "t_grok: grokking times must be > 0"),
        (dict(t_grok=[10.0, 5.0, np.inf, 2.0, None]), ValueError, "t_grok: expected finite numbers, or NaN/None"),
        (dict(t_grok=[10.0, 5.0, 3.0]), ValueError, "length mismatch"),
    ],
)
def test_nu_refuses_malformed_input(kwargs, error, expected):
    args = dict(lambdas=[0.1, 0.2, 0.3, 0.4, 0.5], t_grok=[10.0, 5.0, 3.0, 2.0, None], lambda_c=0.05, n_boot=10)
    args.update(kwargs)
    with pytest.raises(error, match=expected):
        fit_nu(**args)


# ------------------------------------------------------------------ per-λ summaries


def test_regime_table_counts_every_regime_in_lambda_order():
    table = regime_table([0.3, 0.1, 0.3, 0.1, 0.0, 0.1], ["grok", "collapse", "grok", "grok", "diverged", "too-short"])
    assert list(table) == [0.0, 0.1, 0.3]
    assert all(list(counts) == list(REGIMES) for counts in table.values())
    assert table[0.1] == {"grok": 1, "memorization": 0, "collapse": 1, "no-fit": 0, "too-short": 1, "anti-grok": 0,
                          "diverged": 0}
    assert table[0.3]["grok"] == 2 and sum(table[0.0].values()) == 1


def test_regime_table_refuses_unknown_regime_and_mismatch():
    with pytest.raises(ValueError, match="regimes: unknown regime.*'grokked'"):
        regime_table([0.1, 0.2], ["grok", "grokked"])
    with pytest.raises(ValueError, match="length mismatch"):
        regime_table([0.1, 0.2], ["grok"])
    with pytest.raises(TypeError, match="regimes"):
        regime_table([0.1], "grok")


def test_median_t_grok_ignores_non_grokked_runs():
    medians = median_t_grok([0.1, 0.1, 0.1, 0.2, 0.2, 0.05], [100, None, 300, 50, 70, np.nan])
    assert medians == {0.05: None, 0.1: 200.0, 0.2: 60.0}


# ------------------------------------------------------------------ saturating fit


def test_saturating_fit_recovers_known_parameters():
    rng = np.random.default_rng(3)
    c, a, b = 0.1, 0.8, 0.05
    x = np.repeat([4.0, 8.0, 16.0, 32.0, 64.0, 128.0], 5)
    y = c + a * (1 - np.exp(-b * x)) + rng.normal(0.0, 0.02, x.size)
    fit = fit_saturating(x, y, n_boot=200, seed=0)
    for name, true in [("c", c), ("a", a), ("b", b), ("plateau", c + a)]:
        low, high = fit.ci[name]
        assert low < true < high, name
    assert (fit.c, fit.a, fit.b) == pytest.approx((c, a, b), rel=0.15)
    assert fit.plateau == pytest.approx(fit.c + fit.a)
    assert fit.n == 30 and fit.n_boot_ok >= 180


def test_saturating_fit_refuses_too_few_points():
    with pytest.raises(FitError, match="^saturating: need at least 4 points.*got 4 points at 2 distinct"):
        fit_saturating([1.0, 1.0, 2.0, 2.0], [0.1, 0.2, 0.3, 0.4], n_boot=10)


# --------------------------------------------------------------- paired statistics


def test_paired_tests_known_answer():
    control = [1.0, 2.0, 3.0, 4.0, 5.0]
    treated = [2.0, 4.0, 3.5, 6.0, 5.5]
    result = paired_tests(control, treated)
    # Differences 1, 2, 0.5, 2, 0.5: mean 1.2, sample variance 2.3 / 4.
    sd = math.sqrt(2.3 / 4)
    assert result.n == 5
    assert result.mean_diff == pytest.approx(1.2)
    assert result.cohens_d == pytest.approx(1.2 / sd)
    assert result.t_statistic == pytest.approx(1.2 / (sd / math.sqrt(5)))
    assert result.t_pvalue == pytest.approx(2 * stats.t.sf(1.2 / (sd / math.sqrt(5)), df=4))
    reference_t = stats.ttest_rel(treated, control)
    reference_w = stats.wilcoxon(treated, control)
    assert result.t_statistic == pytest.approx(reference_t.statistic)
    assert result.t_pvalue == pytest.approx(reference_t.pvalue)
    assert result.wilcoxon_statistic == pytest.approx(reference_w.statistic)
    assert result.wilcoxon_pvalue == pytest.approx(reference_w.pvalue)
    assert result.wilcoxon_statistic == 0.0            # every difference is positive


def test_paired_tests_refuse_degenerate_input():
    with pytest.raises(ValueError, match="every paired difference equals 1.0"):
        paired_tests([1.0, 2.0, 3.0], [2.0, 3.0, 4.0])
    with pytest.raises(ValueError, match="need at least 2 pairs"):
        paired_tests([1.0], [2.0])
    with pytest.raises(ValueError, match="length mismatch: control has 2, treated has 3"):
        paired_tests([1.0, 2.0], [1.0, 2.0, 3.0])


def test_holm_bonferroni_hand_computed():
    # Sorted: 0.005·4 = 0.02, 0.01·3 = 0.03, 0.03·2 = 0.06, 0.04·1 = 0.04 → running max 0.06.
    adjusted = holm_bonferroni([0.01, 0.04, 0.03, 0.005])
    np.testing.assert_allclose(adjusted, [0.03, 0.06, 0.06, 0.02])
    # 0.7·2 = 1.4 is capped at 1, and monotonicity carries the cap to 0.8.
    np.testing.assert_allclose(holm_bonferroni([0.8, 0.7]), [1.0, 1.0])
    np.testing.assert_allclose(holm_bonferroni([0.01, 0.01]), [0.02, 0.02])
    np.testing.assert_allclose(holm_bonferroni([0.2]), [0.2])


def test_holm_bonferroni_refuses_non_probabilities():
    with pytest.raises(ValueError, match=r"pvalues: expected values in \[0, 1\]"):
        holm_bonferroni([0.1, 1.2])
    with pytest.raises(ValueError, match="pvalues: expected finite numbers"):
        holm_bonferroni([0.1, np.nan])


# ------------------------------------------------------------------ predictive value


def pairwise_auc(labels, score):
    """Hand definition: over all (positive, negative) pairs, win 1, tie 1/2."""
    pos = [s for y, s in zip(labels, score) if y]
    neg = [s for y, s in zip(labels, score) if not y]
    total = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return total / (len(pos) * len(neg))


def test_auc_small_example_with_ties():
    labels = [1, 1, 0, 0, 1, 0]
    score = [0.9, 0.5, 0.5, 0.1, 0.3, 0.3]
    # Positives 0.9, 0.5, 0.3 against negatives 0.5, 0.1, 0.3: 3 + 2.5 + 1.5 = 7 of 9 pairs.
    assert auc_mann_whitney(labels, score) == pytest.approx(7 / 9)
    assert bootstrap_auc(labels, score, n_boot=50).auc == pytest.approx(7 / 9)


def test_auc_matches_pairwise_definition_on_tied_scores():
    rng = np.random.default_rng(5)
    labels = rng.random(60) < 0.4
    score = rng.integers(0, 5, 60).astype(float)            # many ties
    assert auc_mann_whitney(labels, score) == pytest.approx(pairwise_auc(labels, score))


def test_roc_curve_area_is_the_mann_whitney_auc():
    fpr, tpr = roc_curve([1, 1, 0, 0, 1, 0], [0.9, 0.5, 0.5, 0.1, 0.3, 0.3])
    assert fpr.tolist() == pytest.approx([0, 0, 1 / 3, 2 / 3, 1]) and tpr.tolist() == pytest.approx([0, 1 / 3, 2 / 3, 1, 1])
    rng = np.random.default_rng(6)
    labels = rng.random(80) < 0.3
    score = rng.integers(0, 6, 80) + labels * rng.random(80)    # ties and some signal
    fpr, tpr = roc_curve(labels, score)
    assert np.all(np.diff(fpr) >= 0) and np.all(np.diff(tpr) >= 0) and fpr[-1] == tpr[-1] == 1
    assert np.sum(np.diff(fpr) * (tpr[1:] + tpr[:-1]) / 2) == pytest.approx(auc_mann_whitney(labels, score))


def test_auc_perfect_reversed_and_constant_scores():
    labels = np.array([0, 0, 0, 1, 1, 1, 1])
    score = np.arange(7.0)
    perfect = bootstrap_auc(labels, score, n_boot=100, seed=0)
    assert perfect.auc == 1.0 and perfect.ci == (1.0, 1.0)
    assert (perfect.n_pos, perfect.n_neg) == (4, 3)
    assert bootstrap_auc(labels, -score, n_boot=100).auc == 0.0
    assert auc_mann_whitney(labels, np.ones(7)) == 0.5


def test_bootstrap_auc_ci_and_baseline_difference():
    rng = np.random.default_rng(7)
    labels = rng.random(200) < 0.5
    informative = labels + rng.normal(0.0, 1.0, 200)
    noise = rng.normal(0.0, 1.0, 200)
    result = bootstrap_auc(labels, informative, n_boot=N_BOOT, seed=0, baseline_score=noise)
    assert result.ci[0] < result.auc < result.ci[1]
    assert result.baseline_auc == pytest.approx(auc_mann_whitney(labels, noise))
    assert result.diff == pytest.approx(result.auc - result.baseline_auc)
    assert result.diff_ci[0] > 0                            # the informative score adds value


def test_auc_refuses_single_class_and_bad_labels():
    with pytest.raises(ValueError, match="y_true: AUC needs both classes, got only positives"):
        bootstrap_auc([1, 1, 1], [0.1, 0.2, 0.3], n_boot=10)
    with pytest.raises(ValueError, match="got only negatives"):
        auc_mann_whitney([0, 0], [0.1, 0.2])
    with pytest.raises(ValueError, match="y_true: expected booleans"):
        auc_mann_whitney([0, 2], [0.1, 0.2])
    with pytest.raises(ValueError, match="length mismatch"):
        auc_mann_whitney([0, 1], [0.1, 0.2, 0.3])


def test_bootstrap_mae_with_baseline():
    y_true = [1.0, 2.0, 3.0, 4.0]
    result = bootstrap_mae(y_true, [1.5, 2.0, 2.0, 4.0], n_boot=N_BOOT, seed=0, baseline_pred=[2.5] * 4)
    assert result.mae == pytest.approx(1.5 / 4)
    assert result.baseline_mae == pytest.approx(1.0)
    assert result.diff == pytest.approx(1.5 / 4 - 1.0)
    assert result.ci[0] <= result.mae <= result.ci[1]
    assert result.diff_ci[0] <= result.diff <= result.diff_ci[1]
    assert result.n == 4
    plain = bootstrap_mae(y_true, [1.5, 2.0, 2.0, 4.0], n_boot=N_BOOT, seed=0)
    assert plain.baseline_mae is None and plain.diff_ci is None and plain.ci == result.ci


# ------------------------------------------------------------------ typed results (issue 29/31)

def _typed_runs(n_seeds=6):
    rng = np.random.default_rng(1)
    runs, traces = [], {}
    for s in range(n_seeds):
        for j, lam in enumerate((0.1, 0.3, 1.0, 3.0)):
            grokked = bool(rng.random() < 0.6)
            rid = f"r{s}-{j}"
            runs.append({"run_id": rid, "config": {"seed": s, "epochs": 200, "weight_decay": lam, "d_model": 16 * (j + 1),
                                                   "n_heads": 2},
                         "result": {"regime": "grok" if grokked else "memorization",
                                    "t_grok_epoch": 60 + 10 * s + j if grokked else None, "t_mem_epoch": 20}})
            traces[rid] = [{"epoch": e, "train_loss": 1 / e, "test_loss": 3 + rng.normal(0, 0.1),
                            "weight_norm": 30 + rng.normal(), "s_bar": 0.95 + rng.normal(0, 0.01),
                            # peak σ_H after grokking saturating in d/H = 8 (j + 1), as headdim expects
                            "sigma_h": 0.02 + 0.07 * -math.expm1(-0.15 * 8 * (j + 1)) * (e > 60) + rng.normal(0, 0.001)}
                           for e in range(10, 201, 10)]
    return runs, traces


def test_predictive_and_headdim_analyses_are_typed_and_their_json_keeps_its_keys_in_order():
    from fastdiag.analysis.headdim import HeaddimAnalysis, HeaddimBin, HeaddimFit, headdim_analysis
    from fastdiag.analysis.predict import GroksByHorizon, LogTGrokRegression, PredictiveAnalysis, predictive_analysis
    runs, traces = _typed_runs()
    pa = predictive_analysis(runs, traces, t0=40, n_boot=50)
    assert isinstance(pa, PredictiveAnalysis) and isinstance(pa.groks_by_horizon, GroksByHorizon)
    assert isinstance(pa.log_t_grok, LogTGrokRegression) and pa.error is None
    d = pa.to_dict()
    assert list(d) == ["t0", "t0_source", "test_frac", "split_seed", "n_boot", "alpha", "baseline_features",
                       "attention_features", "excluded", "n_cases", "train_seeds", "test_seeds", "n_train", "n_test",
                       "groks_by_horizon", "log_t_grok"]
    assert list(d["groks_by_horizon"]) == ["train_positives", "train_negatives", "test_positives", "test_negatives",
                                           "auc_full", "auc_full_ci", "auc_baseline", "auc_baseline_ci", "diff",
                                           "diff_ci", "verdict", "test_scores"]
    assert list(d["groks_by_horizon"]["test_scores"][0]) == ["run_id", "grokked", "baseline", "full"]
    assert list(d["log_t_grok"]) == ["n_train", "n_test", "mae_full", "mae_full_ci", "mae_baseline",
                                     "mae_baseline_ci", "diff", "diff_ci", "units", "verdict", "test_predictions"]
    assert isinstance(d["train_seeds"], list) and isinstance(d["log_t_grok"]["diff_ci"], list)
    assert json.loads(json.dumps(d)) == d
    # an analysis that cannot be made: the error, and none of the numbers
    failed = predictive_analysis([r for r in runs if r["config"]["seed"] == 0], traces, t0=40, n_boot=20).to_dict()
    assert list(failed)[-1] == "error" and "groks_by_horizon" not in failed

    def width(cfg):
        return cfg["d_model"], cfg["n_heads"]

    hd = headdim_analysis(runs, traces, width, n_boot=30)
    assert isinstance(hd, HeaddimAnalysis) and isinstance(hd.bins[0], HeaddimBin) and isinstance(hd.fit, HeaddimFit)
    d = hd.to_dict()
    assert list(d) == ["n_points", "n_skipped", "n_single_head", "points", "bins", "fit"]
    assert list(d["points"][0]) == ["run_id", "d_model", "n_heads", "d_per_head", "seed", "peak_sigma_h"]
    assert list(d["bins"][0]) == ["d_per_head", "n", "mean", "median", "std", "configs"]
    assert isinstance(d["bins"][0]["configs"][0], list)
    assert (list(d["fit"]) == ["error"]) if hd.fit.error else (list(d["fit"]) == ["c", "a", "b", "plateau", "ci", "n",
                                                                                      "n_boot_ok", "n_boot"])
    one = headdim_analysis(runs[:2], traces, width, n_boot=20).to_dict()
    assert list(one["fit"]) == ["error"]
