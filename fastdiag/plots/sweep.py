"""Figures of a sweep (matplotlib, Agg, no pyplot state), each written as PNG and SVG.

* ``regime_diagram``  λ (log x) × model size N (log y): runs marked by regime, the λ_c line(s),
  regions shaded (memorisation below λ_c, developmental, collapse at large λ where collapse runs exist).
* ``p_grok_figure``   P(grok) per λ with binomial error bars, the logistic fit and its bootstrap band.
* ``t_grok_figure``   t_grok against λ − λ_c on log-log axes with the power-law fit.
* ``trajectories_figure``  median and IQR over seeds of test accuracy, s̄ and σ_H per λ.

When a fit is impossible the figure is drawn without it and its title says why.
"""
from __future__ import annotations

import math
import textwrap
from pathlib import Path

import numpy as np

from fastdiag.analysis.fits import FitError, _lambda_c_point, _logistic, roc_curve
from fastdiag.sweep import file_safe, in_fit_range
from fastdiag.grokking.train import atomic_path

REGIME_STYLE = {   # regime: (marker, colour, label)
    "grok": ("o", "#111111", "grok"),
    "anti-grok": ("^", "#8e44ad", "anti-grok"),
    "memorization": ("x", "#0072b2", "memorization"),
    "collapse": ("X", "#e69f00", "collapse"),
    "diverged": ("s", "#d55e00", "diverged"),
}
REGION_COLOURS = {"memorization": "#dce8f5", "developmental": "#e6f3fa", "collapse": "#fbeedb"}
STYLE = {
    "font.family": "serif",
    "font.size": 10,
    "axes.titlesize": 10.5,
    "axes.labelsize": 11,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.25,
    "legend.frameon": False,
    "legend.fontsize": 9,
    "mathtext.fontset": "dejavuserif",
    "savefig.dpi": 150,
    "svg.fonttype": "none",          # SVG text stays text (searchable, editable)
}
FORMATS = ("png", "svg")


def _figure(width: float, height: float, nrows: int = 1, ncols: int = 1, **kw):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False, **kw)
    return fig, axes


def _save(fig, stem: Path, formats=FORMATS) -> list[Path]:
    paths = []
    for fmt in formats:
        path = stem.with_suffix(f".{fmt}")
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format=fmt)
        paths.append(path)
    return paths


def _wrap(text: str, width: int = 90) -> str:
    return "\n".join(textwrap.wrap(" ".join(str(text).split()), width))


def _fmt_lambda(x: float) -> str:
    return f"{x:.3g}"


def _why(fit: dict) -> str:
    """The reason part of a FitError message, shortened for a title."""
    msg = fit.get("error", "")
    return msg.split(": ", 1)[1] if ": " in msg else msg


# ============================================================================ regime diagram


