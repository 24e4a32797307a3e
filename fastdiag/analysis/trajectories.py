"""One run's trajectory read as phases and stages:

* ``segment_stages``        the five stages of a long trajectory (coordination, differentiation,
                            re-synchronisation, second differentiation, collapse) from s̄, σ_H and
                            test accuracy, by a documented rule (see its docstring).
* ``retention_by_lambda``   long horizons: per λ, how many grokked runs still generalise at the end.
* ``phase_values``          one run's two-phase landmarks: s̄ at init / t_mem / t_grok, the
                            Phase-1 peak, the Phase-2 s̄ trough and σ_H peak after grokking.
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np

from fastdiag.grokking.config import GROK_THRESHOLD, GROKKED
from fastdiag.grokking.labels import anti_grok_epoch, first_epoch_at_or_above, largest


STAGES = ("coordination", "differentiation", "re-synchronisation", "second differentiation", "collapse")


def finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _moving_average(y: np.ndarray, window: int) -> np.ndarray:
    if window <= 1:
        return y.copy()
    half = window // 2
    padded = np.pad(y, (half, half), mode="edge")
    kernel = np.ones(2 * half + 1) / (2 * half + 1)
    return np.convolve(padded, kernel, mode="valid")


def segment_stages(trace: Sequence[dict], *, grok_threshold: float = GROK_THRESHOLD, n_grid: int = 256,
                   smooth_decades: float = 0.1, rate_threshold: float = 0.5, min_decades: float = 0.05,
                   min_change: float = 0.25, min_span_decades: float = 1.5,
                   floors: tuple[float, float] = (0.02, 0.01)) -> dict:
    """Segment one trajectory into the paper's stages.

    The rule (all on a log-epoch axis, as the paper plots it):

    1. Use the evaluations with epoch > 0 and finite s̄ and σ_H; the trajectory must span at least
       ``min_span_decades`` decades of epochs (else ``stages`` is empty and ``note`` says why).
    2. **Collapse** starts where the run's anti-grokking starts — the rule of the ``anti-grok`` label,
       ``fastdiag.grokking.labels.anti_grok_epoch``, read on every evaluation with a test accuracy
       (a sustained fall below 0.5 after grokking; one definition, so a run segmented with a
       collapse stage is exactly a run labelled ``anti-grok``). It lasts to the end.
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
    rows = [r for r in trace if finite(r.get("epoch")) and r["epoch"] > 0
            and finite(r.get("s_bar")) and finite(r.get("sigma_h"))]
    params = dict(grok_threshold=grok_threshold, n_grid=n_grid, smooth_decades=smooth_decades,
                  rate_threshold=rate_threshold, min_decades=min_decades, min_change=min_change,
                  min_span_decades=min_span_decades, floors=list(floors))
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
    out["t_grok_epoch"] = first_epoch_at_or_above(trace, "test_acc", grok_threshold)
    collapse_epoch = anti_grok_epoch(trace, grok_threshold)
    # index of the first evaluation with diagnostics at or after the collapse's start
    collapse = None if collapse_epoch is None else int(np.searchsorted(epochs, collapse_epoch))
    end = collapse if collapse is not None else len(rows)
    stages: list[dict] = []
    notes: list[str] = []
    if end >= 4 and log_e[end - 1] - log_e[0] > 4 * min_decades:
        u = np.linspace(log_e[0], log_e[end - 1], n_grid)
        z = _sync_rate(u, log_e[:end], rows[:end], smooth_decades, floors)
        stretches = _signed_stretches(z, u, rate_threshold, min_decades, min_change)
        stages, notes = _name_stages(stretches, u, epochs)
    if collapse is not None:
        out["collapse_epoch"] = int(collapse_epoch)
        last_epoch = max(r["epoch"] for r in trace if finite(r.get("epoch")))
        stages.append({"stage": "collapse", "start_epoch": int(collapse_epoch), "end_epoch": int(last_epoch)})
    out["stages"] = stages
    if not stages:
        notes.append("no stage found")
    out["note"] = "; ".join(notes) or None
    return out


