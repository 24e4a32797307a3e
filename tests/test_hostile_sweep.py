"""Sweeps under faults: signals to the driver only, dead pool workers, attempts, and
concurrent sweeps sharing one store. Real processes, real signals, real SQLite; the trainers are
small fakes in a module the spawned workers import, so each test takes seconds."""
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest

from fastdiag.grokking.config import RunConfig
from fastdiag.store import LEASE_S, Lease, Store

TINY = ["--preset", "custom", "--layers", "1", "--heads", "2", "--d-model", "32", "--d-ff", "64", "--p", "11"]

_FAKES = textwrap.dedent('''
    import os
    import signal
    import sys
    import time
    from types import SimpleNamespace

    from fastdiag import sweep as sw
    from fastdiag.store import Store

    GRID = dict(arch="transformer", preset="custom", n_layers=1, n_heads=2, d_model=32, d_ff=64, p=11, epochs=2)

    # FD_STOP_ON_IMPORT=<marker>: the first pool worker to import this module (as its main module, while
    # it starts up, its first task already claimed and on its way) stops itself before it says a word.
    if os.environ.get("FD_STOP_ON_IMPORT") and __name__ == "__mp_main__":
        try:
            os.close(os.open(os.environ["FD_STOP_ON_IMPORT"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            os.kill(os.getpid(), signal.SIGSTOP)
        except FileExistsError:
            pass


    def overlapped(marks, me, start):
        """Whether another run started and had not ended when this one started or since."""
        for name in os.listdir(marks):
            other, kind = name.rsplit(".", 1)
            if kind != "start" or other == me:
                continue
            try:
                with open(os.path.join(marks, other + ".end")) as fh:
                    if float(fh.read()) > start:
                        return True
            except FileNotFoundError:          # still training now
                return True
        return False


    def meet_a_partner(cfg, start):
        """Train until another run trains at the same time (or every run of FD_PAIRS_TOTAL has
        started, so none can come), deadline FD_PAIRS_DEADLINE: two at a time shows as overlapping
        spans however slowly workers start on a loaded machine, with no sleep to outlast."""
        marks, me = os.environ["FD_PAIRS"], cfg.run_id()
        with open(os.path.join(marks, me + ".start"), "w") as fh:
            fh.write(repr(start))
        total, deadline = int(os.environ["FD_PAIRS_TOTAL"]), float(os.environ["FD_PAIRS_DEADLINE"])
        while time.time() < deadline:
            if overlapped(marks, me, start):
                break
            if sum(name.endswith(".start") for name in os.listdir(marks)) >= total:
                break
            time.sleep(0.02)


    def slow(cfg):
        """Logs "run_id pid start end" and sleeps (or meets a partner, FD_PAIRS); seed 1 at λ = 1
        kills its worker process when FD_DIE is set."""
        start = time.time()
        if os.environ.get("FD_DIE") and cfg.seed == 1 and cfg.weight_decay == 1.0:
            time.sleep(0.3)
            os._exit(9)
        if os.environ.get("FD_STOP") and cfg.seed == 1 and cfg.weight_decay == 1.0:
            os.kill(os.getpid(), signal.SIGSTOP)          # `kill -STOP <worker>`: stalled, not dead
        if os.environ.get("FD_PAIRS"):
            meet_a_partner(cfg, start)
        else:
            time.sleep(float(os.environ.get("FD_SLEEP", "1")))
        end = time.time()
        if os.environ.get("FD_PAIRS"):
            with open(os.path.join(os.environ["FD_PAIRS"], cfg.run_id() + ".end"), "w") as fh:
                fh.write(repr(end))
        with open(os.environ["FD_LOG"], "a") as fh:
            fh.write(f"{cfg.run_id()} {os.getpid()} {start} {end}\\n")
        return SimpleNamespace(config=cfg, result={"regime": "grok", "t_grok_epoch": 1.0, "n_params": 1},
                               trace=[{"epoch": 1, "step": 1, "test_acc": 1.0}])


    if __name__ == "__main__":
        store, workers, n_seeds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
        if os.environ.get("FD_STALL_S"):
            from fastdiag.sweep import backends
            backends.STALL_S = float(os.environ["FD_STALL_S"])
        grid = sw.build_grid(GRID, [0.1, 1.0], range(n_seeds))
        with Store(store) as st:
            s = sw.run_sweep(grid, st, workers=workers, threads=1, train_fn=slow, progress=False, ensemble=1,
                             max_retries=int(os.environ.get("FD_MAX_RETRIES", "2")))
        print(f"done {s.done} elsewhere {getattr(s, 'elsewhere', None)}", flush=True)
''')


