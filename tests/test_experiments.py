"""fastdiag.analysis.experiments: stage segmentation, retention, per-head dimension, predictive value; and the
`fastdiag analyze` / `plot` / `headdim` sections built on them (synthetic data, no training)."""
import json
import math
import random
from types import SimpleNamespace

import numpy as np
import pytest

from fastdiag.analysis import headdim as hd
from fastdiag.analysis import predict as pred
from fastdiag.analysis import trajectories as traj
from fastdiag.grokking import interventions as iv
from fastdiag.grokking.intervention_settings import PEAK_PATIENCE_EPOCHS, InterventionSettings
from fastdiag.grokking.build import heads_width
from fastdiag import sweep as sw
from fastdiag.cli import main
from fastdiag.store import Store

# ------------------------------------------------------------------ synthetic five-stage trajectory
# s̄ and σ_H piecewise linear in u = log10(epoch); the true stages (in decades):
TRUE = {"coordination": (2.0, 2.3), "differentiation": (3.0, 3.4), "re-synchronisation": (3.65, 3.75),
        "second differentiation": (3.95, 4.05), "collapse": (4.15, 4.30)}
KNOTS_U = [0.0, 2.0, 2.3, 3.0, 3.4, 3.65, 3.75, 3.95, 4.05, 4.15, 4.31]
KNOTS_S = [0.93, 0.93, 0.985, 0.985, 0.91, 0.91, 0.96, 0.96, 0.935, 0.935, 0.935]
KNOTS_H = [0.045, 0.045, 0.045, 0.045, 0.09, 0.09, 0.05, 0.05, 0.075, 0.075, 0.075]


def five_stage_trace(seed=0, collapse=True, noise=0.002, eval_every=10, horizon=20000, stages=4):
    rng = np.random.default_rng(seed)
    last = [None, 2, 4, 6, 8][stages]                 # knots after which everything stays flat
    s_k = KNOTS_S[:last + 1] + [KNOTS_S[last]] * (len(KNOTS_S) - last - 1)
    h_k = KNOTS_H[:last + 1] + [KNOTS_H[last]] * (len(KNOTS_H) - last - 1)
    rows = []
    for e in range(eval_every, horizon + 1, eval_every):
        u = math.log10(e)
        s = float(np.interp(u, KNOTS_U, s_k)) + rng.normal(0, noise)
        h = float(np.interp(u, KNOTS_U, h_k)) + rng.normal(0, noise / 2)
        acc = float(np.interp(u, [0, 2.0, 2.25, 4.3], [0.05, 0.3, 1.0, 1.0]))
        if collapse and u >= TRUE["collapse"][0]:
            acc, s, h = 0.25 + rng.normal(0, 0.03), min(1.0, 0.99 + rng.normal(0, 0.002)), 0.005
        rows.append({"epoch": e, "step": 6 * e, "train_acc": 1.0, "test_acc": acc, "s_bar": s, "sigma_h": h,
                     "train_loss": 0.01, "test_loss": 0.1, "weight_norm": 30.0})
    return rows


@pytest.mark.parametrize("seed,noise", [(0, 0.002), (1, 0.004), (2, 0.001)])
def test_five_stages_found_at_the_known_boundaries(seed, noise):
    seg = traj.segment_stages(five_stage_trace(seed, noise=noise))
    assert [s["stage"] for s in seg["stages"]] == list(traj.STAGES), seg
    for st in seg["stages"]:
        lo, hi = TRUE[st["stage"]]
        assert abs(math.log10(st["start_epoch"]) - lo) <= 0.1, st
        assert abs(math.log10(st["end_epoch"]) - hi) <= 0.1, st
    assert seg["collapse_epoch"] == seg["stages"][-1]["start_epoch"] and seg["t_grok_epoch"] is not None


def test_two_phase_run_has_two_stages_and_no_collapse():
    seg = traj.segment_stages(five_stage_trace(3, collapse=False, stages=2))
    assert [s["stage"] for s in seg["stages"]] == ["coordination", "differentiation"]
    assert seg["collapse_epoch"] is None and seg["note"] is None


