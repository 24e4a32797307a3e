"""Figures of a λ sweep, each written as PNG and SVG.

* ``regime_diagram``  λ (log x) × model size N (log y): runs marked by regime, the λ_c line(s),
  regions shaded (memorisation below λ_c, developmental, collapse at large λ where collapse runs exist).
* ``p_grok_figure``   P(grok) per λ with 95 % Wilson intervals, the logistic fit and its bootstrap band.
* ``t_grok_figure``   t_grok against λ − λ_c on log-log axes with the power-law fit.
* ``trajectories_figure``  test accuracy, s̄ and σ_H per λ: median and IQR over ≥ 5 seeds while all
  run (dotted: survivors only), each run drawn for fewer.

When a fit is impossible the figure is drawn without it and its title says why.
"""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib as mpl
import numpy as np
from matplotlib.lines import Line2D

from fastdiag.analysis.binomial import wilson_interval
from fastdiag.analysis.bootstrap import FitError
from fastdiag.analysis.fits import lambda_c_point, logistic
from fastdiag.analysis.groups import in_fit_range
from fastdiag.analysis.regions import regime_counts, regime_regions
from fastdiag.plots.style import (FORMATS, REGIME_STYLE, REGION_COLOURS, STYLE, count_number, figure, fmt_lambda,
                                  readable_log_axis, save, why, wrap)


def regime_diagram(groups, analyses, stem: Path, formats=FORMATS) -> list[Path]:
    """All groups on one λ × N diagram, written as ``stem``.png/.svg."""
    return save(draw_regime_diagram(groups, analyses), stem, formats)


def draw_regime_diagram(groups, analyses):
    """The regime diagram as a Figure (see ``regime_diagram``)."""
    with mpl.rc_context(STYLE):
        fig, axes = figure(7.5, 4.6)
        ax = axes[0, 0]
        rng = np.random.default_rng(0)
        points = {r: ([], []) for r in REGIME_STYLE}
        all_lams, zero_count, sizes = [], 0, []
        for g in groups:
            n = g.n_params or 1
            sizes.append(n)
            for run in g.runs:
                lam = float(run["config"]["weight_decay"])
                regime = run["result"].get("regime")
                if lam <= 0:
                    zero_count += 1
                    continue
                if regime not in points:
                    continue
                all_lams.append(lam)
                points[regime][0].append(lam * 10 ** rng.normal(0, 0.012))
                points[regime][1].append(n * 10 ** rng.normal(0, 0.025))
        handles = []
        for regime, (xs, ys) in points.items():
            if xs:
                marker, colour, label = REGIME_STYLE[regime]
                ax.scatter(xs, ys, marker=marker, c=colour, s=42 if marker != "x" else 46, alpha=0.7,
                           linewidths=1.6 if marker in "x" else 0.5, zorder=3)
                handles.append(Line2D([], [], marker=marker, color=colour, linestyle="none", label=label,
                                      markersize=7))
        readable_log_axis(ax.xaxis)
        readable_log_axis(ax.yaxis, count_number)
        if all_lams:
            lo, hi = min(all_lams) / 2, max(all_lams) * 2
        else:
            lo, hi = 1e-3, 10.0
        ax.set_xlim(lo, hi)
        distinct_sizes = sorted(set(sizes)) or [1]
        ymin, ymax = distinct_sizes[0] / 2.5, distinct_sizes[-1] * 2.5
        ax.set_ylim(ymin, ymax)

        # λ_c per group; the reference one (the group with the most runs and a fit) sets the regions.
        fitted = [(g, a) for g, a in zip(groups, analyses) if "lambda_c" in a["lambda_c"]]
        reference = max(fitted, key=lambda ga: len(ga[0].runs), default=None)
        single = len(distinct_sizes) == 1
        for g, a in fitted:
            lc = a["lambda_c"]["lambda_c"]
            if single or len(fitted) == 1:
                ax.axvline(lc, color="#6c7a89", linestyle="--", linewidth=1.2, zorder=2)
            else:
                n = g.n_params or 1
                ax.plot([lc, lc], [n / 1.8, n * 1.8], color="#6c7a89", linestyle="--", linewidth=1.4, zorder=2)
        if fitted:
            label = (f"$\\lambda_c = {fmt_lambda(reference[1]['lambda_c']['lambda_c'])}$" if len(fitted) == 1
                     else "$\\lambda_c$ per size")
            handles.append(Line2D([], [], color="#6c7a89", linestyle="--", label=label))

        lam_c = reference[1]["lambda_c"]["lambda_c"] if reference else None
        regions = regime_regions(regime_counts(r for g in groups for r in g.runs if r["result"].get("regime") in points),
                                 lam_c, lo, hi)
        for name, x0, x1 in regions:
            ax.axvspan(x0, x1, color=REGION_COLOURS[name], alpha=0.7, zorder=0, linewidth=0)
            ax.text(math.sqrt(x0 * x1), 0.95, name, transform=ax.get_xaxis_transform(), ha="center",
                    va="top", fontsize=9.5, color="#444444")

        ax.set_xlabel("Weight decay $\\lambda$")
        ax.set_ylabel("Model parameters $N$")
        title = "Regime diagram: $\\lambda \\times N$"
        notes = []
        if not fitted:
            reasons = list(dict.fromkeys(why(a["lambda_c"]).split(", got")[0] for a in analyses))
            notes.append(f"no $\\lambda_c$ fit: {'; '.join(reasons)}" if reasons else "no finished runs")
        elif len(fitted) < len(groups):
            notes.append(f"$\\lambda_c$ fitted for {len(fitted)} of {len(groups)} groups")
        if len(fitted) > 1 and reference is not None:
            notes.append(f"regions from {reference[0].label}")
        if zero_count:
            notes.append(f"{zero_count} run(s) at $\\lambda = 0$ not shown (log axis)")
        notes.append("points jittered (log-normal, s.d. 3 % in $\\lambda$, 6 % in $N$) so that seeds do not hide "
                     "each other")
        if notes:
            title += "\n" + wrap("; ".join(notes), 85)
        ax.set_title(title)
        if handles:
            fig.legend(handles=handles, loc="outside upper center", ncol=min(6, len(handles)))
        return fig


