"""The one report of a result store, behind both ``fastdiag analyze`` (as text or JSON) and
``fastdiag plot`` (as figures): per group λ_c, ν, the regime table and median t_grok; for groups
trained to the horizon retention and stages; the per-head-dimension experiments; the intervention
experiments; and, when asked, the held-out predictive test."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from fastdiag.analysis.groups import Group, analyze_group, load_groups
from fastdiag.analysis.headdim import HeaddimAnalysis, headdim_analysis, headdim_sets
from fastdiag.analysis.paired import compare_arms
from fastdiag.analysis.predict import PredictiveAnalysis, predictive_analysis
from fastdiag.analysis.trajectories import retention_by_lambda, stage_table
from fastdiag.grokking.config import N_BOOT
from fastdiag.store import Store
from fastdiag.store import interventions as tables


@dataclass
class PredictSettings:
    """The held-out predictive test: prediction epoch (None: median t_mem), held-out seed fraction
    and the seed of the seed split."""

    t0: float | None = None
    test_frac: float = 0.5
    split_seed: int = 0


@dataclass
class Report:
    store: Store
    n_boot: int
    seed: int
    counts: dict
    groups: list[Group]
    analyses: list[dict]                                  # per group: analyze_group (+ retention, stages)
    failed_runs: list[dict]
    headdim: list[tuple[dict, list[dict], HeaddimAnalysis]] = field(default_factory=list)  # (shared config, runs, analysis)
    interventions: list[tuple[str, list[dict], dict]] = field(default_factory=list)  # (experiment, arm rows, comparison)
    predict: PredictiveAnalysis | None = None
    _traces: dict = field(default_factory=dict, repr=False)

    def trace(self, run_id: str) -> list[dict]:
        """A done run's trace, read from the store once."""
        if run_id not in self._traces:
            self._traces[run_id] = self.store.trace(run_id)
        return self._traces[run_id]

    def traces(self, runs) -> dict[str, list[dict]]:
        return {r["run_id"]: self.trace(r["run_id"]) for r in runs}

    def to_dict(self) -> dict:
        """The report as JSON-able data (what ``fastdiag analyze --json`` prints)."""
        out = {"store": str(self.store.path), "counts": self.counts, "n_boot": self.n_boot, "seed": self.seed,
               "groups": self.analyses, "failed_runs": self.failed_runs}
        if self.headdim:
            out["headdim"] = [{"config": shared, **analysis.to_dict()} for shared, _, analysis in self.headdim]
        if self.interventions:
            out["interventions"] = [{"experiment": exp_id, "config": rows[0]["config"], "settings": rows[0]["settings"],
                                     "comparison": comparison} for exp_id, rows, comparison in self.interventions]
        if self.predict is not None:
            out["predict"] = self.predict.to_dict()
        return out


def build_report(store: Store, heads_width: Callable[[dict], tuple[int, int] | None], *, n_boot: int = N_BOOT,
                 seed: int = 0, retention_threshold: float = 0.9, fit_max_lambda: float | None = None,
                 predict: PredictSettings | None = None) -> Report:
    """Everything ``store`` holds data for, analysed. ``heads_width(config)`` gives a run's (d_model,
    n_heads) (`fastdiag.grokking.build.heads_width`); the store stays open while the report is used
    (traces are read from it on demand)."""
    groups, counts = load_groups(store)
    report = Report(store=store, n_boot=n_boot, seed=seed, counts=counts, groups=groups, analyses=[],
                    failed_runs=[{"run_id": r["run_id"], "error": r["error"]} for r in store.runs("failed")])
    for g in groups:
        analysis = analyze_group(g, n_boot=n_boot, seed=seed, fit_max_lambda=fit_max_lambda)
        if not g.config.get("stop_at_grok", True):          # trained to the horizon
            analysis["retention"] = retention_by_lambda(g.runs, retention_threshold)
            analysis["stages"] = stage_table(g.runs, report.traces(g.runs))
        report.analyses.append(analysis)
    runs = store.runs("done")
    for shared, members in headdim_sets(runs, heads_width):
        report.headdim.append((shared, members, headdim_analysis(members, report.traces(members), heads_width,
                                                                 n_boot=n_boot, seed=seed)))
    for exp_id, rows in tables.load_experiments(store).items():
        report.interventions.append((exp_id, rows, compare_arms(rows)))
    if predict is not None:
        report.predict = predictive_analysis(runs, report.traces(runs), t0=predict.t0, test_frac=predict.test_frac,
                                             split_seed=predict.split_seed, n_boot=n_boot, seed=seed)
    return report
