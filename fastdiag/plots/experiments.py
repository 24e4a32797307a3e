"""Figures of the experiments beyond the sweep: the held-out predictive test, peak σ_H against d/H,
the intervention arms, and the stages of one long trajectory."""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib as mpl
import numpy as np
from matplotlib.ticker import NullFormatter

from fastdiag.analysis.headdim import HeaddimAnalysis
from fastdiag.analysis.predict import PredictiveAnalysis, roc_curve, seed_list
from fastdiag.plots.style import (ARM_COLOURS, FORMATS, STAGE_COLOURS, STYLE, figure, mathify, no_data,
                                  readable_log_axis, save, why, wrap)
from fastdiag.plots.sweep import quantiles


def predict_figure(pa: PredictiveAnalysis, stem: Path, formats=FORMATS) -> list[Path]:
    """`experiments.predictive_analysis` on the held-out seeds: ROC curves of "groks by the horizon"
    (baselines against baselines + s̄/σ_H) and predicted against true ln t_grok, written as
    ``stem``.png/.svg."""
    return save(draw_predict(pa), stem, formats)


def draw_predict(pa: PredictiveAnalysis):
    """The predictive-value figure (see ``predict_figure``) as a Figure: each panel's legend below it,
    off the data; titles wrapped to the panel's width; the seed lists as ``fastdiag analyze`` prints them."""
    models = (("baseline", "baselines", "#6c7a89"), ("full", "baselines + $\\bar{s}$, $\\sigma_H$", "#d35f0a"))
    with mpl.rc_context(STYLE):
        fig, axes = figure(9.0, 5.0, ncols=2)
        ax, bx = axes[0, 0], axes[0, 1]
        cls = pa.groks_by_horizon
        if cls is not None and cls.error is None:
            y = [c.grokked for c in cls.test_scores]
            for key, label, colour in models:
                fpr, tpr = roc_curve(y, [getattr(c, key) for c in cls.test_scores])
                auc, ci = (cls.auc_baseline, cls.auc_baseline_ci) if key == "baseline" else (cls.auc_full, cls.auc_full_ci)
                ax.plot(fpr, tpr, color=colour, linewidth=1.8,
                        label=f"{label}: AUC {auc:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]")
            ax.plot([0, 1], [0, 1], ":", color="#999999", linewidth=1)
            ax.set_title(wrap(f"groks by the horizon ({cls.test_positives} grokked, {cls.test_negatives} not); "
                               f"ΔAUC {cls.diff:+.3f} [{cls.diff_ci[0]:+.3f}, {cls.diff_ci[1]:+.3f}]: "
                               f"{mathify(cls.verdict)}", PANEL_TITLE_WIDTH))
            ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16))
        else:
            no_data(ax, cls.error if cls is not None else pa.error)
        ax.set_xlabel("false-positive rate")
        ax.set_ylabel("true-positive rate")
        reg = pa.log_t_grok
        if reg is not None and reg.error is None:
            truth = np.array([c.log_t_grok for c in reg.test_predictions])
            for key, label, colour in models:
                pred = np.array([getattr(c, key) for c in reg.test_predictions])
                mae, ci = (reg.mae_baseline, reg.mae_baseline_ci) if key == "baseline" else (reg.mae_full, reg.mae_full_ci)
                bx.scatter(truth, pred, s=26, color=colour, alpha=0.75, linewidths=0,
                           label=f"{label}: MAE {mae:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]")
            lo, hi = float(truth.min()), float(truth.max())
            pad = 0.1 * (hi - lo or 1.0)
            bx.plot([lo - pad, hi + pad], [lo - pad, hi + pad], ":", color="#999999", linewidth=1)
            bx.set_title(wrap(f"ln $t_{{\\mathrm{{grok}}}}$ ({reg.n_test} grokked test runs); ΔMAE {reg.diff:+.3f} "
                               f"[{reg.diff_ci[0]:+.3f}, {reg.diff_ci[1]:+.3f}]: {mathify(reg.verdict)}",
                              PANEL_TITLE_WIDTH))
            bx.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16))
        else:
            no_data(bx, reg.error if reg is not None else pa.error)
        bx.set_xlabel("true ln $t_{\\mathrm{grok}}$")
        bx.set_ylabel("predicted ln $t_{\\mathrm{grok}}$")
        seeds = (f"; train seeds {seed_list(pa.train_seeds)}, test seeds {seed_list(pa.test_seeds)}"
                 if pa.train_seeds is not None else "")
        fig.suptitle(wrap(f"Predictive value on held-out seeds at $t_0$ = {pa.t0:g} epochs "
                          f"({mathify(pa.t0_source)}){seeds}", 100))
        return fig


