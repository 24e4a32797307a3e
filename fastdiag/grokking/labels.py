"""The regime label of a run, read from its evaluation trace — one home for the rules, so the trainer's
label (``fastdiag.grokking.tracking``), the collapse stage of ``segment_stages`` and the re-labelling
of stored runs (``relabel``) cannot disagree.

The labels (docs/experiments.md, "Setup", with the paper's meaning):

* ``grok``          test accuracy reached the run's threshold (0.99 by default) within the horizon.
* ``anti-grok``     grokked, then lost it *for good*: the paper's anti-grokking (its Fig. 3) is the
                    last of five stages, test accuracy decaying to ~0.25 over the final quarter of a
                    20,000-epoch run — not a loss spike that recovers within tens of epochs. The rule
                    is ``anti_grok_epoch`` below.
* ``memorization``  fits the training set (train accuracy reached the threshold), test accuracy not.
* ``collapse``      never fits the training set *and* the heads attend alike: s̄ at the end of the run
                    (median of the last ``COLLAPSE_TAIL_EVALS`` evaluations with s̄) is at least
                    ``COLLAPSE_S_BAR_MIN`` — the paper's λ = 10 runs, where all heads converge to one
                    pattern (s̄ = 1.0).
* ``no-fit``        never fits the training set, but s̄ stays below ``COLLAPSE_S_BAR_MIN`` (or the model
                    has no attention, so s̄ does not exist): it learned nothing, without the paper's
                    collapse signature.
* ``too-short``     never fits the training set, but stopped before that says anything: its last evaluation
                    is before epoch ``NEVER_FIT_MIN_EPOCHS``, or it has fewer than ``COLLAPSE_TAIL_EVALS``
                    evaluations (the end of the run the collapse rule reads). ``collapse`` and ``no-fit``
                    claim the run *never* fits; a 3-epoch run has not had the time, and its s̄ is still
                    the initial near-uniform attention's (≈ 0.975, data/paper/init.json), not a collapse.
                    A short run that did fit or grok keeps ``memorization`` or ``grok``: those happened.
* ``diverged``      a non-finite loss or weight norm.
"""
from __future__ import annotations

import math
import statistics
from typing import Sequence

# Anti-grokking, sustained: after grokking, test accuracy falls below ANTI_GROK_BELOW at an evaluation
# from which at least ANTI_GROK_PERSIST of the evaluations to the end of the run are below it too, and
# there are at least ANTI_GROK_MIN_EVALS such evaluations (one low evaluation at the very end is not a
# decay). 0.5 is half the grokked level; the paper's final stage sits near 0.25 with spikes above it.
ANTI_GROK_BELOW = 0.5
ANTI_GROK_PERSIST = 0.75
ANTI_GROK_MIN_EVALS = 3

# Collapse: the heads' mean pairwise cosine at the end of a run that never fit the training set. The
# paper reports s̄ = 1.0 at λ = 10 (ours reaches 1.0000 to 4 decimals within ~35 epochs there); 0.99
# is the paper's own Phase-1 top (the median of its Fig. 2 peaks at ≈ 0.99), so a run labelled collapse
# has heads at least as alike as a model at the height of synchronisation, and stays unable to fit.
COLLAPSE_S_BAR_MIN = 0.99
COLLAPSE_TAIL_EVALS = 3

# Too short to classify: "never fits the training set" (collapse, no-fit) needs a run long enough that a
# model which fits would have. The canonical model fits by epoch 25-30 (t_mem 25 at λ = 0.001 in 3 of 3
# seeds, data/paper/runs.csv; train accuracy 1.0 by epoch 30 at λ = 1 in the paper's training setup), and at λ = 10 s̄ has
# reached 0.9999 by epoch 30-35 (data/paper/traces.csv); 50 epochs is twice the fitting time seen.
NEVER_FIT_MIN_EPOCHS = 50

LABEL_RULES = {"anti_grok_below": ANTI_GROK_BELOW, "anti_grok_persist": ANTI_GROK_PERSIST,
               "anti_grok_min_evals": ANTI_GROK_MIN_EVALS, "collapse_s_bar_min": COLLAPSE_S_BAR_MIN,
               "collapse_tail_evals": COLLAPSE_TAIL_EVALS, "never_fit_min_epochs": NEVER_FIT_MIN_EPOCHS}


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def largest(trace: Sequence[dict], key: str, from_epoch: int | None = None) -> tuple[float, int] | None:
    """(value, epoch) of the evaluation with the largest finite ``key`` (the first of equals), only among
    epochs >= ``from_epoch`` where given; None if there is none. A run's largest σ_H is often the transient
    a few epochs after initialisation; the paper's Phase-2 peak is the largest from t_grok on
    (``analysis.trajectories.phase2_peak_sigma_h``). `fastdiag run`'s summary and figure name both this way."""
    rows = [r for r in trace if _finite(r.get(key)) and _finite(r.get("epoch"))
            and (from_epoch is None or r["epoch"] >= from_epoch)]
    if not rows:
        return None
    top = max(rows, key=lambda r: r[key])
    return top[key], top["epoch"]


