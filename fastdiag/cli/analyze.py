"""`fastdiag analyze STORE`: λ_c, ν, regime table and median t_grok per architecture/size group."""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

import click

from fastdiag.cli.app import CLIError, loading, open_store
from fastdiag.cli.options import numeric
from fastdiag.grokking.config import N_BOOT, REGIMES, fmt_or_dash

# The statistics (scipy) and the model zoo (torch) load in the bodies that use them, so that
# `fastdiag analyze --help` (and plot's, intervene's, which import this module) needs neither.
if TYPE_CHECKING:
    from fastdiag.analysis.headdim import HeaddimAnalysis
    from fastdiag.analysis.predict import PredictiveAnalysis
    from fastdiag.analysis.report import PredictSettings, Report

# The regime table's column headings: the regime's name, shortened where it is long (every regime in
# REGIMES has one, so a new regime cannot be left out of the table).
REGIME_COLUMNS = {"grok": "grok", "memorization": "memor.", "collapse": "collapse", "no-fit": "no-fit",
                  "too-short": "too-short", "anti-grok": "anti-grok", "diverged": "diverged"}


def _width(regime: str) -> int:
    return max(5, len(REGIME_COLUMNS[regime]))


def store_report(store, n_boot: int = N_BOOT, seed: int = 0, retention_threshold: float = 0.9,
                 predict: PredictSettings | None = None, fit_max_lambda: float | None = None) -> Report:
    """The report of an open store, with the model zoo's head counts for the per-head-dimension sets."""
    with loading():
        from fastdiag.analysis.report import build_report
        from fastdiag.grokking.build import heads_width

    return build_report(store, heads_width, n_boot=n_boot, seed=seed, retention_threshold=retention_threshold,
                        fit_max_lambda=fit_max_lambda, predict=predict)


def _fmt_ci(value, ci, digits: int = 3) -> str:
    return f"{value:.{digits}f} [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def format_experiments(report: Report) -> list[str]:
    lines: list[str] = []
    for g in report.analyses:
        if "retention" not in g:
            continue
        lines += ["", f"== retention (trained to the horizon): {g['group']}"]
        thr = g["retention"][0]["threshold"] if g["retention"] else 0.9
        lines.append(f"  {'λ':>10} {'runs':>5} {'grokked':>7} {'retained':>8} {'retention':>9} "
                     f"{'median final test acc':>21} {'anti-grok':>9}   (retained: final test acc ≥ {thr:g})")
        for row in g["retention"]:
            lines.append(f"  {row['lambda']:>10.4g} {row['n']:>5} {row['grokked']:>7} {row['retained']:>8} "
                         f"{fmt_or_dash(row['retention'], '.3f'):>9} {fmt_or_dash(row['median_final_test_acc'], '.3f'):>21} "
                         f"{row['anti_grok']:>9}")
        long_runs = [s for s in g["stages"] if s["stages"]]
        short = len(g["stages"]) - len(long_runs)
        lines.append(f"  stages (segment_stages): {len(long_runs)} run(s) segmented"
                     + (f", {short} without stages (too short or none found)" if short else ""))
        for s in long_runs:
            parts = ", ".join(f"{st['stage']} {st['start_epoch']}–{st['end_epoch']}" for st in s["stages"])
            lines.append(f"    λ {s['weight_decay']:g} seed {s['seed']} ({s['regime']}): {parts}")
    for shared, _, analysis in report.headdim:
        lines += ["", f"== per-head dimension (λ = {shared.get('weight_decay')})"]
        lines += ["  " + line for line in format_headdim(analysis).splitlines()]
    for exp_id, rows, comparison in report.interventions:
        lines += ["", f"== interventions {exp_id} (λ = {rows[0]['config']['weight_decay']:g}, "
                      f"{rows[0]['settings']['after_peak_epochs']} epochs after the peak)"]
        lines += ["  " + line for line in format_comparison(comparison).splitlines()]
    if report.predict is not None:
        lines += [""] + format_predict(report.predict)
    return lines


