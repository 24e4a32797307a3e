"""The figure of one run: the two-phase trajectory (test accuracy, s̄ and σ_H against epoch, log x); and
the run's outputs (`fastdiag.plots.outputs`) with it drawn here."""
from __future__ import annotations

import os
from pathlib import Path

from matplotlib.figure import Figure  # no pyplot: renders with Agg, no GUI backend, no global state

from fastdiag.grokking.config import GROK_THRESHOLD
from fastdiag.grokking.labels import first_epoch_at_or_above, largest, phase2_peak
from fastdiag.plots import outputs
from fastdiag.plots.style import readable_log_axis


def _series(trace, key):
    xs, ys = [], []
    for row in trace:
        value = row.get(key)
        if value is not None and row.get("epoch"):
            xs.append(row["epoch"])
            ys.append(value)
    return xs, ys


def plot_trajectory(trace: list[dict], path: str | os.PathLike, result: dict | None = None,
                    title: str | None = None) -> None:
    """Draw ``draw_trajectory`` into ``path`` (PNG)."""
    draw_trajectory(trace, result, title).savefig(os.fspath(path), dpi=120)


def draw_trajectory(trace: list[dict], result: dict | None = None, title: str | None = None) -> Figure:
    """Three stacked panels sharing a log epoch axis: accuracy, head synchronisation s̄ and entropy
    spread σ_H, with t_mem / t_grok marked. Runs without attention get the accuracy panel only."""
    result = result or {}
    has_attention = result.get("has_attention", any(r.get("s_bar") is not None for r in trace))
    n_panels = 3 if has_attention else 1
    fig = Figure(figsize=(7.5, 2.6 * n_panels + 0.6), layout="constrained")
    axes = fig.subplots(n_panels, 1, sharex=True, squeeze=False)[:, 0]

    t_mem = result.get("t_mem_epoch", first_epoch_at_or_above(trace, "train_acc", GROK_THRESHOLD))
    t_grok = result.get("t_grok_epoch", first_epoch_at_or_above(trace, "test_acc", GROK_THRESHOLD))

    ax = axes[0]
    for key, label, style in (("train_acc", "train", dict(color="tab:gray", ls="--")),
                              ("test_acc", "test", dict(color="tab:blue"))):
        xs, ys = _series(trace, key)
        ax.plot(xs, ys, label=f"{label} accuracy", lw=1.6, **style)
    ax.set_ylabel("accuracy")
    ax.set_ylim(-0.02, 1.02)

    if has_attention:
        xs, ys = _series(trace, "s_bar")
        axes[1].plot(xs, ys, color="tab:red", lw=1.6, label="s̄ (mean off-diagonal head cosine)")
        axes[1].set_ylabel("head sync s̄")
        xs, ys = _series(trace, "sigma_h")
        axes[2].plot(xs, ys, color="tab:green", lw=1.6, label="σ_H (std of head entropies)")
        axes[2].set_ylabel("entropy spread σ_H (nats)")
        # the run's summary line names the same two points (cli/run.py)
        top, peak = largest(trace, "sigma_h"), phase2_peak(trace, t_grok)
        if top is not None:
            axes[2].plot([top[1]], [top[0]], "o", color="tab:green", mfc="white",
                         label=f"largest σ_H {top[0]:.3f} (epoch {top[1]})")
        if peak is not None:
            axes[2].plot([peak[1]], [peak[0]], "D", color="tab:purple", mfc="white",
                         label=f"largest from t_grok on (Phase 2) {peak[0]:.3f} (epoch {peak[1]})")

    for ax in axes:
        for epoch, label, color in ((t_mem, "t_mem", "tab:gray"), (t_grok, "t_grok", "tab:purple")):
            if epoch:
                ax.axvline(epoch, color=color, ls=":", lw=1.2, label=f"{label} = {epoch}")
        readable_log_axis(ax.xaxis)          # a 3-epoch run gets 1, 2, 3, not one "1"
        ax.grid(True, which="both", alpha=0.25)
        ax.legend(loc="best", fontsize=8)
    axes[-1].set_xlabel("epoch (log scale)")

    if title is None:
        cfg = result.get("config") or {}
        parts = [cfg.get("arch", ""), f"a {cfg['op']} b mod {cfg['p']}" if "op" in cfg else "",
                 f"λ = {cfg['weight_decay']:g}" if "weight_decay" in cfg else "",
                 f"seed {cfg['seed']}" if "seed" in cfg else "",
                 f"regime: {result['regime']}" if "regime" in result else ""]
        title = ", ".join(p for p in parts if p) or "training trajectory"
    if not has_attention:
        title += " (no attention: accuracy only)"
    fig.suptitle(title, fontsize=10)
    return fig


def write_outputs(outcome, out_dir: str | os.PathLike) -> dict[str, Path]:
    """`fastdiag.plots.outputs.write_outputs` with the figure drawn here."""
    return outputs.write_outputs(outcome, out_dir, plot_trajectory)
