"""fastdiag.grokking.interventions and `fastdiag intervene`: the arms differ exactly as designed, the control
is the un-branched run bit for bit, the statistics match scipy, results land in the store."""
import dataclasses
import json

import numpy as np
import pytest
import torch
from scipy import stats

from fastdiag.analysis.paired import compare_arms
from fastdiag.cli.analyze import format_comparison
from fastdiag.grokking import interventions as iv
from fastdiag.grokking.intervention_settings import InterventionSettings, parse_heads
from fastdiag.store import interventions as tables
from fastdiag.cli import main
from fastdiag.grokking.config import RunConfig
from fastdiag.grokking.build import build_model
from fastdiag.store import open_existing
from fastdiag.grokking.train import train_run

# A 2-layer, 4-head model on a+b mod 11; "grokking" at test accuracy 0.6 comes within ~150 epochs,
# so the peak search, the branch and 3 arms of 10 epochs take ~3 s per seed on one core.
SMALL = dict(preset="custom", n_layers=2, n_heads=4, d_model=32, d_ff=64, p=11, train_frac=0.7, lr=3e-3,
             batch_size=32, eval_every=2, diag_every=1, grok_threshold=0.6, device="cpu")


pytestmark = pytest.mark.usefixtures("one_thread")


def _model(seed=0):
    cfg = RunConfig(**SMALL, seed=seed)
    torch.manual_seed(seed)
    return cfg, build_model(cfg)


