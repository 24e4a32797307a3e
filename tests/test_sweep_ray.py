"""The Ray backend, on a local Ray started by the test: real tiny runs, and lost workers retried or
recorded as failed (never silently dropped)."""
import sys

import pytest

ray = pytest.importorskip("ray")

from fastdiag import sweep as sw  # noqa: E402
from fastdiag.store import Store  # noqa: E402
from fastdiag.testing import dying_trainer  # noqa: E402

TINY = dict(preset="custom", n_layers=1, n_heads=2, d_model=32, d_ff=64, p=11, epochs=3)


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    # Functions of this test module travel to the workers by value (the module is not importable there).
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.shutdown()


def test_ray_backend_real_runs_and_lost_workers(local_ray, tmp_path):
    grid = sw.build_grid(TINY, [0.1, 1.0], [0, 1])
    with Store(tmp_path / "ray.sqlite") as st:
        summary = sw.run_sweep(grid, st, backend="ray", progress=False)
        assert summary.done == 4 and summary.failed == 0
        for run in st.runs():
            assert run["status"] == "done" and run["result"]["n_params"] > 0
            assert len(st.trace(run["run_id"])) == 3
        # Rerunning skips everything.
        assert sw.run_sweep(grid, st, backend="ray", progress=False).skipped == 4

    marker_dir = str(tmp_path)

    def dying_here(cfg):
        return dying_trainer(cfg, marker_dir)

    with Store(tmp_path / "lost.sqlite") as st:
        summary = sw.run_sweep(grid, st, backend="ray", train_fn=dying_here, max_retries=1, progress=False)
        assert summary.done == 3 and summary.failed == 1
        (failed,) = st.runs("failed")
        assert (failed["config"]["weight_decay"], failed["config"]["seed"]) == (1.0, 1)
        assert "ray task failed after 1 retries" in failed["error"]
        assert st.counts() == {"pending": 0, "running": 0, "done": 3, "failed": 1}


def test_ray_backend_trains_ensembles(local_ray, tmp_path):
    grid = sw.build_grid(TINY, [0.1, 1.0], [0, 1])
    with Store(tmp_path / "ens.sqlite") as st:
        summary = sw.run_sweep(grid, st, backend="ray", ensemble=4, progress=False)
        assert summary.done == 4 and summary.failed == 0
        runs = st.runs("done")
        assert len(runs) == 4 and all(r["result"]["ensemble_size"] == 4 for r in runs)
        assert all(len(st.trace(r["run_id"])) == 3 for r in runs)


@pytest.mark.slow
def test_sigterm_to_a_ray_sweep_is_one_line_143_and_releases_its_runs(local_ray, tmp_path):
    """SIGTERM to a `--backend ray` sweep (a scheduler's kill): Ray's own handler won (exit 1 or 15, a
    C++ signal dump) and the store showed its runs `running` after the sweep had died. Now the
    driver's handler owns the signal: its Ray tasks cancelled, Ray shut down, one line, 143, the runs
    pending and unclaimed. (The sweep joins this module's Ray by --address: no second Ray to start;
    a signal while Ray starts was tried by hand, see issue 40's closing note.)"""
    import os
    import signal
    import sqlite3
    import subprocess
    import time
    store = tmp_path / "r.sqlite"
    tiny = ["--preset", "custom", "--layers", "1", "--heads", "2", "--d-model", "32", "--d-ff", "64", "--p", "11"]
    proc = subprocess.Popen([sys.executable, "-m", "fastdiag.cli", "sweep", "--backend", "ray", "--wd", "0.1,1",
                             *tiny, "--epochs", "100000", "--ensemble", "1", "--store", str(store), "--quiet",
                             "--address", ray.get_runtime_context().gcs_address],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)

    def statuses():
        try:
            with sqlite3.connect(f"file:{store}?mode=ro", uri=True, timeout=30) as conn:
                return dict(conn.execute("SELECT status, COUNT(*) FROM runs GROUP BY status").fetchall())
        except sqlite3.Error:
            return {}
    try:
        def training():                                  # Ray's workers run our tasks
            return subprocess.run(["pgrep", "-f", "ray::_ray_execute"], capture_output=True).returncode == 0
        deadline = time.time() + 180
        while not training() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert training() and statuses() == {"running": 2}, proc.stderr.read() if proc.poll() is not None else ""
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, err
    assert err.strip().splitlines()[-1] == "fastdiag: error: terminated" and "SIGTERM" not in err, err
    assert "Traceback" not in err, err
    assert statuses() == {"pending": 2}
    with sqlite3.connect(store) as conn:
        assert conn.execute("SELECT COUNT(*) FROM claims").fetchone()[0] == 0
    deadline = time.time() + 30                          # its tasks cancelled: no worker trains on
    while training():
        assert time.time() < deadline, "a Ray worker still runs the sweep's task"
        time.sleep(0.2)
