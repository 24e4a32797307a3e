"""The paper's experiments beyond the λ sweep (issue 8): numpy/scipy only, no torch.

* ``segment_stages``        the five stages of a long trajectory (coordination, differentiation,
                            re-synchronisation, second differentiation, collapse) from s̄, σ_H and
                            test accuracy, by a documented rule (see its docstring).
* ``retention_by_lambda``   long horizons: per λ, how many grokked runs still generalise at the end.
* ``phase_values``          one run's two-phase landmarks: s̄ at init / t_mem / t_grok, the
                            Phase-1 peak, the Phase-2 s̄ trough and σ_H peak after grokking.
* ``phase2_peak_sigma_h``, ``headdim_analysis``   peak σ_H after grokking against the per-head
                            dimension d/H, with the saturating fit σ_max = c + a(1 − e^(−b·d/H)).
* ``predictive_analysis``   does s̄/σ_H at epoch t0 predict "groks by the horizon" or log t_grok
                            better than training-clock, loss and weight-norm baselines? Seeds are
                            split into train and test seeds; AUC/MAE with bootstrap CIs of both
                            models and of their paired difference on the held-out seeds.

The causal interventions (they need torch and the trainer) are in ``fastdiag.grokking.interventions``.
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np

STAGES = ("coordination", "differentiation", "re-synchronisation", "second differentiation", "collapse")
GROKKED = ("grok", "anti-grok")
ANTI_GROK_BELOW = 0.5


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# ============================================================================ stages


def _moving_average(y: np.ndarray, window: int) -> np.ndarray:
    if window <= 1:
        return y.copy()
    half = window // 2
    padded = np.pad(y, (half, half), mode="edge")
    kernel = np.ones(2 * half + 1) / (2 * half + 1)
    return np.convolve(padded, kernel, mode="valid")


def _collapse_index(test_acc: list[float | None], grok_index: int | None, below: float,
                    persist: float = 0.75) -> int | None:
    """First evaluation after grokking with test accuracy < ``below`` from which at least ``persist``
    of the remaining evaluations are also below ``below`` (a collapse that lasts, not a dip)."""
    if grok_index is None:
        return None
    acc = np.array([a if _finite(a) else np.nan for a in test_acc], float)
    low = acc < below
    n = len(acc)
    # fraction of evaluations from i to the end that are low
    tail_low = np.cumsum(low[::-1])[::-1] / (n - np.arange(n))
    for i in range(grok_index + 1, n):
        if low[i] and tail_low[i] >= persist:
            return i
    return None


def segment_stages(trace: Sequence[dict], *, grok_threshold: float = 0.99, n_grid: int = 256,
                   smooth_decades: float = 0.1, rate_threshold: float = 0.5, min_decades: float = 0.05,
                   min_change: float = 0.25, min_span_decades: float = 1.5,
                   collapse_below: float = ANTI_GROK_BELOW, floors: tuple[float, float] = (0.02, 0.01)) -> dict:
    """Segment one trajectory into the paper's stages.

    The rule (all on a log-epoch axis, as the paper plots it):

    1. Use the evaluations with epoch > 0 and finite s̄ and σ_H; the trajectory must span at least
       ``min_span_decades`` decades of epochs (else ``stages`` is empty and ``note`` says why).
    2. **Collapse** starts at the first evaluation after grokking (test accuracy ≥ ``grok_threshold``)
       whose test accuracy is below ``collapse_below`` (0.5, the anti-grok mark) and from which at
       least 75 % of the remaining evaluations are also below it. It lasts to the end.
    3. Before the collapse, s̄ and σ_H are interpolated linearly in log10(epoch) onto ``n_grid``
       evenly spaced points, smoothed by a centred moving average ``smooth_decades`` wide, and
       differentiated in log10(epoch). Each rate is divided by the range of its smoothed series
       (at least ``floors`` = (0.02, 0.01), so flat noisy series stay flat): r_s, r_h in
       "ranges per decade". The synchronisation rate is z = (r_s − r_h) / 2.
    4. Each grid point is labelled +1 (synchronising: z > ``rate_threshold``), −1 (differentiating:
       z < −``rate_threshold``) or 0. A run of ±1 becomes 0 if it is shorter than ``min_decades`` or
       moves the normalised signal by less than ``min_change`` (|∫ z dlog10 t| over the run, i.e.
       (|Δs̄|/range + |Δσ_H|/range)/2 for a clean stage); runs of the same sign separated only by 0
       merge.
    5. The remaining runs are named in order: the first +1 run is **coordination**, the next −1
       run **differentiation**, the next +1 **re-synchronisation**, the next −1 **second
       differentiation**. A −1 run before any coordination is ignored; a run of the sign of the
       stage in progress extends it; a +1 run after the second differentiation is ignored (noted).

    Returns ``{"stages": [{"stage", "start_epoch", "end_epoch"}, ...], "t_grok_epoch",
    "collapse_epoch", "note", "params"}``; epochs are those of the nearest evaluations.
    """
    rows = [r for r in trace if _finite(r.get("epoch")) and r["epoch"] > 0
            and _finite(r.get("s_bar")) and _finite(r.get("sigma_h"))]
    params = dict(grok_threshold=grok_threshold, n_grid=n_grid, smooth_decades=smooth_decades,
                  rate_threshold=rate_threshold, min_decades=min_decades, min_change=min_change,
                  min_span_decades=min_span_decades,
                  collapse_below=collapse_below, floors=list(floors))
    out = {"stages": [], "t_grok_epoch": None, "collapse_epoch": None, "note": None, "params": params}
    if len(rows) < 8:
        out["note"] = f"too short: {len(rows)} evaluations with s̄ and σ_H (need 8)"
        return out
    epochs = np.array([float(r["epoch"]) for r in rows])
    log_e = np.log10(epochs)
    span = float(log_e[-1] - log_e[0])
    if span < min_span_decades:
        out["note"] = (f"too short: spans {span:.2f} decades of epochs ({epochs[0]:g}–{epochs[-1]:g}), "
                       f"need {min_span_decades:g}")
        return out
    test_acc = [r.get("test_acc") for r in rows]
    grok_index = next((i for i, a in enumerate(test_acc) if _finite(a) and a >= grok_threshold), None)
    out["t_grok_epoch"] = int(epochs[grok_index]) if grok_index is not None else None
    collapse = _collapse_index(test_acc, grok_index, collapse_below)
    end = collapse if collapse is not None else len(rows)
    stages: list[dict] = []
    notes: list[str] = []
    if end >= 4 and log_e[end - 1] - log_e[0] > 4 * min_decades:
        u = np.linspace(log_e[0], log_e[end - 1], n_grid)
        du = u[1] - u[0]
        s = np.interp(u, log_e[:end], [r["s_bar"] for r in rows[:end]])
        h = np.interp(u, log_e[:end], [r["sigma_h"] for r in rows[:end]])
        window = max(1, int(round(smooth_decades / du)))
        window += 1 - window % 2
        s, h = _moving_average(s, window), _moving_average(h, window)
        r_s = np.gradient(s, u) / max(float(np.ptp(s)), floors[0])
        r_h = np.gradient(h, u) / max(float(np.ptp(h)), floors[1])
        z = (r_s - r_h) / 2.0
        labels = np.where(z > rate_threshold, 1, np.where(z < -rate_threshold, -1, 0))
        runs = _runs(labels)
        runs = [(sign, a, b) if sign == 0 or ((u[b] - u[a] + du) >= min_decades
                                              and abs(float(z[a:b + 1].sum()) * du) >= min_change)
                else (0, a, b) for sign, a, b in runs]
        merged: list[list[int]] = []
        for sign, a, b in runs:
            if sign == 0:
                continue
            if merged and merged[-1][0] == sign:
                merged[-1][2] = b
            else:
                merged.append([sign, a, b])
        expected = (1, -1, 1, -1)
        k = 0
        for sign, a, b in merged:
            if k < 4 and sign == expected[k]:
                stages.append({"stage": STAGES[k], "a": a, "b": b})
                k += 1
            elif k > 0 and sign == expected[k - 1]:
                stages[-1]["b"] = b
            elif k == 0:
                continue                       # differentiating drift before any coordination
            else:
                notes.append(f"a further synchronising stretch at epoch ≈ {10 ** u[a]:.0f} is not named")
        for st in stages:
            st["start_epoch"] = _nearest_epoch(epochs, 10 ** u[st.pop("a")])
            st["end_epoch"] = _nearest_epoch(epochs, 10 ** u[st.pop("b")])
    if collapse is not None:
        out["collapse_epoch"] = int(epochs[collapse])
        stages.append({"stage": "collapse", "start_epoch": int(epochs[collapse]), "end_epoch": int(epochs[-1])})
    out["stages"] = stages
    if not stages:
        notes.append("no stage found")
    out["note"] = "; ".join(notes) or None
    return out


def _runs(labels: np.ndarray) -> list[tuple[int, int, int]]:
    """(value, first index, last index) of each run of equal labels."""
    runs = []
    start = 0
    for i in range(1, len(labels) + 1):
        if i == len(labels) or labels[i] != labels[start]:
            runs.append((int(labels[start]), start, i - 1))
            start = i
    return runs


def _nearest_epoch(epochs: np.ndarray, value: float) -> int:
    return int(epochs[int(np.argmin(np.abs(np.log10(epochs) - math.log10(value))))])


def stage_table(runs: Iterable[dict], traces: dict[str, list[dict]], **kw) -> list[dict]:
    """``segment_stages`` of each run (store run dicts) whose trace is long enough."""
    out = []
    for run in runs:
        cfg = run["config"]
        seg = segment_stages(traces.get(run["run_id"], []), grok_threshold=cfg.get("grok_threshold", 0.99), **kw)
        out.append({"run_id": run["run_id"], "weight_decay": cfg.get("weight_decay"), "seed": cfg.get("seed"),
                    "regime": (run.get("result") or {}).get("regime"), **seg})
    return out


# ============================================================================ retention


def retention_by_lambda(runs: Iterable[dict], threshold: float = 0.9) -> list[dict]:
    """Per λ over the given runs (store run dicts, status done): runs, grokked (t_grok reached),
    retained (grokked and final test accuracy ≥ ``threshold``), retention = retained / grokked,
    median final test accuracy of the grokked runs, anti-grok count."""
    by_lambda: dict[float, list[dict]] = {}
    for run in runs:
        by_lambda.setdefault(float(run["config"]["weight_decay"]), []).append(run["result"] or {})
    table = []
    for lam in sorted(by_lambda):
        results = by_lambda[lam]
        grokked = [r for r in results if r.get("regime") in GROKKED]
        finals = [r["final_test_acc"] for r in grokked if _finite(r.get("final_test_acc"))]
        retained = sum(1 for a in finals if a >= threshold)
        table.append({
            "lambda": lam, "n": len(results), "grokked": len(grokked), "retained": retained,
            "retention": retained / len(grokked) if grokked else None,
            "median_final_test_acc": float(np.median(finals)) if finals else None,
            "anti_grok": sum(1 for r in results if r.get("regime") == "anti-grok"),
            "threshold": threshold,
        })
    return table


# ============================================================================ per-head dimension


def phase2_peak_sigma_h(trace: Sequence[dict], t_grok_epoch: int | None) -> float | None:
    """Largest σ_H at or after grokking (None if the run did not grok or has no σ_H there)."""
    if t_grok_epoch is None:
        return None
    values = [r["sigma_h"] for r in trace if _finite(r.get("epoch")) and r["epoch"] >= t_grok_epoch
              and _finite(r.get("sigma_h"))]
    return max(values) if values else None


def phase_values(trace: Sequence[dict], t_mem_epoch: int | None, t_grok_epoch: int | None) -> dict:
    """The paper's two-phase landmarks of one run (its Fig. 2: s̄ ≈ 0.93 → 0.995 → 0.88, σ_H peak
    ≈ 0.09–0.10), read off the trace rows with a finite value; a landmark the trace does not reach is
    None, never a guess.

    * ``s_bar_init``: s̄ of the first evaluation (with diag_every ≥ steps per epoch and eval_every 1
      that is the forward pass of step 0, the initialised model).
    * ``s_bar_mem`` / ``s_bar_grok``: s̄ at the evaluations of t_mem and t_grok.
    * after grokking (rows with epoch > t_grok): ``s_bar_min_after_grok`` (Phase-2 trough) and
      ``sigma_h_peak_after_grok`` (Phase-2 peak), each with its epoch; ``epochs_after_grok`` says
      how far the trace reaches past t_grok (0 for a run stopped at grokking).
    * ``s_bar_peak_phase1``: largest s̄ from t_mem up to the Phase-2 trough (or up to t_grok when
      the run stopped there) — the top of the Phase-1 rise."""
    rows = [r for r in trace if _finite(r.get("epoch")) and _finite(r.get("s_bar"))]
    at = {r["epoch"]: r for r in rows}
    out: dict = {"s_bar_init": rows[0]["s_bar"] if rows else None, "init_epoch": rows[0]["epoch"] if rows else None,
                 "s_bar_mem": at[t_mem_epoch]["s_bar"] if t_mem_epoch in at else None,
                 "s_bar_grok": at[t_grok_epoch]["s_bar"] if t_grok_epoch in at else None,
                 "s_bar_min_after_grok": None, "s_bar_min_epoch": None,
                 "sigma_h_peak_after_grok": None, "sigma_h_peak_epoch": None,
                 "epochs_after_grok": None, "s_bar_peak_phase1": None}
    if t_grok_epoch is None:
        return out
    after = [r for r in rows if r["epoch"] > t_grok_epoch]
    out["epochs_after_grok"] = (after[-1]["epoch"] - t_grok_epoch) if after else 0
    if after:
        trough = min(after, key=lambda r: r["s_bar"])
        out["s_bar_min_after_grok"], out["s_bar_min_epoch"] = trough["s_bar"], trough["epoch"]
        with_h = [r for r in after if _finite(r.get("sigma_h"))]
        if with_h:
            peak = max(with_h, key=lambda r: r["sigma_h"])
            out["sigma_h_peak_after_grok"], out["sigma_h_peak_epoch"] = peak["sigma_h"], peak["epoch"]
    if t_mem_epoch is not None:
        end = out["s_bar_min_epoch"] if out["s_bar_min_epoch"] is not None else t_grok_epoch
        phase1 = [r["s_bar"] for r in rows if t_mem_epoch <= r["epoch"] <= end]
        out["s_bar_peak_phase1"] = max(phase1) if phase1 else None
    return out


def resolved_heads_width(cfg: dict) -> tuple[int, int] | None:
    """(d_model, n_heads) of a transformer config dict (preset values filled in), else None."""
    if cfg.get("arch") != "transformer":
        return None
    from fastdiag.models.transformer import PRESETS

    preset = PRESETS.get(cfg.get("preset"), PRESETS["canonical"])
    d = cfg.get("d_model") or preset["d_model"]
    h = cfg.get("n_heads") or preset["n_heads"]
    return int(d), int(h)


HEADDIM_EXCLUDE = ("seed", "device", "n_heads", "d_model", "d_ff", "preset")


def headdim_sets(runs: Iterable[dict], min_distinct: int = 3) -> list[tuple[dict, list[dict]]]:
    """Transformer runs that differ only in seed, width and heads, with at least ``min_distinct``
    distinct d/H: the per-head-dimension experiments in a store, as (shared config, runs)."""
    groups: dict[tuple, tuple[dict, list]] = {}
    for run in runs:
        cfg = run["config"]
        if resolved_heads_width(cfg) is None:
            continue
        shared = {k: v for k, v in cfg.items() if k not in HEADDIM_EXCLUDE}
        key = tuple(sorted((k, repr(v)) for k, v in shared.items()))
        groups.setdefault(key, (shared, []))[1].append(run)
    out = []
    for shared, members in groups.values():
        ratios = {d / h for d, h in (resolved_heads_width(r["config"]) for r in members)}
        if len(ratios) >= min_distinct:
            out.append((shared, members))
    return out


def headdim_analysis(runs: Sequence[dict], traces: dict[str, list[dict]], n_boot: int = 1500,
                     seed: int = 0) -> dict:
    """Phase-2 peak σ_H (``phase2_peak_sigma_h``) against d/H over grokked runs; per-d/H summaries and
    the saturating fit σ_max = c + a(1 − exp(−b·d/H)) with bootstrap CIs (``{"error": why}`` if it
    cannot be made)."""
    from fastdiag.analysis import fits as analysis

    points = []
    skipped = single_head = 0
    for run in runs:
        dh = resolved_heads_width(run["config"])
        if dh is not None and dh[1] < 2:     # σ_H over one head is 0 by definition, not a measurement
            single_head += 1
            continue
        result = run.get("result") or {}
        peak = phase2_peak_sigma_h(traces.get(run["run_id"], []), result.get("t_grok_epoch")) \
            if result.get("regime") in GROKKED else None
        if dh is None or peak is None:
            skipped += 1
            continue
        d, h = dh
        points.append({"run_id": run["run_id"], "d_model": d, "n_heads": h, "d_per_head": d / h,
                       "seed": run["config"].get("seed"), "peak_sigma_h": peak})
    by_x: dict[float, list[float]] = {}
    for p in points:
        by_x.setdefault(p["d_per_head"], []).append(p["peak_sigma_h"])
    bins = [{"d_per_head": x, "n": len(v), "mean": float(np.mean(v)), "median": float(np.median(v)),
             "std": float(np.std(v, ddof=1)) if len(v) > 1 else None,
             "configs": sorted({(p["d_model"], p["n_heads"]) for p in points if p["d_per_head"] == x})}
            for x, v in sorted(by_x.items())]
    out = {"n_points": len(points), "n_skipped": skipped, "n_single_head": single_head, "points": points,
           "bins": bins}
    try:
        fit = analysis.fit_saturating([p["d_per_head"] for p in points], [p["peak_sigma_h"] for p in points],
                                      n_boot=n_boot, seed=seed)
        out["fit"] = {"c": fit.c, "a": fit.a, "b": fit.b, "plateau": fit.plateau,
                      "ci": {k: list(v) for k, v in fit.ci.items()}, "n": fit.n, "n_boot_ok": fit.n_boot_ok,
                      "n_boot": n_boot}
    except (analysis.FitError, ValueError) as exc:
        out["fit"] = {"error": str(exc)}
    return out


# ============================================================================ predictive value

BASELINE_FEATURES = ("epoch", "log_train_loss", "log_test_loss", "weight_norm",
                     "d_log_train_loss", "d_log_test_loss", "d_weight_norm")
ATTENTION_FEATURES = ("s_bar", "sigma_h", "d_s_bar", "d_sigma_h")


def _row_at(trace: Sequence[dict], epoch: float) -> dict | None:
    best = None
    for r in trace:
        if _finite(r.get("epoch")) and r["epoch"] <= epoch:
            best = r
    return best


def _log(x):
    return math.log(max(x, 1e-12)) if _finite(x) else None


def features_at(trace: Sequence[dict], t0: float) -> dict | None:
    """What is known at epoch ``t0``: the last evaluation at or before t0 and the change since the
    last evaluation at or before t0/2. Baselines: the epoch (training clock), log train/test loss and
    weight norm and their changes; attention: s̄, σ_H and their changes. None when a value is missing."""
    now, before = _row_at(trace, t0), _row_at(trace, t0 / 2)
    if now is None:
        return None
    if before is None or before is now:
        before = next((r for r in trace if _finite(r.get("epoch"))), now)
    f = {"epoch": float(now["epoch"]),
         "log_train_loss": _log(now.get("train_loss")), "log_test_loss": _log(now.get("test_loss")),
         "weight_norm": now.get("weight_norm"), "s_bar": now.get("s_bar"), "sigma_h": now.get("sigma_h")}
    prev = {"log_train_loss": _log(before.get("train_loss")), "log_test_loss": _log(before.get("test_loss")),
            "weight_norm": before.get("weight_norm"), "s_bar": before.get("s_bar"),
            "sigma_h": before.get("sigma_h")}
    for k, v in prev.items():
        f["d_" + k] = f[k] - v if _finite(f[k]) and _finite(v) else None
    if not all(_finite(f[k]) for k in BASELINE_FEATURES + ATTENTION_FEATURES):
        return None
    return f


def _standardise(train: np.ndarray, test: np.ndarray):
    mean, std = train.mean(axis=0), train.std(axis=0)
    keep = std > 1e-12                          # constant columns (e.g. the epoch at a fixed t0) carry nothing
    return (train[:, keep] - mean[keep]) / std[keep], (test[:, keep] - mean[keep]) / std[keep]


def fit_logistic(x: np.ndarray, y: np.ndarray, alpha: float = 1.0) -> tuple[np.ndarray, float]:
    """L2-penalised logistic regression (penalty alpha/2·|w|², intercept free) by L-BFGS."""
    from scipy import optimize, special

    y = np.asarray(y, float)
    n, k = x.shape

    def loss(theta):
        w, b = theta[:k], theta[k]
        z = x @ w + b
        # log(1 + e^z) − y z, stably
        nll = np.sum(np.logaddexp(0.0, z) - y * z)
        p = special.expit(z)
        grad_w = x.T @ (p - y) + alpha * w
        grad_b = np.sum(p - y)
        return nll + 0.5 * alpha * w @ w, np.append(grad_w, grad_b)

    res = optimize.minimize(loss, np.zeros(k + 1), jac=True, method="L-BFGS-B")
    return res.x[:k], float(res.x[k])


def fit_ridge(x: np.ndarray, y: np.ndarray, alpha: float = 1.0) -> tuple[np.ndarray, float]:
    """Ridge regression (penalty alpha·|w|², intercept free) on standardised features."""
    k = x.shape[1]
    ym = float(np.mean(y))
    w = np.linalg.solve(x.T @ x + alpha * np.eye(k), x.T @ (y - ym)) if k else np.zeros(0)
    return w, ym


def split_seeds(seeds: Iterable[int], test_frac: float = 0.5, split_seed: int = 0) -> tuple[list[int], list[int]]:
    distinct = sorted(set(int(s) for s in seeds))
    if len(distinct) < 2:
        raise ValueError(f"predict: need runs of at least 2 seeds to split train/test seeds, got {len(distinct)}")
    rng = np.random.default_rng(split_seed)
    order = [distinct[i] for i in rng.permutation(len(distinct))]
    n_test = min(len(distinct) - 1, max(1, int(round(test_frac * len(distinct)))))
    return sorted(order[n_test:]), sorted(order[:n_test])


def _verdict(diff_ci: tuple[float, float], better_if_positive: bool) -> str:
    lo, hi = diff_ci
    if lo <= 0 <= hi:
        return "adds no measurable value"
    gain = lo > 0 if better_if_positive else hi < 0
    return "adds measurable value" if gain else "is measurably worse than the baselines alone"


def predictive_analysis(runs: Sequence[dict], traces: dict[str, list[dict]], t0: float | None = None,
                        test_frac: float = 0.5, split_seed: int = 0, n_boot: int = 1500, seed: int = 0,
                        alpha: float = 1.0) -> dict:
    """Held-out test of the attention readouts' predictive value (see the module docstring).

    Cases: done runs with s̄/σ_H, a horizon beyond ``t0`` and not yet grokked at ``t0``. Seeds are
    split (``split_seed``) into train and test seeds; every run of a seed is on one side. Models:
    L2-logistic regression for "groks by the horizon" and ridge regression of ln t_grok (grokked runs),
    each on the baselines alone and on baselines + attention features, fitted on the train seeds,
    scored on the test seeds: AUC (``analysis.bootstrap_auc``) and MAE of ln t_grok
    (``analysis.bootstrap_mae``), with 95 % bootstrap CIs of both and of the paired difference.
    ``t0`` defaults to the median memorisation epoch of the runs (10 % of the shortest horizon if
    none memorised)."""
    from fastdiag.analysis import fits as analysis

    done = [r for r in runs if r.get("result")]
    if t0 is None:
        t_mems = [r["result"]["t_mem_epoch"] for r in done if _finite(r["result"].get("t_mem_epoch"))]
        horizons = [r["config"]["epochs"] for r in done]
        t0 = float(np.median(t_mems)) if t_mems else (0.1 * min(horizons) if horizons else 1.0)
        t0_source = "median t_mem" if t_mems else "10% of the shortest horizon"
    else:
        t0_source = "given"
    out: dict = {"t0": t0, "t0_source": t0_source, "test_frac": test_frac, "split_seed": split_seed,
                 "n_boot": n_boot, "alpha": alpha, "baseline_features": list(BASELINE_FEATURES),
                 "attention_features": list(ATTENTION_FEATURES), "excluded": {}}
    cases = []
    excluded = {"horizon not beyond t0": 0, "grokked by t0": 0, "no s̄/σ_H or loss at t0": 0}
    for run in done:
        res, cfg = run["result"], run["config"]
        if cfg["epochs"] <= t0:
            excluded["horizon not beyond t0"] += 1
            continue
        if _finite(res.get("t_grok_epoch")) and res["t_grok_epoch"] <= t0:
            excluded["grokked by t0"] += 1
            continue
        f = features_at(traces.get(run["run_id"], []), t0)
        if f is None:
            excluded["no s̄/σ_H or loss at t0"] += 1
            continue
        grokked = res.get("regime") in GROKKED
        cases.append({"run_id": run["run_id"], "seed": int(cfg["seed"]), "grokked": grokked,
                      "log_t_grok": math.log(res["t_grok_epoch"]) if grokked and _finite(res.get("t_grok_epoch"))
                      else None, "features": f})
    out["excluded"] = excluded
    out["n_cases"] = len(cases)
    try:
        train_seeds, test_seeds = split_seeds([c["seed"] for c in cases], test_frac, split_seed)
    except ValueError as exc:
        out["error"] = str(exc)
        return out
    out["train_seeds"], out["test_seeds"] = train_seeds, test_seeds
    train = [c for c in cases if c["seed"] in train_seeds]
    test = [c for c in cases if c["seed"] in test_seeds]
    out["n_train"], out["n_test"] = len(train), len(test)

    def matrix(cs, names):
        return np.array([[c["features"][n] for n in names] for c in cs], float).reshape(len(cs), len(names))

    full_names = BASELINE_FEATURES + ATTENTION_FEATURES

    # ---- groks by the horizon
    cls: dict = {}
    y_train = np.array([c["grokked"] for c in train], bool)
    y_test = np.array([c["grokked"] for c in test], bool)
    cls["train_positives"], cls["train_negatives"] = int(y_train.sum()), int((~y_train).sum())
    cls["test_positives"], cls["test_negatives"] = int(y_test.sum()), int((~y_test).sum())
    if y_train.all() or not y_train.any():
        cls["error"] = "groks-by-horizon: the train seeds hold only one class; nothing to learn"
    elif y_test.all() or not y_test.any():
        cls["error"] = "groks-by-horizon: the test seeds hold only one class; AUC undefined"
    else:
        scores = {}
        for name, names in (("baseline", BASELINE_FEATURES), ("full", full_names)):
            xtr, xte = _standardise(matrix(train, names), matrix(test, names))
            w, b = fit_logistic(xtr, y_train.astype(float), alpha)
            scores[name] = xte @ w + b
        res = analysis.bootstrap_auc(y_test, scores["full"], n_boot=n_boot, seed=seed,
                                     baseline_score=scores["baseline"])
        base = analysis.bootstrap_auc(y_test, scores["baseline"], n_boot=n_boot, seed=seed)
        cls.update({"auc_full": res.auc, "auc_full_ci": list(res.ci), "auc_baseline": res.baseline_auc,
                    "auc_baseline_ci": list(base.ci), "diff": res.diff, "diff_ci": list(res.diff_ci),
                    "verdict": _verdict(res.diff_ci, better_if_positive=True),
                    "test_scores": [{"run_id": c["run_id"], "grokked": bool(y), "baseline": float(sb), "full": float(sf)}
                                    for c, y, sb, sf in zip(test, y_test, scores["baseline"], scores["full"])]})
    out["groks_by_horizon"] = cls

    # ---- ln t_grok
    reg: dict = {}
    tr = [c for c in train if c["log_t_grok"] is not None]
    te = [c for c in test if c["log_t_grok"] is not None]
    reg["n_train"], reg["n_test"] = len(tr), len(te)
    if len(tr) < 3 or len(te) < 2:
        reg["error"] = f"ln t_grok: need ≥ 3 grokked train runs and ≥ 2 grokked test runs, got {len(tr)} and {len(te)}"
    else:
        ytr = np.array([c["log_t_grok"] for c in tr])
        yte = np.array([c["log_t_grok"] for c in te])
        preds = {}
        for name, names in (("baseline", BASELINE_FEATURES), ("full", full_names)):
            xtr, xte = _standardise(matrix(tr, names), matrix(te, names))
            w, b = fit_ridge(xtr, ytr, alpha)
            preds[name] = xte @ w + b
        res = analysis.bootstrap_mae(yte, preds["full"], n_boot=n_boot, seed=seed, baseline_pred=preds["baseline"])
        base = analysis.bootstrap_mae(yte, preds["baseline"], n_boot=n_boot, seed=seed)
        reg.update({"mae_full": res.mae, "mae_full_ci": list(res.ci), "mae_baseline": res.baseline_mae,
                    "mae_baseline_ci": list(base.ci), "diff": res.diff, "diff_ci": list(res.diff_ci),
                    "units": "ln(epochs)", "verdict": _verdict(res.diff_ci, better_if_positive=False),
                    "test_predictions": [{"run_id": c["run_id"], "log_t_grok": float(y), "baseline": float(pb),
                                          "full": float(pf)}
                                         for c, y, pb, pf in zip(te, yte, preds["baseline"], preds["full"])]})
    out["log_t_grok"] = reg
    return out