def test_reinit_changes_exactly_the_chosen_heads():
    cfg, model = _model(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fresh = iv.fresh_model(cfg, seed=123, device="cpu")
    state = torch.random.get_rng_state()
    heads = iv.choose_heads(model, 2, seed=0)
    assert len(heads) == 4 and {h["layer"] for h in heads} == {"blocks.0.attn", "blocks.1.attn"}
    assert heads == iv.choose_heads(model, 2, seed=0) and heads != iv.choose_heads(model, 2, seed=5)
    iv.reinit_heads(model, fresh, heads)
    assert torch.equal(torch.random.get_rng_state(), state), "the global RNG is not disturbed"
    after, new = model.state_dict(), fresh.state_dict()
    C, dh = 32, 8
    for name in before:
        changed = torch.zeros_like(before[name], dtype=torch.bool)
        for h in heads:
            prefix = h["layer"] + "."
            if name in (prefix + "qkv.weight", prefix + "qkv.bias"):
                for part in range(3):
                    changed[part * C + h["head"] * dh: part * C + (h["head"] + 1) * dh] = True
            if name == prefix + "proj.weight":
                changed[:, h["head"] * dh:(h["head"] + 1) * dh] = True
        assert torch.equal(after[name][~changed], before[name][~changed]), f"{name}: other weights untouched"
        assert torch.equal(after[name][changed], new[name][changed]), f"{name}: heads from the fresh model"
        if changed.any():
            assert not torch.equal(after[name][changed], before[name][changed])
    # explicit heads, and their checks
    assert iv.choose_heads(model, 2, 0, explicit=((1, 3), (0, 0))) == [
        {"layer": "blocks.0.attn", "layer_index": 0, "head": 0}, {"layer": "blocks.1.attn", "layer_index": 1, "head": 3}]
    with pytest.raises(ValueError, match="head 4 out of range"):
        iv.choose_heads(model, 2, 0, explicit=((0, 4),))
    with pytest.raises(ValueError, match="5 heads per layer"):
        iv.choose_heads(model, 5, 0)
    assert parse_heads("0:1, 1:3") == ((0, 1), (1, 3))
    with pytest.raises(ValueError, match="LAYER:HEAD"):
        parse_heads("0-1")


@pytest.mark.parametrize("scope", ["all-2d", "attention"])
def test_clip_caps_norms_at_the_median(scope):
    _, model = _model(1)
    with torch.no_grad():
        model.blocks[0].attn.qkv.weight.mul_(5.0)         # spread the norms
    mats = iv.clip_matrices(model, scope)
    before = {n: p.detach().clone() for n, p in mats}
    norms = {n: float(p.double().norm()) for n, p in before.items()}
    median = float(np.median(list(norms.values())))
    rec = iv.clip_weight_norms(model, scope)
    assert rec["median"] == pytest.approx(median) and rec["norm"] == "Frobenius" and rec["scope"] == scope
    assert {c["matrix"] for c in rec["clipped"]} == {n for n, v in norms.items() if v > median}
    for n, p in iv.clip_matrices(model, scope):
        if norms[n] > median:
            assert float(p.detach().double().norm()) == pytest.approx(median, rel=1e-6)
            assert torch.allclose(p / p.norm(), before[n] / before[n].norm(), atol=1e-6), "direction kept"
        else:
            assert torch.equal(p, before[n])
    if scope == "all-2d":
        assert any(".mlp." in n for n in rec["matrices"]) and "tok_emb.weight" in rec["matrices"]
    else:
        assert all(n.endswith(("qkv.weight", "proj.weight")) and ".attn." in n for n in rec["matrices"])


def test_seed_run_control_is_the_unbranched_run_and_arms_differ():
    cfg = RunConfig(**SMALL, seed=0, epochs=300)
    settings = InterventionSettings(after_peak_epochs=10, peak_patience=3, max_epochs=300)
    out = iv.run_seed(cfg, settings)
    info = out["info"]
    assert info["peak_confirmed"] and info["t_grok_epoch"] <= info["peak_epoch"] == info["branch_epoch"]
    b = info["branch_epoch"]
    control = out["arms"]["control"]["outcome"]
    plain = train_run(dataclasses.replace(cfg, stop_at_grok=False, epochs=b + 10))
    assert control.trace == plain.trace, "control = an un-branched run to the same horizon, bit for bit"
    peak_row = next(r for r in control.trace if r["epoch"] == b)
    assert peak_row["sigma_h"] == info["peak_sigma_h"]
    assert max(r["sigma_h"] for r in control.trace if r["epoch"] >= info["t_grok_epoch"] and r["epoch"] <= b) \
        == info["peak_sigma_h"], "the branch point is the σ_H maximum after grokking"
    for arm in ("reinit", "clip"):
        tr = out["arms"][arm]["outcome"].trace
        assert [r for r in tr if r["epoch"] <= b] == [r for r in control.trace if r["epoch"] <= b]
        assert [r for r in tr if r["epoch"] > b] != [r for r in control.trace if r["epoch"] > b]
        assert out["arms"][arm]["outcome"].result["epochs_run"] == b + 10
    assert out["arms"]["reinit"]["intervention"]["heads"] and out["arms"]["clip"]["intervention"]["clipped"]


def test_compare_arms_matches_scipy_and_holm():
    rng = np.random.default_rng(0)
    rows = []
    for seed in range(8):
        base = 0.1 + 0.01 * rng.normal()
        for arm, shift in (("control", 0.0), ("reinit", -0.03), ("clip", 0.001)):
            rows.append({"seed": seed, "arm": arm, "metrics": {
                "peak_sigma_h_after": base + shift + 0.005 * rng.normal(), "final_test_acc": 1.0}})
    rows.append({"seed": 99, "arm": "control", "metrics": {"peak_sigma_h_after": 0.5, "final_test_acc": 1.0}})
    cmp = compare_arms(rows)
    assert cmp["seeds"] == list(range(8)), "a seed without all arms is left out"
    by = {(t["arm"], t["metric"]): t for t in cmp["tests"]}
    ctrl = [r["metrics"]["peak_sigma_h_after"] for r in rows if r["arm"] == "control" and r["seed"] < 99]
    p_t = []
    for arm in ("reinit", "clip"):
        treated = [r["metrics"]["peak_sigma_h_after"] for r in rows if r["arm"] == arm]
        t = by[(arm, "peak_sigma_h_after")]
        ref = stats.ttest_rel(treated, ctrl)
        assert t["t_p"] == pytest.approx(ref.pvalue) and t["t"] == pytest.approx(ref.statistic)
        assert t["wilcoxon_p"] == pytest.approx(stats.wilcoxon(treated, ctrl).pvalue)
        d = np.subtract(treated, ctrl)
        assert t["cohens_d"] == pytest.approx(d.mean() / d.std(ddof=1))
        p_t.append(ref.pvalue)
    # two testable comparisons form the Holm family: the smaller p doubled, the larger kept (monotone)
    lo, hi = sorted(p_t)
    holm = sorted(t["t_p_holm"] for t in cmp["tests"] if "t_p_holm" in t)
    assert holm == pytest.approx([min(1, 2 * lo), max(min(1, 2 * lo), hi)])
    assert by[("reinit", "peak_sigma_h_after")]["mean_diff"] < -0.02 and by[("reinit", "peak_sigma_h_after")]["t_p"] < 1e-3
    assert "error" in by[("clip", "final_test_acc")], "identical arms: no test, not a fake p-value"
    assert "no test" in format_comparison(cmp)


def test_intervene_command_store_json_analyze_plot(tmp_path, capsys):
    store, out = tmp_path / "iv.sqlite", tmp_path / "iv"
    args = ["intervene", "--preset", "custom", "--layers", "2", "--heads", "4", "--d-model", "32", "--d-ff", "64",
            "--p", "11", "--train-frac", "0.7", "--lr", "3e-3", "--batch", "32", "--eval-every", "2",
            "--diag-every", "1", "--grok-threshold", "0.6", "--epochs", "300", "--seeds", "2",
            "--after-peak-epochs", "10", "--peak-patience", "3", "--heads-to-reinit", "1", "--clip", "attention",
            "--device", "cpu", "--threads", "1", "--store", str(store), "--out", str(out)]
    main(args)
    cap = capsys.readouterr()
    assert "2 seed(s) with all arms" in cap.out and "peak_sigma_h_after" in cap.out and "Holm" in cap.out
    report = json.loads((out / "intervention.json").read_text())
    assert report["comparison"]["n_seeds"] == 2 and len(report["per_seed"]) == 6
    reinit = [r for r in report["per_seed"] if r["arm"] == "reinit"]
    assert all(len(r["intervention"]["heads"]) == 2 for r in reinit)          # 1 per layer × 2 layers
    assert (out / "intervention.png").stat().st_size > 5000
    with open_existing(store) as st:
        exps = tables.load_experiments(st)
        assert len(exps) == 1 and len(next(iter(exps.values()))) == 6
        assert st.runs() == [], "the sweep runs table is left alone"
        row = next(iter(exps.values()))[0]
        assert row["branch_of"] == RunConfig.from_dict({**row["config"], "epochs": 300}).run_id()
        assert len(tables.arm_trace(st, row["arm_id"])) > 0
    main(args)                                               # rerun: seeds already stored are skipped
    assert cap.err.count("seed 0:") >= 1 and "already in" in capsys.readouterr().err
    main(["analyze", str(store), "--n-boot", "20"])
    assert "== interventions iv-" in capsys.readouterr().out
    main(["plot", str(store), "--out", str(tmp_path / "p"), "--format", "png"])
    assert (tmp_path / "p" / "intervention.png").exists()
    with pytest.raises(SystemExit) as exc:
        main(args[:-4] + ["--reinit-heads", "0:9"])             # refused before any training
    assert exc.value.code == 2 and "head 9 out of range" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["intervene", "--arch", "mlp", "--seeds", "2"])
    assert exc.value.code == 2
