"""fastdiag.grokking.labels: the regime labels mean what the paper means — anti-grokking is a sustained
loss of generalisation (one rule shared by the trainer's label and segment_stages), collapse needs
identical heads (s̄ ≥ COLLAPSE_S_BAR_MIN) — and stored runs can be re-labelled."""
import pytest

from fastdiag.analysis.trajectories import segment_stages
from fastdiag.grokking import labels
from fastdiag.grokking.config import REGIMES, RunConfig
from fastdiag.grokking.tracking import RunTracker


def _trace(test_acc, train_acc=1.0, s_bar=0.95, every=10):
    """Evaluation rows at epochs every, 2·every, …; scalars are repeated, sequences taken as given."""
    n = len(test_acc)
    as_list = (lambda v: list(v) if isinstance(v, (list, tuple)) else [v] * n)
    return [{"epoch": every * (i + 1), "step": 6 * every * (i + 1), "train_acc": tr, "test_acc": te,
             "s_bar": s, "sigma_h": 0.05} for i, (te, tr, s) in enumerate(zip(test_acc, as_list(train_acc),
                                                                             as_list(s_bar)))]


def _tracked(trace, has_s_bar=True):
    """The label the trainer gives: the rows fed to a RunTracker as its evaluations."""
    tracker = RunTracker(RunConfig(epochs=10_000), layer_names=[])
    for r in trace:
        metrics = {"train_loss": 0.1, "test_loss": 0.1, "weight_norm": 30.0, "loss_sum": 1.0,
                   "train_acc": r["train_acc"], "test_acc": r["test_acc"]}
        if has_s_bar:
            metrics |= {"s_bar": r["s_bar"], "sigma_h": r["sigma_h"]}
        tracker.record(r["epoch"], r["step"], metrics)
    return tracker


def test_a_loss_spike_that_recovers_is_grok_not_anti_grok():
    # the earlier session's long λ = 1 runs: short collapses after grokking, recovered, ending at 1.0
    acc = [0.1] * 10 + [1.0] * 50 + [0.36, 0.34] + [1.0] * 40 + [0.48] + [1.0] * 20
    trace = _trace(acc)
    assert labels.anti_grok_epoch(trace, 0.99) is None
    assert labels.regime_label(trace, 0.99) == "grok"
    tracker = _tracked(trace)
    assert tracker.regime == "grok" and tracker.anti_grok_epoch is None


def test_a_sustained_decay_is_anti_grok_and_the_segmenter_calls_the_same_epoch_collapse():
    # 2,000 evaluations over 20,000 epochs: groks by 300, a spike at 5,000, decays for good from 15,000
    # with the odd evaluation back above 0.5 (as in the paper's Fig. 3)
    acc = [min(1.0, 0.05 + e / 300) for e in range(10, 15_000, 10)]
    acc[499] = 0.3                                                   # epoch 5,000: a spike
    acc += [0.6 if i % 10 == 0 else 0.25 for i in range(1, 501)]     # epochs 15,000 … 20,000
    s_bar = [0.93 + 0.05 * min(1, e / 300) for e in range(10, 20_001, 10)]
    trace = _trace(acc, s_bar=s_bar)
    onset = labels.anti_grok_epoch(trace, 0.99)
    assert onset == 15_000
    assert labels.regime_label(trace, 0.99) == "anti-grok" and _tracked(trace).regime == "anti-grok"
    assert _tracked(trace).result(epochs_run=20_000, steps=1, wall_seconds=1.0, has_attention=True, n_params=1,
                                  device="cpu")["anti_grok_epoch"] == onset
    seg = segment_stages(trace)
    assert seg["collapse_epoch"] == onset and seg["stages"][-1]["stage"] == "collapse"
    assert seg["stages"][-1]["end_epoch"] == trace[-1]["epoch"]


def test_the_segmenter_and_the_label_agree_on_every_trace_here():
    spike = [0.1] * 5 + [1.0] * 300 + [0.2] * 3 + [1.0] * 300
    decay = [0.1] * 5 + [1.0] * 300 + [0.2] * 300
    end_dip = [0.1] * 5 + [1.0] * 600 + [0.3]                        # one low evaluation at the end
    for acc in (spike, decay, end_dip):
        trace = _trace(acc)
        seg = segment_stages(trace)
        assert (seg["collapse_epoch"] is not None) == (labels.regime_label(trace, 0.99) == "anti-grok")
    assert labels.regime_label(_trace(end_dip), 0.99) == "grok", "one evaluation is not a sustained decay"


@pytest.mark.parametrize("s_bar,expected", [(1.0, "collapse"), (0.995, "collapse"), (0.96, "no-fit")])
def test_a_run_that_never_fits_is_collapse_only_with_identical_heads(s_bar, expected):
    trace = _trace([0.05] * 30, train_acc=0.1, s_bar=s_bar)
    assert labels.regime_label(trace, 0.99) == expected
    assert _tracked(trace).regime == expected


def test_without_attention_a_run_that_never_fits_is_no_fit():
    trace = _trace([0.05] * 30, train_acc=0.1, s_bar=None)
    assert labels.final_s_bar(trace) is None
    assert _tracked(trace, has_s_bar=False).regime == "no-fit"


