"""The README's "Reproducing the paper" numbers and figure, from the canonical-model stores of
`fastdiag sweep` (4 × 8 × 128, a + b mod 97, 50 % split, batch 512, lr 1e-3).

    python benchmarks/paper_repro.py cost                       # CPU time per step / per evaluation
    python benchmarks/paper_repro.py init --seeds 8             # s̄, σ_H of the initialised model (step 0)
    python benchmarks/paper_repro.py plan --wd 0.005:10:23 --seeds 16 --epochs 20000  # GPU time of a grid
    python benchmarks/paper_repro.py table  runs/paper/*.sqlite  # t_grok, t_mem, phase values, regimes
    python benchmarks/paper_repro.py figure runs/paper/*.sqlite --out docs/img/paper_two_phase.png

`table` groups the done runs of all stores by λ (a long run trained past grokking counts like any
other for t_grok / t_mem, and alone supplies the after-grokking values); per-run landmarks come from
``fastdiag.analysis.trajectories.phase_values``. Paper values are SPEC §4 / the paper's Fig. 2.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from fastdiag.grokking.config import RunConfig
from fastdiag.grokking.ensemble_train import pack_runs
from fastdiag.analysis.trajectories import phase_values
from fastdiag.store import open_existing
from fastdiag.sweep import build_grid, parse_wd
from fastdiag.plots.style import STYLE, figure as _figure, save as _save
from fastdiag.grokking.train import Trainer

PAPER = {"t_grok_lambda1": 130, "lambda_c": 0.0158, "lambda_c_ci": (0.0109, 0.0200),
         "nu": 0.757, "nu_ci": (0.725, 0.799), "s_bar": (0.93, 0.995, 0.88), "sigma_h_peak": (0.09, 0.10)}


def power_law_ratio(lam: float, lam_ref: float, lambda_c: float, nu: float) -> float:
    """t_grok(λ) / t_grok(λ_ref) under t ∝ (λ − λ_c)^−ν."""
    return ((lam - lambda_c) / (lam_ref - lambda_c)) ** -nu


# ------------------------------------------------------------------ cost
def measure_cost(epochs: int = 4, threads: int = 1) -> dict:
    """CPU seconds (process time, so other processes on the machine do not inflate it) of a canonical
    training epoch without and with its evaluation, one torch thread as a sweep worker has; the two
    trainers alternate epoch by epoch."""
    torch.set_num_threads(threads)
    trainers = {"train only": Trainer(RunConfig(weight_decay=1.0, epochs=10_000, eval_every=10_000, seed=0,
                                                device="cpu")),
                "train + eval": Trainer(RunConfig(weight_decay=1.0, epochs=10_000, eval_every=1, seed=0,
                                                  device="cpu"))}
    for t in trainers.values():                     # warm-up epoch (allocator, first-call costs)
        t.run_epoch()
    cpu = {k: [] for k in trainers}
    for _ in range(epochs):
        for name, t in trainers.items():
            start = time.process_time()
            t.run_epoch()
            cpu[name].append(time.process_time() - start)
    steps_per_epoch = trainers["train only"].step // trainers["train only"].epoch
    train = float(np.median(cpu["train only"]))
    both = float(np.median(cpu["train + eval"]))
    return {"threads": threads, "epochs_timed": epochs, "steps_per_epoch": steps_per_epoch,
            "cpu_s_per_epoch_train": train, "cpu_ms_per_step": 1000 * train / steps_per_epoch,
            "cpu_s_per_epoch_train_eval": both, "cpu_s_per_eval": both - train,
            "torch_version": torch.__version__}


def initial_diagnostics(seeds: list[int]) -> list[dict]:
    """s̄ and σ_H of step 0 (the initialised model on its first minibatch), per seed: one epoch of a
    trainer evaluated at epoch 1 records exactly one diagnostic step (diag_every 10 ≥ 10 steps per
    epoch). The same numbers as a sweep run with eval_every 1, without training the rest."""
    torch.set_num_threads(1)       # a sweep worker's share; more threads only spin on a loaded machine
    out = []
    for seed in seeds:
        t = Trainer(RunConfig(weight_decay=1.0, epochs=1, eval_every=1, seed=seed, device="cpu"))
        row = t.run_epoch()
        if t.step > t.cfg.diag_every:                  # more than step 0 would be merged into the row
            raise ValueError(f"epoch 1 has {t.step} steps > diag_every {t.cfg.diag_every}: not step 0 alone")
        out.append({"seed": seed, "s_bar": row["s_bar"], "sigma_h": row["sigma_h"]})
    return out


# ------------------------------------------------------------------ GPU plan
STEP_GFLOP = 7.29      # matmul GFLOP of one canonical training step (benchmarks/ensemble_step_scan.py)
EVAL_GFLOP = 44.7      # forward over all 9,409 pairs ≈ 9409/512 × STEP_GFLOP/3


def predicted_t_grok(lam: float, t_ref: float = 130.0, lambda_c: float = PAPER["lambda_c"],
                     nu: float = PAPER["nu"]) -> float:
    """The paper's law t = t_ref·((λ − λ_c)/(1 − λ_c))^−ν; inf at or below λ_c (memorisation)."""
    return t_ref * ((lam - lambda_c) / (1 - lambda_c)) ** -nu if lam > lambda_c else math.inf


