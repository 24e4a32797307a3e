"""Checkpoint and resume inside a run: a run killed with SIGKILL at a random moment after its first
checkpoint, rerun, ends with the trace of an uninterrupted run, bit for bit (CPU, one thread). Real
processes, real signals, real files."""
import csv
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
import warnings

import pytest

from fastdiag.grokking.checkpoint import Checkpointer, checkpoint_path
from fastdiag.grokking.config import RunConfig, parse_cadence
from fastdiag.grokking.train import Trainer, train_run

TINY_RUN = ["--preset", "custom", "--layers", "1", "--heads", "2", "--d-model", "32", "--d-ff", "64", "--p", "23",
            "--batch", "64", "--lr", "3e-3", "--eval-every", "2", "--no-stop-at-grok", "--device", "cpu",
            "--threads", "1", "--quiet"]
TINY_CFG = RunConfig(arch="transformer", preset="custom", n_layers=1, n_heads=2, d_model=32, d_ff=64, p=23,
                     batch_size=64, lr=3e-3, eval_every=2, stop_at_grok=False, device="cpu")


def fastdiag(*args, **popen):
    return subprocess.Popen([sys.executable, "-m", "fastdiag.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, **popen)


def finish(proc, timeout=600):
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return out, err


def kill_once_saved(proc, saved, delay: float) -> None:
    """SIGKILL ``proc``'s process group ``delay`` seconds after ``saved()`` (a new checkpoint is on
    disk) first holds; it must within 300 s."""
    try:
        deadline = time.time() + 300
        while not saved() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        assert saved(), f"no new checkpoint was written: {proc.poll()=}"
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def trace_rows(out_dir):
    with open(out_dir / "trace.csv", newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.mark.slow
def test_a_killed_fastdiag_run_resumes_bit_identically(tmp_path):
    """`fastdiag run` killed with SIGKILL twice, each time at a random moment after a new checkpoint
    (mid-epoch, mid-evaluation, mid-save): the rerun resumes from the last checkpoint (not from epoch
    0) and writes exactly the uninterrupted run's trace and results; the checkpoint is gone once the
    outputs are written."""
    # 160 epochs, a checkpoint every 10 and kills within 0.3 s of one: the second kill comes by epoch ~140
    # even at 5 ms an epoch (a fast machine; ~30 here at 20-40 ms), and the three trainings cost ~340
    # epochs, not 1,200
    epochs, every = "160", 10
    whole = fastdiag("run", *TINY_RUN, "--epochs", epochs, "--checkpoint-every", "off", "--out", str(tmp_path / "whole"))
    out, err = finish(whole)
    assert whole.returncode == 0, err

    cut = tmp_path / "cut"
    ckpt = checkpoint_path(cut, "run")
    seed = random.randrange(10**6)
    moments = random.Random(seed)
    for kill in range(2):
        before = ckpt.stat().st_mtime_ns if ckpt.exists() else None
        killed = fastdiag("run", *TINY_RUN, "--epochs", epochs, "--checkpoint-every", str(every), "--out", str(cut))
        kill_once_saved(killed, lambda: ckpt.exists() and ckpt.stat().st_mtime_ns != before, moments.uniform(0, 0.3))
        assert killed.returncode == -signal.SIGKILL, f"run {kill} ended before the kill (seed {seed}): make it longer"
        assert not (cut / "result.json").exists() and ckpt.exists()

    rerun = fastdiag("run", *TINY_RUN, "--epochs", epochs, "--checkpoint-every", str(every), "--out", str(cut))
    out, err = finish(rerun)
    assert rerun.returncode == 0, err
    resumed = int(out.split("resumed from the checkpoint at epoch ")[1].split(")")[0])
    assert 2 * every <= resumed < int(epochs), out          # the second run went on from the first's
    assert (cut / "trace.csv").read_bytes() == (tmp_path / "whole" / "trace.csv").read_bytes(), f"seed {seed}"
    assert len(trace_rows(cut)) == int(epochs) // 2
    a, b = (json.loads((d / "result.json").read_text()) for d in (tmp_path / "whole", cut))
    for r in (a, b):
        r.pop("wall_seconds")
    assert a == b
    assert sorted(p.name for p in cut.iterdir()) == ["result.json", "trace.csv", "trajectory.png"]


@pytest.mark.usefixtures("one_thread")
def test_resume_in_process_matches_an_uninterrupted_run(tmp_path):
    """train_run stopped by an exception right after a checkpoint, then resumed, equals the
    uninterrupted run in every trace value and every parameter bit."""
    cfg = RunConfig(**{**TINY_CFG.__dict__, "epochs": 30, "eval_every": 3})
    whole = Trainer(cfg)
    while not whole.done:
        whole.run_epoch()

    class Killed(Exception):
        pass

    def stop_at_20(row):
        if row["epoch"] >= 20:
            raise Killed

    path = tmp_path / "x.ckpt.pt"
    with pytest.raises(Killed):
        train_run(cfg, stop_at_20, Checkpointer(path, cfg.run_id(), every_epochs=4))
    again = Checkpointer(path, cfg.run_id(), every_epochs=4)
    outcome = train_run(cfg, None, again)
    assert again.resumed_epoch == 18
    assert outcome.trace == whole.outcome().trace
    assert outcome.result["steps"] == whole.step


def test_a_foreign_or_damaged_checkpoint_is_ignored_with_a_warning(tmp_path, one_thread):
    cfg = RunConfig(**{**TINY_CFG.__dict__, "epochs": 4})
    path = tmp_path / "x.ckpt.pt"
    other = RunConfig(**{**TINY_CFG.__dict__, "epochs": 4, "seed": 7})
    train_run(other, None, Checkpointer(path, other.run_id(), every_epochs=1))
    assert path.exists()
    with pytest.warns(RuntimeWarning, match="another run"):
        outcome = train_run(cfg, None, c := Checkpointer(path, cfg.run_id(), every_epochs=100))
    assert c.resumed_epoch is None and len(outcome.trace) == 2
    path.write_bytes(b"not a checkpoint")
    with pytest.warns(RuntimeWarning, match="unreadable"):
        train_run(cfg, None, Checkpointer(path, cfg.run_id(), every_epochs=100))


def test_a_checkpoint_that_cannot_be_written_warns_once_and_the_run_goes_on(tmp_path, one_thread):
    cfg = RunConfig(**{**TINY_CFG.__dict__, "epochs": 6})
    blocker = tmp_path / "file"
    blocker.write_text("")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outcome = train_run(cfg, None, Checkpointer(blocker / "x.ckpt.pt", cfg.run_id(), every_epochs=1))
    assert len(outcome.trace) == 3
    assert sum("cannot be written" in str(w.message) for w in caught) == 1


def test_cadence_spellings():
    assert parse_cadence("500") == (None, 500)
    assert parse_cadence("5m") == (300.0, None) and parse_cadence("90s") == (90.0, None)
    assert parse_cadence("off") is None
    for bad in ("0", "-1", "m", "5h", "nanm", "infs"):
        with pytest.raises(ValueError, match="checkpoint_every"):
            parse_cadence(bad)


def test_fastdiag_run_refuses_a_bad_cadence_in_one_line(tmp_path):
    proc = fastdiag("run", *TINY_RUN, "--epochs", "2", "--checkpoint-every", "soon", "--out", str(tmp_path / "o"))
    out, err = finish(proc, 120)
    assert proc.returncode == 2
    assert err.strip().splitlines() == [err.strip()] and "--checkpoint-every" in err


def store_traces(store):
    conn = sqlite3.connect(f"file:{store}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT run_id, idx, row FROM trace ORDER BY run_id, idx").fetchall()
    finally:
        conn.close()


# 140 epochs, a checkpoint every 10, a kill within 0.5 s of the first: by epoch ~110 at 5 ms an epoch
SWEEP_EPOCHS = 140
SWEEP_GRID = ["--wd", "0.3,1", "--seeds", "1", *TINY_RUN[:-5], "--device", "cpu", "--epochs", str(SWEEP_EPOCHS),
              "--threads", "1", "--quiet"]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["--ensemble 2 --workers 1", "--ensemble 1 --workers 2"])
def test_a_killed_sweep_resumes_bit_identically(tmp_path, how):
    """`fastdiag sweep` killed with SIGKILL after its first checkpoint — a pack of two trained in the
    driver, or two runs one by one in two worker processes: the rerun resumes from the checkpoints
    (a pack's runs packed together again) and stores exactly the traces of an uninterrupted sweep; the
    checkpoint folder is gone at the end."""
    grid = [*SWEEP_GRID, *how.split()]
    # the uninterrupted reference in the driver alone (`--workers 1`: one process, not three); at one thread
    # a run's trace does not depend on the process it ran in
    ensemble = how.split()[:2]
    whole = fastdiag("sweep", *SWEEP_GRID, *ensemble, "--workers", "1", "--store", str(tmp_path / "whole.sqlite"),
                     "--checkpoint-every", "off")
    _, err = finish(whole)
    assert whole.returncode == 0, err

    store = tmp_path / "cut.sqlite"
    folder = tmp_path / "cut.sqlite.checkpoints"
    seed = random.randrange(10**6)
    killed = fastdiag("sweep", *grid, "--store", str(store), "--checkpoint-every", "10")
    kill_once_saved(killed, lambda: bool(list(folder.glob("*.ckpt.pt"))), random.Random(seed).uniform(0, 0.5))
    assert killed.returncode == -signal.SIGKILL, f"the sweep ended before the kill (seed {seed})"
    assert len(store_traces(store)) < 2 * SWEEP_EPOCHS // 2            # an evaluation every 2 epochs

    rerun = fastdiag("sweep", *grid, "--store", str(store), "--checkpoint-every", "10")
    _, err = finish(rerun)
    assert rerun.returncode == 0, err
    assert "resumed from checkpoints" in err, err
    if "--ensemble 2" in how:
        assert "2 resumed from checkpoints" in err, err
    assert store_traces(store) == store_traces(tmp_path / "whole.sqlite"), f"seed {seed}"
    assert len(store_traces(store)) == 2 * SWEEP_EPOCHS // 2
    assert not folder.exists()


@pytest.mark.usefixtures("one_thread")
def test_a_pack_resumes_with_only_its_unfinished_members(tmp_path):
    """A pack's checkpoint resumes any subset of the members it saved (those finished since are left
    out), each member exactly as in the uninterrupted pack; a pack with a member it never saved starts
    from epoch 0 with a warning."""
    import dataclasses

    from fastdiag.grokking.checkpoint import pack_key
    from fastdiag.grokking.ensemble_train import train_ensemble
    base = RunConfig(**{**TINY_CFG.__dict__, "epochs": 24, "eval_every": 2})
    cfgs = [dataclasses.replace(base, seed=s, weight_decay=w) for s, w in ((0, 1.0), (1, 0.1), (2, 3.0))]
    whole = train_ensemble(cfgs)
    key = pack_key(c.run_id() for c in cfgs)

    class Killed(Exception):
        pass

    def stop_at_18(index, row):
        if row["epoch"] >= 18:
            raise Killed
    path = tmp_path / "pack.ckpt.pt"
    with pytest.raises(Killed):
        train_ensemble(cfgs, stop_at_18, checkpoint=Checkpointer(path, key, every_epochs=4))
    again = Checkpointer(path, key, every_epochs=100)
    outcomes = train_ensemble(cfgs[1:], checkpoint=again)
    assert again.resumed_epoch == 16
    assert [o.trace for o in outcomes] == [o.trace for o in whole[1:]]
    stranger = dataclasses.replace(base, seed=9)
    with pytest.warns(RuntimeWarning, match="other members"):
        train_ensemble([cfgs[0], stranger], checkpoint=(c := Checkpointer(path, key, every_epochs=100)))
    assert c.resumed_epoch is None


def test_leftovers_of_a_save_killed_midway_are_removed_with_the_checkpoint(tmp_path):
    """kill -9 during a save leaves atomic_path's hidden temporary file: removing the checkpoint (the
    run ended) removes it too, and a sweep's tidy-up removes those of runs that cannot resume."""
    from fastdiag.grokking.checkpoint import remove_checkpoint
    from fastdiag.sweep.checkpoints import SweepCheckpoints
    path = checkpoint_path(tmp_path, "run")
    path.write_bytes(b"x")
    (tmp_path / ".run.ckpt.k1llEd.tmp.pt").write_bytes(b"half")
    (tmp_path / "result.json").write_text("{}")
    remove_checkpoint(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]

    folder = tmp_path / "s.sqlite.checkpoints"
    folder.mkdir()
    for name in (".aaaa.ckpt.x1.tmp.pt", "bbbb.ckpt.pt", ".bbbb.ckpt.x2.tmp.pt", ".pack-cc.ckpt.x3.tmp.pt"):
        (folder / name).write_bytes(b"half")
    SweepCheckpoints(folder, (300.0, None)).tidy(["bbbb"])          # bbbb may still resume
    assert sorted(p.name for p in folder.iterdir()) == [".bbbb.ckpt.x2.tmp.pt", "bbbb.ckpt.pt"]
    SweepCheckpoints(folder, (300.0, None)).tidy([])
    assert not folder.exists()


# ----------------------------------------------------------------------------- checkpoints that do not fit

def _damaged(state, how):
    """A real checkpoint state edited the way an upgrade, a hand or another tool leaves one."""
    import torch
    if how == "empty state":
        return {}
    if how == "no optimizer":
        return {k: v for k, v in state.items() if k != "optimizer"}
    if how == "weight of another shape":
        name = next(iter(state["model"]))
        return {**state, "model": {**state["model"], name: torch.zeros(3, 5)}}
    if how == "moment of another shape":
        opt = state["optimizer"]
        first = next(iter(opt["state"]))
        return {**state, "optimizer": {**opt, "state": {**opt["state"], first: {
            **opt["state"][first], "exp_avg": torch.zeros(7)}}}}
    if how == "wrong shuffle state":
        return {**state, "shuffle": torch.zeros(16, dtype=torch.uint8)}
    if how in ("epoch 1e9", "epoch -5"):
        return {**state, "epoch": int(float(how.split()[1]))}
    if how == "step off":
        return {**state, "step": state["step"] + 1}
    if how == "elapsed NaN":
        return {**state, "elapsed": float("nan")}
    if how == "trace cut":
        return {**state, "tracker": {**state["tracker"], "trace": state["tracker"]["trace"][:-1]}}
    raise AssertionError(how)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("how", ["empty state", "no optimizer", "weight of another shape", "moment of another shape",
                                 "wrong shuffle state", "epoch 1e9", "epoch -5", "step off", "elapsed NaN", "trace cut"])
def test_a_checkpoint_that_does_not_fit_is_moved_aside_and_the_run_starts_over(tmp_path, how):
    import torch

    from fastdiag.grokking.checkpoint import CHECKPOINT_FORMAT
    cfg = RunConfig(**{**TINY_CFG.__dict__, "epochs": 6})
    path = tmp_path / "x.ckpt.pt"

    class Killed(Exception):
        pass

    def stop_at_4(row):
        if row["epoch"] >= 4:
            raise Killed
    with pytest.raises(Killed):
        train_run(cfg, stop_at_4, Checkpointer(path, cfg.run_id(), every_epochs=1))
    payload = torch.load(path, weights_only=True)
    payload["state"] = _damaged(payload["state"], how)
    assert payload["format"] == CHECKPOINT_FORMAT
    torch.save(payload, path)
    with pytest.warns(RuntimeWarning, match=rf"checkpoint {path}: .*moved aside to {path}.unusable; starting from epoch 0"):
        outcome = train_run(cfg, None, c := Checkpointer(path, cfg.run_id(), every_epochs=100))
    assert c.resumed_epoch is None and outcome.result["epochs_run"] == 6
    assert [r["epoch"] for r in outcome.trace] == [2, 4, 6]
    assert outcome.trace == train_run(cfg).trace                  # exactly the run from epoch 0
    assert not path.exists() and (tmp_path / "x.ckpt.pt.unusable").exists()
    with warnings.catch_warnings():
        warnings.simplefilter("error")                             # a rerun has nothing left to trip on
        train_run(cfg, None, Checkpointer(path, cfg.run_id(), every_epochs=100))


def test_a_fifo_checkpoint_never_blocks_fastdiag_run(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    os.mkfifo(out / "run.ckpt.pt")
    proc = fastdiag("run", *TINY_RUN, "--epochs", "2", "--out", str(out))
    _, err = finish(proc, timeout=120)
    assert proc.returncode == 0, err
    assert "run.ckpt.pt: unreadable (ValueError: not a regular file" in err and "moved aside" in err
    assert (out / "result.json").exists() and not (out / "run.ckpt.pt").exists()


@pytest.mark.usefixtures("one_thread")
def test_a_pack_checkpoint_that_does_not_fit_is_moved_aside(tmp_path):
    import dataclasses

    import torch

    from fastdiag.grokking.checkpoint import pack_key
    from fastdiag.grokking.ensemble_train import train_ensemble
    base = RunConfig(**{**TINY_CFG.__dict__, "epochs": 6})
    cfgs = [dataclasses.replace(base, seed=s, weight_decay=w) for s, w in ((0, 1.0), (1, 0.1))]
    key = pack_key(c.run_id() for c in cfgs)
    path = tmp_path / "pack.ckpt.pt"

    class Killed(Exception):
        pass

    def stop_at_4(index, row):
        if row["epoch"] >= 4:
            raise Killed
    with pytest.raises(Killed):
        train_ensemble(cfgs, stop_at_4, checkpoint=Checkpointer(path, key, every_epochs=1))
    payload = torch.load(path, weights_only=True)
    for edit in ({"epoch": 10**9}, {"elapsed": float("nan")},
                 {"params": [p[:, :1] for p in payload["state"]["params"]]}):
        torch.save({**payload, "state": {**payload["state"], **edit}}, path)
        with pytest.warns(RuntimeWarning, match="moved aside"):
            outcomes = train_ensemble(cfgs, checkpoint=(c := Checkpointer(path, key, every_epochs=100)))
        assert c.resumed_epoch is None and [o.result["epochs_run"] for o in outcomes] == [6, 6]
        assert not path.exists()


def test_a_fifo_where_a_sweeps_run_checkpoint_would_be_never_blocks_it(tmp_path):
    """A FIFO at a run's checkpoint path blocked the sweep's worker in the load for ever (its heartbeat
    thread beating on). Now it is not opened: moved aside with a warning, the run trained from epoch 0."""
    from fastdiag.grokking.config import RunConfig
    cfg = RunConfig(**{**TINY_CFG.__dict__, "epochs": 2, "weight_decay": 1.0, "seed": 0})
    folder = tmp_path / "s.sqlite.checkpoints"
    folder.mkdir()
    os.mkfifo(folder / f"{cfg.run_id()}.ckpt.pt")
    sweep = fastdiag("sweep", "--wd", "1", "--seeds", "1", *TINY_RUN[:-5], "--device", "cpu", "--epochs", "2",
                     "--ensemble", "1", "--workers", "1", "--threads", "1", "--quiet", "--store", str(tmp_path / "s.sqlite"))
    _, err = finish(sweep, timeout=120)
    assert sweep.returncode == 0, err
    assert "not a regular file" in err and "moved aside" in err, err
    assert len(store_traces(tmp_path / "s.sqlite")) == 1
    assert not (folder / f"{cfg.run_id()}.ckpt.pt").exists()
