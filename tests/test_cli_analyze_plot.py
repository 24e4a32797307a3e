"""`fastdiag analyze`, `plot` and `export` on stores, and their one-line errors on bad stores."""
import csv
import json
import math
import random
import sqlite3
from types import SimpleNamespace

import pytest

from fastdiag import sweep as sw
from fastdiag.cli import main
from fastdiag.store import Store

TINY = dict(preset="custom", n_layers=1, n_heads=2, d_model=32, d_ff=64, p=11, epochs=3)


def fake_train(cfg):
    """λ_c ≈ 0.02 logistic grokking, t_grok ∝ (λ − λ_c)^-0.75, collapse at λ ≥ 5 (deterministic)."""
    rng = random.Random(f"{cfg.weight_decay}/{cfg.seed}/{cfg.preset}")
    lam, lc = cfg.weight_decay, 0.02
    t_grok = None
    if lam >= 5:
        regime = "collapse"
    elif lam > 0 and rng.random() < 1 / (1 + math.exp(-4 * (math.log10(lam) - math.log10(lc)))):
        regime = "grok"
        t_grok = round(50 * (lam - lc) ** -0.75 * math.exp(rng.gauss(0, 0.05))) if lam > lc else 900
    else:
        regime = "memorization"
    trace = [{"epoch": e, "step": 3 * e, "train_acc": 1.0,
              "test_acc": 1.0 if t_grok and e >= t_grok else 0.1 * rng.random(),
              "s_bar": 0.9 + 0.05 * rng.random(), "sigma_h": 0.05 + 0.01 * rng.random(),
              "test_loss": float("nan")} for e in (1, 3, 10, 30, 100, 300, 1000)]
    result = {"run_id": cfg.run_id(), "regime": regime, "t_grok_epoch": t_grok,
              "n_params": 820_000 if cfg.preset == "canonical" else 19_000_000}
    return SimpleNamespace(config=cfg, result=result, trace=trace)


@pytest.fixture(scope="module")
def synthetic_store(tmp_path_factory):
    path = tmp_path_factory.mktemp("syn") / "syn.sqlite"
    grid = sw.build_grid({**TINY, "preset": "canonical", "n_layers": None, "n_heads": None, "d_model": None,
                          "d_ff": None}, [0, 0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.3, 1, 3, 10], range(6))
    grid += sw.build_grid({**TINY, "preset": "19m", "n_layers": None, "n_heads": None, "d_model": None,
                           "d_ff": None}, [0.01, 0.1, 1], range(2))
    with Store(path) as st:
        sw.run_sweep(grid, st, workers=1, train_fn=fake_train, progress=False)
    return path


def test_analyze_text_and_json(synthetic_store, capsys):
    main(["analyze", str(synthetic_store), "--n-boot", "200"])
    text = capsys.readouterr().out
    assert "λ_c = " in text and "95% CI" in text and "ν (λ_c fixed) = " in text and "ν (joint" in text
    assert "6 run(s) at λ = 0 kept out of the λ_c fit" in text
    assert "λ_c: no fit — lambda_c:" in text                    # the 19m group: 3 λ × 2 seeds
    main(["analyze", str(synthetic_store), "--json", "--n-boot", "200"])
    report = json.loads(capsys.readouterr().out)
    assert report["counts"]["done"] == 66 + 6 and len(report["groups"]) == 2
    canonical = next(g for g in report["groups"] if g["config"]["preset"] == "canonical")
    big = next(g for g in report["groups"] if g["config"]["preset"] == "19m")
    assert canonical["n_params"] == 820_000 and big["n_params"] == 19_000_000
    lc = canonical["lambda_c"]
    assert lc["ci"][0] <= lc["lambda_c"] <= lc["ci"][1] and lc["n_boot"] == 200 and lc["n_runs"] == 60
    assert canonical["nu"]["nu"] > 0 and canonical["nu_joint"]["ci"][0] <= canonical["nu_joint"]["ci"][1]
    assert set(big["lambda_c"]) == {"error"} and set(big["nu"]) == {"error"}      # no fake number
    row = next(r for r in canonical["regimes"] if r["lambda"] == 10.0)
    assert row["collapse"] == 6 and row["median_t_grok"] is None