def grid_plan(lambdas: list[float], seeds: int, epochs: int, eval_every: int, ensemble: int,
              tflops: float, floor_ms: float, collapse_from: float = 10.0) -> dict:
    """GPU time of a stop-at-grok canonical grid packed exactly as `fastdiag sweep --ensemble K` packs it
    (`fastdiag.grokking.ensemble_train.pack_runs`, packs run one after another on one GPU), every run taking the
    paper's predicted t_grok, capped at the horizon; runs at λ ≥ ``collapse_from`` (the paper's
    collapse at λ = 10: never fit) and at λ ≤ λ_c train to the horizon.
    A pack-step costs max(floor_ms, live members × STEP_GFLOP / tflops): compute-bound with the assumed
    sustained fp32 matmul rate, launch-bound below floor_ms; an evaluation costs its forward FLOPs."""
    configs = build_grid(RunConfig(epochs=epochs, eval_every=eval_every, device="cuda").to_dict(), lambdas,
                         list(range(seeds)))
    packs = pack_runs(configs, ensemble)
    seconds = member_epochs = 0.0
    for pack in packs:
        ends = sorted(epochs if c.weight_decay >= collapse_from else min(predicted_t_grok(c.weight_decay), epochs)
                      for c in pack)
        start = 0.0
        for i, end in enumerate(ends):            # members still training between two finishes
            live = len(ends) - i
            step_ms = max(floor_ms, live * STEP_GFLOP / tflops)
            eval_ms = max(floor_ms, live * EVAL_GFLOP / tflops)
            seconds += (end - start) * (10 * step_ms + eval_ms / eval_every) / 1e3
            member_epochs += (end - start) * live
            start = end
    return {"runs": len(configs), "packs": len(packs), "member_epochs": member_epochs, "hours": seconds / 3600,
            "assumed_tflops": tflops, "assumed_floor_ms": floor_ms,
            "t_pred": {f"{lam:.4g}": (None if math.isinf(predicted_t_grok(lam)) else round(predicted_t_grok(lam)))
                       for lam in lambdas}}


# ------------------------------------------------------------------ table
def load_runs(stores: list[str]) -> list[dict]:
    """Done runs of all stores with their traces and phase values. A run whose whole configuration
    (seed included) was already read from another store is a rerun: it is counted once, and its result
    is checked against the first (training on the CPU is deterministic, so they must agree)."""
    runs = []
    seen: dict[str, dict] = {}
    for path in stores:
        with open_existing(path) as store:
            for run in store.runs("done"):
                key = json.dumps(run["config"], sort_keys=True)
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


# ------------------------------------------------------------------ figure
COLOURS = {0.001: "#0072b2", 0.05: "#cc79a7", 0.1: "#009e73", 1.0: "#111111", 10.0: "#e69f00"}