# characters of a panel title line in a two-panel 9-inch figure at the style's 10.5 pt (longer lines are clipped)
PANEL_TITLE_WIDTH = 48


def headdim_figure(analysis: HeaddimAnalysis, stem: Path, title_note: str = "", formats=FORMATS) -> list[Path]:
    """Peak σ_H after grokking against d/H (log x): runs as points, mean ± s.d. per d/H, the saturating
    fit σ_max = c + a(1 − e^(−b·d/H)) and its plateau CI (``experiments.headdim_analysis``)."""

    with mpl.rc_context(STYLE):
        fig, axes = figure(5.6, 4.3)
        ax = axes[0, 0]
        pts = analysis.points
        if pts:
            rng = np.random.default_rng(0)
            xs = np.array([p.d_per_head for p in pts], float)
            ax.scatter(xs * 10 ** rng.normal(0, 0.01, len(xs)), [p.peak_sigma_h for p in pts], s=22,
                       color="#3b8bc2", alpha=0.4, linewidths=0, label="runs", zorder=2)
            bins = analysis.bins
            bx = [b.d_per_head for b in bins]
            ax.errorbar(bx, [b.mean for b in bins], yerr=[b.std or 0.0 for b in bins], fmt="-o",
                        color="#0072b2", mfc="white", mew=1.8, capsize=4, linewidth=1.6, zorder=3,
                        label=f"mean ± s.d. ({min(b.n for b in bins)}–{max(b.n for b in bins)} runs per d/H)")
            fit = analysis.fit
            if fit.error is None:
                grid = np.logspace(math.log10(min(bx) / 1.2), math.log10(max(bx) * 1.2), 200)
                ax.plot(grid, fit.c + fit.a * -np.expm1(-fit.b * grid), "--", color="#d35f0a",
                        linewidth=1.6, label="saturating fit", zorder=4)
                ys = [p.peak_sigma_h for p in pts] + [b.mean + (b.std or 0.0) for b in bins] \
                    + [b.mean - (b.std or 0.0) for b in bins]
                pad = 0.1 * (max(ys) - min(ys) or abs(max(ys)) or 1e-3)
                view = (min(ys) - pad, max(ys) + pad)       # the data set the axes, not a wild CI
                lo, hi = fit.ci["plateau"]
                clipped = lo < view[0] or hi > view[1]
                ax.axhspan(max(lo, view[0]), min(hi, view[1]), color="#d35f0a", alpha=0.08, linewidth=0,
                           label="plateau $c + a$: 95% CI" + (" (beyond the axes)" if clipped else ""))
                ax.set_ylim(*view)
                title = (f"$\\sigma_{{max}} = c + a(1 - e^{{-b\\,d/H}})$: plateau {fit.plateau:.3g} "
                         f"[{fit.ci['plateau'][0]:.3g}, {fit.ci['plateau'][1]:.3g}]")
            else:
                title = wrap(f"no saturating fit: {why({'error': fit.error})}", 60)
            ax.set_xscale("log")
            ax.set_xticks(bx, [f"{x:g}" for x in bx])
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.legend(loc="best")
        else:
            title = "no grokked runs with σ_H after $t_{grok}$"
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="#666666")
        ax.set_xlabel("per-head dimension $d/H$")
        ax.set_ylabel("peak $\\sigma_H$ after grokking (nats)")
        ax.set_title("Per-head dimension and differentiation amplitude" + (f" ({title_note})" if title_note else "")
                     + "\n" + title)
        return save(fig, stem, formats)


