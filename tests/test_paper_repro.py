"""`fastdiag paper`: the README's paper table, from synthetic runs with known answers, and from data/paper/."""
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from fastdiag.analysis.trajectories import phase_values
from fastdiag.grokking.config import RunConfig
from fastdiag.store import Lease, Store

from fastdiag.analysis import paper, paper_data
from fastdiag.cli import main

GPU_ROWS = [(1.0, 1.0, [0.5, 0.5])]          # the GPU plan is not what these tests check


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
    report = paper_data.table(runs)
    checks = report["power_law"]
    assert set(checks) == {"0.1", "0.05"}                   # λ = 10 is above 1, λ = 0.001 below the paper's λ_c
    lc, nu = paper_data.PAPER["lambda_c"], paper_data.PAPER["nu"]
    assert checks["0.1"]["predicted_ratio"] == pytest.approx(((0.1 - lc) / (1 - lc)) ** -nu)
    assert checks["0.1"]["predicted_ratio"] == pytest.approx(6.43, abs=0.01)
    assert checks["0.1"]["predicted_t_grok"] == pytest.approx(checks["0.1"]["predicted_ratio"] * 155)
    assert checks["0.1"]["observed_ratio_of_medians"] == pytest.approx(1400 / 155)
    assert checks["0.1"]["implied_nu"] == pytest.approx(math.log(1400 / 155) / -math.log((0.1 - lc) / (1 - lc)))
    assert checks["0.1"]["not_grokked_horizons"] == [1200] and checks["0.1"]["grokked"] == 1
    assert "observed_ratio_of_medians" not in checks["0.05"] and checks["0.05"]["not_grokked_horizons"] == [2000]
    lo, hi = checks["0.05"]["predicted_ratio_range_over_paper_cis"]
    assert lo < checks["0.05"]["predicted_ratio"] < hi
    text = "\n".join(paper_data.format_table(report))
    assert "λ = 0.05: predicted" in text and "not grokked within [2000] epochs: 1 run(s)" in text


def test_no_power_law_rows_without_lambda_one():
    assert paper_data.table([_run(0.1, 0, 1400, 3000)])["power_law"] == {}


# ------------------------------------------------------------------ committed data → the README's table
def test_readme_paper_table_is_what_regenerate_prints_from_data_paper(capsys):
    """Every number of the README's paper table (and of the prose under it) comes from data/paper/
    through one command, `fastdiag paper regenerate` (`--write-readme` rewrites the block)."""
    main(["paper", "regenerate"])
    assert capsys.readouterr().out.splitlines() == paper.readme_block()


def test_median_interval_has_its_exact_binomial_coverage():
    eleven = [160, 150, 130, 150, 155, 135, 155, 160, 155, 130, 140]
    m = paper_data.median_ci(eleven)
    assert m["median"] == 150 and m["k"] == 2 and m["ci"] == [130, 160]
    assert m["coverage"] == pytest.approx(1 - 2 * 12 / 2048)                  # 98.8 %: P(Bin(11, ½) ≤ 1) = 12/2048
    assert paper_data.median_ci(eleven, coverage=0.93)["ci"] == [135, 155]   # 93.5 %
    three = paper_data.median_ci([1450, 1470, 1600])
    assert three["ci"] == [1450, 1600] and three["coverage"] == pytest.approx(0.75)   # the range, short of 95 %
    assert "at 0.0 %" not in paper_data.median_text([1450, 1470, 1600])


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
    paper_data.export([str(tmp_path / "s.sqlite")], out)
    paper_data.export([str(tmp_path / "s.sqlite")], out)                   # again: nothing appended twice
    for name in ("printed.json", "init.json", "published.json"):
        (out / name).write_text((paper_data.DATA / name).read_text())
    data = paper_data.load_data(out)
    assert [(r["lambda"], r["seed"], r["regime"], r["regime_current_rules"]) for r in data["runs"]] == [
        (1.0, 3, "anti-grok", "grok"), (10.0, 0, "collapse", "collapse")]
    assert [len(r["trace"]) for r in data["runs"]] == [10, 5] and data["runs"][0]["t_grok_epoch"] == 20
    groups = paper._exported_groups(data)
    assert groups[1.0]["current"] == {"grok": 1} and groups[1.0]["regimes"] == {"anti-grok": 1}
    assert groups[10.0]["current"] == {"collapse": 1}