def regime_diagram(groups, analyses, stem: Path, formats=FORMATS) -> list[Path]:
    """All groups on one λ × N diagram."""
    import matplotlib as mpl
    from matplotlib.lines import Line2D

    with mpl.rc_context(STYLE):
        fig, axes = _figure(7.5, 4.6)
        ax = axes[0, 0]
        rng = np.random.default_rng(0)
        points = {r: ([], []) for r in REGIME_STYLE}
        all_lams, zero_count, sizes = [], 0, []
        per_lambda: dict[float, dict[str, int]] = {}
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
                per_lambda.setdefault(lam, {}).setdefault(regime, 0)
                per_lambda[lam][regime] += 1
        handles = []
        for regime, (xs, ys) in points.items():
            if xs:
                marker, colour, label = REGIME_STYLE[regime]
                ax.scatter(xs, ys, marker=marker, c=colour, s=42 if marker != "x" else 46, alpha=0.7,
                           linewidths=1.6 if marker in "x" else 0.5, zorder=3)
                handles.append(Line2D([], [], marker=marker, color=colour, linestyle="none", label=label,
                                      markersize=7))
        ax.set_xscale("log")
        ax.set_yscale("log")
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
            label = (f"$\\lambda_c = {_fmt_lambda(reference[1]['lambda_c']['lambda_c'])}$" if len(fitted) == 1
                     else "$\\lambda_c$ per size")
            handles.append(Line2D([], [], color="#6c7a89", linestyle="--", label=label))

        # Regions.
        lam_c = reference[1]["lambda_c"]["lambda_c"] if reference else None
        grok_lams = [lam for lam, c in per_lambda.items() if c.get("grok", 0) + c.get("anti-grok", 0) > 0]
        collapse_edge = None
        if grok_lams:
            top_grok = max(grok_lams)
            collapse_lams = [lam for lam, c in per_lambda.items()
                             if lam > top_grok and c.get("collapse", 0) * 2 >= sum(c.values())]
            if collapse_lams:
                first = min(collapse_lams)
                below = [lam for lam in per_lambda if top_grok <= lam < first]
                collapse_edge = math.sqrt(max(below) * first) if below else first / 1.5
        regions = []
        if lam_c is not None and lo < lam_c:
            regions.append(("memorization", lo, min(lam_c, hi)))
        if lam_c is not None:
            regions.append(("developmental", max(lam_c, lo), collapse_edge or hi))
        if collapse_edge is not None:
            regions.append(("collapse", collapse_edge, hi))
        for name, x0, x1 in regions:
            if x1 <= x0:
                continue
            ax.axvspan(x0, x1, color=REGION_COLOURS[name], alpha=0.7, zorder=0, linewidth=0)
            ax.text(math.sqrt(x0 * x1), 0.95, name, transform=ax.get_xaxis_transform(), ha="center",
                    va="top", fontsize=9.5, color="#444444")

        ax.set_xlabel("Weight decay $\\lambda$")
        ax.set_ylabel("Model parameters $N$")
        title = "Regime diagram: $\\lambda \\times N$"
        notes = []
        if not fitted:
            reasons = list(dict.fromkeys(_why(a["lambda_c"]).split(", got")[0] for a in analyses))
            notes.append(f"no $\\lambda_c$ fit: {'; '.join(reasons)}" if reasons else "no finished runs")
        elif len(fitted) < len(groups):
            notes.append(f"$\\lambda_c$ fitted for {len(fitted)} of {len(groups)} groups")
        if len(fitted) > 1 and reference is not None:
            notes.append(f"regions from {reference[0].label}")
        if zero_count:
            notes.append(f"{zero_count} run(s) at $\\lambda = 0$ not shown (log axis)")
        if notes:
            title += "\n" + _wrap("; ".join(notes), 85)
        ax.set_title(title)
        if handles:
            fig.legend(handles=handles, loc="outside upper center", ncol=min(6, len(handles)))
        return _save(fig, stem, formats)