def test_plot_all_figures(synthetic_store, tmp_path, capsys):
    out = tmp_path / "figs"
    main(["plot", str(synthetic_store), "--out", str(out), "--n-boot", "200", "--n-band", "100"])
    written = capsys.readouterr()
    names = sorted(p.name for p in out.iterdir())
    slugs = {"transformer-canonical-add-p11-e3", "transformer-19m-add-p11-e3"}
    expected = {"regime_diagram.png", "regime_diagram.svg"}
    for slug in slugs:
        for stem in ("p_grok", "t_grok", "trajectories"):
            expected |= {f"{stem}_{slug}.png", f"{stem}_{slug}.svg"}
    assert set(names) == expected
    assert all((out / n).stat().st_size > 5000 for n in names)
    assert "drawn without the λ_c fit" in written.err
    # The figure whose fit is impossible says so in its title; the fitted one shows λ_c and its band.
    assert "no logistic fit" in (out / "p_grok_transformer-19m-add-p11-e3.svg").read_text()
    fitted = (out / "p_grok_transformer-canonical-add-p11-e3.svg").read_text()
    assert "95% bootstrap band" in fitted and "logistic fit" in fitted
    diagram = (out / "regime_diagram.svg").read_text()
    for word in ("memorization", "developmental", "collapse", "Model parameters", "not shown"):
        assert word in diagram


def test_analyze_and_plot_tiny_real_store(tmp_path, capsys):
    path = tmp_path / "real.sqlite"
    with Store(path) as st:
        sw.run_sweep(sw.build_grid(TINY, [0.1, 1.0], [0]), st, workers=1, threads=1, progress=False)
    main(["analyze", str(path), "--n-boot", "20"])
    assert "no fit" in capsys.readouterr().out
    main(["plot", str(path), "--out", str(tmp_path / "f"), "--n-boot", "20"])
    assert (tmp_path / "f" / "trajectories.png").stat().st_size > 1000
    assert "no logistic fit" in (tmp_path / "f" / "p_grok.svg").read_text()


