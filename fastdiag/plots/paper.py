"""The paper's Fig. 2 layout drawn from our canonical runs (`fastdiag paper figure`)."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from fastdiag.analysis.paper_data import PAPER
from fastdiag.plots.style import STYLE, figure as _figure, plain_number, readable_log_axis, save as _save
from fastdiag.plots.sweep import FEW_RUNS

INIT_X = 0.4      # where step 0 is drawn on the log epoch axis: left of epoch 1, with its own tick
COLOURS = {0.001: "#0072b2", 0.05: "#cc79a7", 0.1: "#009e73", 1.0: "#111111", 10.0: "#e69f00"}


def figure(runs: list[dict], out: Path, init: list[dict] | None = None) -> list[Path]:
    """The paper's Fig. 2 layout (test accuracy, s̄, σ_H against epoch, log x) for every λ in the stores:
    thin lines one run each, thick line the median over the λ's runs where all of them have a value;
    dotted grey: the paper's Fig. 2 landmarks; ``init`` (rows of `fastdiag paper init`): step-0 values,
    drawn left of the first epoch under their own "step 0" tick (not at an epoch)."""
    import matplotlib as mpl

    by_lambda: dict[float, list[dict]] = {}
    for r in runs:
        by_lambda.setdefault(r["lambda"], []).append(r)
    panels = [("test_acc", "test accuracy"), ("s_bar", "$\\bar{s}(t)$"), ("sigma_h", "$\\sigma_H(t)$ (nats)")]
    with mpl.rc_context(STYLE):
        fig, axes = _figure(8.4, 7.4, nrows=3, sharex=True)
        for row, (key, label) in enumerate(panels):
            ax = axes[row, 0]
            for lam in sorted(by_lambda):
                colour = COLOURS.get(lam, "#777777")
                series = []
                for r in by_lambda[lam]:
                    pts = [(x["epoch"], x[key]) for x in r["trace"]
                           if isinstance(x.get(key), (int, float)) and math.isfinite(x[key])]
                    if not pts:
                        continue
                    long = not r["config"]["stop_at_grok"] and r["result"]["t_grok_epoch"] is not None
                    alone = len(by_lambda[lam]) < FEW_RUNS
                    e, v = zip(*pts)
                    ax.plot(e, v, color=colour, linewidth=1.6 if long or alone else 0.6,
                            alpha=0.95 if long or alone else 0.45, linestyle="--" if long else "-")
                    series.append(dict(pts))
                common = sorted(set.intersection(*(set(s) for s in series))) if series else []
                if len(series) >= FEW_RUNS and common:     # no median of 2-4 runs: they are drawn one by one
                    med = [float(np.median([s[e] for s in series])) for e in common]
                    ax.plot(common, med, color=colour, linewidth=2.2)
                if row == 0:
                    n = len(by_lambda[lam])
                    ax.plot([], [], color=colour, linewidth=2.2, label=f"$\\lambda = {lam:g}$ ({n} run{'s' * (n > 1)})")
            if init and key in ("s_bar", "sigma_h"):
                ax.plot([INIT_X] * len(init), [r[key] for r in init], "o", color="#111111", markersize=3, alpha=0.6,
                        label=f"step 0 (initialisation), {len(init)} seeds")
            ax.set_ylabel(label)
        s_ax, h_ax = axes[1, 0], axes[2, 0]
        for v in PAPER["s_bar"]:
            s_ax.axhline(v, color="#888888", linestyle=":", linewidth=1)
        h_ax.axhspan(*PAPER["sigma_h_peak"], color="#888888", alpha=0.15, linewidth=0)
        s_ax.text(1.01, PAPER["s_bar"][2], "paper 0.93 / 0.995 / 0.88", transform=s_ax.get_yaxis_transform(),
                  fontsize=7.5, color="#666666", va="center")
        h_ax.text(1.01, np.mean(PAPER["sigma_h_peak"]), "paper peak\n0.09–0.10", transform=h_ax.get_yaxis_transform(),
                  fontsize=7.5, color="#666666", va="center")
        if any(not r["config"]["stop_at_grok"] and r["result"]["t_grok_epoch"] is not None for r in runs):
            axes[0, 0].plot([], [], color="#111111", linewidth=1.3, linestyle="--", label="run trained past grokking")
        axes[0, 0].axvline(PAPER["t_grok_lambda1"], color="#888888", linestyle=":", linewidth=1)
        axes[0, 0].text(PAPER["t_grok_lambda1"], 0.12, "paper t_grok(λ=1) ≈ 130 ", fontsize=7.5, color="#666666",
                        ha="right")
        axes[0, 0].set_ylim(-0.03, 1.03)
        readable_log_axis(axes[-1, 0].xaxis)
        axes[-1, 0].set_xlabel("training epoch")
        if init:        # step 0 is no epoch: its own tick left of the first evaluation, apart from the axis's
            fig.canvas.draw()
            axis = axes[-1, 0].xaxis
            lo = min(x["epoch"] for r in runs for x in r["trace"] if x.get("epoch"))
            ticks = [t for t in axis.get_majorticklocs() if t >= lo]
            axes[-1, 0].set_xlim(INIT_X / 1.6, None)
            axes[-1, 0].set_xticks([INIT_X, *ticks], ["step 0", *(plain_number(t) for t in ticks)])
            for ax in axes[:, 0]:
                ax.axvline(INIT_X * 1.5, color="#bbbbbb", linewidth=0.8)
        axes[0, 0].legend(loc="upper left", fontsize=8)
        if init:
            s_ax.legend(loc="best", fontsize=8)
        fig.suptitle("Canonical 4×8×128, a + b mod 97 (2-core CPU)\n"
                     f"one line per run; thick: median over a λ's seeds (≥ {FEW_RUNS}) while all of them run")
        return _save(fig, out.with_suffix(""), formats=(out.suffix.lstrip(".") or "png",))