def _sync_rate(u: np.ndarray, log_e: np.ndarray, rows: Sequence[dict], smooth_decades: float,
               floors: tuple[float, float]) -> np.ndarray:
    """z = (r_s − r_h) / 2 on the grid ``u`` (rule 3 of `segment_stages`)."""
    du = u[1] - u[0]
    s = np.interp(u, log_e, [r["s_bar"] for r in rows])
    h = np.interp(u, log_e, [r["sigma_h"] for r in rows])
    window = max(1, int(round(smooth_decades / du)))
    window += 1 - window % 2
    s, h = _moving_average(s, window), _moving_average(h, window)
    r_s = np.gradient(s, u) / max(float(np.ptp(s)), floors[0])
    r_h = np.gradient(h, u) / max(float(np.ptp(h)), floors[1])
    return (r_s - r_h) / 2.0


def _signed_stretches(z: np.ndarray, u: np.ndarray, rate_threshold: float, min_decades: float,
                      min_change: float) -> list[list[int]]:
    """[sign, first, last] grid indices of the synchronising (+1) and differentiating (−1) stretches
    long and large enough, same-sign stretches separated only by neutral ones merged (rule 4)."""
    du = u[1] - u[0]
    labels = np.where(z > rate_threshold, 1, np.where(z < -rate_threshold, -1, 0))
    merged: list[list[int]] = []
    for sign, a, b in _runs(labels):
        if sign == 0 or (u[b] - u[a] + du) < min_decades or abs(float(z[a:b + 1].sum()) * du) < min_change:
            continue
        if merged and merged[-1][0] == sign:
            merged[-1][2] = b
        else:
            merged.append([sign, a, b])
    return merged


def _name_stages(stretches: list[list[int]], u: np.ndarray, epochs: np.ndarray) -> tuple[list[dict], list[str]]:
    """The stretches named in the paper's order (rule 5), with the epochs of the nearest evaluations."""
    expected = (1, -1, 1, -1)
    named: list[dict] = []
    notes: list[str] = []
    for sign, a, b in stretches:
        k = len(named)
        if k < 4 and sign == expected[k]:
            named.append({"stage": STAGES[k], "a": a, "b": b})
        elif k > 0 and sign == expected[k - 1]:
            named[-1]["b"] = b
        elif k == 0:
            continue                       # differentiating drift before any coordination
        else:
            notes.append(f"a further synchronising stretch at epoch ≈ {10 ** u[a]:.0f} is not named")
    stages = [{"stage": st["stage"], "start_epoch": _nearest_epoch(epochs, 10 ** u[st["a"]]),
               "end_epoch": _nearest_epoch(epochs, 10 ** u[st["b"]])} for st in named]
    return stages, notes


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
        seg = segment_stages(traces.get(run["run_id"], []), grok_threshold=cfg.get("grok_threshold", GROK_THRESHOLD), **kw)
        out.append({"run_id": run["run_id"], "weight_decay": cfg.get("weight_decay"), "seed": cfg.get("seed"),
                    "regime": (run.get("result") or {}).get("regime"), **seg})
    return out


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
        finals = [r["final_test_acc"] for r in grokked if finite(r.get("final_test_acc"))]
        retained = sum(1 for a in finals if a >= threshold)
        table.append({
            "lambda": lam, "n": len(results), "grokked": len(grokked), "retained": retained,
            "retention": retained / len(grokked) if grokked else None,
            "median_final_test_acc": float(np.median(finals)) if finals else None,
            "anti_grok": sum(1 for r in results if r.get("regime") == "anti-grok"),
            "threshold": threshold,
        })
    return table


def phase2_peak_sigma_h(trace: Sequence[dict], t_grok_epoch: int | None) -> float | None:
    """Largest σ_H at or after grokking (None if the run did not grok or has no σ_H there)."""
    if t_grok_epoch is None:
        return None
    found = largest(trace, "sigma_h", from_epoch=t_grok_epoch)
    return None if found is None else found[0]


def _largest_fall(rows: Sequence[dict]) -> dict | None:
    """The row at the bottom of the largest fall of s̄ from any earlier row (None if s̄ never falls)."""
    top, fall, bottom = -math.inf, 0.0, None
    for r in rows:
        top = max(top, r["s_bar"])
        if top - r["s_bar"] > fall:
            fall, bottom = top - r["s_bar"], r
    return bottom