# ============================================================================ P(grok)


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
            log_lc, k = _lambda_c_point(lambdas[idx], grokked[idx])
        except (FitError, ValueError):
            continue
        curves.append(_logistic(np.log10(grid), log_lc, k))   # log λ_c: λ_c may underflow
    if len(curves) < max(10, n_boot // 2):
        return None
    return np.percentile(np.asarray(curves), [2.5, 97.5], axis=0)


def p_grok_figure(group, analysis: dict, stem: Path, n_band: int = 300, seed: int = 0,
                  formats=FORMATS) -> list[Path]:
    import matplotlib as mpl

    lambdas, regimes, grokked, _ = group.arrays()
    lam = np.asarray(lambdas, float)
    g = np.asarray(grokked, bool)
    with mpl.rc_context(STYLE):
        fig, axes = _figure(5.6, 4.6)
        ax = axes[0, 0]
        positive = lam > 0
        distinct = np.unique(lam[positive])
        if distinct.size:
            frac = np.array([g[lam == x].mean() for x in distinct])
            n = np.array([(lam == x).sum() for x in distinct])
            err = np.sqrt(frac * (1 - frac) / n)
            ax.errorbar(distinct, frac, yerr=err, fmt="o", color="#0072b2", mfc="white", mew=1.8, capsize=4,
                        label="fraction grokked (± binomial s.e.)", zorder=3)
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
            ax.plot(grid, _logistic(np.log10(grid), math.log10(fit["lambda_c"]), fit["k"]), color="#e1812c", linewidth=1.8,
                    label="logistic fit")
            ax.axvline(fit["lambda_c"], color="#6c7a89", linestyle="--", linewidth=1.1, label="$\\lambda_c$")
            ax.axvspan(*fit["ci"], color="#6c7a89", alpha=0.08, linewidth=0)
            title = (f"$\\lambda_c = {fit['lambda_c']:.3g}$  95% CI $[{fit['ci'][0]:.3g}, {fit['ci'][1]:.3g}]$,"
                     f"  $k = {fit['k']:.2f}$")
        else:
            title = _wrap(f"no logistic fit: {_why(fit)}", 58)
        ax.set_xscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(-0.06, 1.06)
        ax.set_xlabel("Weight decay $\\lambda$")
        ax.set_ylabel("$P(\\mathrm{grok})$")
        n_zero = int((~positive).sum())
        sub = f"{group.label} — {len(lam)} runs" + (f", {n_zero} at $\\lambda=0$ not shown" if n_zero else "")
        if analysis.get("fit_max_lambda") is not None and lam.max(initial=0) > analysis["fit_max_lambda"]:
            ax.axvspan(analysis["fit_max_lambda"], hi, color="#999999", alpha=0.12, linewidth=0)
            sub += f"; $\\lambda > {analysis['fit_max_lambda']:g}$ (grey) not fitted"
        ax.set_title(title + "\n" + _wrap(sub, 60))
        handles, _ = ax.get_legend_handles_labels()
        if handles:
            fig.legend(loc="outside lower center", ncol=2)
        return _save(fig, stem, formats)


# ============================================================================ t_grok power law


def t_grok_figure(group, analysis: dict, stem: Path, formats=FORMATS) -> list[Path]:
    import matplotlib as mpl

    lambdas, regimes, grokked, t_grok = group.arrays()
    lam = np.asarray(lambdas, float)
    t = np.asarray(t_grok, float)
    with mpl.rc_context(STYLE):
        fig, axes = _figure(5.6, 4.0)
        ax = axes[0, 0]
        fit = analysis["lambda_c"]
        nu = analysis["nu"]
        drawn = False
        if "lambda_c" in fit:
            lc = fit["lambda_c"]
            ok = np.isfinite(t) & (lam > lc)
            if ok.any():
                x = lam[ok] - lc
                ax.scatter(x, t[ok], s=28, color="#3b8bc2", alpha=0.45, linewidths=0, label="grokked runs",
                           zorder=3)
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
                           label="grokked runs (against $\\lambda$: no $\\lambda_c$)", zorder=3)
                drawn = True
            xlabel = "Weight decay $\\lambda$ (no $\\lambda_c$ fit)"
        if "nu" in nu:
            joint = analysis.get("nu_joint", {})
            title = f"$\\nu = {nu['nu']:.3g}$  95% CI $[{nu['ci'][0]:.3g}, {nu['ci'][1]:.3g}]$ ($\\lambda_c$ fixed)"
            if "nu" in joint:
                title += f"\njoint CI $[{joint['ci'][0]:.3g}, {joint['ci'][1]:.3g}]$ ($\\lambda_c$ refitted)"
        else:
            title = _wrap(f"no power-law fit: {_why(nu)}", 58)
        if drawn:
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.legend(loc="upper right")
        else:
            ax.text(0.5, 0.5, "no grokked runs to show", transform=ax.transAxes, ha="center", va="center",
                    color="#666666")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("$t_{\\mathrm{grok}}$ (epochs)")
        ax.set_title(title + "\n" + _wrap(group.label, 60))
        return _save(fig, stem, formats)


# ============================================================================ trajectories


def _quantiles(series: list[list[tuple[int, float]]]):
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