@pytest.fixture
def fakes(tmp_path, monkeypatch):
    (tmp_path / "fd_hostile_fakes.py").write_text(_FAKES)
    monkeypatch.syspath_prepend(str(tmp_path))          # the spawned workers get this sys.path too
    monkeypatch.setenv("FD_LOG", str(tmp_path / "log.txt"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    import importlib

    import fd_hostile_fakes
    return importlib.reload(fd_hostile_fakes)


def log_rows(tmp_path):
    path = tmp_path / "log.txt"
    if not path.exists():
        return []
    return [(rid, int(pid), float(a), float(b)) for rid, pid, a, b in
            (line.split() for line in path.read_text().splitlines())]


def rows(store, sql):
    if not os.path.exists(store):
        return []
    conn = sqlite3.connect(f"file:{store}?mode=ro", uri=True, timeout=30)
    try:
        return conn.execute(sql).fetchall()
    except sqlite3.OperationalError:            # not created yet
        return []
    finally:
        conn.close()


def wait_for(condition, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_dead_worker_blames_only_its_run_and_keeps_parallelism(tmp_path, fakes, monkeypatch):
    from fastdiag import sweep as sw

    monkeypatch.setenv("FD_DIE", "1")
    (tmp_path / "pairs").mkdir()                             # each run waits for a partner, not a fixed time
    monkeypatch.setenv("FD_PAIRS", str(tmp_path / "pairs"))
    monkeypatch.setenv("FD_PAIRS_TOTAL", "5")
    monkeypatch.setenv("FD_PAIRS_DEADLINE", repr(time.time() + 60))
    grid = sw.build_grid(fakes.GRID, [0.1, 1.0], range(3))
    culprit = next(c.run_id() for c in grid if c.seed == 1 and c.weight_decay == 1.0)
    with Store(tmp_path / "s.sqlite") as st:
        summary = sw.run_sweep(grid, st, workers=2, threads=1, train_fn=fakes.slow, progress=False,
                               max_retries=0, ensemble=1)
        failed = st.runs("failed")
        assert [r["run_id"] for r in failed] == [culprit], [r["error"] for r in failed]
        assert "worker process died" in failed[0]["error"]
        done = st.runs("done")
        assert len(done) == 5 and summary.done == 5
        assert all(r["attempts"] == 1 for r in done)         # no innocent run was charged or rerun
    spans = sorted((a, b) for _, _, a, b in log_rows(tmp_path))
    assert len(spans) == 5                                   # each innocent run trained exactly once
    # Still two at a time, not one by one: every run met a partner, except perhaps the last to start
    # (no run was left to come). One by one, none would have and each would have waited out the deadline.
    alone = [(a, b) for i, (a, b) in enumerate(spans)
             if not any(a2 < b and a < b2 for j, (a2, b2) in enumerate(spans) if j != i)]
    assert alone in ([], spans[-1:]), (alone, spans)


_DRIVER_ENV = {"FD_SLEEP": "1.5"}


def _driver(tmp_path, store, workers, n_seeds, **popen):
    env = {**os.environ, **_DRIVER_ENV, "PYTHONPATH": os.environ["PYTHONPATH"]}  # the fakes, then this tree
    return subprocess.Popen([sys.executable, str(tmp_path / "fd_hostile_fakes.py"), str(store), str(workers),
                             str(n_seeds)], env=env, **popen)


def _stalling_sweep(tmp_path, store, **env):
    """The fakes' sweep (2 workers, 4 runs of 0.2 s, STALL_S 4) with ``env``: (exit status, stderr)."""
    env = {**os.environ, "FD_SLEEP": "0.2", "FD_STALL_S": "4", **env,
           "PYTHONPATH": os.environ["PYTHONPATH"]}       # the fakes, then this tree
    proc = subprocess.Popen([sys.executable, str(tmp_path / "fd_hostile_fakes.py"), str(store), "2", "2"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=240)            # a deadline for the old hang, not a measurement
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)           # the stopped worker too
    return proc.returncode, err


def test_a_stopped_worker_is_detected_and_its_run_failed(tmp_path, fakes):
    """`kill -STOP` on a worker: before, the sweep waited for ever (> 300 s) and kept renewing the
    run's claim. Now the stopped worker is killed after STALL_S without progress and its run
    (max_retries 0) failed, the others done, the claims released."""
    store = tmp_path / "stop.sqlite"
    code, err = _stalling_sweep(tmp_path, store, FD_STOP="1", FD_MAX_RETRIES="0")
    assert code == 0, err
    failed = rows(store, "SELECT run_id, error, attempts FROM runs WHERE status = 'failed'")
    assert len(failed) == 1 and "stalled" in failed[0][1] and failed[0][2] == 1, failed
    assert rows(store, "SELECT COUNT(*) FROM runs WHERE status = 'done'") == [(3,)]
    assert rows(store, "SELECT COUNT(*) FROM claims") == [(0,)]


def test_a_worker_stopped_before_it_says_a_word_is_killed_and_its_run_retried(tmp_path, fakes):
    """A worker stopped right after its run was marked running, before any message or heartbeat: it
    was never judged and the sweep hung (221 s, issue 40). Now it is judged from the moment the task is
    handed over, by its CPU time: killed after STALL_S, its run retried on a fresh worker and done."""
    store = tmp_path / "quiet.sqlite"
    code, err = _stalling_sweep(tmp_path, store, FD_STOP_ON_IMPORT=str(tmp_path / "stopped"), FD_MAX_RETRIES="1")
    assert code == 0 and (tmp_path / "stopped").exists(), err
    assert rows(store, "SELECT status, COUNT(*) FROM runs GROUP BY status") == [("done", 4)]
    assert sorted(n for (n,) in rows(store, "SELECT attempts FROM runs")) == [1, 1, 1, 2]
    assert rows(store, "SELECT COUNT(*) FROM claims") == [(0,)]


def test_attempts_count_only_runs_that_started(tmp_path, fakes):
    store = tmp_path / "a.sqlite"
    proc = _driver(tmp_path, store, 2, 5, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: rows(store, "SELECT 1 FROM runs WHERE status = 'done'"), 120, "a finished run")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    attempts = dict(rows(store, "SELECT run_id, attempts FROM runs"))
    started = {rid for rid, *_ in log_rows(tmp_path)} | set(
        rid for (rid,) in rows(store, "SELECT run_id FROM runs WHERE started_at IS NOT NULL"))
    assert len(attempts) == 10 and sum(attempts.values()) <= 4, attempts   # 2 workers: at most 2 runs started twice
    assert sum(1 for n in attempts.values() if n == 0) >= 6
    assert all(attempts[rid] == 1 for rid in started), (attempts, started)


def test_concurrent_sweeps_share_the_grid(tmp_path, fakes):
    store = tmp_path / "c.sqlite"
    Store(store).close()
    procs = [_driver(tmp_path, store, 1, 4, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    trained = [(rid, pid) for rid, pid, *_ in log_rows(tmp_path)]
    assert len(trained) == 8 and len({rid for rid, _ in trained}) == 8       # every run once, none twice
    assert len({pid for _, pid in trained}) == 2                              # and both sweeps worked
    assert rows(store, "SELECT status, COUNT(*) FROM runs GROUP BY status") == [("done", 8)]
    assert rows(store, "SELECT COUNT(*) FROM claims") == [(0,)]


def test_claims_of_dead_or_silent_sweeps_are_taken_over(tmp_path):
    cfgs = [RunConfig(weight_decay=w, seed=0, epochs=2, p=11) for w in (0.1, 1.0, 3.0, 10.0)]
    ids = [c.run_id() for c in cfgs]
    with Store(tmp_path / "s.sqlite") as st:
        st.add_runs(cfgs)
        with Lease(st) as first, Lease(st) as second:
            assert first.claim(ids[:1]) == ids[:1]
            assert second.claim(ids) == ids[1:]                # a live claim is respected
            assert second.held_elsewhere(ids) == {ids[0]: first.owner}
        gone = subprocess.Popen(["true"])
        gone.wait()
        with st.transaction() as conn:                          # a sweep on this host that was killed -9
            conn.execute("INSERT OR REPLACE INTO claims VALUES (?, 'x:1:dead', ?, ?, ?)",
                         (ids[0], os.uname().nodename, gone.pid, time.time() + 3600))
            conn.execute("INSERT OR REPLACE INTO claims VALUES (?, 'far:1:quiet', 'far-away-host', 1, ?)",
                         (ids[1], time.time() - 1))             # another host's sweep that stopped renewing
            conn.execute("INSERT OR REPLACE INTO claims VALUES (?, 'far:2:live', 'far-away-host', 2, ?)",
                         (ids[2], time.time() + LEASE_S / 2))
            conn.execute("INSERT OR REPLACE INTO claims VALUES (?, 'far:3:forever', 'far-away-host', 3, ?)",
                         (ids[3], time.time() + 10 * 365 * 86400))   # no renewal writes this: not honoured
        with Lease(st) as third:
            assert third.claim(ids) == [ids[0], ids[1], ids[3]]
        assert st.get(ids[0])["attempts"] == 2                 # claimed twice: two starts


def test_sigint_to_the_driver_only_ends_an_ensemble_sweep(tmp_path):
    """`kill -INT <driver>` (Jupyter, timeout -s INT): the workers see nothing; the driver stores what
    finished, stops the workers and exits 130 promptly. (At lr 6e-3 the seed-0 λ = 1 member groks, and
    stops, at epoch 70, measured; the λ = 0 members run on towards 3000.)"""
    store = tmp_path / "e.sqlite"
    groks = ["--preset", "custom", "--layers", "2", "--heads", "4", "--d-model", "64", "--d-ff", "256",
             "--p", "31", "--train-frac", "0.7", "--lr", "6e-3", "--batch", "128", "--eval-every", "10"]
    proc = subprocess.Popen([sys.executable, "-m", "fastdiag.cli", "sweep", "--wd", "0,1", "--seeds", "2", *groks,
                             "--epochs", "3000", "--ensemble", "2", "--workers", "2", "--threads", "1",
                             "--store", str(store), "--quiet"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)       # no terminal: only the driver gets it
    try:
        wait_for(lambda: rows(store, "SELECT 1 FROM runs WHERE status = 'done'"), 240, "a finished member")
        before = rows(store, "SELECT run_id FROM runs WHERE status = 'done'")
        os.kill(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "fastdiag: error: interrupted"
    after = rows(store, "SELECT run_id FROM runs WHERE status = 'done'")
    assert set(before) <= set(after) and len(after) < 4
    assert rows(store, "SELECT COUNT(*) FROM claims") == [(0,)]
    def session_gone():
        return subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True).returncode == 1
    try:
        wait_for(session_gone, 10, "the worker processes to end")
    except AssertionError:
        ps = subprocess.run(["ps", "-o", "pid,stat,args", "-g", str(proc.pid)], capture_output=True, text=True)
        raise AssertionError(f"worker processes outlived the sweep:\n{ps.stdout}") from None


def test_sigterm_ends_a_pool_sweep_keeping_what_finished(tmp_path):
    """SIGTERM (a scheduler's kill, `timeout`) to a one-by-one pool sweep: like SIGINT, exit 143."""
    sig, code = signal.SIGTERM, 143
    store = tmp_path / "p.sqlite"
    proc = subprocess.Popen([sys.executable, "-m", "fastdiag.cli", "sweep", "--wd", "0.1,0.3,1,3", "--seeds", "2",
                             *TINY, "--epochs", "150", "--no-stop-at-grok", "--ensemble", "1", "--workers", "2",
                             "--threads", "1", "--store", str(store), "--quiet"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for(lambda: rows(store, "SELECT 1 FROM runs WHERE status = 'done'"), 240, "a finished run")
        os.kill(proc.pid, sig)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == code, err
    done = rows(store, "SELECT COUNT(*) FROM runs WHERE status = 'done'")[0][0]
    assert 1 <= done < 8
    assert rows(store, "SELECT COUNT(*) FROM trace")[0][0] == done * 150
    assert rows(store, "SELECT COUNT(*) FROM claims") == [(0,)]