def figure(runs: list[dict], out: Path, init: list[dict] | None = None) -> list[Path]:
    """The paper's Fig. 2 layout (test accuracy, s̄, σ_H against epoch, log x) for every λ in the stores:
    thin lines one run each, thick line the median over the λ's runs where all of them have a value;
    dotted grey: the paper's Fig. 2 landmarks; ``init`` (rows of `init`): step-0 values drawn at epoch 1."""
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
                    alone = len(by_lambda[lam]) == 1
                    e, v = zip(*pts)
                    ax.plot(e, v, color=colour, linewidth=1.6 if long or alone else 0.6,
                            alpha=0.95 if long or alone else 0.45, linestyle="--" if long else "-")
                    series.append(dict(pts))
                common = sorted(set.intersection(*(set(s) for s in series))) if series else []
                if len(series) > 1 and common:
                    med = [float(np.median([s[e] for s in series])) for e in common]
                    ax.plot(common, med, color=colour, linewidth=2.2)
                if row == 0:
                    n = len(by_lambda[lam])
                    ax.plot([], [], color=colour, linewidth=2.2, label=f"$\\lambda = {lam:g}$ ({n} run{'s' * (n > 1)})")
            if init and key in ("s_bar", "sigma_h"):
                ax.plot([1] * len(init), [r[key] for r in init], "o", color="#111111", markersize=3, alpha=0.6,
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
        axes[-1, 0].set_xscale("log")
        axes[-1, 0].set_xlabel("training epoch")
        axes[0, 0].legend(loc="upper left", fontsize=8)
        if init:
            s_ax.legend(loc="lower right", fontsize=8)
        fig.suptitle("Canonical 4×8×128, a + b mod 97 (2-core CPU)\n"
                     "thin: one run; thick: median over seeds while all of them run")
        return _save(fig, out.with_suffix(""), formats=(out.suffix.lstrip(".") or "png",))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cost")
    c.add_argument("--epochs", type=int, default=4)
    c.add_argument("--threads", type=int, default=1)
    i = sub.add_parser("init")
    i.add_argument("--seeds", type=int, default=8)
    g = sub.add_parser("plan")
    g.add_argument("--wd", required=True)
    g.add_argument("--seeds", type=int, required=True)
    g.add_argument("--epochs", type=int, required=True)
    g.add_argument("--eval-every", type=int, default=10)
    g.add_argument("--ensemble", type=int, default=32)
    g.add_argument("--collapse-from", type=float, default=10.0)
    g.add_argument("--tflops", type=float, default=20.0,
                   help="assumed sustained fp32 matmul TFLOP/s of a full ensemble step on the GPU")
    g.add_argument("--floor-ms", type=float, default=3.0,
                   help="assumed launch-bound floor of one ensemble step / evaluation on the GPU")
    t = sub.add_parser("table")
    t.add_argument("stores", nargs="+")
    t.add_argument("--json", action="store_true")
    f = sub.add_parser("figure")
    f.add_argument("stores", nargs="+")
    f.add_argument("--out", type=Path, required=True)
    f.add_argument("--init", type=Path, help="JSON written by `init`: step-0 values drawn at epoch 1")
    args = ap.parse_args()
    if args.cmd == "cost":
        print(json.dumps(measure_cost(args.epochs, args.threads), indent=1))
    elif args.cmd == "init":
        rows = initial_diagnostics(list(range(args.seeds)))
        print(json.dumps({"per_seed": rows, "s_bar": summary([r["s_bar"] for r in rows]),
                          "sigma_h": summary([r["sigma_h"] for r in rows])}, indent=1))
    elif args.cmd == "plan":
        print(json.dumps(grid_plan(parse_wd(args.wd), args.seeds, args.epochs, args.eval_every, args.ensemble,
                                   args.tflops, args.floor_ms, args.collapse_from), indent=1))
    elif args.cmd == "table":
        report = table(load_runs(args.stores))
        print(json.dumps(report, indent=1) if args.json else "\n".join(format_table(report)))
    else:
        init = json.loads(args.init.read_text())["per_seed"] if args.init else None
        for p in figure(load_runs(args.stores), args.out, init):
            print(p)


if __name__ == "__main__":
    main()