def test_flat_noise_has_no_stage_and_short_traces_are_refused():
    rng = np.random.default_rng(0)
    flat = [{"epoch": e, "test_acc": 1.0, "s_bar": 0.95 + rng.normal(0, 0.001),
             "sigma_h": 0.05 + rng.normal(0, 0.0005)} for e in range(10, 20001, 10)]
    seg = traj.segment_stages(flat)
    assert seg["stages"] == [] and "no stage found" in seg["note"]
    short = five_stage_trace(0)[:20]                  # epochs 10..200: 1.3 decades
    seg = traj.segment_stages(short)
    assert seg["stages"] == [] and seg["note"].startswith("too short")
    # a dip in test accuracy that recovers is not a collapse
    dip = five_stage_trace(0, collapse=False)
    for r in dip[1500:1520]:
        r["test_acc"] = 0.2
    assert traj.segment_stages(dip)["collapse_epoch"] is None


def _run(rid, lam, seed, regime, final, t_grok=100, **cfg):
    return {"run_id": rid, "config": {"weight_decay": lam, "seed": seed, "arch": "transformer", **cfg},
            "result": {"regime": regime, "final_test_acc": final, "t_grok_epoch": t_grok}}


def test_retention_by_lambda():
    runs = [_run("a", 1.0, 0, "grok", 1.0), _run("b", 1.0, 1, "anti-grok", 0.3), _run("c", 1.0, 2, "grok", 0.95),
            _run("d", 0.1, 0, "memorization", 0.4, None), _run("e", 0.1, 1, "grok", 0.85)]
    table = {row["lambda"]: row for row in traj.retention_by_lambda(runs, threshold=0.9)}
    assert table[1.0] == {"lambda": 1.0, "n": 3, "grokked": 3, "retained": 2, "retention": 2 / 3,
                          "median_final_test_acc": 0.95, "anti_grok": 1, "threshold": 0.9}
    assert table[0.1]["grokked"] == 1 and table[0.1]["retained"] == 0 and table[0.1]["retention"] == 0.0


def test_phase2_peak_and_headdim_fit_recover_a_saturating_curve():
    trace = [{"epoch": 10, "sigma_h": 0.5}, {"epoch": 20, "sigma_h": 0.1}, {"epoch": 30, "sigma_h": 0.2}]
    assert traj.phase2_peak_sigma_h(trace, 20) == 0.2 and traj.phase2_peak_sigma_h(trace, None) is None
    rng = np.random.default_rng(0)
    runs, traces = [], {}
    for d in (16, 32, 64, 128):
        for h in (2, 4, 8):
            for seed in range(3):
                x = d / h
                peak = 0.04 + 0.07 * (1 - math.exp(-0.15 * x)) + rng.normal(0, 0.003)
                rid = f"{d}-{h}-{seed}"
                runs.append(_run(rid, 1.0, seed, "grok", 1.0, t_grok=50, preset="custom", d_model=d, n_heads=h))
                traces[rid] = [{"epoch": 40, "sigma_h": 0.5}, {"epoch": 50, "sigma_h": peak - 0.01},
                               {"epoch": 60, "sigma_h": peak}]
    runs.append(_run("nogrok", 1.0, 0, "memorization", 0.2, t_grok=None, preset="custom", d_model=32, n_heads=4))
    runs.append(_run("onehead", 1.0, 0, "grok", 1.0, t_grok=50, preset="custom", d_model=64, n_heads=1))
    traces["onehead"] = [{"epoch": 60, "sigma_h": 0.0}]
    a = hd.headdim_analysis(runs, traces, heads_width, n_boot=200)
    assert a.n_points == 36 and a.n_skipped == 1 and a.n_single_head == 1
    fit = a.fit
    assert abs(fit.plateau - 0.11) < 0.01 and fit.ci["plateau"][0] <= fit.plateau <= fit.ci["plateau"][1]
    assert [b.d_per_head for b in a.bins][:3] == [2.0, 4.0, 8.0]
    assert len(hd.headdim_sets(runs, heads_width)) == 1