def trajectories_figure(group, traces: dict[str, list[dict]], stem: Path, formats=FORMATS) -> list[Path]:
    """Median and IQR across seeds, per λ, of test accuracy, s̄ and σ_H against epoch (log x)."""
    import matplotlib as mpl

    panels = [("test_acc", "test accuracy"), ("s_bar", "$\\bar{s}(t)$"), ("sigma_h", "$\\sigma_H(t)$ (nats)")]
    by_lambda: dict[float, list[str]] = {}
    for run in group.runs:
        by_lambda.setdefault(float(run["config"]["weight_decay"]), []).append(run["run_id"])
    lambdas = sorted(by_lambda)
    with mpl.rc_context(STYLE):
        fig, axes = _figure(8.2, 6.8, nrows=3, sharex=True)
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
                q = _quantiles(series)
                if q is None:
                    continue
                any_data[key] = True
                epochs, med, q25, q75 = q
                ax.plot(epochs, med, color=colours[lam], linewidth=1.7,
                        label=f"$\\lambda = {_fmt_lambda(lam)}$ ({len(series)} runs)")
                ax.fill_between(epochs, q25, q75, color=colours[lam], alpha=0.18, linewidth=0)
            ax.set_ylabel(label)
            if not any_data[key]:
                ax.text(0.5, 0.5, f"no {label.split(' (')[0]} values (no attention layers in {group.config['arch']})"
                        if key != "test_acc" else "no data", transform=ax.transAxes, ha="center",
                        va="center", color="#666666")
        if any(any_data.values()):
            axes[-1, 0].set_xscale("log")
        axes[-1, 0].set_xlabel("training epoch")
        if any_data["test_acc"]:
            axes[0, 0].set_ylim(-0.03, 1.03)
            handles, labels = axes[0, 0].get_legend_handles_labels()
            fig.legend(handles, labels, loc="outside right center", ncol=1 if len(labels) <= 14 else 2)
        fig.suptitle(_wrap(f"Trajectories per $\\lambda$: {group.label}", 80)
                     + "\nline: median over seeds, band: interquartile range")
        return _save(fig, stem, formats)


def plot_store(store, out_dir, n_boot: int = 1500, n_band: int = 300, seed: int = 0,
               formats=FORMATS, fit_max_lambda: float | None = None,
               predict: dict | None = None) -> tuple[list[Path], list[dict]]:
    """Every sweep figure of a store into ``out_dir``; returns (paths written, group analyses).
    ``predict`` (t0, test_frac, split_seed) adds the held-out predictive-value figure."""
    from fastdiag.sweep import analyze_group, load_groups

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    groups, _ = load_groups(store)
    if not groups:
        from fastdiag.grokking.interventions import load_experiments

        if load_experiments(store):                  # a store holding only intervention experiments
            return experiment_figures(store, out, n_boot=n_boot, seed=seed, formats=formats), []
        raise ValueError(f"store {store.path}: no finished runs to plot")
    analyses = [analyze_group(g, n_boot=n_boot, seed=seed, fit_max_lambda=fit_max_lambda) for g in groups]
    paths = regime_diagram(groups, analyses, out / "regime_diagram", formats)
    all_traces: dict[str, list[dict]] = {}
    for g, a in zip(groups, analyses):
        suffix = g.slug if len(groups) > 1 else ""
        name = (lambda base: out / (f"{base}_{suffix}" if suffix else base))
        paths += p_grok_figure(g, a, name("p_grok"), n_band=min(n_band, n_boot), seed=seed, formats=formats)
        paths += t_grok_figure(g, a, name("t_grok"), formats=formats)
        traces = {run["run_id"]: store.trace(run["run_id"]) for run in g.runs}
        all_traces.update(traces)
        paths += trajectories_figure(g, traces, name("trajectories"), formats=formats)
        paths += _stages_for_group(g, traces, name, formats)
    paths += experiment_figures(store, out, n_boot=n_boot, seed=seed, formats=formats)
    if predict is not None:
        from fastdiag.analysis.experiments import predictive_analysis

        runs = [r for g in groups for r in g.runs]      # the groups hold every done run
        pa = predictive_analysis(runs, all_traces, n_boot=n_boot, seed=seed, **predict)
        paths += predict_figure(pa, out / "predict", formats=formats)
    return paths, analyses