def format_comparison(cmp: dict) -> str:
    lines = [f"paired over {cmp['n_seeds']} seed(s); differences are arm − control; Holm–Bonferroni over "
             f"{sum(1 for t in cmp['tests'] if 't_p' in t)} t-tests (and separately the Wilcoxon tests)"]
    lines.append(f"  {'arm':<7} {'metric':<19} {'n':>3} {'control':>9} {'arm':>9} {'Δ mean':>9} "
                 f"{'t p':>9} {'t p_Holm':>9} {'W p':>9} {'W p_Holm':>9} {'Cohen d':>8}")
    for t in cmp["tests"]:
        if "error" in t:
            lines.append(f"  {t['arm']:<7} {t['metric']:<19} {t['n']:>3} {fmt_or_dash(t['control_mean']):>9} "
                         f"{fmt_or_dash(t['arm_mean']):>9} {fmt_or_dash(t['mean_diff']):>9}   no test: {t['error']}")
            continue
        lines.append(f"  {t['arm']:<7} {t['metric']:<19} {t['n']:>3} {fmt_or_dash(t['control_mean']):>9} "
                     f"{fmt_or_dash(t['arm_mean']):>9} {t['mean_diff']:>+9.4f} {t['t_p']:>9.2g} "
                     f"{t.get('t_p_holm', float('nan')):>9.2g} {t['wilcoxon_p']:>9.2g} "
                     f"{t.get('wilcoxon_p_holm', float('nan')):>9.2g} {t['cohens_d']:>+8.2f}")
    return "\n".join(lines)


def format_headdim(a: HeaddimAnalysis) -> str:
    lines = [f"peak σ_H after grokking against d/H: {a.n_points} grokked run(s)"
             + (f", {a.n_skipped} left out (did not grok or no σ_H after t_grok)" if a.n_skipped else "")
             + (f", {a.n_single_head} single-head run(s) left out (σ_H of one head is 0)" if a.n_single_head else "")]
    lines.append(f"  {'d/H':>6} {'runs':>5} {'mean':>8} {'median':>8} {'std':>8}  (d, H)")
    for b in a.bins:
        lines.append(f"  {b.d_per_head:>6g} {b.n:>5} {b.mean:>8.4f} {b.median:>8.4f} "
                     f"{'-' if b.std is None else format(b.std, '.4f'):>8}  "
                     + " ".join(f"({d},{h})" for d, h in b.configs))
    fit = a.fit
    if fit.error is not None:
        lines.append(f"  saturating fit: no fit — {fit.error}")
    else:
        ci = fit.ci
        lines.append(f"  saturating fit σ_max = c + a(1 − exp(−b·d/H)): c = {fit.c:.4g} [{ci['c'][0]:.4g}, "
                     f"{ci['c'][1]:.4g}], a = {fit.a:.4g} [{ci['a'][0]:.4g}, {ci['a'][1]:.4g}], "
                     f"b = {fit.b:.4g} [{ci['b'][0]:.4g}, {ci['b'][1]:.4g}]; plateau c + a = "
                     f"{fit.plateau:.4g} [{ci['plateau'][0]:.4g}, {ci['plateau'][1]:.4g}] "
                     f"(95% bootstrap CIs, {fit.n_boot_ok}/{fit.n_boot} resamples)")
    return "\n".join(lines)