def _predict_runs(signal: str, n_seeds=16, n_lambda=6, seed=0):
    """Runs whose fate (groks by the horizon) is set by the weight norm at t0 (signal "baseline") or by
    σ_H at t0 (signal "attention"); the other feature is noise."""
    rng = np.random.default_rng(seed)
    runs, traces = [], {}
    for s in range(n_seeds):
        for j in range(n_lambda):
            latent = rng.normal()
            wn = 30 + 5 * (latent if signal == "baseline" else rng.normal())
            sig = 0.05 + 0.01 * (latent if signal == "attention" else rng.normal())
            grokked = latent + 0.3 * rng.normal() > 0
            t_grok = float(np.exp(6 - 0.5 * latent + 0.1 * rng.normal())) + 100 if grokked else None
            rid = f"r{s}-{j}"
            runs.append({"run_id": rid, "config": {"seed": s, "epochs": 2000, "weight_decay": 0.1 * (j + 1)},
                         "result": {"regime": "grok" if grokked else "memorization", "t_grok_epoch": t_grok,
                                    "t_mem_epoch": 40}})
            traces[rid] = [{"epoch": e, "train_loss": 0.1 / e + 0.001 * rng.random(),
                            "test_loss": 3 + 0.01 * rng.normal(), "weight_norm": wn + e / 100,
                            "s_bar": 0.95 + 0.01 * rng.normal(), "sigma_h": sig + 0.0001 * e}
                           for e in (10, 20, 30, 40, 50)]
    return runs, traces


def test_predictive_value_known_answers():
    runs, traces = _predict_runs("baseline")
    p = pred.predictive_analysis(runs, traces, t0=50, n_boot=300)
    assert p.t0 == 50 and set(p.train_seeds).isdisjoint(p.test_seeds)
    assert p.n_train + p.n_test == p.n_cases == len(runs)
    c = p.groks_by_horizon
    assert c.auc_baseline > 0.85 and c.verdict == "adds no measurable value", c
    assert c.diff_ci[0] <= 0 <= c.diff_ci[1]
    assert p.log_t_grok.verdict == "adds no measurable value"
    runs, traces = _predict_runs("attention")
    c = pred.predictive_analysis(runs, traces, t0=50, n_boot=300).groks_by_horizon
    assert c.auc_full > c.auc_baseline + 0.2 and c.verdict == "adds measurable value", c
    # runs that grokked by t0 are left out, and too few seeds is an error, not a number
    p = pred.predictive_analysis(runs, traces, t0=50, n_boot=50)
    assert p.excluded["grokked by t0"] == 0
    one = [r for r in runs if r["config"]["seed"] == 0]
    assert pred.predictive_analysis(one, traces, t0=50, n_boot=50).error is not None


# ------------------------------------------------------------------ CLI on synthetic stores

def _long_fake_train(cfg):
    """A 20,000-epoch run: seeds ≥ 2 anti-grok (five stages), the others keep grokking (two stages)."""
    anti = cfg.seed >= 2
    trace = five_stage_trace(cfg.seed, collapse=anti, stages=4 if anti else 2, eval_every=20)
    t_grok = next(r["epoch"] for r in trace if r["test_acc"] >= 0.99)
    result = {"run_id": cfg.run_id(), "regime": "anti-grok" if anti else "grok", "t_grok_epoch": t_grok,
              "t_mem_epoch": 50, "final_test_acc": trace[-1]["test_acc"], "n_params": 1000}
    return SimpleNamespace(config=cfg, result=result, trace=trace)


TINY = dict(preset="custom", n_layers=1, n_heads=2, d_model=32, d_ff=64, p=11)


def test_analyze_and_plot_long_horizon_store(tmp_path, capsys):
    path = tmp_path / "long.sqlite"
    grid = sw.build_grid({**TINY, "epochs": 20000, "stop_at_grok": False, "eval_every": 20}, [1.0], range(4))
    with Store(path) as st:
        sw.run_sweep(grid, st, workers=1, train_fn=_long_fake_train, progress=False)
    main(["analyze", str(path), "--n-boot", "20"])
    text = capsys.readouterr().out
    assert "== retention (trained to the horizon)" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("1 ") and "0.500" in line)
    assert row.split()[1:5] == ["4", "4", "2", "0.500"], row       # 4 runs, 4 grokked, 2 retained
    assert "stages (segment_stages): 4 run(s) segmented" in text
    assert "coordination" in text and "second differentiation" in text and "collapse" in text
    main(["analyze", str(path), "--n-boot", "20", "--json"])
    g = json.loads(capsys.readouterr().out)["groups"][0]
    assert g["retention"][0]["anti_grok"] == 2
    anti = [s for s in g["stages"] if s["regime"] == "anti-grok"]
    assert all([x["stage"] for x in s["stages"]] == list(traj.STAGES) for s in anti)
    main(["plot", str(path), "--out", str(tmp_path / "f"), "--n-boot", "20", "--format", "png"])
    assert (tmp_path / "f" / "stages.png").stat().st_size > 5000


