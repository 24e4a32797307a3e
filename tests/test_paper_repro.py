"""`benchmarks/paper_repro.py table`: the README's paper table, from synthetic runs with known answers."""
import importlib.util
import math
from pathlib import Path

import pytest

from fastdiag.analysis.trajectories import phase_values
from fastdiag.grokking.config import RunConfig
from fastdiag.store import Lease, Store

_spec = importlib.util.spec_from_file_location(
    "paper_repro", Path(__file__).resolve().parent.parent / "benchmarks" / "paper_repro.py")
paper_repro = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(paper_repro)


def _run(lam, seed, t_grok, epochs):
    trace = [{"epoch": e, "train_acc": 1.0 if e >= 30 else 0.5, "s_bar": 0.9, "sigma_h": 0.01,
              "test_acc": 1.0 if t_grok is not None and e >= t_grok else 0.3} for e in range(10, epochs + 1, 10)]
    result = {"t_grok_epoch": t_grok, "t_mem_epoch": 30, "regime": "grok" if t_grok else "memorize",
              "final_train_acc": 1.0, "final_test_acc": trace[-1]["test_acc"], "final_s_bar": 0.9, "wall_seconds": 1.0}
    return {"lambda": lam, "seed": seed, "config": {"epochs": epochs, "eval_every": 10}, "result": result,
            "trace": trace, "phase": phase_values(trace, 30, t_grok)}


def test_power_law_rows_for_every_lambda_below_one():
    runs = [_run(1.0, 0, 150, 1000), _run(1.0, 1, 160, 1000), _run(0.1, 0, 1400, 3000), _run(0.1, 1, None, 1200),
            _run(0.05, 0, None, 2000), _run(10.0, 0, None, 150), _run(0.001, 0, None, 150)]
    report = paper_repro.table(runs)
    checks = report["power_law"]
    assert set(checks) == {"0.1", "0.05"}                   # λ = 10 is above 1, λ = 0.001 below the paper's λ_c
    lc, nu = paper_repro.PAPER["lambda_c"], paper_repro.PAPER["nu"]
    assert checks["0.1"]["predicted_ratio"] == pytest.approx(((0.1 - lc) / (1 - lc)) ** -nu)
    assert checks["0.1"]["predicted_ratio"] == pytest.approx(6.43, abs=0.01)
    assert checks["0.1"]["predicted_t_grok"] == pytest.approx(checks["0.1"]["predicted_ratio"] * 155)
    assert checks["0.1"]["observed_ratio_of_medians"] == pytest.approx(1400 / 155)
    assert checks["0.1"]["implied_nu"] == pytest.approx(math.log(1400 / 155) / -math.log((0.1 - lc) / (1 - lc)))
    assert checks["0.1"]["not_grokked_horizons"] == [1200] and checks["0.1"]["grokked"] == 1
    assert "observed_ratio_of_medians" not in checks["0.05"] and checks["0.05"]["not_grokked_horizons"] == [2000]
    lo, hi = checks["0.05"]["predicted_ratio_range_over_paper_cis"]
    assert lo < checks["0.05"]["predicted_ratio"] < hi
    text = "\n".join(paper_repro.format_table(report))
    assert "λ = 0.05: predicted" in text and "not grokked within [2000] epochs: 1 run(s)" in text


def test_no_power_law_rows_without_lambda_one():
    assert paper_repro.table([_run(0.1, 0, 1400, 3000)])["power_law"] == {}


# ------------------------------------------------------------------ committed data → the README's table
def test_readme_paper_table_is_what_regenerate_prints_from_data_paper():
    """Every number of the README's paper table comes from data/paper/ through one command
    (`python benchmarks/paper_repro.py regenerate --write-readme` rewrites the block)."""
    assert paper_repro.readme_block() == paper_repro.regenerate(paper_repro.DATA)


def test_median_interval_has_its_exact_binomial_coverage():
    eleven = [160, 150, 130, 150, 155, 135, 155, 160, 155, 130, 140]
    m = paper_repro.median_ci(eleven)
    assert m["median"] == 150 and m["k"] == 2 and m["ci"] == [130, 160]
    assert m["coverage"] == pytest.approx(1 - 2 * 12 / 2048)                  # 98.8 %: P(Bin(11, ½) ≤ 1) = 12/2048
    assert paper_repro.median_ci(eleven, coverage=0.93)["ci"] == [135, 155]   # 93.5 %
    three = paper_repro.median_ci([1450, 1470, 1600])
    assert three["ci"] == [1450, 1600] and three["coverage"] == pytest.approx(0.75)   # the range, short of 95 %
    assert "at 0.0 %" not in paper_repro._median_text([1450, 1470, 1600])


def test_export_writes_runs_and_traces_that_regenerate_relabels(tmp_path):
    """A stored single-evaluation dip after grokking (the old anti-grok label) is exported with the
    label as stored and re-labelled grok from its committed trace; a never-fit run with s̄ = 1 is collapse."""
    dip = [{"epoch": e, "train_acc": 1.0, "test_acc": 0.3 if e == 50 else (1.0 if e >= 20 else 0.1),
            "s_bar": 0.95, "sigma_h": 0.02} for e in range(10, 110, 10)]
    flat = [{"epoch": e, "train_acc": 0.1, "test_acc": 0.05, "s_bar": 1.0, "sigma_h": 0.0} for e in range(10, 60, 10)]
    cfgs = [RunConfig(weight_decay=1.0, seed=3, epochs=100, eval_every=10), RunConfig(weight_decay=10.0, seed=0, epochs=50, eval_every=10)]
    with Store(tmp_path / "s.sqlite") as st:
        st.add_runs(cfgs)
        with Lease(st) as lease:
            lease.claim([c.run_id() for c in cfgs])
        st.record_done(cfgs[0].run_id(), {"regime": "anti-grok", "t_grok_epoch": 20, "t_mem_epoch": 10}, dip)
        st.record_done(cfgs[1].run_id(), {"regime": "collapse", "t_grok_epoch": None, "t_mem_epoch": None}, flat)
    out = tmp_path / "data"
    paper_repro.export([str(tmp_path / "s.sqlite")], out)
    paper_repro.export([str(tmp_path / "s.sqlite")], out)                   # again: nothing appended twice
    for name in ("printed.json", "init.json", "published.json"):
        (out / name).write_text((paper_repro.DATA / name).read_text())
    data = paper_repro.load_data(out)
    assert [(r["lambda"], r["seed"], r["regime"], r["regime_current_rules"]) for r in data["runs"]] == [
        (1.0, 3, "anti-grok", "grok"), (10.0, 0, "collapse", "collapse")]
    assert [len(r["trace"]) for r in data["runs"]] == [10, 5] and data["runs"][0]["t_grok_epoch"] == 20
    groups = paper_repro._exported_groups(data)
    assert groups[1.0]["current"] == {"grok": 1} and groups[1.0]["regimes"] == {"anti-grok": 1}
    assert groups[10.0]["current"] == {"collapse": 1}
