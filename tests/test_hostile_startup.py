"""Ctrl-C in the first seconds of an ensemble sweep, while its worker processes are being spawned and
are still importing torch: the driver stops at once with one line and exit status 130, and no worker
outlives it (an interrupt in the middle of spawning one used to leave a child that printed an EOFError
traceback; idle workers still starting up were waited for). Real processes, real signals."""
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

SMALL = ["--preset", "custom", "--layers", "2", "--heads", "4", "--d-model", "64", "--d-ff", "256", "--p", "31",
         "--train-frac", "0.7", "--lr", "3e-3", "--batch", "128", "--eval-every", "10"]


def live_in_session(sid: int) -> list[str]:
    """Processes of the session still running (zombies waiting to be reaped by init do not count)."""
    ps = subprocess.run(["ps", "-o", "pid=,stat=,args=", "-s", str(sid)], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if line.split()[1:2] and not line.split()[1].startswith("Z")]


@pytest.mark.parametrize("after_spawn_s", [0.0, 0.0, 0.4, 1.5])
def test_sigint_while_an_ensemble_sweep_starts_its_workers(tmp_path, after_spawn_s):
    store = tmp_path / "s.sqlite"
    proc = subprocess.Popen([sys.executable, "-m", "fastdiag.cli", "sweep", "--wd", "0,1", "--seeds", "2", *SMALL,
                             "--epochs", "3000", "--ensemble", "4", "--store", str(store), "--quiet"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 240
        while subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True).returncode != 0:
            assert proc.poll() is None and time.time() < deadline, "no worker process was started"
            time.sleep(0.005)
        time.sleep(after_spawn_s)
        sent = time.monotonic()
        os.kill(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert err.strip() == "fastdiag: error: interrupted", err
    assert took < 20, f"{took:.1f} s to stop"
    deadline = time.time() + 10
    while live_in_session(proc.pid) and time.time() < deadline:
        time.sleep(0.1)
    assert not live_in_session(proc.pid), live_in_session(proc.pid)
    conn = sqlite3.connect(f"file:{store}?mode=ro", uri=True)
    try:
        assert conn.execute("SELECT COUNT(*) FROM claims").fetchone() == (0,)
    finally:
        conn.close()


def live_children() -> list[str]:
    """This process's children still running: neither zombies, nor multiprocessing's resource
    tracker (it lives as long as this process), nor the ps that lists them."""
    out = subprocess.run(["ps", "-ww", "-o", "pid=,stat=,args=", "--ppid", str(os.getpid())], capture_output=True,
                         text=True).stdout
    rows = [line.split(None, 2) for line in out.splitlines()]
    return [" ".join(row) for row in rows if not row[1].startswith("Z") and "resource_tracker" not in row[2]
            and row[2].split()[0] != "ps"]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("at_worker", [0, 2])
def test_a_signal_while_the_worker_pool_spawns_leaves_no_worker_behind(monkeypatch, at_worker, signum):
    """The signal arrives the instant worker ``at_worker``'s process has been spawned, before it was
    sent its start-up data (the worst moment of Ctrl-C in a sweep's first seconds): the interrupt
    propagates, that child and the workers started before it are stopped at once, not left to import
    torch for seconds (and, for the half-started one, to print an EOFError traceback)."""
    import multiprocessing.util

    from fastdiag.sweep.backends import _WorkerPool

    class Stop(BaseException):
        pass

    def stop(signum, frame):
        raise Stop
    monkeypatch.setattr(signal, "signal", signal.signal)       # undone below: handlers as they were
    previous = signal.signal(signum, stop)
    spawn, spawned = multiprocessing.util.spawnv_passfds, []

    def spawn_then_signal(path, args, passfds):
        pid = spawn(path, args, passfds)
        if "resource_tracker" in " ".join(map(str, args)):     # multiprocessing's own helper
            return pid
        spawned.append(pid)
        if len(spawned) == at_worker + 1:
            os.kill(os.getpid(), signum)                        # handled at the next bytecode
        return pid
    monkeypatch.setattr(multiprocessing.util, "spawnv_passfds", spawn_then_signal)
    try:
        with pytest.raises(Stop):
            pool = _WorkerPool(4, 1, cuda=False)
            pool.close()
    finally:
        signal.signal(signum, previous)
    assert len(spawned) == at_worker + 1
    time.sleep(1.0)                                 # far less than a worker's start-up (torch import)
    assert live_children() == []