def _headdim_fake_train(cfg, progress=None, checkpoint=None):   # train_run's signature
    rng = random.Random(f"{cfg.d_model}/{cfg.n_heads}/{cfg.seed}")
    x = cfg.d_model / cfg.n_heads
    peak = 0.04 + 0.07 * (1 - math.exp(-0.15 * x)) + rng.gauss(0, 0.003)
    trace = [{"epoch": e, "step": e, "train_acc": 1.0, "test_acc": 1.0 if e >= 20 else 0.1,
              "s_bar": 0.95, "sigma_h": peak if e == 30 else 0.03} for e in (10, 20, 30, 40)]
    result = {"run_id": cfg.run_id(), "regime": "grok", "t_grok_epoch": 20, "n_params": 1000}
    return SimpleNamespace(config=cfg, result=result, trace=trace)


def test_headdim_command_fits_and_draws(tmp_path, capsys, monkeypatch):
    import fastdiag.grokking.train
    monkeypatch.setattr(fastdiag.grokking.train, "train_run", _headdim_fake_train)
    store, out = tmp_path / "hd.sqlite", tmp_path / "hd"
    args = ["headdim", "--d-model", "16,32,64,128", "--heads", "2,4,8,3", "--wd", "1", "--seeds", "3",
            "--p", "11", "--epochs", "40", "--store", str(store), "--out", str(out), "--workers", "1",
            "--n-boot", "50", "--quiet", "--device", "cpu"]
    main(args)
    cap = capsys.readouterr()
    assert "skipped d=16, H=3 (H does not divide d)" in cap.err
    assert "saturating fit σ_max = c + a(1 − exp(−b·d/H))" in cap.out and "plateau c + a = 0.1" in cap.out
    report = json.loads((out / "headdim.json").read_text())
    assert report["n_points"] == 36 and abs(report["fit"]["plateau"] - 0.11) < 0.01
    assert (out / "headdim.png").stat().st_size > 5000
    main(args)                                          # finished runs are skipped
    assert "36 already done" in capsys.readouterr().err
    main(["analyze", str(store), "--n-boot", "50"])
    assert "== per-head dimension (λ = 1.0)" in capsys.readouterr().out
    main(["plot", str(store), "--out", str(tmp_path / "p"), "--n-boot", "50", "--format", "png"])
    assert (tmp_path / "p" / "headdim.png").exists()
    with pytest.raises(SystemExit) as exc:
        main([*args[:4], "1,2", *args[5:]])
    assert exc.value.code == 2 and "--heads: σ_H is a spread across heads" in capsys.readouterr().err


