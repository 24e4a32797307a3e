"""End-to-end sweeps with the real trainer (tiny configs): local pool, mamba on CPU, kill -9 and resume,
shards + merge, and the one-line CLI errors of impossible grids."""
import json
import os
import pty
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import pytest

from fastdiag.cli import main
from fastdiag.grokking.config import REGIMES
from fastdiag.store import Store

TINY = ["--preset", "custom", "--layers", "1", "--heads", "2", "--d-model", "32", "--d-ff", "64", "--p", "11"]


def fastdiag_cli(*args, timeout=240):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "fastdiag.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env)


def fastdiag_cli_on_terminal(*args, timeout=240):
    """Run the CLI with stderr on a pseudo-terminal (the progress bar draws only on a terminal);
    returns (exit status, what it wrote to the terminal)."""
    master, slave = pty.openpty()
    chunks: list[bytes] = []

    def read() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:                  # the child side is closed
                return
            if not data:
                return
            chunks.append(data)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc = subprocess.run([sys.executable, "-m", "fastdiag.cli", *map(str, args)], stdout=subprocess.DEVNULL,
                              stderr=slave, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    finally:
        os.close(slave)
        reader.join(timeout=10)
        os.close(master)
    return proc.returncode, b"".join(chunks).decode(errors="replace")


def finished(path):
    if not os.path.exists(path):
        return {}
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    try:
        return dict(conn.execute("SELECT run_id, finished_at FROM runs WHERE status = 'done'").fetchall())
    except sqlite3.OperationalError:            # not created yet
        return {}
    finally:
        conn.close()


@pytest.mark.slow
def test_local_sweep_two_workers_then_analyze_and_plot(tmp_path):
    store = tmp_path / "s.sqlite"
    r = fastdiag_cli("sweep", "--wd", "0.1,1", "--seeds", "2", *TINY, "--epochs", "3", "--workers", "2",
                     "--threads", "1", "--store", store)
    assert r.returncode == 0, r.stderr
    assert "4 runs" in r.stderr and "4 finished now" in r.stderr
    assert "\r" not in r.stderr and "█" not in r.stderr   # a pipe gets plain status lines, never a redrawn bar
    with Store(store) as st:
        runs = st.runs()
        assert [r["status"] for r in runs] == ["done"] * 4
        for run in runs:
            assert run["result"]["regime"] in REGIMES
            assert run["result"]["n_params"] > 0
            trace = st.trace(run["run_id"])
            assert [row["epoch"] for row in trace] == [1, 2, 3] and "s_bar" in trace[0]
        assert len({r["worker"] for r in runs}) >= 1
    r = fastdiag_cli("analyze", store, "--json", "--n-boot", "50")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    (group,) = report["groups"]
    assert group["n_runs"] == 4 and "error" in group["lambda_c"]          # 2 λ: no fit, and says why
    assert sum(row["n"] for row in group["regimes"]) == 4
    out = tmp_path / "figs"
    r = fastdiag_cli("plot", store, "--out", out, "--n-boot", "50")
    assert r.returncode == 0, r.stderr
    files = sorted(p.name for p in out.iterdir())
    for stem in ("regime_diagram", "p_grok", "t_grok", "trajectories"):
        for ext in ("png", "svg"):
            assert f"{stem}.{ext}" in files
            assert (out / f"{stem}.{ext}").stat().st_size > 1000


def test_mamba_sweep_on_cpu(tmp_path):
    store = tmp_path / "m.sqlite"
    main(["sweep", "--wd", "0.1,1", "--seeds", "1", "--arch", "mamba", "--layers", "1", "--d-model", "16",
          "--p", "11", "--epochs", "2", "--workers", "1", "--threads", "1", "--store", str(store), "--quiet"])
    with Store(store) as st:
        runs = st.runs()
        assert [r["status"] for r in runs] == ["done", "done"]
        assert all(r["config"]["arch"] == "mamba" and r["result"]["has_attention"] is False for r in runs)



def _sweep_then_kill_9_after_first_finished_run(args, store, timeout):
    proc = subprocess.Popen([sys.executable, "-m", "fastdiag.cli", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + timeout
        while time.time() < deadline and not finished(store):
            time.sleep(0.05)
        assert finished(store), "no run finished in time"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()

@pytest.mark.slow
def test_kill_9_then_rerun_redoes_only_unfinished(tmp_path):
    store = tmp_path / "k.sqlite"
    # four runs one after another, killed within 50 ms of the first one's end (a run takes ~1 s at least)
    args = ["sweep", "--wd", "0.1,1", "--seeds", "2", *TINY, "--epochs", "150", "--no-stop-at-grok",
            "--workers", "1", "--threads", "1", "--ensemble", "1", "--store", str(store)]
    _sweep_then_kill_9_after_first_finished_run(args, store, timeout=180)
    before = finished(store)
    assert 1 <= len(before) < 4, "the sweep should have been killed mid-way"
    main(args + ["--quiet"])
    after = finished(store)
    assert len(after) == 4
    assert {k: after[k] for k in before} == before            # finished runs were not redone
    with Store(store) as st:
        assert st.counts() == {"pending": 0, "running": 0, "done": 4, "failed": 0}
        n_trace = st.conn.execute("SELECT COUNT(*), COUNT(DISTINCT run_id) FROM trace").fetchone()
        assert n_trace == (4 * 150, 4)                         # one trace per run, none duplicated


def test_two_shards_merge_to_the_full_grid(tmp_path):
    grid = ["--wd", "0.1,1,3", "--seeds", "2", *TINY, "--epochs", "2", "--workers", "1", "--threads", "1", "--quiet"]
    for i in (0, 1):
        main(["sweep", *grid, "--shard", f"{i}/2", "--store", str(tmp_path / f"shard{i}.sqlite")])
    main(["sweep", *grid, "--store", str(tmp_path / "full.sqlite")])
    shard_ids = [set(finished(tmp_path / f"shard{i}.sqlite")) for i in (0, 1)]
    assert shard_ids[0] and shard_ids[1] and not shard_ids[0] & shard_ids[1]
    out = tmp_path / "merged.sqlite"
    for _ in range(2):                                         # idempotent
        main(["merge", str(out), str(tmp_path / "shard0.sqlite"), str(tmp_path / "shard1.sqlite")])
    assert set(finished(out)) == set(finished(tmp_path / "full.sqlite")) and len(finished(out)) == 6
    with Store(out) as st:
        assert st.conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 6
        assert st.conn.execute("SELECT COUNT(*) FROM trace").fetchone()[0] == 6 * 2


@pytest.mark.parametrize("args,match", [
    (["--wd", ""], "--wd: empty"),
    (["--wd", "-0.1,1"], "--wd: weight decay must be a finite number >= 0"),
    (["--wd", "1e-3:2:0"], "--wd: range count must be >= 1"),
    (["--wd", "1e-3::13"], "--wd: bad range"),
    (["--wd", "1", "--seeds", "0"], "--seeds: the count must be >= 1"),
    (["--wd", "1", "--arch", "gpt"], "--arch: unknown architecture 'gpt'"),
    (["--wd", "1", "--shard", "2/2"], "--shard"),
])
def test_impossible_grid_is_one_line_exit_2(tmp_path, args, match):
    r = fastdiag_cli("sweep", *args, "--store", tmp_path / "s.sqlite")
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and match in r.stderr, r.stderr
    assert not (tmp_path / "s.sqlite").exists()                # nothing created for a bad grid


def test_sweep_packs_runs_into_ensembles(tmp_path):
    """`--ensemble 4`: vectorisable runs train together, the rest one by one; same store form."""
    import json
    import sqlite3
    import subprocess
    import sys

    store = tmp_path / "ens.sqlite"
    common = ["--p", "11", "--epochs", "4", "--store", str(store), "--workers", "1", "--threads", "1"]
    sizes = {"transformer": ["--preset", "custom", "--layers", "1", "--heads", "2", "--d-model", "32", "--d-ff", "64"],
             "lstm": ["--layers", "1", "--d-model", "32"]}
    for arch, size in sizes.items():
        args = [sys.executable, "-m", "fastdiag.cli", "sweep", "--wd", "0.3,1", "--seeds", "2", "--arch", arch,
                "--ensemble", "4", *size, *common]
        proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        said = {"transformer": "ensembles: 4 runs as 1 vectorised ensemble(s) of 4 members",
                "lstm": "ensembles: 4 lstm run(s) one by one (lstm cannot be vectorised; only transformer, mlp, mamba can)"}
        assert said[arch] in proc.stderr
    con = sqlite3.connect(store)
    rows = con.execute("SELECT status, result FROM runs").fetchall()
    assert len(rows) == 8 and all(status == "done" for status, _ in rows)
    results = [json.loads(r) for _, r in rows]
    packed = [r for r in results if r.get("ensemble_size") == 4]
    assert len(packed) == 4 and all(r["config"]["arch"] == "transformer" for r in packed)
    assert all(r["config"]["arch"] == "lstm" for r in results if "ensemble_size" not in r)
    traces = con.execute("SELECT run_id, COUNT(*) FROM trace GROUP BY run_id").fetchall()
    assert len(traces) == 8 and all(n == 4 for _, n in traces)


@pytest.mark.slow
def test_kill_9_mid_ensemble_keeps_members_that_finished_early(tmp_path):
    """Packed runs are stored the moment their member is done, not when the whole ensemble ends. (A pack
    of two, 120 epochs: at lr 6e-3 the λ = 1 member groks, and stops, at 70 (measured; 100 at 3e-3) while
    the λ = 0 one has memorised by 30 and sits at test accuracy ≤ 0.66 to 120; the rerun resumes the
    λ = 0 member from the pack's checkpoint.)"""
    store = tmp_path / "ke.sqlite"
    groks = ["--preset", "custom", "--layers", "2", "--heads", "4", "--d-model", "64", "--d-ff", "256",
             "--p", "31", "--train-frac", "0.7", "--lr", "6e-3", "--batch", "128", "--eval-every", "10"]
    args = ["sweep", "--wd", "0,1", "--seeds", "1", *groks, "--epochs", "120", "--ensemble", "2",
            "--workers", "1", "--threads", "1", "--checkpoint-every", "20", "--store", str(store)]
    _sweep_then_kill_9_after_first_finished_run(args, store, timeout=240)
    before = finished(store)
    assert len(before) == 1, "the λ = 1 member groks early; the λ = 0 one trains on to epoch 120"
    with Store(store) as st:
        assert all(r["config"]["weight_decay"] == 1.0 for r in st.runs("done"))
    main(args + ["--quiet"])
    after = finished(store)
    assert len(after) == 2 and {k: after[k] for k in before} == before


@pytest.mark.parametrize("ensemble", ["1", "auto"])
def test_long_runs_report_their_epochs_from_worker_processes(tmp_path, ensemble):
    """Pool workers (one by one) and packed ensembles both send their epochs to the progress bar."""
    store = tmp_path / f"ep{ensemble}.sqlite"
    code, terminal = fastdiag_cli_on_terminal(
        "sweep", "--wd", "0.3,1", "--seeds", "1", *TINY, "--epochs", "300", "--no-stop-at-grok", "--eval-every",
        "10", "--workers", "2", "--threads", "1", "--ensemble", ensemble, "--store", store)
    assert code == 0, terminal
    assert "running: epoch " in terminal and "/300" in terminal and "run/s" in terminal
    assert len(finished(store)) == 2