def format_predict(p: PredictiveAnalysis) -> list[str]:
    from fastdiag.analysis.predict import seed_list

    lines = [f"== predictive value at t0 = {p.t0:g} epochs ({p.t0_source}); seeds split train/test "
             f"(test fraction {p.test_frac:g}, split seed {p.split_seed})"]
    ex = ", ".join(f"{n} {why}" for why, n in p.excluded.items() if n)
    lines.append(f"  {p.n_cases} runs usable" + (f" (left out: {ex})" if ex else ""))
    if p.error is not None:
        lines.append(f"  no analysis: {p.error}")
        return lines
    lines.append(f"  train seeds {seed_list(p.train_seeds)} ({p.n_train} runs), test seeds {seed_list(p.test_seeds)} "
                 f"({p.n_test} runs); baselines: {', '.join(p.baseline_features)}; "
                 f"+ attention: {', '.join(p.attention_features)}")
    c, r = p.groks_by_horizon, p.log_t_grok
    lines.append(_with_and_without_attention(
        "groks by the horizon", c, f"held-out AUC, 95% CI; {c.test_positives} grokked, {c.test_negatives} not",
        (c.auc_baseline, c.auc_baseline_ci), (c.auc_full, c.auc_full_ci)))
    lines.append(_with_and_without_attention(
        "ln t_grok", r, f"held-out MAE in ln epochs, 95% CI; {r.n_test} runs",
        (r.mae_baseline, r.mae_baseline_ci), (r.mae_full, r.mae_full_ci)))
    return lines


def _with_and_without_attention(target: str, result, measure: str, baseline: tuple, full: tuple) -> str:
    """One line of the predictive analysis: the held-out score of the baselines alone and with s̄/σ_H."""
    if result.error is not None:
        return f"  {target}: no result — {result.error}"
    return (f"  {target} ({measure}): baselines {_fmt_ci(*baseline)}, baselines + s̄/σ_H {_fmt_ci(*full)}, "
            f"difference {result.diff:+.3f} [{result.diff_ci[0]:+.3f}, {result.diff_ci[1]:+.3f}]: "
            f"s̄/σ_H {result.verdict}")


def format_report(report: Report) -> str:
    """The text ``fastdiag analyze`` prints: the groups' fits and regime tables (their JSON form), then
    the experiments (typed results)."""
    data = report.to_dict()
    lines = _format_groups(data)
    lines += format_experiments(report)
    return "\n".join(lines)


def _format_groups(report: dict) -> list[str]:
    c = report["counts"]
    lines = [f"store {report['store']}: {c['done']} done, {c['pending']} pending, {c['running']} running "
             f"(unfinished), {c['failed']} failed; {len(report['groups'])} group(s); "
             f"bootstrap {report['n_boot']} resamples, seed {report['seed']}"]
    if c["pending"] or c["running"]:
        lines.append("  note: unfinished runs are left out; rerun the sweep command to finish them")
    if c["failed"]:
        lines.append(f"  note: {c['failed']} failed run(s) left out (see `fastdiag export --status failed`)")
    if not report["groups"]:
        lines.append("no finished runs: nothing to analyse")
    for g in report["groups"]:
        lines.append("")
        n_params = f"N = {g['n_params']:,} parameters" if g.get("n_params") else "N unknown"
        lines.append(f"== {g['group']}  ({g['n_runs']} runs, {n_params})")
        for note in g["notes"]:
            lines.append(f"  note: {note}")
        lc = g["lambda_c"]
        if "error" in lc:
            lines.append(f"  λ_c: no fit — {lc['error']}")
        else:
            lines.append(f"  λ_c = {fmt_or_dash(lc['lambda_c'], '.4g')}  95% CI [{fmt_or_dash(lc['ci'][0], '.4g')}, {fmt_or_dash(lc['ci'][1], '.4g')}]"
                         f"  k = {fmt_or_dash(lc['k'], '.3g')} per decade  ({lc['n_boot_ok']}/{lc['n_boot']} resamples "
                         f"converged, {lc['n_runs']} runs)")
        for key, name in (("nu", "ν (λ_c fixed)"), ("nu_joint", "ν (joint, λ_c refitted per resample)")):
            nu = g[key]
            if "error" in nu:
                lines.append(f"  {name}: no fit — {nu['error']}")
            else:
                lines.append(f"  {name} = {fmt_or_dash(nu['nu'], '.3g')}  95% CI [{fmt_or_dash(nu['ci'][0], '.3g')}, "
                             f"{fmt_or_dash(nu['ci'][1], '.3g')}]  amplitude {fmt_or_dash(nu['amplitude'], '.3g')} epochs  "
                             f"({nu['n']} grokked runs above λ_c, {nu['n_boot_ok']}/{nu['n_boot']} resamples)")
        lines.append(f"  {'λ':>10} {'runs':>5} " + " ".join(f"{REGIME_COLUMNS[r]:>{_width(r)}}" for r in REGIMES)
                     + f" {'median t_grok (epochs)':>22}")
        for row in g["regimes"]:
            lines.append(f"  {row['lambda']:>10.4g} {row['n']:>5} " + " ".join(f"{row[r]:>{_width(r)}}" for r in REGIMES)
                         + f" {fmt_or_dash(row['median_t_grok'], '.4g'):>22}")
    if report["failed_runs"]:
        lines.append("")
        lines.append(f"failed runs ({len(report['failed_runs'])}):")
        for f in report["failed_runs"][:10]:
            lines.append(f"  {f['run_id']}: {' '.join(str(f['error']).split())[:200]}")
    return lines


