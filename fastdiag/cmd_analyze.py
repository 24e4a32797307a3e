"""`fastdiag analyze STORE`: λ_c, ν, regime table and median t_grok per architecture/size group."""
from __future__ import annotations

import json

import click


def _fmt(x, digits: int = 4) -> str:
    return "-" if x is None else f"{x:.{digits}g}"


def analyze_store(store_path: str, n_boot: int = 1500, seed: int = 0) -> dict:
    from .store import open_existing
    from .sweep import analyze_group, load_groups

    with open_existing(store_path) as store:
        groups, counts = load_groups(store)
        failed = [{"run_id": r["run_id"], "error": r["error"]} for r in store.runs("failed")]
    report = {"store": str(store_path), "counts": counts, "n_boot": n_boot, "seed": seed,
              "groups": [analyze_group(g, n_boot=n_boot, seed=seed) for g in groups],
              "failed_runs": failed}
    return report


def format_report(report: dict) -> str:
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
            lines.append(f"  λ_c = {_fmt(lc['lambda_c'])}  95% CI [{_fmt(lc['ci'][0])}, {_fmt(lc['ci'][1])}]"
                         f"  k = {_fmt(lc['k'], 3)} per decade  ({lc['n_boot_ok']}/{lc['n_boot']} resamples "
                         f"converged, {lc['n_runs']} runs)")
        for key, name in (("nu", "ν (λ_c fixed)"), ("nu_joint", "ν (joint, λ_c refitted per resample)")):
            nu = g[key]
            if "error" in nu:
                lines.append(f"  {name}: no fit — {nu['error']}")
            else:
                lines.append(f"  {name} = {_fmt(nu['nu'], 3)}  95% CI [{_fmt(nu['ci'][0], 3)}, "
                             f"{_fmt(nu['ci'][1], 3)}]  amplitude {_fmt(nu['amplitude'], 3)} epochs  "
                             f"({nu['n']} grokked runs above λ_c, {nu['n_boot_ok']}/{nu['n_boot']} resamples)")
        header = f"  {'λ':>10} {'runs':>5} {'grok':>5} {'memor.':>6} {'collapse':>8} {'anti-grok':>9} " \
                 f"{'diverged':>8} {'median t_grok (epochs)':>22}"
        lines.append(header)
        for row in g["regimes"]:
            lines.append(f"  {row['lambda']:>10.4g} {row['n']:>5} {row['grok']:>5} {row['memorization']:>6} "
                         f"{row['collapse']:>8} {row['anti-grok']:>9} {row['diverged']:>8} "
                         f"{_fmt(row['median_t_grok']):>22}")
    if report["failed_runs"]:
        lines.append("")
        lines.append(f"failed runs ({len(report['failed_runs'])}):")
        for f in report["failed_runs"][:10]:
            lines.append(f"  {f['run_id']}: {' '.join(str(f['error']).split())[:200]}")
    return "\n".join(lines)


@click.command("analyze")
@click.argument("store_path", metavar="STORE", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--n-boot", type=int, default=1500, show_default=True, help="Bootstrap resamples per fit.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the bootstrap.")
def analyze_cmd(store_path, as_json, n_boot, seed):
    """Critical weight decay λ_c, exponent ν (with bootstrap CIs), regime table and median t_grok
    per architecture/size group of a sweep store."""
    from .cli import CLIError

    if n_boot < 1:
        raise CLIError(f"--n-boot: must be >= 1, got {n_boot}")
    report = analyze_store(store_path, n_boot=n_boot, seed=seed)
    if as_json:
        click.echo(json.dumps(report, indent=2, ensure_ascii=False, allow_nan=False))
    else:
        click.echo(format_report(report))


COMMANDS = [analyze_cmd]