def _stages_for_group(group, traces, name, formats) -> list[Path]:
    """Runs trained to the horizon (stop_at_grok off): the stages of the run with the most of them."""
    from fastdiag.analysis.experiments import segment_stages

    if group.config.get("stop_at_grok", True):
        return []
    best = None
    for run in group.runs:
        seg = segment_stages(traces.get(run["run_id"], []), grok_threshold=run["config"].get("grok_threshold", 0.99))
        if seg["stages"] and (best is None or len(seg["stages"]) > len(best[1]["stages"])):
            best = (run, seg)
    if best is None:
        return []
    run, seg = best
    title = (f"Stages: {group.label}, λ = {run['config']['weight_decay']:g}, seed {run['config']['seed']} "
             f"({(run['result'] or {}).get('regime')})")
    return stages_figure(traces[run["run_id"]], seg, name("stages"), title=title, formats=formats)


def experiment_figures(store, out: Path, n_boot: int = 1500, seed: int = 0, formats=FORMATS) -> list[Path]:
    """The issue-8 figures a store has data for: peak σ_H against d/H (runs differing only in width,
    heads and seed, at 3 or more d/H) and the interventions (the intervention tables)."""
    from fastdiag.grokking import interventions as exp_intervene
    from fastdiag.analysis.experiments import headdim_analysis, headdim_sets

    paths: list[Path] = []
    sets = headdim_sets(store.runs("done"))
    for i, (shared, runs) in enumerate(sets):
        traces = {r["run_id"]: store.trace(r["run_id"]) for r in runs}
        a = headdim_analysis(runs, traces, n_boot=n_boot, seed=seed)
        stem = out / ("headdim" if len(sets) == 1 else f"headdim_{i + 1}")
        note = f"λ = {shared.get('weight_decay'):g}" if shared.get("weight_decay") is not None else ""
        paths += headdim_figure(a, stem, title_note=note, formats=formats)
    experiments = exp_intervene.load_experiments(store)
    for exp_id, rows in experiments.items():
        traces = {r["arm_id"]: exp_intervene.arm_trace(store, r["arm_id"]) for r in rows}
        # experiment ids come from the store: untrusted, never a path of their own
        stem = out / ("intervention" if len(experiments) == 1 else f"intervention_{file_safe(exp_id)}")
        paths += intervention_figure(rows, traces, stem, formats=formats)
    return paths


def _no_data(ax, why: str) -> None:
    ax.text(0.5, 0.5, _wrap(why, 40), transform=ax.transAxes, ha="center", va="center", color="#666666")


