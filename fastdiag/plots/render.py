"""Every figure of a result store, drawn from its report (`fastdiag.analysis.report`): the numbers in
the figures are the numbers ``fastdiag analyze`` prints."""
from __future__ import annotations

from pathlib import Path

from fastdiag.analysis.report import Report
from fastdiag.analysis.trajectories import segment_stages
from fastdiag.analysis.groups import file_safe
from fastdiag.grokking.config import GROK_THRESHOLD
from fastdiag.grokking.labels import regime_label
from fastdiag.plots.experiments import headdim_figure, intervention_figure, predict_figure, stages_figure
from fastdiag.plots.style import FORMATS
from fastdiag.plots.sweep import p_grok_figure, regime_diagram, t_grok_figure, trajectories_figure
from fastdiag.store import interventions as tables


def plot_report(report: Report, out_dir, n_band: int = 300, formats=FORMATS) -> list[Path]:
    """Draw every figure ``report`` has data for into ``out_dir``; returns the paths written. A store
    with neither finished runs nor intervention experiments is an error (ValueError)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    groups = report.groups
    if not groups and not report.interventions:
        raise ValueError(f"store {report.store.path}: no finished runs to plot")
    paths = regime_diagram(groups, report.analyses, out / "regime_diagram", formats) if groups else []
    for g, a in zip(groups, report.analyses):
        suffix = g.slug if len(groups) > 1 else ""
        name = (lambda base: out / (f"{base}_{suffix}" if suffix else base))
        paths += p_grok_figure(g, a, name("p_grok"), n_band=min(n_band, report.n_boot), seed=report.seed,
                               formats=formats)
        paths += t_grok_figure(g, a, name("t_grok"), formats=formats)
        traces = report.traces(g.runs)
        paths += trajectories_figure(g, traces, name("trajectories"), formats=formats)
        paths += _stages_for_group(g, traces, name, formats)
    for i, (shared, _, analysis) in enumerate(report.headdim):
        stem = out / ("headdim" if len(report.headdim) == 1 else f"headdim_{i + 1}")
        note = f"λ = {shared.get('weight_decay'):g}" if shared.get("weight_decay") is not None else ""
        paths += headdim_figure(analysis, stem, title_note=note, formats=formats)
    for exp_id, rows, _ in report.interventions:
        traces = {r["arm_id"]: tables.arm_trace(report.store, r["arm_id"]) for r in rows}
        # experiment ids come from the store: untrusted, never a path of their own
        stem = out / ("intervention" if len(report.interventions) == 1 else f"intervention_{file_safe(exp_id)}")
        paths += intervention_figure(rows, traces, stem, formats=formats)
    if report.predict is not None and groups:
        paths += predict_figure(report.predict, out / "predict", formats=formats)
    return paths


def _stages_for_group(group, traces, name, formats) -> list[Path]:
    """Runs trained to the horizon (stop_at_grok off): the stages of the run with the most of them."""
    if group.config.get("stop_at_grok", True):
        return []
    best = None
    for run in group.runs:
        seg = segment_stages(traces.get(run["run_id"], []), grok_threshold=run["config"].get("grok_threshold", GROK_THRESHOLD))
        if seg["stages"] and (best is None or len(seg["stages"]) > len(best[1]["stages"])):
            best = (run, seg)
    if best is None:
        return []
    run, seg = best
    stored = (run["result"] or {}).get("regime")
    trace = traces[run["run_id"]]
    current = regime_label(trace, run["config"].get("grok_threshold", GROK_THRESHOLD), diverged=stored == "diverged")
    label = current if current == stored else f"{current} by today's rules; stored as {stored}"
    title = (f"Stages: {group.label}, λ = {run['config']['weight_decay']:g}, seed {run['config']['seed']} "
             f"({label})")
    return stages_figure(trace, seg, name("stages"), title=title, formats=formats)
