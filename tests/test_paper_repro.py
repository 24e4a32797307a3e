"""`benchmarks/paper_repro.py table`: the README's paper table, from synthetic runs with known answers."""
import importlib.util
import math
from pathlib import Path

import pytest

from fastdiag.analysis.trajectories import phase_values

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
