"""The paper reproduction's data (README, "Reproducing the paper"): the paper's published constants and
its power law, done runs read from result stores (`load_runs`, `table`), their compact committed form in
data/paper/ (`export` writes runs.csv and traces.csv, `load_data` reads the folder back), and the
order-statistic interval of a median every comparison uses. numpy/scipy, no torch.
"""
from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

import numpy as np
from scipy import stats as sps

from fastdiag.analysis.trajectories import phase_values
from fastdiag.grokking.config import EXECUTION_FIELDS, RunConfig
from fastdiag.grokking.labels import relabel
from fastdiag.store import open_existing

PAPER = {"t_grok_lambda1": 130, "lambda_c": 0.0158, "lambda_c_ci": (0.0109, 0.0200),
         "nu": 0.757, "nu_ci": (0.725, 0.799), "s_bar": (0.93, 0.995, 0.88), "sigma_h_peak": (0.09, 0.10)}


def power_law_ratio(lam: float, lam_ref: float, lambda_c: float, nu: float) -> float:
    """t_grok(λ) / t_grok(λ_ref) under t ∝ (λ − λ_c)^−ν."""
    return ((lam - lambda_c) / (lam_ref - lambda_c)) ** -nu



def predicted_t_grok(lam: float, t_ref: float = 130.0, lambda_c: float = PAPER["lambda_c"],
                     nu: float = PAPER["nu"]) -> float:
    """The paper's law t = t_ref·((λ − λ_c)/(1 − λ_c))^−ν; inf at or below λ_c (memorisation)."""
    return t_ref * ((lam - lambda_c) / (1 - lambda_c)) ** -nu if lam > lambda_c else math.inf


# ------------------------------------------------------------------ table
def load_runs(stores: list[str]) -> list[dict]:
    """Done runs of all stores with their traces and phase values. A run whose whole configuration
    (seed included; where and how it executed aside: `EXECUTION_FIELDS`) was already read from another store is a rerun: it is counted once, and its result
    is checked against the first (training on the CPU is deterministic, so they must agree)."""
    runs = []
    seen: dict[str, dict] = {}
    for path in stores:
        with open_existing(path) as store:
            for run in store.runs("done"):
                key = json.dumps({k: v for k, v in run["config"].items() if k not in EXECUTION_FIELDS}, sort_keys=True)
                if key in seen:
                    first = seen[key]
                    same = all(first["result"].get(k) == run["result"].get(k)
                               for k in ("t_grok_epoch", "t_mem_epoch", "regime"))
                    print(f"# λ = {run['config']['weight_decay']:g} seed {run['config']['seed']}: rerun in {path} "
                          f"counted once ({'same' if same else 'DIFFERENT'} t_grok/t_mem/regime as in {first['store']})", file=sys.stderr)
                    continue
                trace = store.trace(run["run_id"])
                res = run["result"]
                seen[key] = run | {"store": path}
                runs.append({"store": path, "lambda": float(run["config"]["weight_decay"]),
                             "seed": run["config"]["seed"], "config": run["config"], "result": res,
                             "trace": trace,
                             "phase": phase_values(trace, res.get("t_mem_epoch"), res.get("t_grok_epoch"))})
    return runs


def summary(values: list[float]) -> dict | None:
    """n, median, IQR, range and a 95 % percentile-bootstrap CI of the median (2,000 resamples, seed 0)."""
    x = np.array([v for v in values if v is not None and math.isfinite(v)], dtype=float)
    if x.size == 0:
        return None
    boot = np.median(np.random.default_rng(0).choice(x, size=(2000, x.size)), axis=1)
    return {"n": int(x.size), "median": float(np.median(x)), "iqr": [float(v) for v in np.percentile(x, [25, 75])],
            "range": [float(x.min()), float(x.max())], "median_ci95": [float(v) for v in np.percentile(boot, [2.5, 97.5])],
            "values": [float(v) for v in x]}


