"""A rerun of a sweep with --skip-failed says what it skipped: runs that failed before are reported as
failed and skipped, never counted among the runs "already done"."""
import sqlite3
import subprocess
import sys
from types import SimpleNamespace

from fastdiag.grokking.config import RunConfig
from fastdiag.store import Store
from fastdiag.sweep import build_grid, run_sweep

TINY = ["--preset", "custom", "--layers", "1", "--heads", "2", "--d-model", "32", "--d-ff", "64", "--p", "11",
        "--epochs", "2", "--device", "cpu", "--threads", "1", "--workers", "1", "--ensemble", "1", "--quiet"]


def fake_train(cfg):
    return SimpleNamespace(config=cfg, result={"regime": "grok", "t_grok_epoch": 1, "n_params": 1},
                           trace=[{"epoch": 1, "step": 1, "test_acc": 1.0}])


def mark_failed(store, run_id):
    conn = sqlite3.connect(store)
    with conn:
        conn.execute("UPDATE runs SET status = 'failed', result = NULL, error = 'boom' WHERE run_id = ?", (run_id,))
    conn.execute("DELETE FROM trace WHERE run_id = ?", (run_id,))
    conn.commit()
    conn.close()


def test_summary_counts_skipped_failed_runs_apart_from_done_ones(tmp_path):
    grid = build_grid(dict(arch="transformer", preset="custom", n_layers=1, n_heads=2, d_model=32, d_ff=64, p=11,
                           epochs=2), [0.1, 1.0], range(2))
    path = tmp_path / "s.sqlite"
    with Store(path) as st:
        run_sweep(grid, st, train_fn=fake_train, progress=False, ensemble=1, workers=1)
    failed = sorted(c.run_id() for c in grid)[0]
    mark_failed(path, failed)
    with Store(path) as st:
        summary = run_sweep(grid, st, train_fn=fake_train, progress=False, ensemble=1, workers=1, retry_failed=False)
    assert (summary.total, summary.skipped, summary.skipped_failed, summary.done) == (4, 3, 1, 0)
    with Store(path) as st:
        assert st.get(failed)["status"] == "failed"
        summary = run_sweep(grid, st, train_fn=fake_train, progress=False, ensemble=1, workers=1)
    assert (summary.skipped, summary.skipped_failed, summary.done) == (3, 0, 1)


def test_cli_rerun_with_skip_failed_reports_the_failed_run_as_skipped(tmp_path):
    store = tmp_path / "s.sqlite"
    cmd = [sys.executable, "-m", "fastdiag.cli", "sweep", "--wd", "0.1,1", *TINY, "--store", str(store)]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    ids = [RunConfig(arch="transformer", preset="custom", n_layers=1, n_heads=2, d_model=32, d_ff=64, p=11, epochs=2,
                     device="cpu", seed=0, weight_decay=wd).run_id() for wd in (0.1, 1.0)]
    mark_failed(store, ids[0])
    again = subprocess.run(cmd + ["--skip-failed"], capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    line = [x for x in again.stderr.splitlines() if x.startswith("sweep: 2 runs")][0]
    assert "1 already done" in line, line
    assert "1 failed before and skipped (--skip-failed)" in line, line