def test_collapse_reads_the_end_of_the_run_not_a_passing_peak():
    # s̄ touched 1.0 early, then the heads separated again: not collapsed at the end
    s_bar = [1.0] * 10 + [0.9] * 20
    assert labels.regime_label(_trace([0.05] * 30, train_acc=0.1, s_bar=s_bar), 0.99) == "no-fit"
    # the median of the last COLLAPSE_TAIL_EVALS: one low value at the very end does not undo a collapse
    s_bar = [0.9] * 10 + [1.0] * 19 + [0.97]
    assert labels.regime_label(_trace([0.05] * 30, train_acc=0.1, s_bar=s_bar), 0.99) == "collapse"


def test_every_label_is_a_known_regime_and_relabel_reports_the_change():
    old = {"regime": "anti-grok"}
    trace = _trace([0.1] * 5 + [1.0] * 50 + [0.3] + [1.0] * 20)
    change = labels.relabel(old, trace, 0.99)
    assert change["stored"] == "anti-grok" and change["current"] == "grok" and change["changed"]
    assert labels.relabel({"regime": "diverged"}, trace, 0.99)["current"] == "diverged"
    assert {"collapse", "no-fit", "too-short", "anti-grok", "grok", "memorization", "diverged"} == set(REGIMES)
    assert set(labels.LABEL_RULES) >= {"anti_grok_below", "collapse_s_bar_min"}


# ------------------------------------------------------------------------------ too short to classify

@pytest.mark.parametrize("s_bar", [1.0, 0.96])
def test_a_run_stopped_before_it_could_fit_is_too_short_not_collapse_or_no_fit(s_bar):
    # three evaluations at epochs 1-3: s̄ near 1 there is the initial, near-uniform attention, not a collapse
    trace = _trace([0.05] * 3, train_acc=0.1, s_bar=s_bar, every=1)
    assert labels.regime_label(trace, 0.99) == "too-short"
    assert _tracked(trace).regime == "too-short"
    # the same never-fit trace once the run has trained NEVER_FIT_MIN_EPOCHS epochs is classified
    long = _trace([0.05] * labels.NEVER_FIT_MIN_EPOCHS, train_acc=0.1, s_bar=s_bar, every=1)
    assert labels.regime_label(long, 0.99) == ("collapse" if s_bar >= labels.COLLAPSE_S_BAR_MIN else "no-fit")
    assert labels.regime_label(long[:-1], 0.99) == "too-short"        # one epoch short of the minimum


def test_too_few_evaluations_for_the_tail_rule_is_too_short_whatever_the_epochs():
    # two evaluations, 100 epochs apart: the collapse rule reads the last COLLAPSE_TAIL_EVALS of them
    trace = _trace([0.05] * (labels.COLLAPSE_TAIL_EVALS - 1), train_acc=0.1, s_bar=1.0, every=100)
    assert labels.regime_label(trace, 0.99) == "too-short"
    assert labels.regime_label([], 0.99) == "too-short"


def test_a_short_run_that_fit_or_grokked_keeps_its_label():
    # what happened is known however short the run: grokking and memorisation are events, not absences
    assert labels.regime_label(_trace([0.1, 0.5, 1.0], every=1), 0.99) == "grok"
    assert labels.regime_label(_trace([0.1, 0.2, 0.3], every=1), 0.99) == "memorization"
    assert labels.regime_label(_trace([0.05] * 3, train_acc=0.1, every=1), 0.99, diverged=True) == "diverged"


def test_a_real_three_epoch_run_is_too_short():
    # the case: `fastdiag run --epochs 3` was labelled collapse
    from fastdiag.grokking.train import train_run
    cfg = RunConfig(preset="custom", n_layers=1, n_heads=2, d_model=16, d_ff=32, p=7, train_frac=0.6,
                    batch_size=8, epochs=3, eval_every=1, diag_every=2, device="cpu", seed=0)
    result = train_run(cfg).result
    assert result["final_train_acc"] < 0.99 and result["regime"] == "too-short"


def test_largest_and_the_phase2_peak_name_the_transient_and_the_peak_apart():
    """`fastdiag run`'s summary and figure: the largest σ_H at any evaluation (here the transient at epoch 6)
    and the Phase-2 peak (the largest from t_grok on), which a run stopped at t_grok does not have."""
    sigma = {1: 0.01, 6: 0.07, 50: 0.02, 100: 0.015, 400: 0.05, 900: 0.06, 1200: 0.04}
    trace = [{"epoch": e, "sigma_h": s, "s_bar": 0.9} for e, s in sigma.items()]
    trace.insert(3, {"epoch": 70, "sigma_h": float("nan"), "s_bar": None})      # not finite: never the largest
    assert labels.largest(trace, "sigma_h") == (0.07, 6)
    assert labels.largest(trace, "s_bar") == (0.9, 1)                           # the first of equals
    assert labels.largest(trace, "sigma_h", from_epoch=100) == (0.06, 900)
    assert labels.largest(trace, "missing") is None
    assert labels.phase2_peak(trace, 100) == (0.06, 900)
    assert labels.phase2_peak(trace, None) is None
    stopped = [r for r in trace if r["epoch"] <= 100]
    assert labels.phase2_peak(stopped, 100) is None and labels.largest(stopped, "sigma_h", from_epoch=100) == (0.015, 100)