def table(runs: list[dict]) -> dict:
    by_lambda: dict[float, list[dict]] = {}
    for r in runs:
        by_lambda.setdefault(r["lambda"], []).append(r)
    out: dict = {"per_lambda": {}}
    for lam in sorted(by_lambda):
        rs = by_lambda[lam]
        regimes: dict[str, int] = {}
        for r in rs:
            regimes[r["result"]["regime"]] = regimes.get(r["result"]["regime"], 0) + 1
        entry = {"n": len(rs), "regimes": regimes,
                 "horizons": sorted({r["config"]["epochs"] for r in rs}),
                 "eval_every": sorted({r["config"]["eval_every"] for r in rs}),
                 "t_grok": summary([r["result"]["t_grok_epoch"] for r in rs]),
                 "t_mem": summary([r["result"]["t_mem_epoch"] for r in rs]),
                 "final_train_acc": summary([r["result"]["final_train_acc"] for r in rs]),
                 "final_test_acc": summary([r["result"]["final_test_acc"] for r in rs]),
                 "max_train_acc": summary([max((x["train_acc"] for x in r["trace"]), default=None) for r in rs]),
                 "max_test_acc": summary([max((x["test_acc"] for x in r["trace"]), default=None) for r in rs]),
                 "final_s_bar": summary([r["result"]["final_s_bar"] for r in rs]),
                 "wall_s": summary([r["result"]["wall_seconds"] for r in rs])}
        for key in ("s_bar_init", "s_bar_mem", "s_bar_grok", "s_bar_peak_phase1", "s_bar_min_after_grok",
                    "s_bar_min_epoch", "s_bar_top_after_grok", "s_bar_top_epoch", "s_bar_min_after_top",
                    "s_bar_min_after_top_epoch", "sigma_h_peak_after_grok", "sigma_h_peak_epoch", "epochs_after_grok"):
            entry[key] = summary([r["phase"][key] for r in rs])
        out["per_lambda"][str(lam)] = entry
    out["power_law"] = power_law_check(out["per_lambda"], by_lambda)
    return out


def power_law_check(per_lambda: dict, by_lambda: dict[float, list[dict]]) -> dict:
    """For every λ below 1 (above the paper's λ_c): the paper's predicted t(λ)/t(1) (and its range over
    the paper's CIs of λ_c and ν), our observed ratio of medians with the ν it implies (λ_c held fixed),
    and the horizons of runs that did not grok — each a lower bound on t(λ)."""
    lc, nu = PAPER["lambda_c"], PAPER["nu"]
    t1 = per_lambda.get("1.0", {}).get("t_grok")
    out = {}
    for lam, runs in sorted(by_lambda.items()):
        if not lc < lam < 1.0 or t1 is None:
            continue
        corners = [power_law_ratio(lam, 1.0, a, b) for a in PAPER["lambda_c_ci"] for b in PAPER["nu_ci"]]
        check = {"predicted_ratio": power_law_ratio(lam, 1.0, lc, nu),
                 "predicted_ratio_range_over_paper_cis": [min(corners), max(corners)],
                 "predicted_t_grok": power_law_ratio(lam, 1.0, lc, nu) * t1["median"],
                 "not_grokked_horizons": sorted(r["config"]["epochs"] for r in runs
                                                if r["result"]["t_grok_epoch"] is None)}
        t = per_lambda[str(lam)]["t_grok"]
        if t:
            ratio = t["median"] / t1["median"]
            check |= {"grokked": t["n"], "observed_ratio_of_medians": ratio,
                      "implied_nu": math.log(ratio) / -math.log((lam - lc) / (1.0 - lc))}
        out[str(lam)] = check
    return out


def format_table(report: dict) -> list[str]:
    lines = []
    for lam, entry in report["per_lambda"].items():
        lines.append(f"λ = {float(lam):g}: {entry['n']} run(s), regimes {entry['regimes']}, horizon(s) "
                     f"{entry['horizons']} epochs, eval every {entry['eval_every']}")
        for key, v in entry.items():
            if isinstance(v, dict) and "median" in v:
                vals = " ".join(f"{x:.4g}" for x in v["values"])
                lines.append(f"  {key:<24} n={v['n']:<2} median {v['median']:.4g}  IQR [{v['iqr'][0]:.4g}, "
                             f"{v['iqr'][1]:.4g}]  95% CI of median [{v['median_ci95'][0]:.4g}, "
                             f"{v['median_ci95'][1]:.4g}]  values {vals}")
    lines.append("power law t ∝ (λ − λ_c)^−ν, paper λ_c = 0.0158, ν = 0.757 (ratios to our median t_grok at λ = 1):")
    for lam, c in report["power_law"].items():
        lo, hi = c["predicted_ratio_range_over_paper_cis"]
        line = (f"  λ = {float(lam):g}: predicted t(λ)/t(1) = {c['predicted_ratio']:.3g} ({lo:.3g}–{hi:.3g} over the "
                f"paper's CIs), t ≈ {c['predicted_t_grok']:.0f} epochs")
        if "observed_ratio_of_medians" in c:
            line += (f"; observed {c['observed_ratio_of_medians']:.3g} (median of {c['grokked']} grokked run(s)), "
                     f"implied ν {c['implied_nu']:.3g} with λ_c fixed")
        if c["not_grokked_horizons"]:
            line += f"; not grokked within {c['not_grokked_horizons']} epochs: {len(c['not_grokked_horizons'])} run(s)"
        lines.append(line)
    return lines