def test_export_csv_and_parquet(synthetic_store, tmp_path, capsys):
    main(["export", str(synthetic_store), "--format", "csv", "--out", str(tmp_path / "runs.csv"),
          "--trace-out", str(tmp_path / "trace.csv")])
    with open(tmp_path / "runs.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 72 and len({r["run_id"] for r in rows}) == 72
    assert {"run_id", "status", "weight_decay", "seed", "arch", "regime", "t_grok_epoch", "n_params",
            "finished_at"} <= set(rows[0])
    with open(tmp_path / "trace.csv") as fh:
        trace = list(csv.DictReader(fh))
    assert len(trace) == 72 * 7 and {"run_id", "epoch", "s_bar", "test_acc"} <= set(trace[0])
    pq = pytest.importorskip("pyarrow.parquet")
    main(["export", str(synthetic_store), "--format", "parquet", "--out", str(tmp_path / "runs.parquet"),
          "--status", "done"])
    table = pq.read_table(tmp_path / "runs.parquet")
    assert table.num_rows == 72 and str(table.schema.field("weight_decay").type) == "double"


def test_bad_stores_are_one_line_exit_2(tmp_path, capsys):
    """In process (the CLI's own entry point, as the console script calls it): a subprocess per case
    cost ~4 s of torch import each."""
    text = tmp_path / "notes.sqlite"
    text.write_text("not a database at all\n" * 10)
    foreign = tmp_path / "foreign.db"
    conn = sqlite3.connect(foreign)
    conn.execute("CREATE TABLE invoices (id INTEGER, amount REAL)")
    conn.commit()
    conn.close()
    cases = [
        (["analyze", text], "not an SQLite database"),
        (["plot", foreign, "--out", tmp_path / "o"], "foreign SQLite database"),
        (["export", foreign, "--out", tmp_path / "x.csv"], "foreign SQLite database"),
        (["sweep", "--wd", "1", "--store", text], "not an SQLite database"),
        (["analyze", tmp_path / "missing.sqlite"], "no such file"),
        (["merge", tmp_path / "out.sqlite", foreign], "foreign SQLite database"),
    ]
    for args, match in cases:
        with pytest.raises(SystemExit) as exc:
            main([str(a) for a in args])
        err = capsys.readouterr().err
        assert exc.value.code == 2, (args, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("fastdiag: error:") and match in lines[0], (args, err)
    assert text.read_text().startswith("not a database")          # never overwritten
    assert not (tmp_path / "out.sqlite").exists()


def test_fit_max_lambda_keeps_collapse_runs_out_of_the_fits(synthetic_store, tmp_path, capsys):
    def canonical(extra):
        main(["analyze", str(synthetic_store), "--json", "--n-boot", "100", *extra])
        report = json.loads(capsys.readouterr().out)
        return next(g for g in report["groups"] if g["config"]["preset"] == "canonical")

    everything, capped = canonical([]), canonical(["--fit-max-lambda", "5"])
    assert capped["fit_max_lambda"] == 5 and everything["fit_max_lambda"] is None
    assert "6 run(s) with λ > 5 kept out of the λ_c and ν fits" in capped["notes"]
    assert everything["lambda_c"]["n_runs"] - capped["lambda_c"]["n_runs"] == 6
    assert sum(r["n"] for r in capped["regimes"]) == sum(r["n"] for r in everything["regimes"])  # table keeps them
    assert capped["lambda_c"]["lambda_c"] != everything["lambda_c"]["lambda_c"]
    main(["plot", str(synthetic_store), "--out", str(tmp_path / "figs"), "--n-boot", "50", "--n-band", "20",
          "--format", "png", "--fit-max-lambda", "5"])
    assert "p_grok" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["analyze", str(synthetic_store), "--fit-max-lambda", "0"])
    assert exc.value.code == 2 and "--fit-max-lambda" in capsys.readouterr().err


def test_nothing_to_analyse_or_plot_is_exit_2_for_both(tmp_path, capsys):
    path = tmp_path / "empty.sqlite"
    Store(path).close()
    for argv in (["analyze", str(path)], ["analyze", str(path), "--json"], ["plot", str(path), "--out", str(tmp_path / "f")]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert exc.value.code == 2 and len(err) == 1 and "no finished runs" in err[0], (argv, err)


def test_too_short_runs_are_counted_in_the_table_and_drawn_in_the_regime_diagram(tmp_path, capsys):
    from fastdiag.cli.analyze import REGIME_COLUMNS
    from fastdiag.grokking.config import REGIMES
    from fastdiag.plots.style import REGIME_STYLE
    assert set(REGIME_COLUMNS) == set(REGIMES) == set(REGIME_STYLE)     # no regime left out of a summary

    def short_train(cfg):
        trace = [{"epoch": e, "step": e, "train_acc": 0.1, "test_acc": 0.05, "s_bar": 0.99, "sigma_h": 0.01}
                 for e in (1, 2, 3)]
        return SimpleNamespace(config=cfg, result={"run_id": cfg.run_id(), "regime": "too-short",
                                                   "t_grok_epoch": None, "n_params": 1000}, trace=trace)

    path = tmp_path / "short.sqlite"
    with Store(path) as st:
        sw.run_sweep(sw.build_grid(TINY, [0.1, 1.0], range(2)), st, workers=1, train_fn=short_train, progress=False)
    main(["analyze", str(path), "--n-boot", "20"])
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if "median t_grok" in line)
    assert header.split()[:9] == ["λ", "runs", "grok", "memor.", "collapse", "no-fit", "too-short", "anti-grok",
                                  "diverged"]
    row = next(line for line in lines if line.split()[:1] == ["1"])
    assert row.split()[1:9] == ["2", "0", "0", "0", "0", "2", "0", "0"]
    assert "note: 4 run(s) too short to classify (never fit the training set, stopped before epoch 50)" in "\n".join(lines)
    main(["plot", str(path), "--out", str(tmp_path / "figs"), "--n-boot", "20", "--n-band", "20"])
    assert "too short to classify" in (tmp_path / "figs" / "regime_diagram.svg").read_text()