def _band(lambdas, grokked, grid, n_boot: int, seed: int):
    """95 % pointwise band of the logistic over ``grid`` from a run bootstrap (None if unavailable)."""
    lambdas = np.asarray(lambdas, float)
    grokked = np.asarray(grokked, bool)
    keep = lambdas > 0
    lambdas, grokked = lambdas[keep], grokked[keep]
    rng = np.random.default_rng(seed)
    curves = []
    for _ in range(n_boot):
        idx = rng.integers(0, len(lambdas), len(lambdas))
        try:
            log_lc, k = lambda_c_point(lambdas[idx], grokked[idx])
        except (FitError, ValueError):
            continue
        curves.append(logistic(np.log10(grid), log_lc, k))   # log λ_c: λ_c may underflow
    if len(curves) < max(10, n_boot // 2):
        return None
    return np.percentile(np.asarray(curves), [2.5, 97.5], axis=0)


def p_grok_figure(group, analysis: dict, stem: Path, n_band: int = 300, seed: int = 0,
                  formats=FORMATS) -> list[Path]:
    """P(grok) per λ with the logistic fit, written as ``stem``.png/.svg."""
    return save(draw_p_grok(group, analysis, n_band=n_band, seed=seed), stem, formats)


def draw_p_grok(group, analysis: dict, n_band: int = 300, seed: int = 0):
    """P(grok) per λ with 95 % Wilson intervals, the logistic fit and its bootstrap band, as a Figure."""
    lambdas, regimes, grokked, _ = group.arrays()
    lam = np.asarray(lambdas, float)
    g = np.asarray(grokked, bool)
    with mpl.rc_context(STYLE):
        fig, axes = figure(5.6, 4.6)
        ax = axes[0, 0]
        positive = lam > 0
        distinct = np.unique(lam[positive])
        if distinct.size:
            k = np.array([int(g[lam == x].sum()) for x in distinct])
            n = np.array([int((lam == x).sum()) for x in distinct])
            frac = k / n
            bounds = np.array([wilson_interval(int(a), int(b)) for a, b in zip(k, n)])
            err = np.clip(np.vstack([frac - bounds[:, 0], bounds[:, 1] - frac]), 0, None)   # rounding: 1e-17 below 0
            runs = f"{n.min()}" if n.min() == n.max() else f"{n.min()}–{n.max()}"
            ax.errorbar(distinct, frac, yerr=err, fmt="o", color="#0072b2", mfc="white", mew=1.8, capsize=4,
                        label=f"fraction grokked, 95% Wilson interval ({runs} runs per $\\lambda$)", zorder=3)
            lo, hi = distinct.min() / 2, distinct.max() * 2
        else:
            lo, hi = 1e-3, 10.0
        fit = analysis["lambda_c"]
        if "lambda_c" in fit:
            grid = np.logspace(math.log10(lo), math.log10(hi), 200)
            fitted = np.array(in_fit_range(lam, analysis.get("fit_max_lambda")))
            band = _band(lam[fitted], g[fitted], grid, n_band, seed)
            if band is not None:
                ax.fill_between(grid, band[0], band[1], color="#e1812c", alpha=0.22, linewidth=0,
                                label=f"95% bootstrap band ({n_band} resamples)")
            ax.plot(grid, logistic(np.log10(grid), math.log10(fit["lambda_c"]), fit["k"]), color="#e1812c", linewidth=1.8,
                    label="logistic fit")
            ax.axvline(fit["lambda_c"], color="#6c7a89", linestyle="--", linewidth=1.1, label="$\\lambda_c$")
            ax.axvspan(*fit["ci"], color="#6c7a89", alpha=0.08, linewidth=0)
            title = (f"$\\lambda_c = {fit['lambda_c']:.3g}$  95% CI $[{fit['ci'][0]:.3g}, {fit['ci'][1]:.3g}]$,"
                     f"  $k = {fit['k']:.2f}$")
        else:
            title = wrap(f"no logistic fit: {why(fit)}", 58)
        readable_log_axis(ax.xaxis)
        ax.set_xlim(lo, hi)
        ax.set_ylim(-0.06, 1.06)
        ax.set_xlabel("Weight decay $\\lambda$")
        ax.set_ylabel("$P(\\mathrm{grok})$")
        n_zero = int((~positive).sum())
        sub = f"{group.label} — {len(lam)} runs" + (f", {n_zero} at $\\lambda=0$ not shown" if n_zero else "")
        if analysis.get("fit_max_lambda") is not None and lam.max(initial=0) > analysis["fit_max_lambda"]:
            ax.axvspan(analysis["fit_max_lambda"], hi, color="#999999", alpha=0.12, linewidth=0)
            sub += f"; $\\lambda > {analysis['fit_max_lambda']:g}$ (grey) not fitted"
        ax.set_title(title + "\n" + wrap(sub, 60))
        handles, _ = ax.get_legend_handles_labels()
        if handles:
            fig.legend(loc="outside lower center", ncol=1)      # two columns ran off the 5.6-inch figure
        return fig


def t_grok_figure(group, analysis: dict, stem: Path, formats=FORMATS) -> list[Path]:
    """t_grok against λ − λ_c with the power-law fit, written as ``stem``.png/.svg."""
    return save(draw_t_grok(group, analysis), stem, formats)


def draw_t_grok(group, analysis: dict):
    """t_grok against λ − λ_c (log-log) with the power-law fit, as a Figure; without a λ_c fit, against λ."""
    lambdas, regimes, grokked, t_grok = group.arrays()
    lam = np.asarray(lambdas, float)
    t = np.asarray(t_grok, float)
    with mpl.rc_context(STYLE):
        fig, axes = figure(5.6, 4.0)
        ax = axes[0, 0]
        fit = analysis["lambda_c"]
        nu = analysis["nu"]
        drawn = False
        if "lambda_c" in fit:
            lc = fit["lambda_c"]
            ok = np.isfinite(t) & (lam > lc)
            if ok.any():
                x = lam[ok] - lc
                ax.scatter(x, t[ok], s=28, color="#3b8bc2", alpha=0.45, linewidths=0,
                           label=f"grokked runs ({int(ok.sum())})", zorder=3)
                drawn = True
                if "nu" in nu:
                    grid = np.logspace(math.log10(x.min() / 1.3), math.log10(x.max() * 1.3), 100)
                    ax.plot(grid, nu["amplitude"] * grid ** (-nu["nu"]), color="#d35f0a", linewidth=1.8,
                            label=f"fit $t = A(\\lambda-\\lambda_c)^{{-\\nu}}$, $\\nu = {nu['nu']:.2f}$")
            xlabel = f"$\\lambda - \\lambda_c$  ($\\lambda_c = {lc:.3g}$)"
        else:
            ok = np.isfinite(t) & (lam > 0)
            if ok.any():
                ax.scatter(lam[ok], t[ok], s=28, color="#3b8bc2", alpha=0.45, linewidths=0,
                           label=f"grokked runs ({int(ok.sum())})", zorder=3)
                drawn = True
            # without λ_c there is no λ − λ_c: the axis says what is drawn instead, and why
            xlabel = "Weight decay $\\lambda$  (no $\\lambda_c$ fit, so not $\\lambda - \\lambda_c$)"
        if "nu" in nu:
            joint = analysis.get("nu_joint", {})
            title = f"$\\nu = {nu['nu']:.3g}$  95% CI $[{nu['ci'][0]:.3g}, {nu['ci'][1]:.3g}]$ ($\\lambda_c$ fixed)"
            if "nu" in joint:
                title += f"\njoint CI $[{joint['ci'][0]:.3g}, {joint['ci'][1]:.3g}]$ ($\\lambda_c$ refitted)"
        else:
            title = wrap(f"no power-law fit: {why(nu)}", 58)
        if drawn:
            readable_log_axis(ax.xaxis)
            readable_log_axis(ax.yaxis)
            fig.legend(loc="outside lower center", ncol=2)          # below the axes, never over the points
        else:
            ax.text(0.5, 0.5, "no grokked runs to show", transform=ax.transAxes, ha="center", va="center",
                    color="#666666")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("$t_{\\mathrm{grok}}$ (epochs)")
        ax.set_title(title + "\n" + wrap(group.label, 60))
        return fig


def quantiles(series: list[list[tuple[int, float]]]):
    """Per epoch over runs: (epochs, median, q25, q75, runs per epoch)."""
    by_epoch: dict[int, list[float]] = {}
    for rows in series:
        for epoch, value in rows:
            by_epoch.setdefault(epoch, []).append(value)
    epochs = np.array(sorted(by_epoch))
    if epochs.size == 0:
        return None
    q = np.array([np.percentile(by_epoch[e], [50, 25, 75]) for e in epochs])
    return epochs, q[:, 0], q[:, 1], q[:, 2]


# Below this many runs a λ's runs are drawn one by one (a median and IQR of 2-4 runs mislead).
FEW_RUNS = 5


def trajectories_figure(group, traces: dict[str, list[dict]], stem: Path, formats=FORMATS) -> list[Path]:
    """Median and IQR across seeds, per λ, of test accuracy, s̄ and σ_H against epoch (log x), written
    as ``stem``.png/.svg."""
    return save(draw_trajectories(group, traces), stem, formats)


def draw_trajectories(group, traces: dict[str, list[dict]]):
    """The trajectories figure (see ``trajectories_figure``) as a Figure."""

    panels = [("test_acc", "test accuracy"), ("s_bar", "$\\bar{s}(t)$"), ("sigma_h", "$\\sigma_H(t)$ (nats)")]
    by_lambda: dict[float, list[str]] = {}
    for run in group.runs:
        by_lambda.setdefault(float(run["config"]["weight_decay"]), []).append(run["run_id"])
    lambdas = sorted(by_lambda)
    with mpl.rc_context(STYLE):
        fig, axes = figure(8.2, 6.8, nrows=3, sharex=True)
        cmap = mpl.colormaps["viridis"]
        colours = {lam: cmap(0.9 * i / max(1, len(lambdas) - 1)) for i, lam in enumerate(lambdas)}
        any_data = {key: False for key, _ in panels}
        for row, (key, label) in enumerate(panels):
            ax = axes[row, 0]
            for lam in lambdas:
                series = []
                for rid in by_lambda[lam]:
                    pts = [(r["epoch"], r[key]) for r in traces.get(rid, [])
                           if r.get(key) is not None and r.get("epoch") and
                           isinstance(r[key], (int, float)) and math.isfinite(r[key])]
                    if pts:
                        series.append(pts)
                if not series:
                    continue
                any_data[key] = True
                name = f"$\\lambda = {fmt_lambda(lam)}$ ({len(series)} run{'s' * (len(series) > 1)})"
                if len(series) < FEW_RUNS:         # a median of 2 runs is a curve neither run had: draw each
                    for i, pts in enumerate(series):
                        ax.plot(*zip(*pts), color=colours[lam], linewidth=0.9, alpha=0.7, label=name if i == 0 else None)
                    continue
                epochs, med, q25, q75 = quantiles(series)
                everyone = np.array([sum(e in dict(pts) for pts in series) == len(series) for e in epochs])
                full = np.where(everyone, med, np.nan)
                survivors = np.where(~everyone, med, np.nan)
                ax.plot(epochs, full, color=colours[lam], linewidth=1.7, label=name)
                ax.plot(epochs, survivors, color=colours[lam], linewidth=1.2, linestyle=":")
                ax.fill_between(epochs, q25, q75, where=everyone, color=colours[lam], alpha=0.18, linewidth=0)
            ax.set_ylabel(label)
            if not any_data[key]:
                ax.text(0.5, 0.5, f"no {label.split(' (')[0]} values (no attention layers in {group.config['arch']})"
                        if key != "test_acc" else "no data", transform=ax.transAxes, ha="center",
                        va="center", color="#666666")
        if any(any_data.values()):
            readable_log_axis(axes[-1, 0].xaxis)
        axes[-1, 0].set_xlabel("training epoch")
        if any_data["test_acc"]:
            axes[0, 0].set_ylim(-0.03, 1.03)
            handles, labels = axes[0, 0].get_legend_handles_labels()
            fig.legend(handles, labels, loc="outside right center", ncol=1 if len(labels) <= 14 else 2)
        fig.suptitle(wrap(f"Trajectories per $\\lambda$: {group.label}", 80)
                     + "\n" + wrap(f"$\\lambda$ with ≥ {FEW_RUNS} runs: median (band: IQR) while all its runs go on, "
                                   "dotted once some have stopped (runs stop at grokking: the dotted part is the "
                                   "survivors, the late grokkers); fewer runs: each run drawn", 95))
        return fig