def phase2_peak(trace: Sequence[dict], t_grok_epoch: int | None) -> tuple[float, int] | None:
    """(σ_H, epoch) of the Phase-2 peak as `fastdiag run` reports and draws it: the largest σ_H from t_grok
    on, where the run went on past t_grok (``--no-stop-at-grok``, ``--patience``); None otherwise -- the
    value at the evaluation a run stopped on is not a peak."""
    if t_grok_epoch is None or not any(_finite(r.get("epoch")) and r["epoch"] > t_grok_epoch for r in trace):
        return None
    return largest(trace, "sigma_h", from_epoch=t_grok_epoch)


def first_epoch_at_or_above(trace: Sequence[dict], key: str, threshold: float) -> int | None:
    """Epoch of the first evaluation whose ``key`` (train_acc, test_acc) is ≥ ``threshold``."""
    return next((r["epoch"] for r in trace if _finite(r.get(key)) and r[key] >= threshold), None)


def anti_grok_epoch(trace: Sequence[dict], grok_threshold: float, *, below: float = ANTI_GROK_BELOW,
                    persist: float = ANTI_GROK_PERSIST, min_evals: int = ANTI_GROK_MIN_EVALS) -> int | None:
    """Epoch where a sustained loss of generalisation begins, or None: the first evaluation after the
    first one with test accuracy ≥ ``grok_threshold`` whose test accuracy is < ``below`` and from which
    at least ``persist`` of the remaining evaluations (it included, at least ``min_evals`` of them) are
    also < ``below``. Evaluations without a finite test accuracy are skipped."""
    rows = [r for r in trace if _finite(r.get("test_acc")) and _finite(r.get("epoch"))]
    grok = next((i for i, r in enumerate(rows) if r["test_acc"] >= grok_threshold), None)
    if grok is None:
        return None
    low = [r["test_acc"] < below for r in rows]
    n = len(rows)
    low_to_end = [0] * (n + 1)                         # low evaluations from i to the end
    for i in range(n - 1, -1, -1):
        low_to_end[i] = low_to_end[i + 1] + low[i]
    for i in range(grok + 1, n):
        if low[i] and low_to_end[i] >= min_evals and low_to_end[i] / (n - i) >= persist:
            return int(rows[i]["epoch"])
    return None


def final_s_bar(trace: Sequence[dict], tail: int = COLLAPSE_TAIL_EVALS) -> float | None:
    """Median s̄ of the last ``tail`` evaluations that have one (None without any)."""
    values = [r["s_bar"] for r in trace if _finite(r.get("s_bar"))][-tail:]
    return float(statistics.median(values)) if values else None


def too_short_to_judge(trace: Sequence[dict], min_epochs: int = NEVER_FIT_MIN_EPOCHS,
                       min_evals: int = COLLAPSE_TAIL_EVALS) -> bool:
    """Whether a run that never fit the training set stopped too early to say it never fits: its last
    evaluation is before epoch ``min_epochs``, or it has fewer than ``min_evals`` evaluations with a train
    accuracy."""
    evaluated = [r for r in trace if _finite(r.get("train_acc")) and _finite(r.get("epoch"))]
    return len(evaluated) < min_evals or max(r["epoch"] for r in evaluated) < min_epochs


def regime_label(trace: Sequence[dict], grok_threshold: float, *, diverged: bool = False,
                 collapse_s_bar_min: float = COLLAPSE_S_BAR_MIN) -> str:
    """The regime of a finished run from its evaluation rows (epoch, train_acc, test_acc, s_bar): see
    the module docstring for the rules."""
    if diverged:
        return "diverged"
    if first_epoch_at_or_above(trace, "test_acc", grok_threshold) is not None:
        return "anti-grok" if anti_grok_epoch(trace, grok_threshold) is not None else "grok"
    if first_epoch_at_or_above(trace, "train_acc", grok_threshold) is not None:
        return "memorization"
    if too_short_to_judge(trace):
        return "too-short"
    s_end = final_s_bar(trace)
    return "collapse" if s_end is not None and s_end >= collapse_s_bar_min else "no-fit"


def relabel(result: dict, trace: Sequence[dict], grok_threshold: float) -> dict:
    """A stored run's label under the current rules: ``{"stored", "current", "changed",
    "anti_grok_epoch", "final_s_bar"}``. A run stored as ``diverged`` stays so (the non-finite
    minibatch losses that marked it are not in the trace)."""
    stored = result.get("regime")
    current = regime_label(trace, grok_threshold, diverged=stored == "diverged")
    return {"stored": stored, "current": current, "changed": stored != current,
            "anti_grok_epoch": anti_grok_epoch(trace, grok_threshold), "final_s_bar": final_s_bar(trace)}