def analysis_options(command):
    """--fit-max-lambda, --predict, --t0, --test-frac, --split-seed: shared by analyze and plot."""
    options = [
        click.option("--fit-max-lambda", type=numeric("fit_max_lambda"), default=None, metavar="λ",
                     help="Keep runs with a larger λ (e.g. the collapse regime) out of the λ_c and ν fits."),
        click.option("--predict", is_flag=True,
                     help="Also test on held-out seeds whether s̄/σ_H at epoch t0 add predictive value (groks by "
                          "the horizon; ln t_grok) beyond epoch, loss and weight-norm baselines."),
        click.option("--t0", type=numeric("t0"), default=None,
                     help="--predict: the epoch of the prediction [default: median t_mem]."),
        click.option("--test-frac", type=numeric("test_frac"), default=0.5, show_default=True,
                     help="--predict: fraction of seeds held out."),
        click.option("--split-seed", type=numeric("split_seed"), default=0, show_default=True, help="--predict: seed of the seed split."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


@click.command("analyze")
@click.argument("store_path", metavar="STORE", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--n-boot", type=numeric("n_boot"), default=N_BOOT, show_default=True, help="Bootstrap resamples per fit.")
@click.option("--seed", type=numeric("seed"), default=0, show_default=True, help="Seed of the bootstrap.")
@click.option("--retention-threshold", type=numeric("retention_threshold"), default=0.9, show_default=True,
              help="Runs trained to the horizon: a grokked run is retained if its final test accuracy is ≥ this.")
@analysis_options
def analyze_cmd(store_path, as_json, n_boot, seed, fit_max_lambda, retention_threshold, predict, t0, test_frac,
                split_seed):
    """Critical weight decay λ_c, exponent ν (with bootstrap CIs), regime table and median t_grok
    per architecture/size group of a sweep store."""
    with loading():         # scipy: after the command line's own start-up, under its Ctrl-C handler
        from fastdiag.analysis.report import PredictSettings

    with open_store(store_path) as store:
        report = store_report(store, n_boot=n_boot, seed=seed, retention_threshold=retention_threshold,
                              predict=PredictSettings(t0, test_frac, split_seed) if predict else None,
                              fit_max_lambda=fit_max_lambda)
        if not (report.groups or report.interventions or report.headdim):
            # nothing to analyse (no finished sweep run, intervention or head-dimension set) is an error a script can see
            c = report.counts
            raise CLIError(f"store {store_path}: no finished runs to analyse ({c['pending']} pending, "
                           f"{c['running']} running, {c['failed']} failed)")
        click.echo(json.dumps(report.to_dict(), indent=2, ensure_ascii=False, allow_nan=False) if as_json
                   else format_report(report))


COMMANDS = [analyze_cmd]
