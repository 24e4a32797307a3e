"""`fastdiag plot STORE --out DIR`: the sweep figures (regime diagram, P(grok), t_grok, trajectories)."""
from __future__ import annotations

import click

from fastdiag.cli.analyze import analysis_options, store_report
from fastdiag.cli.app import CLIError, loading, open_store
from fastdiag.cli.options import numeric
from fastdiag.grokking.config import N_BOOT


@click.command("plot")
@click.argument("store_path", metavar="STORE", type=click.Path())
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Directory for the figures (created if missing).")
@click.option("--n-boot", type=numeric("n_boot"), default=N_BOOT, show_default=True, help="Bootstrap resamples of the fits.")
@click.option("--n-band", type=numeric("n_band"), default=300, show_default=True,
              help="Bootstrap resamples of the P(grok) confidence band.")
@click.option("--seed", type=numeric("seed"), default=0, show_default=True, help="Seed of the bootstraps.")
@analysis_options
@click.option("--format", "formats", default="png,svg", show_default=True, help="Comma list of png, svg, pdf.")
def plot_cmd(store_path, out_dir, n_boot, n_band, seed, fit_max_lambda, predict, t0, test_frac, split_seed, formats):
    """Draw the sweep figures of STORE as PNG and SVG into DIR: regime diagram (λ × N), P(grok) with
    the logistic fit and its bootstrap band, t_grok against λ − λ_c with the power-law fit, and
    trajectories of test accuracy, s̄ and σ_H per λ (median/IQR from 5 runs, each run below)."""
    fmts = tuple(f.strip().lower() for f in formats.split(",") if f.strip())
    bad = [f for f in fmts if f not in ("png", "svg", "pdf")]
    if not fmts or bad:
        raise CLIError(f"--format: expected a comma list of png, svg, pdf, got {formats!r}")
    with loading():         # scipy and matplotlib: loaded only when figures are drawn
        from fastdiag.analysis.report import PredictSettings
        from fastdiag.plots.render import plot_report

    with open_store(store_path) as store:
        report = store_report(store, n_boot=n_boot, seed=seed, fit_max_lambda=fit_max_lambda,
                              predict=PredictSettings(t0, test_frac, split_seed) if predict else None)
        paths = plot_report(report, out_dir, n_band=n_band, formats=fmts)
    for path in paths:
        click.echo(str(path))
    for a in report.analyses:
        for key, name in (("lambda_c", "λ_c"), ("nu", "ν")):
            if "error" in a[key]:
                click.echo(f"plot: {a['group']}: drawn without the {name} fit ({a[key]['error']})", err=True)


COMMANDS = [plot_cmd]