def predict_figure(pa: dict, stem: Path, formats=FORMATS) -> list[Path]:
    """`experiments.predictive_analysis` on the held-out seeds: ROC curves of "groks by the horizon"
    (baselines against baselines + s̄/σ_H) and predicted against true ln t_grok."""
    import matplotlib as mpl

    models = (("baseline", "baselines", "#6c7a89"), ("full", "baselines + $\\bar{s}$, $\\sigma_H$", "#d35f0a"))
    with mpl.rc_context(STYLE):
        fig, axes = _figure(9.0, 4.2, ncols=2)
        ax, bx = axes[0, 0], axes[0, 1]
        cls = pa.get("groks_by_horizon", {})
        if "test_scores" in cls:
            y = [c["grokked"] for c in cls["test_scores"]]
            for key, label, colour in models:
                fpr, tpr = roc_curve(y, [c[key] for c in cls["test_scores"]])
                auc, ci = cls[f"auc_{key}"], cls[f"auc_{key}_ci"]
                ax.plot(fpr, tpr, color=colour, linewidth=1.8,
                        label=f"{label}: AUC {auc:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]")
            ax.plot([0, 1], [0, 1], ":", color="#999999", linewidth=1)
            ax.set_title(_wrap(f"groks by the horizon ({cls['test_positives']} grokked, {cls['test_negatives']} not); "
                               f"ΔAUC {cls['diff']:+.3f} [{cls['diff_ci'][0]:+.3f}, {cls['diff_ci'][1]:+.3f}]", 62))
            ax.legend(loc="lower right")
        else:
            _no_data(ax, cls.get("error", pa.get("error", "no data")))
        ax.set_xlabel("false-positive rate")
        ax.set_ylabel("true-positive rate")
        reg = pa.get("log_t_grok", {})
        if "test_predictions" in reg:
            truth = np.array([c["log_t_grok"] for c in reg["test_predictions"]])
            for key, label, colour in models:
                pred = np.array([c[key] for c in reg["test_predictions"]])
                mae, ci = reg[f"mae_{key}"], reg[f"mae_{key}_ci"]
                bx.scatter(truth, pred, s=26, color=colour, alpha=0.75, linewidths=0,
                           label=f"{label}: MAE {mae:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]")
            lo, hi = float(truth.min()), float(truth.max())
            pad = 0.1 * (hi - lo or 1.0)
            bx.plot([lo - pad, hi + pad], [lo - pad, hi + pad], ":", color="#999999", linewidth=1)
            bx.set_title(_wrap(f"ln t_grok ({reg['n_test']} grokked test runs); ΔMAE {reg['diff']:+.3f} "
                               f"[{reg['diff_ci'][0]:+.3f}, {reg['diff_ci'][1]:+.3f}]", 62))
            bx.legend(loc="upper left")
        else:
            _no_data(bx, reg.get("error", pa.get("error", "no data")))
        bx.set_xlabel("true ln $t_{grok}$")
        bx.set_ylabel("predicted ln $t_{grok}$")
        fig.suptitle(f"Predictive value on held-out seeds at $t_0$ = {pa['t0']:g} epochs ({pa['t0_source']}); "
                     f"train seeds {len(pa.get('train_seeds', []))}, test seeds {len(pa.get('test_seeds', []))}")
        return _save(fig, stem, formats)


# ============================================================================ issue 8: experiments


def headdim_figure(analysis: dict, stem: Path, title_note: str = "", formats=FORMATS) -> list[Path]:
    """Peak σ_H after grokking against d/H (log x): runs as points, mean ± s.d. per d/H, the saturating
    fit σ_max = c + a(1 − e^(−b·d/H)) and its plateau CI (``experiments.headdim_analysis``)."""
    import matplotlib as mpl

    with mpl.rc_context(STYLE):
        fig, axes = _figure(5.6, 4.3)
        ax = axes[0, 0]
        pts = analysis["points"]
        if pts:
            rng = np.random.default_rng(0)
            xs = np.array([p["d_per_head"] for p in pts], float)
            ax.scatter(xs * 10 ** rng.normal(0, 0.01, len(xs)), [p["peak_sigma_h"] for p in pts], s=22,
                       color="#3b8bc2", alpha=0.4, linewidths=0, label="runs", zorder=2)
            bins = analysis["bins"]
            bx = [b["d_per_head"] for b in bins]
            ax.errorbar(bx, [b["mean"] for b in bins], yerr=[b["std"] or 0.0 for b in bins], fmt="-o",
                        color="#0072b2", mfc="white", mew=1.8, capsize=4, linewidth=1.6, zorder=3,
                        label=f"mean ± s.d. ({min(b['n'] for b in bins)}–{max(b['n'] for b in bins)} runs per d/H)")
            fit = analysis["fit"]
            if "error" not in fit:
                grid = np.logspace(math.log10(min(bx) / 1.2), math.log10(max(bx) * 1.2), 200)
                ax.plot(grid, fit["c"] + fit["a"] * -np.expm1(-fit["b"] * grid), "--", color="#d35f0a",
                        linewidth=1.6, label="saturating fit", zorder=4)
                ys = [p["peak_sigma_h"] for p in pts] + [b["mean"] + (b["std"] or 0.0) for b in bins] \
                    + [b["mean"] - (b["std"] or 0.0) for b in bins]
                pad = 0.1 * (max(ys) - min(ys) or abs(max(ys)) or 1e-3)
                view = (min(ys) - pad, max(ys) + pad)       # the data set the axes, not a wild CI
                lo, hi = fit["ci"]["plateau"]
                clipped = lo < view[0] or hi > view[1]
                ax.axhspan(max(lo, view[0]), min(hi, view[1]), color="#d35f0a", alpha=0.08, linewidth=0,
                           label="plateau $c + a$: 95% CI" + (" (beyond the axes)" if clipped else ""))
                ax.set_ylim(*view)
                title = (f"$\\sigma_{{max}} = c + a(1 - e^{{-b\\,d/H}})$: plateau {fit['plateau']:.3g} "
                         f"[{fit['ci']['plateau'][0]:.3g}, {fit['ci']['plateau'][1]:.3g}]")
            else:
                title = _wrap(f"no saturating fit: {_why(fit)}", 60)
            ax.set_xscale("log")
            from matplotlib.ticker import NullFormatter
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
        return _save(fig, stem, formats)


