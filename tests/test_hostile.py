"""Hostile inputs and faults: bad values, damaged and read-only stores, full disks, signals.

Every CLI failure is one line on stderr with exit status 2 (130 for Ctrl-C), before any training
where the input alone decides it, and nothing finished is lost. Faults are real: a full disk is a
tiny tmpfs, a read-only store sits on a read-only mount (both need root; skipped otherwise),
damaged stores are real SQLite files edited behind fastdiag's back, signals are real signals.
"""
import json
import os
import pty
import re
import select
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
import torch

from fastdiag.cli import main
from fastdiag.grokking.config import RunConfig
from fastdiag.store import Store, StoreError, open_existing
from tests.helpers import cli, insert_arms, one_line_error, remount_read_only, small_store, tmpfs

TINY_RUN = ["--p", "7", "--preset", "custom", "--layers", "1", "--heads", "2", "--d-model", "16",
            "--batch", "8", "--train-frac", "0.6", "--device", "cpu", "--threads", "1"]


# ----------------------------------------------------------------------------- fastdiag run

def test_run_checks_out_before_the_first_step(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    r = cli("run", *TINY_RUN, "--epochs", "3", "--out", not_a_dir / "sub")
    one_line_error(r, "--out")
    assert "epoch 1/" not in r.stderr                       # refused before training, not after


def test_run_read_only_out_refused_before_training(tmp_path):
    with tmpfs(tmp_path / "ro", "1m") as ro:
        remount_read_only(ro)
        r = cli("run", *TINY_RUN, "--epochs", "3", "--out", ro / "run")
        one_line_error(r, "--out")
        assert "epoch 1/" not in r.stderr


def test_run_disk_full_is_one_line_and_keeps_no_partial_file(tmp_path):
    with tmpfs(tmp_path / "full", "12k") as full:              # result.json fits, the figure does not
        r = cli("run", *TINY_RUN, "--epochs", "3", "--quiet", "--out", full / "run")
        one_line_error(r, "No space left on device")
        assert "regime:" in r.stdout                          # the finished run is still reported
        names = sorted(p.name for p in (full / "run").iterdir())
        assert not [n for n in names if "tmp" in n], names      # nothing half-written is left behind
        if "result.json" in names:
            json.loads((full / "run" / "result.json").read_text())


@pytest.mark.parametrize("argv, needle", [
    (["--wd", "inf"], "--wd"),
    (["--lr", "inf"], "--lr"),
    (["--grok-threshold", "nan"], "--grok-threshold"),
    (["--grok-threshold", "2"], "--grok-threshold"),
    (["--p", "50021"], "--p"),
    (["--layers", "100000000"], "--layers"),          # refused before a model is built, even on meta
    (["--d-model", "1000000"], "--d-model"),          # one weight matrix beyond the memory
    (["--layers", "2000", "--d-model", "2048"], "GiB to train"),
    (["--lr", "1e300"], "--lr"),                      # finite, but AdamW's float32 step overflows
    (["--device", "meta"], "--device"),
    (["--threads", "100000"], "--threads"),           # OpenMP would throw std::bad_alloc
], ids=["wd-inf", "lr-inf", "threshold-nan", "threshold-2", "huge-p", "absurd-layers", "absurd-width",
        "beyond-memory", "lr-overflow", "meta-device", "absurd-threads"])
def test_run_values_checked_before_training(capsys, tmp_path, argv, needle):
    with pytest.raises(SystemExit) as exc:
        main(["run", *TINY_RUN, "--epochs", "3", "--out", str(tmp_path / "out"), *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and not (tmp_path / "out").exists()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "epoch 1/" not in err, err


def test_modulus_limit_comes_from_memory():
    from fastdiag.grokking.tasks import check_task, max_modulus

    assert max_modulus(8 * 2**30) > 5_000                     # 8 GiB: every p of the paper and far beyond
    with pytest.raises(ValueError, match=r"^p: .*50021.*GiB"):
        check_task("+", 50021, memory=8 * 2**30)
    check_task("+", 97, memory=8 * 2**30)
    with pytest.raises(ValueError, match=r"^p: .*prime"):
        check_task("/", 12)


def test_ctrl_c_exits_130(tmp_path):
    # stderr on a pseudo-terminal: the progress bar, the sign that training has started, is drawn
    # only on a terminal
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "fastdiag.cli", "run", *TINY_RUN, "--epochs", "100000",
                             "--out", str(tmp_path / "r")], stdout=subprocess.DEVNULL, stderr=slave,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    os.close(slave)
    seen = b""

    def read(wait: float) -> bool:
        nonlocal seen
        if not select.select([master], [], [], wait)[0]:
            return False
        try:
            data = os.read(master, 65536)
        except OSError:                                      # the child side is closed
            return False
        seen += data
        return bool(data)

    try:
        deadline = time.monotonic() + 120
        while not re.search(rb"[1-9][0-9]*/100000", seen):    # an epoch has finished
            assert time.monotonic() < deadline and proc.poll() is None, seen
            read(1.0)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        while read(0.5):
            pass
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    text = seen.decode(errors="replace").replace("\r", "\n")
    assert proc.returncode == 130, text
    assert text.strip().splitlines()[-1].strip() == "fastdiag: error: interrupted"


# ----------------------------------------------------------------------------- sweep grid values

@pytest.mark.parametrize("args, needle", [
    (["--wd", "1", "--preset", "7b"], "--preset"),
    (["--wd", "1", "--op", "/", "--p", "12"], "prime"),
    (["--wd", "1e-3:1:100000000"], "--wd"),
    (["--wd", "1", "--seeds", "100000000000000000000000"], "--seeds"),
    (["--wd", "1", "--lr", "inf"], "--lr"),
    (["--wd", "1", "--grok-threshold", "2"], "--grok-threshold"),
    (["--wd", "1", "--p", "50021"], "--p"),
], ids=["preset", "div-non-prime", "huge-wd-grid", "huge-seeds", "lr-inf", "threshold-2", "huge-p"])
def test_sweep_bad_values_refused_even_dry_run(tmp_path, args, needle):
    r = cli("sweep", *args, "--dry-run", "--store", tmp_path / "s.sqlite", timeout=60)
    one_line_error(r, needle)
    assert not (tmp_path / "s.sqlite").exists()


def test_library_errors_name_parameters_not_flags():
    from fastdiag import sweep as sw

    with pytest.raises(ValueError, match=r"^weight_decays: "):
        sw.parse_wd("")
    with pytest.raises(ValueError, match=r"^seeds: "):
        sw.parse_seeds("0")
    with pytest.raises(ValueError, match=r"^weight_decays: .*at most"):
        sw.parse_wd("1e-3:1:100000000")


# ----------------------------------------------------------------------------- stores

def test_readers_do_not_write(tmp_path):
    small_store(tmp_path / "s.sqlite")
    with open_existing(tmp_path / "s.sqlite") as st:
        with pytest.raises(StoreError, match="readonly"):
            st.conn.execute("DELETE FROM runs")


def test_read_only_store_analyze_plot_export(tmp_path):
    with tmpfs(tmp_path / "ro", "4m") as ro:
        small_store(ro / "s.sqlite")
        remount_read_only(ro)
        r = cli("analyze", ro / "s.sqlite", "--n-boot", "20")
        assert r.returncode == 0 and "3 done" in r.stdout, r.stderr
        r = cli("export", ro / "s.sqlite", "--out", tmp_path / "runs.csv")
        assert r.returncode == 0 and "3 runs" in r.stdout, r.stderr
        r = cli("plot", ro / "s.sqlite", "--out", tmp_path / "figs", "--n-boot", "20", "--n-band", "5")
        assert r.returncode == 0, r.stderr


def test_export_out_a_directory_is_one_line_and_leaves_nothing(tmp_path):
    small_store(tmp_path / "s.sqlite")
    (tmp_path / "dir").mkdir()
    r = cli("export", tmp_path / "s.sqlite", "--out", tmp_path / "dir")
    one_line_error(r, "--out")
    assert not [p.name for p in tmp_path.rglob("*") if "tmp" in p.name] and not list((tmp_path / "dir").iterdir())


def test_store_disk_full_is_one_line_not_cannot_rollback(tmp_path):
    src = tmp_path / "big.sqlite"
    cfgs = [RunConfig(weight_decay=0.1 * (i + 1), seed=i, epochs=5, p=11) for i in range(40)]
    with Store(src) as st:
        st.add_runs(cfgs)
        for c in cfgs:
            st.record_done(c.run_id(), {"regime": "grok"}, [{"epoch": e, "pad": "x" * 200} for e in range(100)])
    with tmpfs(tmp_path / "full", "256k") as full:
        r = cli("merge", full / "out.sqlite", src)
        one_line_error(r, "disk is full")
        assert "rollback" not in r.stderr
        with open_existing(full / "out.sqlite") as out:          # what was committed is intact
            done = out.runs("done")
            assert 0 < len(done) < 40 and all(len(out.trace(r["run_id"])) == 100 for r in done)


def test_corrupted_store_pages_are_one_line(tmp_path):
    path = tmp_path / "s.sqlite"
    small_store(path, n=30)
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    data = bytearray(path.read_bytes())
    page = 4096
    for start in range(2 * page, len(data), page):            # keep page 1 (header, schema) intact
        data[start:start + 200] = b"\xa5" * 200
    path.write_bytes(bytes(data))
    for cmd in (["analyze", path], ["export", path, "--out", tmp_path / "x.csv"]):
        r = cli(*cmd)
        one_line_error(r, str(path))
        assert "Traceback" not in r.stderr


@pytest.mark.parametrize("sql, needle", [
    ("UPDATE runs SET result = NULL WHERE run_id = :rid", "no result"),
    ("UPDATE runs SET config = json_remove(config, '$.arch') WHERE run_id = :rid", "arch"),
    ("UPDATE runs SET config = json_set(config, '$.weight_decay', 'heavy') WHERE run_id = :rid", "weight_decay"),
    ("UPDATE runs SET config = '[1, 2]' WHERE run_id = :rid", "config"),
    ("UPDATE runs SET result = '{\"regime\": ' WHERE run_id = :rid", "invalid JSON"),
    ("UPDATE runs SET result = '{\"regime\": 7}' WHERE run_id = :rid", "regime"),
    ("UPDATE trace SET row = 'nope' WHERE run_id = :rid", "invalid JSON"),
], ids=["null-result", "missing-key", "wrong-type", "config-list", "bad-json", "regime-type", "bad-trace"])
def test_damaged_store_content_names_store_and_run(tmp_path, sql, needle):
    path = tmp_path / "s.sqlite"
    cfgs = small_store(path)
    rid = cfgs[1].run_id()
    conn = sqlite3.connect(path)
    conn.execute(sql, {"rid": rid})
    conn.commit()
    conn.close()
    commands = [["export", path, "--out", tmp_path / "x.csv", "--trace-out", tmp_path / "t.csv"]]
    if "trace" not in sql:                                    # analyze reads no trace of these runs
        commands.append(["analyze", path, "--n-boot", "20"])   # few resamples: the damage is found on reading
    for cmd in commands:
        r = cli(*cmd)
        one_line_error(r, needle)
        assert str(path) in r.stderr and rid in r.stderr, r.stderr


def _intervention_store(path, experiment):
    with Store(path) as st:
        insert_arms(st, experiment, arm_id="a-{arm}", config=json.dumps(RunConfig(epochs=5, p=11).to_dict()))


def test_plot_never_writes_outside_out(tmp_path):
    path = tmp_path / "evil.sqlite"
    _intervention_store(path, "x/../../../escaped")
    with Store(path) as st:                                 # two experiments: file names come from the ids
        with st.transaction() as conn:
            conn.execute("UPDATE intervention_runs SET experiment = 'x' WHERE arm = 'reinit'")
    out = tmp_path / "a" / "b" / "figs"
    (out / "intervention_x").mkdir(parents=True)             # e.g. left by an earlier plot
    r = cli("plot", path, "--out", out, "--n-boot", "10")
    assert r.returncode == 0, r.stderr
    outside = [p for p in tmp_path.rglob("*") if p.is_file() and out not in p.parents
               and not p.name.startswith("evil.sqlite")]
    assert outside == [] and len(list(out.glob("intervention_*.png"))) == 2


def test_merge_quotes_column_names_of_the_input(tmp_path):
    src = tmp_path / "src.sqlite"
    _intervention_store(src, "x")
    conn = sqlite3.connect(src)
    conn.execute('ALTER TABLE intervention_runs ADD COLUMN "a) VALUES (1); DROP TABLE runs; --" TEXT')
    conn.commit()
    conn.close()
    r = cli("merge", tmp_path / "out.sqlite", src)
    assert r.returncode == 0, r.stderr
    with open_existing(tmp_path / "out.sqlite") as out:
        assert out.conn.execute("SELECT COUNT(*) FROM intervention_runs").fetchone()[0] == 2
        assert out.counts()["done"] == 0                      # the runs table is still there


# ----------------------------------------------------------------------------- HeadStats read-out

def test_valid_is_false_where_sync_is_nan():
    from fastdiag.core.stats import HeadStats

    gram = torch.eye(3, dtype=torch.float64).repeat(2, 1, 1)
    gram[1, 2, 2] = 0.0                                       # an all-zero (or underflowed) head
    stats = HeadStats(gram, torch.ones(2, 3), torch.tensor([4.0, 4.0]), torch.zeros(2))
    assert stats.valid().tolist() == [True, False]
    assert torch.isnan(stats.sync()[1]) and not torch.isnan(stats.sync()[0])


def test_summarize_mismatched_layers_is_a_named_value_error():
    from fastdiag.core.stats import HeadStats, summarize

    def stats(*lead):
        return HeadStats(torch.eye(2).expand(*lead, 2, 2), torch.ones(*lead, 2), torch.ones(lead),
                         torch.zeros(lead))

    with pytest.raises(ValueError, match=r"stats_per_layer: .*'b'"):
        summarize({"a": stats(3), "b": stats(4)})


# ----------------------------------------------------------------------------- bench

def test_bench_with_nothing_to_run_is_an_error():
    r = cli("bench", "--shapes", "", "--no-steps", "--no-ensembles", "--no-archs")
    one_line_error(r, "nothing to run")


def test_sweep_disk_full_is_one_line_and_keeps_whole_runs(tmp_path):
    with tmpfs(tmp_path / "full", "160k") as full:
        store = full / "s.sqlite"
        r = cli("sweep", "--wd", "0.1,0.3,1,3", "--seeds", "2", "--preset", "custom", "--layers", "1", "--heads", "2",
                "--d-model", "16", "--d-ff", "32", "--p", "11", "--epochs", "150", "--no-stop-at-grok",
                "--ensemble", "1", "--workers", "1", "--threads", "1", "--quiet", "--store", store, timeout=300)
        one_line_error(r, "disk is full")
        assert str(store) in r.stderr and "rollback" not in r.stderr
        with open_existing(store) as st:
            done = st.runs("done")
            assert len(done) < 8 and all(len(st.trace(run["run_id"])) == 150 for run in done)