def phase_values(trace: Sequence[dict], t_mem_epoch: int | None, t_grok_epoch: int | None) -> dict:
    """The paper's two-phase landmarks of one run (its Fig. 2: s̄ ≈ 0.93 → 0.995 → 0.88, σ_H peak
    ≈ 0.09–0.10), read off the trace rows with a finite value; a landmark the trace does not reach is
    None, never a guess.

    * ``s_bar_init``: s̄ of the first evaluation (with diag_every ≥ steps per epoch and eval_every 1
      that is the forward pass of step 0, the initialised model).
    * ``s_bar_mem`` / ``s_bar_grok``: s̄ at the evaluations of t_mem and t_grok.
    * after grokking: ``s_bar_min_after_grok`` (Phase-2 trough), the bottom of the largest fall of
      s̄ from an earlier value at or after t_grok (a run whose s̄ only rises after grokking has
      none: the first evaluations after t_grok, where s̄ is still climbing, are not a trough), and
      ``sigma_h_peak_after_grok`` (Phase-2 peak, largest σ_H after t_grok), each with its epoch;
      ``epochs_after_grok`` says how far the trace reaches past t_grok (0 for a run stopped at
      grokking). ``s_bar_top_after_grok`` (the highest s̄ after t_grok) and ``s_bar_min_after_top``
      (the lowest after that top), each with its epoch, read the slow fall after the Phase-1 top
      even where a short dip right after grokking (a loss spike) is the larger fall.
    * ``s_bar_peak_phase1``: largest s̄ from t_mem up to the Phase-2 trough (to the end of the
      trace when there is none, t_grok for a run stopped there) — the top of the Phase-1 rise."""
    rows = [r for r in trace if finite(r.get("epoch")) and finite(r.get("s_bar"))]
    at = {r["epoch"]: r for r in rows}
    out: dict = {"s_bar_init": rows[0]["s_bar"] if rows else None, "init_epoch": rows[0]["epoch"] if rows else None,
                 "s_bar_mem": at[t_mem_epoch]["s_bar"] if t_mem_epoch in at else None,
                 "s_bar_grok": at[t_grok_epoch]["s_bar"] if t_grok_epoch in at else None,
                 "s_bar_min_after_grok": None, "s_bar_min_epoch": None,
                 "sigma_h_peak_after_grok": None, "sigma_h_peak_epoch": None,
                 "epochs_after_grok": None, "s_bar_peak_phase1": None,
                 "s_bar_top_after_grok": None, "s_bar_top_epoch": None,
                 "s_bar_min_after_top": None, "s_bar_min_after_top_epoch": None}
    if t_grok_epoch is None or not rows:
        return out
    after = [r for r in rows if r["epoch"] > t_grok_epoch]
    out["epochs_after_grok"] = (after[-1]["epoch"] - t_grok_epoch) if after else 0
    trough = _largest_fall([r for r in rows if r["epoch"] >= t_grok_epoch])
    if trough is not None:
        out["s_bar_min_after_grok"], out["s_bar_min_epoch"] = trough["s_bar"], trough["epoch"]
    if after:
        top = max(after, key=lambda r: r["s_bar"])
        out["s_bar_top_after_grok"], out["s_bar_top_epoch"] = top["s_bar"], top["epoch"]
        later = [r for r in after if r["epoch"] > top["epoch"]]
        if later:
            low = min(later, key=lambda r: r["s_bar"])
            out["s_bar_min_after_top"], out["s_bar_min_after_top_epoch"] = low["s_bar"], low["epoch"]
        with_h = [r for r in after if finite(r.get("sigma_h"))]
        if with_h:
            peak = max(with_h, key=lambda r: r["sigma_h"])
            out["sigma_h_peak_after_grok"], out["sigma_h_peak_epoch"] = peak["sigma_h"], peak["epoch"]
    if t_mem_epoch is not None:
        end = out["s_bar_min_epoch"] if out["s_bar_min_epoch"] is not None else rows[-1]["epoch"]
        phase1 = [r["s_bar"] for r in rows if t_mem_epoch <= r["epoch"] <= end]
        out["s_bar_peak_phase1"] = max(phase1) if phase1 else None
    return out