def test_analyze_predict_on_a_store(tmp_path, capsys):
    runs, traces = _predict_runs("baseline", n_seeds=8, n_lambda=4)
    by_key = {(r["config"]["seed"], r["config"]["weight_decay"]): r for r in runs}

    def fake(cfg):
        r = by_key[(cfg.seed, round(cfg.weight_decay, 10))]
        return SimpleNamespace(config=cfg, result={**r["result"], "run_id": cfg.run_id()}, trace=traces[r["run_id"]])

    lambdas = sorted({round(k[1], 10) for k in by_key})
    path = tmp_path / "pred.sqlite"
    with Store(path) as st:
        sw.run_sweep(sw.build_grid({**TINY, "epochs": 2000}, lambdas, range(8)), st, workers=1, train_fn=fake,
                     progress=False)
    main(["analyze", str(path), "--n-boot", "100", "--predict", "--t0", "50"])
    text = capsys.readouterr().out
    assert "== predictive value at t0 = 50 epochs (given)" in text
    assert "groks by the horizon (held-out AUC" in text and "s̄/σ_H adds no measurable value" in text
    main(["analyze", str(path), "--n-boot", "100", "--predict", "--json"])
    p = json.loads(capsys.readouterr().out)["predict"]
    assert p["t0_source"] == "median t_mem" and p["t0"] == 40
    assert len(p["groks_by_horizon"]["test_scores"]) == p["n_test"]
    assert len(p["log_t_grok"]["test_predictions"]) == p["log_t_grok"]["n_test"]
    main(["plot", str(path), "--out", str(tmp_path / "figs"), "--n-boot", "50", "--format", "png", "--predict",
          "--t0", "50"])
    assert str(tmp_path / "figs" / "predict.png") in capsys.readouterr().out
    assert (tmp_path / "figs" / "predict.png").stat().st_size > 5000
    with pytest.raises(SystemExit) as exc:
        main(["analyze", str(path), "--predict", "--test-frac", "1.5"])
    assert exc.value.code == 2


def test_phase_values_reads_the_two_phase_landmarks():
    # s̄: 0.93 at init, rises to 0.995 after t_grok = 40, falls to a trough 0.88 at epoch 120;
    # σ_H peaks (0.095) at epoch 120; a late s̄ bump after the trough is not the Phase-1 peak.
    s = {1: 0.93, 10: 0.90, 20: 0.95, 30: 0.97, 40: 0.98, 60: 0.995, 80: 0.95, 120: 0.88, 160: 0.999}
    h = {1: 0.04, 10: 0.06, 20: 0.05, 30: 0.05, 40: 0.03, 60: 0.04, 80: 0.07, 120: 0.095, 160: 0.05}
    trace = [{"epoch": e, "s_bar": s[e], "sigma_h": h[e]} for e in s]
    trace.insert(3, {"epoch": 25, "s_bar": None, "sigma_h": None})      # an evaluation without diagnostics
    v = traj.phase_values(trace, t_mem_epoch=20, t_grok_epoch=40)
    assert v["s_bar_init"] == 0.93 and v["init_epoch"] == 1
    assert v["s_bar_mem"] == 0.95 and v["s_bar_grok"] == 0.98
    assert (v["s_bar_min_after_grok"], v["s_bar_min_epoch"]) == (0.88, 120)
    assert (v["sigma_h_peak_after_grok"], v["sigma_h_peak_epoch"]) == (0.095, 120)
    assert v["s_bar_peak_phase1"] == 0.995 and v["epochs_after_grok"] == 120
    # Stopped at grokking: nothing after t_grok, the Phase-1 peak only up to t_grok.
    stopped = traj.phase_values([r for r in trace if r["epoch"] <= 40], 20, 40)
    assert stopped["epochs_after_grok"] == 0 and stopped["s_bar_min_after_grok"] is None
    assert stopped["sigma_h_peak_after_grok"] is None and stopped["s_bar_peak_phase1"] == 0.98
    # Never grokked / t_mem not an evaluation of the trace: those landmarks are None.
    never = traj.phase_values(trace, t_mem_epoch=None, t_grok_epoch=None)
    assert never["s_bar_init"] == 0.93 and never["s_bar_mem"] is None and never["s_bar_grok"] is None
    assert never["epochs_after_grok"] is None and never["s_bar_peak_phase1"] is None
    assert traj.phase_values([], 20, 40)["s_bar_init"] is None
    # s̄ still climbing after t_grok (its lowest value after grokking is the first one) before a
    # shallow Phase-2 fall: the trough is the bottom of that fall, not the climb's first point.
    climb = {30: 0.845, 150: 0.883, 160: 0.896, 400: 0.97, 730: 0.984, 1100: 0.98, 1500: 0.961, 1600: 0.976}
    v = traj.phase_values([{"epoch": e, "s_bar": x, "sigma_h": 0.01} for e, x in climb.items()], 30, 150)
    assert (v["s_bar_min_after_grok"], v["s_bar_min_epoch"]) == (0.961, 1500) and v["s_bar_peak_phase1"] == 0.984
    assert (v["s_bar_top_after_grok"], v["s_bar_top_epoch"], v["s_bar_min_after_top"]) == (0.984, 730, 0.961)
    # A loss spike right after grokking (s̄ 0.94 → 0.90) is a larger fall than the slow Phase-2 one:
    # the largest fall finds the spike, the fall after the top still reads Phase 2.
    spiked = traj.phase_values([{"epoch": e, "s_bar": 0.94 if e == 150 else 0.90 if e == 160 else x}
                                for e, x in climb.items()], 30, 150)
    assert spiked["s_bar_min_epoch"] == 160 and spiked["s_bar_min_after_top_epoch"] == 1500
    rising = traj.phase_values([{"epoch": e, "s_bar": x} for e, x in climb.items() if e <= 730], 30, 150)
    assert rising["s_bar_min_after_grok"] is None and rising["s_bar_peak_phase1"] == 0.984