ARM_COLOURS = {"control": "#333333", "reinit": "#d55e00", "clip": "#0072b2"}


def intervention_figure(rows: list[dict], traces: dict[str, list[dict]], stem: Path, formats=FORMATS) -> list[Path]:
    """Left: σ_H against epochs since the branch point, median and IQR over seeds per arm. Right: the
    peak σ_H after the branch per seed and arm, paired lines (``exp_intervene`` store rows)."""
    import matplotlib as mpl

    arms = [a for a in ARM_COLOURS if any(r["arm"] == a for r in rows)]
    with mpl.rc_context(STYLE):
        fig, axes = _figure(9.0, 4.0, ncols=2)
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
            q = _quantiles(series)
            if q is None:
                continue
            epochs, med, q25, q75 = q
            ax.plot(epochs, med, color=ARM_COLOURS[arm], linewidth=1.6, label=f"{arm} ({len(series)} seeds)")
            ax.fill_between(epochs, q25, q75, color=ARM_COLOURS[arm], alpha=0.15, linewidth=0)
        ax.set_xlabel("epochs after the branch point (Phase-2 $\\sigma_H$ peak)")
        ax.set_ylabel("$\\sigma_H$ (nats)")
        ax.legend(loc="best")
        by_seed: dict = {}
        for r in rows:
            by_seed.setdefault(r["seed"], {})[r["arm"]] = r["metrics"].get("peak_sigma_h_after")
        for seed, vals in by_seed.items():
            xs = [i for i, a in enumerate(arms) if vals.get(a) is not None]
            bx.plot(xs, [vals[arms[i]] for i in xs], color="#999999", linewidth=0.8, alpha=0.6, marker="o",
                    markersize=3)
        for i, arm in enumerate(arms):
            v = [vals[arm] for vals in by_seed.values() if vals.get(arm) is not None]
            if v:
                bx.scatter([i], [np.mean(v)], s=70, color=ARM_COLOURS[arm], zorder=4, marker="D")
        bx.set_xticks(range(len(arms)), arms)
        bx.set_ylabel("peak $\\sigma_H$ after the branch")
        bx.set_title("per seed (lines) and mean (diamonds)")
        fig.suptitle(f"Interventions at the Phase-2 peak: {len(by_seed)} seeds")
        return _save(fig, stem, formats)


STAGE_COLOURS = {"coordination": "#009e73", "differentiation": "#f0e442", "re-synchronisation": "#d55e00",
                 "second differentiation": "#cc79a7", "collapse": "#555555"}


def stages_figure(trace: list[dict], segmentation: dict, stem: Path, title: str = "", formats=FORMATS) -> list[Path]:
    """Test accuracy, s̄ and σ_H of one long run (log epochs) with its stages shaded."""
    import matplotlib as mpl

    panels = [("test_acc", "test accuracy"), ("s_bar", "$\\bar{s}(t)$"), ("sigma_h", "$\\sigma_H(t)$")]
    with mpl.rc_context(STYLE):
        fig, axes = _figure(7.5, 6.5, nrows=3, sharex=True)
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
        axes[-1, 0].set_xscale("log")
        axes[-1, 0].set_xlabel("training epoch")
        fig.suptitle(_wrap(title or "Stages of a long run", 80) + "\n")
        return _save(fig, stem, formats)
