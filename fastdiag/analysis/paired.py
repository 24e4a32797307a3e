"""Paired tests across seeds (t-test, Wilcoxon, Cohen's d), Holm–Bonferroni, and the comparison of each
intervention arm with the control."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy import stats

from fastdiag.analysis.bootstrap import as_float_array, require_same_length
from fastdiag.grokking.config import ARMS, TESTED_METRICS


@dataclass(frozen=True)
class PairedTests:
    mean_diff: float                           # mean of (treated − control)
    t_statistic: float
    t_pvalue: float
    wilcoxon_statistic: float
    wilcoxon_pvalue: float
    cohens_d: float                            # mean diff / std of diffs (ddof 1)
    n: int


def paired_tests(control: Sequence[float], treated: Sequence[float]) -> PairedTests:
    """Paired comparison of treated vs control (same seeds): differences are treated − control."""
    control = as_float_array(control, "control")
    treated = as_float_array(treated, "treated")
    require_same_length(control=control, treated=treated)
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
    p = as_float_array(pvalues, "pvalues")
    if ((p < 0) | (p > 1)).any():
        raise ValueError(f"pvalues: expected values in [0, 1], got {float(p[(p < 0) | (p > 1)][0])!r}")
    m = len(p)
    order = np.argsort(p, kind="stable")
    stepped = np.maximum.accumulate((m - np.arange(m)) * p[order])
    adjusted = np.empty(m)
    adjusted[order] = np.minimum(stepped, 1.0)
    return adjusted


def compare_arms(rows: Sequence[dict]) -> dict:
    """Paired tests of each treated arm against the control over the seeds that have all arms."""
    by_seed: dict[int, dict[str, dict]] = {}
    for r in rows:
        by_seed.setdefault(r["seed"], {})[r["arm"]] = r["metrics"]
    seeds = sorted(s for s, arms in by_seed.items() if all(a in arms for a in ARMS))
    tests = []
    for arm in ARMS[1:]:
        for metric in TESTED_METRICS:
            pairs = [(by_seed[s]["control"].get(metric), by_seed[s][arm].get(metric)) for s in seeds]
            pairs = [(c, t) for c, t in pairs if c is not None and t is not None]
            entry = {"arm": arm, "metric": metric, "n": len(pairs),
                     "control_mean": float(np.mean([c for c, _ in pairs])) if pairs else None,
                     "arm_mean": float(np.mean([t for _, t in pairs])) if pairs else None}
            try:
                pt = paired_tests([c for c, _ in pairs], [t for _, t in pairs])
                entry.update({"mean_diff": pt.mean_diff, "t": pt.t_statistic, "t_p": pt.t_pvalue,
                              "wilcoxon": pt.wilcoxon_statistic, "wilcoxon_p": pt.wilcoxon_pvalue,
                              "cohens_d": pt.cohens_d})
            except ValueError as exc:
                entry["mean_diff"] = (float(np.mean([t - c for c, t in pairs])) if pairs else None)
                entry["error"] = " ".join(str(exc).split())
            tests.append(entry)
    for key in ("t_p", "wilcoxon_p"):
        family = [e for e in tests if e.get(key) is not None and math.isfinite(e[key])]
        if family:
            adjusted = holm_bonferroni([e[key] for e in family])
            for e, p in zip(family, adjusted):
                e[key + "_holm"] = float(p)
    return {"seeds": seeds, "n_seeds": len(seeds), "tests": tests,
            "holm_families": "t-test p-values of all (arm, metric) tests; Wilcoxon p-values likewise"}