def intervention_figure(rows: list[dict], traces: dict[str, list[dict]], stem: Path, formats=FORMATS) -> list[Path]:
    """Left: σ_H against epochs since the branch point, every seed's arm drawn thin and the median over
    seeds thick. Right: the peak σ_H after the branch, one dot per seed and arm (arms side by side, not
    joined: each arm is compared with the control, not with each other) and each arm's median as a bar,
    so a split response (some seeds move, some do not) stays visible (``exp_intervene`` store rows)."""

    arms = [a for a in ARM_COLOURS if any(r["arm"] == a for r in rows)]
    with mpl.rc_context(STYLE):
        fig, axes = figure(9.0, 4.2, ncols=2)
        ax, bx = axes[0, 0], axes[0, 1]
        for arm in arms:
            series = []
            for r in rows:
                if r["arm"] != arm:
                    continue
                b = r["branch_epoch"] or 0
                pts = [(row["epoch"] - b, row["sigma_h"]) for row in traces.get(r["arm_id"], [])
                       if row["epoch"] >= b and row.get("sigma_h") is not None]
                if pts:
                    series.append(pts)
                    ax.plot(*zip(*pts), color=ARM_COLOURS[arm], linewidth=0.6, alpha=0.35)
            q = quantiles(series)
            if q is None:
                continue
            epochs, med, _, _ = q
            ax.plot(epochs, med, color=ARM_COLOURS[arm], linewidth=2.0, label=f"{arm}: median of {len(series)} seeds")
        ax.set_xlabel("epochs after the branch point")
        ax.set_ylabel("$\\sigma_H$ (nats)")
        ax.set_title("thin: one seed; thick: median over seeds")
        ax.legend(loc="best")
        by_seed: dict = {}
        for r in rows:
            by_seed.setdefault(r["seed"], {})[r["arm"]] = r["metrics"].get("peak_sigma_h_after")
        offsets = np.linspace(-0.18, 0.18, max(1, len(by_seed)))
        for i, arm in enumerate(arms):
            v = [(j, vals[arm]) for j, vals in enumerate(by_seed.values()) if vals.get(arm) is not None]
            if not v:
                continue
            bx.scatter([i + offsets[j] for j, _ in v], [x for _, x in v], s=26, color=ARM_COLOURS[arm], alpha=0.8,
                       linewidths=0, zorder=3)
            median = float(np.median([x for _, x in v]))
            bx.plot([i - 0.3, i + 0.3], [median, median], color=ARM_COLOURS[arm], linewidth=2.2, zorder=4)
        bx.set_xticks(range(len(arms)), arms)
        bx.set_xlim(-0.6, len(arms) - 0.4)
        bx.set_ylabel("peak $\\sigma_H$ after the branch")
        bx.set_title(wrap("dots: seeds (spread sideways in seed order); bar: median", PANEL_TITLE_WIDTH))
        fig.suptitle(f"Interventions at the confirmed $\\sigma_H$ peak, {len(by_seed)} seeds: each arm branches "
                     "from its seed's checkpoint")
        return save(fig, stem, formats)


def stages_figure(trace: list[dict], segmentation: dict, stem: Path, title: str = "", formats=FORMATS) -> list[Path]:
    """Test accuracy, s̄ and σ_H of one long run (log epochs) with its stages shaded, written as
    ``stem``.png/.svg."""
    return save(draw_stages(trace, segmentation, title), stem, formats)


def draw_stages(trace: list[dict], segmentation: dict, title: str = ""):
    """The stages figure (see ``stages_figure``) as a Figure."""

    panels = [("test_acc", "test accuracy"), ("s_bar", "$\\bar{s}(t)$"), ("sigma_h", "$\\sigma_H(t)$")]
    with mpl.rc_context(STYLE):
        fig, axes = figure(7.5, 6.5, nrows=3, sharex=True)
        for i, (key, label) in enumerate(panels):
            ax = axes[i, 0]
            pts = [(r["epoch"], r[key]) for r in trace if r.get(key) is not None and r.get("epoch", 0) > 0]
            if pts:
                ax.plot(*zip(*pts), color="#333333", linewidth=0.9)
            for st in segmentation["stages"]:
                ax.axvspan(st["start_epoch"], max(st["end_epoch"], st["start_epoch"] * 1.01),
                           color=STAGE_COLOURS[st["stage"]], alpha=0.25, linewidth=0)
                if i == 0:
                    ax.text(math.sqrt(st["start_epoch"] * max(st["end_epoch"], st["start_epoch"])), 1.02,
                            st["stage"].replace("second ", "2nd ").replace("re-synchronisation", "re-sync."),
                            transform=ax.get_xaxis_transform(), ha="center", va="bottom", fontsize=7.5)
            ax.set_ylabel(label)
        readable_log_axis(axes[-1, 0].xaxis)
        axes[-1, 0].set_xlabel("training epoch")
        fig.suptitle(wrap(title or "Stages of a long run", 80) + "\n")
        return fig