# ------------------------------------------------------------------ exported groups in place of printed ones
def _write_data(folder: Path, runs: list[dict], traces: dict[tuple, list[dict]], lambda1_printed=(170, 175, 180, 185)):
    """A synthetic data folder: runs.csv / traces.csv written as `export` writes them, printed.json
    (the committed one with fresh λ = 1 values), init.json and published.json copied."""
    import csv
    import json
    folder.mkdir()
    with (folder / "runs.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=paper_data.RUN_COLUMNS, lineterminator="\n")
        w.writeheader()
        for r in runs:
            w.writerow({k: ("" if r.get(k) is None else r[k]) for k in paper_data.RUN_COLUMNS})
    with (folder / "traces.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=paper_data.TRACE_COLUMNS, lineterminator="\n")
        w.writeheader()
        for (lam, seed), rows in traces.items():
            for x in rows:
                w.writerow({"lambda": lam, "seed": seed} | {k: x.get(k, "") for k in paper_data.TRACE_COLUMNS[2:]})
    printed = json.loads((paper_data.DATA / "printed.json").read_text())
    one = next(g for g in printed["groups"] if g["lambda"] == 1.0)
    one["t_grok_epoch_values"] = list(lambda1_printed)
    one["t_mem_epoch_values"] = [35] * len(lambda1_printed)
    (folder / "printed.json").write_text(json.dumps(printed))
    for name in ("init.json", "published.json"):
        (folder / name).write_text((paper_data.DATA / name).read_text())


def _csv_run(lam, seed, epochs, eval_every, stop, t_grok, t_mem=25, regime="grok", test_end=1.0):
    return {"lambda": lam, "seed": seed, "epochs": epochs, "eval_every": eval_every, "stop_at_grok": int(stop),
            "grok_threshold": 0.99, "t_mem_epoch": t_mem, "t_grok_epoch": t_grok, "regime": regime,
            "regime_current_rules": regime, "final_train_acc": 1.0, "final_test_acc": test_end, "final_s_bar": 0.9,
            "wall_seconds": 100.0, "store": "synthetic.sqlite"}


def _grok_trace(t_grok, every, s_offset, end=None, dip_at=None):
    """Train accuracy 1 from epoch 25, test accuracy ≥ 0.99 from t_grok; s̄ = 0.8 + s_offset + epoch/10⁴
    (so each run's s̄ at t_mem and t_grok is known); one evaluation at ``dip_at`` falls to 0.40/0.45."""
    rows = []
    for e in range(every, (end or t_grok) + 1, every):
        test = 0.995 if e >= t_grok else 0.2
        train = 1.0 if e >= 25 else 0.3
        if e == dip_at:
            train, test = 0.45, 0.40
        rows.append({"epoch": e, "train_acc": train, "test_acc": test, "s_bar": 0.8 + s_offset + e / 1e4,
                     "sigma_h": 0.01 + e / 1e5})
    return rows


@pytest.fixture
def fast_report(monkeypatch):
    """The fits of the paper's data are not what these tests check: constants."""
    monkeypatch.setattr(paper, "_published_fits", lambda published: (["a", "b", "c"], ["d", "e", "f"]))


def test_exported_lambda1_replaces_the_printed_values_which_stay_for_comparison(tmp_path, fast_report):
    t_grok = {0: 140, 1: 145, 2: 165}
    runs = [_csv_run(1.0, s, 1000, 5, True, t) for s, t in t_grok.items()]
    runs.append(_csv_run(1.0, 9, 1600, 10, False, 120, regime="anti-grok"))      # trained past grokking, one dip
    runs.append(_csv_run(10.0, 0, 60, 5, True, None, t_mem=None, regime="collapse"))   # not the printed 150 epochs
    traces = {(1.0, s): _grok_trace(t, 5, 0.01 * s) for s, t in t_grok.items()}
    traces[(1.0, 9)] = _grok_trace(120, 10, 0.03, end=1600, dip_at=200)
    traces[(10.0, 0)] = [{"epoch": e, "train_acc": 0.05, "test_acc": 0.02, "s_bar": 1.0, "sigma_h": 0.0}
                         for e in range(5, 65, 5)]
    _write_data(tmp_path / "d", runs, traces)
    data = paper_data.load_data(tmp_path / "d")
    groups = paper.table_groups(data)
    assert groups[1.0]["source"] == "exported" and groups[1.0]["printed"]["t_grok"] == [170, 175, 180, 185]
    assert sorted(groups[1.0]["t_grok"]) == [120, 140, 145, 165] and groups[1.0]["seeds"] == [0, 1, 2, 9]
    # λ = 10's row reads only regimes: exported runs of another horizon replace the printed ones there
    assert groups[10.0]["source"] == "exported" and groups[10.0]["printed"]["seeds"]
    assert {lam: g["source"] for lam, g in groups.items() if lam not in (1.0, 10.0)} == {
        0.001: "printed", 0.05: "printed", 0.1: "printed"}

    block = "\n".join(paper.regenerate(GPU_ROWS, tmp_path / "d"))
    row = next(line for line in block.splitlines() if line.startswith("| t_grok at λ = 1 "))
    assert "re-derived from traces, seeds 0, 1, 2, 9: n = 4, median 142.5" in row
    assert "values 120 140 145 165" in row
    assert "regimes as stored: anti-grok 1, grok 3; current rules: grok 4" in row     # re-labelled from the trace
    assert "printed before (lost stores): n = 4, median 177.5" in row
    published = [r["t_grok_epoch"] for r in data["published"]["runs"] if r["weight_decay"] == 1.0]
    mw = sps.mannwhitneyu([140, 145, 165, 120], published, alternative="two-sided", method="asymptotic")
    assert f"U = {mw.statistic:g}, two-sided p = {mw.pvalue:.2g}" in row
    t_mem = next(line for line in block.splitlines() if line.startswith("| t_mem at λ = 1 "))
    assert "n = 4, median 25" in t_mem and "printed before (lost stores): n = 4, median 35" in t_mem
    # phase values from the traces: s̄ at t_grok of seeds 0–3 = 0.8 + 0.01·seed + t_grok/10⁴
    phase = next(line for line in block.splitlines() if line.startswith("| s̄ early dip"))
    at_grok = sorted(0.8 + 0.01 * s + t / 1e4 for s, t in (*t_grok.items(), (3, 120)))    # seed 9: offset 0.03
    assert f"at t_grok n = 4, median {float(np.median(at_grok)):.3g}" in phase
    assert ("highest after grokking (n = 2): seed 9 (re-derived) 0.990 at 1,600 (printed before: 0.984 at 730); "
            "seed 10 (transcribed) 0.985 at 1,560") in phase                 # seed 10 was not redone
    instab = next(line for line in block.splitlines() if line.startswith("| instabilities"))
    assert "seed 9 (re-derived): 1 dip(s) below 0.99: epochs 200 (train/test 0.45/0.40); 1 recovered within 10 epochs" in instab
    assert "re-derived: labels as stored anti-grok 1; current rules grok 1" in instab
    assert "transcribed: stored `anti-grok` by the old one-evaluation rule" in instab
    sources = next(line for line in block.splitlines() if line.startswith("Sources:"))
    assert sources.startswith("Sources: our runs at λ = 10, 1 re-derived")
    assert "at λ = 0.1, 0.05, 0.001 transcribed" in sources
    assert "the runs trained past grokking of seed(s) 10 are still transcribed" in sources
    # the prose under the table reads the same data: n, coverages, intervals, the ratio's verdict
    assert "(a median of n values has only a few coverages on offer: with n = 4, 87.5 % or 37.5 %)" in block
    assert "- **λ = 1 groks later here than in the paper** (seeds 0, 1, 2, 9: n = 4, median 142.5, [120, 165] at 87.5 %" in block
    assert "the two lists share 0 of 4 values (re-run 120 140 145 165; printed 170 175 180 185)" in block
    ratio05 = next(line for line in block.splitlines() if line.startswith("| t(0.05) / t(1)"))
    assert ratio05.endswith("t(0.05) is 1 run(s): its seed spread is not in our range, so this does not test the law "
                            "(no contradiction, no confirmation) |") or "ranges disjoint" in ratio05
    regimes10 = next(line for line in block.splitlines() if line.startswith("| λ = 10: regimes"))
    assert "Committed: n = 1 (seeds 0; 60-epoch horizon" in regimes10
    assert "printed before (lost stores): n = 3 (150-epoch horizon" in regimes10


def test_exported_group_of_another_configuration_leaves_the_printed_one(tmp_path, fast_report):
    """λ = 1 runs evaluated every 10 over 1,000 epochs are not a redo of the printed setup (every 5;
    1,600 epochs past grokking): the printed values stay in the table."""
    runs = [_csv_run(1.0, s, 1000, 10, True, 150) for s in range(3)]
    _write_data(tmp_path / "d", runs, {(1.0, s): _grok_trace(150, 10, 0.0) for s in range(3)})
    groups = paper.table_groups(paper_data.load_data(tmp_path / "d"))
    assert groups[1.0]["source"] == "printed" and groups[1.0]["exported"]["seeds"] == [0, 1, 2]
    block = "\n".join(paper.regenerate(GPU_ROWS, tmp_path / "d"))
    assert "transcribed (printed.json): n = 4, median 177.5" in block
    assert "Sources: no λ of ours re-derived" in block


def test_lambda1_rows_after_grokking_stay_printed_without_an_exported_long_run(tmp_path, fast_report):
    runs = [_csv_run(1.0, s, 1000, 5, True, 150 + 5 * s) for s in range(3)]
    _write_data(tmp_path / "d", runs, {(1.0, s): _grok_trace(150 + 5 * s, 5, 0.0) for s in range(3)})
    block = "\n".join(paper.regenerate(GPU_ROWS, tmp_path / "d"))
    phase = next(line for line in block.splitlines() if line.startswith("| s̄ early dip"))
    assert "re-derived" not in phase.split("highest after grokking")[1]
    assert "highest after grokking (n = 2, transcribed from the lost stores): seed 9 0.984 at 730" in phase
    assert "(printed before: 0.885, n = 11)" in phase                      # s̄ at t_grok, printed
    assert "the runs trained past grokking of seed(s) 9, 10 are still transcribed" in block
    trough = next(line for line in block.splitlines() if line.startswith("| s̄ Phase-2"))
    assert "1,600 epochs" in trough


def test_export_refuses_runs_it_could_not_tell_apart(tmp_path):
    """runs.csv has no column for the model or task, traces.csv keys its rows by (λ, seed)."""
    cfgs = [RunConfig(weight_decay=1.0, seed=0, epochs=50, eval_every=10, lr=3e-3)]
    trace = [{"epoch": e, "train_acc": 0.5, "test_acc": 0.1, "s_bar": 0.9, "sigma_h": 0.01} for e in range(10, 60, 10)]
    with Store(tmp_path / "odd.sqlite") as st:
        st.add_runs(cfgs)
        with Lease(st) as lease:
            lease.claim([c.run_id() for c in cfgs])
        st.record_done(cfgs[0].run_id(), {"regime": "no-fit", "t_grok_epoch": None, "t_mem_epoch": None}, trace)
    with pytest.raises(ValueError, match="not the canonical setup.*'lr': 0.003"):
        paper_data.export([str(tmp_path / "odd.sqlite")], tmp_path / "out")
    assert not (tmp_path / "out" / "runs.csv").exists()
    two = [RunConfig(weight_decay=1.0, seed=0, epochs=50, eval_every=10),
           RunConfig(weight_decay=1.0, seed=0, epochs=40, eval_every=10)]
    with Store(tmp_path / "two.sqlite") as st:
        st.add_runs(two)
        with Lease(st) as lease:
            lease.claim([c.run_id() for c in two])
        for c in two:
            st.record_done(c.run_id(), {"regime": "no-fit", "t_grok_epoch": None, "t_mem_epoch": None}, trace)
    with pytest.raises(ValueError, match="a second run of this λ and seed"):
        paper_data.export([str(tmp_path / "two.sqlite")], tmp_path / "out")


# ------------------------------------------------------------------ the command line
def test_paper_plan_prints_the_hours_of_the_readme_estimate(capsys):
    import json

    from fastdiag.cli.paper import GPU_GRIDS, gpu_rows
    wd, seeds, epochs = GPU_GRIDS[1]
    main(["paper", "plan", "--wd", wd, "--seeds", str(seeds), "--epochs", str(epochs), "--tflops", "40", "--floor-ms", "6"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["runs"] == 9 * 16 and plan["assumed_tflops"] == 40
    row = next(r for r in gpu_rows() if r[:2] == (40.0, 6.0))
    assert plan["hours"] == pytest.approx(row[2][1])
    assert f"| 40 | 6 | {row[2][0]:.1f} + {row[2][1]:.1f} = **{sum(row[2]):.1f} h** |" in paper.readme_block()


def test_paper_commands_fail_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["paper", "export", str(tmp_path / "missing.sqlite"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "missing.sqlite" in err and "Traceback" not in err


def test_near_top_span_counts_every_evaluation_close_to_the_highest():
    trace = [{"epoch": e, "s_bar": v} for e, v in ((100, 0.90), (200, 0.985), (300, 0.983), (400, 0.97), (900, 0.9845))]
    assert paper.near_top_span(trace, t_grok=100) == {"n": 3, "first": 200, "last": 900, "near": paper.NEAR_TOP}
    assert paper.near_top_span(trace, t_grok=900) is None


def test_paper_figure_draws_step_0_under_its_own_tick_not_at_an_epoch(tmp_path, capsys):
    """`fastdiag paper figure` from data/paper/: step 0 is drawn left of the first epoch under a "step 0"
    tick (it was drawn at epoch 1 of the log axis), and λ groups of fewer than 5 runs get no median."""
    import json

    import matplotlib.figure

    saved = {}
    original = matplotlib.figure.Figure.savefig
    matplotlib.figure.Figure.savefig = lambda self, *a, **k: saved.setdefault("fig", self)
    try:
        main(["paper", "figure", "--init", str(paper_data.DATA / "init.json"), "--out", str(tmp_path / "f.png")])
    finally:
        matplotlib.figure.Figure.savefig = original
    fig = saved["fig"]
    bottom = fig.axes[-1]
    labels = [t.get_text() for t in bottom.get_xticklabels()]
    assert labels[0] == "step 0" and bottom.get_xticks()[0] < 1 and "10" in labels
    init = json.loads((paper_data.DATA / "init.json").read_text())["per_seed"]
    step0 = [line for line in fig.axes[1].get_lines() if len(line.get_xdata()) == len(init)
             and set(line.get_xdata()) == {bottom.get_xticks()[0]}]
    assert step0, "step-0 points not at the step-0 tick"