class _SigmaTrainer:
    """A stand-in for Trainer in find_peak: one evaluation every ``every`` epochs with σ_H from
    ``sigma(epoch)``, grokked from ``t_grok`` on."""

    def __init__(self, sigma, every=10, t_grok=130, horizon=5000):
        self.sigma, self.every, self.horizon, self.epoch = sigma, every, horizon, 0
        self.tracker = SimpleNamespace(t_grok=None, diverged=False, _t=t_grok)

    @property
    def done(self):
        return self.epoch >= self.horizon

    def run_epoch(self):
        self.epoch += 1
        if self.epoch >= self.tracker._t and self.tracker.t_grok is None:
            self.tracker.t_grok = (self.epoch, self.epoch * 10)
        if self.epoch % self.every:
            return None
        return {"epoch": self.epoch, "sigma_h": self.sigma(self.epoch)}

    def branch(self):
        return SimpleNamespace(epoch=self.epoch)


def _paper_like_sigma(epoch):
    """The paper's Fig. 2 shape: a transient bump just after grokking (0.05 at 150, back to 0.02 by 200),
    then a slow rise with a stall (flat 400–600) to the Phase-2 peak 0.095 at 1,300, falling to 3,000."""
    if epoch < 200:
        return 0.05 if 140 <= epoch <= 160 else 0.02
    if epoch < 400:
        return 0.02 + 0.0002 * (epoch - 200)          # 0.06 at 400
    if epoch < 600:
        return 0.06                                    # a 200-epoch stall of the rise
    if epoch <= 1300:
        return 0.06 + 0.035 * (epoch - 600) / 700
    return 0.095 - 0.04 * (epoch - 1300) / 1700


def test_peak_confirmed_in_epochs_branches_at_the_phase2_peak():
    """The default rule (500 epochs without a new σ_H maximum) branches at the paper's Phase-2 peak; the
    old rule (10 evaluations) confirmed the transient maximum just after grokking."""
    ckpt, info = iv.find_peak(_SigmaTrainer(_paper_like_sigma))
    assert PEAK_PATIENCE_EPOCHS == 500
    assert info["peak_confirmed"] and ckpt.epoch == 1300 and info["search_epochs"] == 1800
    ckpt_old, info_old = iv.find_peak(_SigmaTrainer(_paper_like_sigma), patience=10)
    assert info_old["peak_confirmed"] and ckpt_old.epoch == 140           # the transient right after grokking
    ckpt_short, _ = iv.find_peak(_SigmaTrainer(_paper_like_sigma), patience_epochs=150)
    assert ckpt_short.epoch == 140                                         # shorter than the climb past the transient
    unconfirmed = iv.find_peak(_SigmaTrainer(_paper_like_sigma, horizon=1500))[1]
    assert not unconfirmed["peak_confirmed"] and unconfirmed["peak_sigma_h"] == pytest.approx(0.095)


def test_intervention_defaults_are_named_and_overridable():
    settings = InterventionSettings()
    assert settings.peak_patience_epochs == PEAK_PATIENCE_EPOCHS and settings.peak_patience is None
    with pytest.raises(ValueError, match="peak_patience_epochs"):
        InterventionSettings(peak_patience_epochs=0).validate()