# ------------------------------------------------------------------ committed data 
DATA = Path(__file__).resolve().parents[2] / "data" / "paper"
RUN_COLUMNS = ("lambda", "seed", "epochs", "eval_every", "stop_at_grok", "grok_threshold", "t_mem_epoch",
               "t_grok_epoch", "regime", "regime_current_rules", "final_train_acc", "final_test_acc",
               "final_s_bar", "wall_seconds", "store")
TRACE_COLUMNS = ("lambda", "seed", "epoch", "train_acc", "test_acc", "train_loss", "test_loss", "s_bar", "sigma_h",
                 "weight_norm")
CI_COVERAGE = 0.95        # the least coverage of a median's order-statistic interval


def _num(text: str):
    """A CSV cell: '' → None, else int where it is one, else float."""
    if text == "":
        return None
    value = float(text)
    return int(value) if value.is_integer() and "." not in text and "e" not in text.lower() else value


def export(stores: list[str], out: Path) -> list[Path]:
    """The compact, committed form of done runs (a rerun counted once, see `load_runs`): OUT/runs.csv,
    one row per run (configuration, landmarks, the label as stored and under the current rules of
    fastdiag/grokking/labels.py), and OUT/traces.csv, every evaluation row (the per-layer columns left
    out). Appends to files already there, skipping runs (λ, seed, horizon) they already hold."""
    out.mkdir(parents=True, exist_ok=True)
    runs_path, traces_path = out / "runs.csv", out / "traces.csv"
    have = set()
    if runs_path.exists():
        with runs_path.open() as f:
            have = {(float(r["lambda"]), int(r["seed"]), int(r["epochs"])) for r in csv.DictReader(f)}
    new = [r for r in sorted(load_runs(stores), key=lambda r: (r["lambda"], r["seed"]))
           if (r["lambda"], r["seed"], r["config"]["epochs"]) not in have]
    _check_exportable(new, {(lam, seed) for lam, seed, _ in have})
    for path, columns, rows in (
            (runs_path, RUN_COLUMNS, [_run_row(r) for r in new]),
            (traces_path, TRACE_COLUMNS, [{"lambda": r["lambda"], "seed": r["seed"]} | {k: x.get(k) for k in TRACE_COLUMNS[2:]}
                                          for r in new for x in r["trace"]])):
        fresh = not path.exists()
        with path.open("a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns, lineterminator="\n")
            if fresh:
                writer.writeheader()
            for row in rows:
                writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
    return [runs_path, traces_path]


# What runs.csv leaves out, so every exported run must have it at the canonical default (RunConfig's).
CANONICAL_FIELDS = ("arch", "preset", "n_layers", "n_heads", "d_model", "d_ff", "op", "p", "lr", "batch_size",
                    "train_frac", "diag_every", "patience")


def _check_exportable(runs: list[dict], have: set[tuple]) -> None:
    """Refuse what runs.csv / traces.csv could not tell apart: a run off the canonical model (the fields
    runs.csv leaves out must be RunConfig's defaults), and a second run of one (λ, seed) (traces.csv keys
    its rows by λ and seed)."""
    default = RunConfig().to_dict()
    seen = set(have)
    for r in runs:
        off = {k: r["config"].get(k) for k in CANONICAL_FIELDS if r["config"].get(k) != default[k]}
        if off:
            raise ValueError(f"λ = {r['lambda']:g} seed {r['seed']} ({r['store']}): not the canonical setup, {off}; "
                             "runs.csv has no column for it")
        if (r["lambda"], r["seed"]) in seen:
            raise ValueError(f"λ = {r['lambda']:g} seed {r['seed']} ({r['store']}): a second run of this λ and seed "
                             f"(horizon {r['config']['epochs']}); traces.csv could not tell their rows apart")
        seen.add((r["lambda"], r["seed"]))


def _run_row(run: dict) -> dict:
    cfg, res = run["config"], run["result"]
    return {"lambda": run["lambda"], "seed": run["seed"], "epochs": cfg["epochs"], "eval_every": cfg["eval_every"],
            "stop_at_grok": int(bool(cfg.get("stop_at_grok", True))), "grok_threshold": cfg["grok_threshold"],
            "t_mem_epoch": res.get("t_mem_epoch"), "t_grok_epoch": res.get("t_grok_epoch"), "regime": res.get("regime"),
            "regime_current_rules": relabel(res, run["trace"], cfg["grok_threshold"])["current"],
            "final_train_acc": res.get("final_train_acc"), "final_test_acc": res.get("final_test_acc"),
            "final_s_bar": res.get("final_s_bar"), "wall_seconds": res.get("wall_seconds"),
            "store": Path(run["store"]).name}


def load_data(data: Path = DATA) -> dict:
    """Everything `regenerate` reads, from ``data`` alone: the exported runs with their traces
    (runs.csv, traces.csv), the values printed from stores that were never committed (printed.json),
    step 0 (init.json) and the paper's published aggregate (published.json)."""
    runs = []
    if (data / "runs.csv").exists():
        traces: dict[tuple, list[dict]] = {}
        with (data / "traces.csv").open() as f:
            for row in csv.DictReader(f):
                traces.setdefault((float(row["lambda"]), int(row["seed"])), []).append(
                    {k: _num(v) for k, v in row.items() if k not in ("lambda", "seed")})
        with (data / "runs.csv").open() as f:
            for row in csv.DictReader(f):
                run = {k: (v if k in ("regime", "regime_current_rules", "store") else _num(v)) for k, v in row.items()}
                run["lambda"] = float(run["lambda"])
                run["trace"] = traces.get((run["lambda"], run["seed"]), [])
                runs.append(run)
    return {"runs": runs, "printed": json.loads((data / "printed.json").read_text()),
            "init": json.loads((data / "init.json").read_text()),
            "published": json.loads((data / "published.json").read_text())}


def median_ci(values: list[float], coverage: float = CI_COVERAGE) -> dict:
    """Distribution-free interval of a median from order statistics: [x_(k), x_(n+1−k)] with the largest
    k whose exact coverage 1 − 2·P(Bin(n, ½) ≤ k − 1) is ≥ ``coverage`` (k = 1, the range, when even
    that falls short: its coverage is then below ``coverage`` and says so)."""
    x = sorted(values)
    n = len(x)
    k = 1
    while k + 1 <= (n + 1) // 2 and 1 - 2 * sps.binom.cdf(k, n, 0.5) >= coverage:
        k += 1
    return {"n": n, "median": float(np.median(x)), "ci": [x[k - 1], x[n - k]], "k": k,
            "coverage": float(1 - 2 * sps.binom.cdf(k - 1, n, 0.5))}



def fmt(x, digits: int = 3) -> str:
    if x is None:
        return "—"
    if float(x).is_integer() and abs(x) >= 10:
        return f"{int(x):,}"
    if float(2 * x).is_integer() and abs(x) >= 10:      # a median of an even count of epochs: x.5
        return f"{x:,.1f}"
    return f"{x:.{digits}g}"


def median_text(values: list[float], digits: int = 3) -> str:
    """n, median, the ≥ 95 % order-statistic interval and the next narrower one, each with its exact
    coverage (a median's interval has only these discrete coverages)."""
    m = median_ci(values)
    text = f"n = {m['n']}, median {fmt(m['median'], digits)}"
    if m["n"] < 2:
        return text
    lo, hi = m["ci"]
    text += f", [{fmt(lo, digits)}, {fmt(hi, digits)}] at {100 * m['coverage']:.1f} %"
    k, x = m["k"] + 1, sorted(values)
    if k < m["n"] + 1 - k:                          # the next narrower pair, below the target coverage
        cov = 1 - 2 * sps.binom.cdf(k - 1, m["n"], 0.5)
        text += f" or [{fmt(x[k - 1], digits)}, {fmt(x[m['n'] - k], digits)}] at {100 * cov:.1f} %"
    return text


def mann_whitney_text(ours: list[float], theirs: list[float]) -> str:
    test = sps.mannwhitneyu(ours, theirs, alternative="two-sided", method="asymptotic")
    return f"Mann–Whitney U = {test.statistic:g}, two-sided p = {test.pvalue:.2g} (normal approximation, ties corrected)"


def runs_from_data(data: dict) -> list[dict]:
    """The exported runs of ``load_data`` in the shape `figure` draws (that of `load_runs`)."""
    return [{"lambda": r["lambda"], "seed": r["seed"], "store": r["store"], "trace": r["trace"],
             "config": {"epochs": r["epochs"], "eval_every": r["eval_every"], "stop_at_grok": bool(r["stop_at_grok"])},
             "result": {"t_grok_epoch": r["t_grok_epoch"], "t_mem_epoch": r["t_mem_epoch"], "regime": r["regime"]}}
            for r in data["runs"]]
