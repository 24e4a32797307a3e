"""Files under attack: exports that would clobber their own store, special files or a planted link at
the temporary name, and read-only readers of a store whose committed runs are still in its -wal.

Real files everywhere: FIFOs from os.mkfifo, real symlinks, a writer process killed before it
checkpoints its WAL, read-only tmpfs mounts (root only; skipped otherwise)."""
import os
import stat
import subprocess
import sys
import textwrap

import pytest

from fastdiag.cli import main
from fastdiag.store import StoreError, open_existing
from fastdiag.store.files import atomic_path
from tests.helpers import cli, cli_in_process, one_line_error, refused, remount_read_only, small_store, tmpfs


def export(capsys, *args):
    return cli_in_process(capsys, "export", *args)


def still_a_store(path, n=3):
    with open_existing(path) as st:
        assert len(st.runs("done")) == n


# ----------------------------------------------------------------------------- export targets

@pytest.mark.parametrize("spelling", ["same", "relative", "symlink", "hardlink", "wal", "shm"])
def test_export_onto_its_own_store_is_refused(tmp_path, capsys, monkeypatch, spelling):
    store = tmp_path / "k.sqlite"
    small_store(store)
    monkeypatch.chdir(tmp_path)
    out = {"same": store, "relative": "k.sqlite", "symlink": tmp_path / "alias.csv",
           "hardlink": tmp_path / "twin.csv", "wal": "k.sqlite-wal", "shm": tmp_path / "k.sqlite-shm"}[spelling]
    if spelling == "symlink":
        os.symlink(store, out)
    if spelling == "hardlink":
        os.link(store, out)
    code, _, err = export(capsys, store, "--out", out)
    refused(code, err, "is the store being exported")
    still_a_store(store)


def test_export_through_a_symlinked_store_guards_the_real_wal(tmp_path, capsys):
    real = tmp_path / "real"
    real.mkdir()
    small_store(real / "k.sqlite")
    os.symlink(real / "k.sqlite", tmp_path / "link.sqlite")
    code, _, err = export(capsys, tmp_path / "link.sqlite", "--out", real / "k.sqlite-wal")
    refused(code, err, "is the store being exported")


def test_trace_out_equal_to_out_is_refused(tmp_path, capsys):
    small_store(tmp_path / "s.sqlite")
    code, _, err = export(capsys, tmp_path / "s.sqlite", "--out", tmp_path / "x.csv", "--trace-out", tmp_path / "x.csv")
    refused(code, err, "--trace-out")
    assert not (tmp_path / "x.csv").exists()                # refused before anything was written


def test_export_to_a_fifo_is_refused_and_the_fifo_stays(tmp_path, capsys):
    small_store(tmp_path / "s.sqlite")
    fifo = tmp_path / "pipe.csv"
    os.mkfifo(fifo)
    code, _, err = export(capsys, tmp_path / "s.sqlite", "--out", fifo)
    refused(code, err, "not a regular file")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    code, _, err = export(capsys, tmp_path / "s.sqlite", "--out", tmp_path / "runs.csv", "--trace-out", fifo)
    refused(code, err, "--trace-out")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and not (tmp_path / "runs.csv").exists()
    assert not [p.name for p in tmp_path.iterdir() if "tmp" in p.name]


def test_export_to_a_device_is_refused(tmp_path, capsys):
    """A private null device, not /dev/null: a regression must not break the machine (as root the
    old code did turn /dev/null into a regular file)."""
    small_store(tmp_path / "s.sqlite")
    device = tmp_path / "null"
    try:
        os.mknod(device, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("making a device node needs root")
    code, _, err = export(capsys, tmp_path / "s.sqlite", "--out", device)
    refused(code, err, "not a regular file")
    assert stat.S_ISCHR(os.stat(device).st_mode)


def test_a_link_planted_at_the_old_temporary_name_is_not_followed(tmp_path, capsys):
    """The temporary name used to be ``.<stem>.tmp<suffix>``: a link planted there got its target
    overwritten. Now the temporary file is created new under an unpredictable name."""
    small_store(tmp_path / "s.sqlite")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    for name in (".runs.tmp.csv", ".runs.csv.tmp", "runs.csv.tmp"):
        os.symlink(victim, tmp_path / name)
    code, out, err = export(capsys, tmp_path / "s.sqlite", "--out", tmp_path / "runs.csv")
    assert code == 0, err
    assert victim.read_text() == "precious\n"
    assert (tmp_path / "runs.csv").read_text().startswith("run_id,")
    assert not (tmp_path / "runs.csv").is_symlink()


def test_atomic_path_creates_its_file_exclusively_with_the_usual_mode(tmp_path):
    target = tmp_path / "out.csv"
    with atomic_path(target) as first, atomic_path(target) as second:
        assert first != second and first.parent == tmp_path and first.suffix == ".csv"
        assert first.exists() and not first.is_symlink()    # already created: nobody can plant a link there
        first.write_text("a\n")
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o666 & ~umask       # like open(path, "w"), not 0600
    assert [p.name for p in tmp_path.iterdir()] == ["out.csv"]             # both temporaries gone


def test_atomic_path_refuses_special_files_and_removes_its_temporary(tmp_path):
    fifo = tmp_path / "f.png"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="f.png: not a regular file"):
        with atomic_path(fifo):
            pass
    target = tmp_path / "t.png"
    with pytest.raises(ValueError, match="not a regular file"):
        with atomic_path(target) as tmp:                    # the target became a FIFO while we wrote
            tmp.write_text("x")
            os.mkfifo(target)
    assert stat.S_ISFIFO(os.stat(target).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.png", "t.png"]


# ----------------------------------------------------------------------------- read-only readers and the WAL

_KILLED_WRITER = textwrap.dedent('''
    import os, sys
    from fastdiag.grokking.config import RunConfig
    from fastdiag.store import Store

    st = Store(sys.argv[1])
    for i in range(3):
        cfg = RunConfig(weight_decay=0.1 * (i + 1), seed=i, epochs=5, p=11)
        st.add_runs([cfg])
        st.record_done(cfg.run_id(), {"regime": "grok", "t_grok_epoch": 3, "n_params": 10},
                       [{"epoch": 1, "step": 1, "test_acc": 1.0, "train_acc": 1.0}])
        if i == 0:
            st.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")   # the main file holds run 1 only
    os._exit(0)                                                   # killed: no checkpoint on close
''')


def killed_writer_store(path):
    """A store whose last writer died with 3 done runs committed, only 1 of them in the main file."""
    subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(path)], check=True)
    assert os.path.getsize(f"{path}-wal") > 0


def test_reader_sees_runs_still_in_the_wal(tmp_path):
    killed_writer_store(tmp_path / "s.sqlite")
    still_a_store(tmp_path / "s.sqlite", n=3)


def test_read_only_mount_with_its_shm_reads_the_wal(tmp_path):
    with tmpfs(tmp_path / "ro", "4m") as ro:
        killed_writer_store(ro / "s.sqlite")
        remount_read_only(ro)
        still_a_store(ro / "s.sqlite", n=3)


def test_read_only_mount_without_shm_refuses_rather_than_read_stale(tmp_path):
    """Without a -shm file SQLite cannot open a WAL store read-only; reading it as immutable would
    ignore the -wal and report 1 run of 3 (before: `analyze` called grokked runs collapse)."""
    with tmpfs(tmp_path / "ro", "4m") as ro:
        killed_writer_store(ro / "s.sqlite")
        os.unlink(ro / "s.sqlite-shm")                       # copied without it, or cleaned up
        remount_read_only(ro)
        with pytest.raises(StoreError, match=r"s\.sqlite-wal.*copy"):
            open_existing(ro / "s.sqlite")
        r = cli("analyze", ro / "s.sqlite", "--n-boot", "20")
        one_line_error(r, "s.sqlite-wal")
        assert "unreadable" not in r.stderr


def test_read_only_mount_with_an_empty_wal_is_read(tmp_path):
    with tmpfs(tmp_path / "ro", "4m") as ro:
        small_store(ro / "s.sqlite")
        (ro / "s.sqlite-wal").write_bytes(b"")               # a checkpoint that truncated it: no commits
        remount_read_only(ro)
        still_a_store(ro / "s.sqlite")


# ----------------------------------------------------------------------------- CSV formula injection

def test_exported_csv_cells_never_run_as_formulas(tmp_path, capsys):
    """Text a spreadsheet would execute (= + - @, tab, CR first) is prefixed with a quote (OWASP);
    numbers, negative ones included, stay numbers."""
    import csv

    from fastdiag.grokking.config import RunConfig
    from fastdiag.store import Store

    done, failed = (RunConfig(weight_decay=w, seed=0, epochs=5, p=11) for w in (0.1, 1.0))
    with Store(tmp_path / "s.sqlite") as st:
        st.add_runs([done, failed])
        st.record_done(done.run_id(), {"regime": "=HYPERLINK(\"http://x\")", "note": "@SUM(A1)", "n_params": 10},
                       [{"epoch": 1, "step": 1, "loss": -0.5, "tag": "+1+cmd|' /C calc'!A0", "\tx": "\rA"}])
        st.record_failed(failed.run_id(), "=cmd|' /C calc'!A0")
    code, _, err = export(capsys, tmp_path / "s.sqlite", "--out", tmp_path / "runs.csv",
                          "--trace-out", tmp_path / "trace.csv")
    assert code == 0, err
    runs = {r["run_id"]: r for r in csv.DictReader(open(tmp_path / "runs.csv", newline=""))}
    assert runs[done.run_id()]["regime"] == "'=HYPERLINK(\"http://x\")"
    assert runs[done.run_id()]["note"] == "'@SUM(A1)"
    assert runs[failed.run_id()]["error"] == "'=cmd|' /C calc'!A0"
    (trace,) = csv.DictReader(open(tmp_path / "trace.csv", newline=""))
    assert trace["loss"] == "-0.5" and trace["tag"] == "'+1+cmd|' /C calc'!A0"
    assert trace["'\tx"] == "'\rA"                          # column names are store content too
    every_cell = [c for f in ("runs.csv", "trace.csv") for row in csv.reader(open(tmp_path / f, newline=""))
                  for c in row]
    assert not [c for c in every_cell if c[:1] in ("=", "+", "@", "\t", "\r") or
                (c.startswith("-") and not c.lstrip("-").replace(".", "", 1).isdigit())]


# ----------------------------------------------------------------------------- messages that say what happened

def test_a_store_on_a_read_only_mount_is_not_called_unreadable(tmp_path, capsys):
    from fastdiag.cli.app import create_store

    with tmpfs(tmp_path / "ro", "4m") as ro:
        small_store(ro / "s.sqlite")
        remount_read_only(ro)
        with pytest.raises(StoreError) as exc:
            create_store(ro / "s.sqlite")
        assert "cannot be written here" in str(exc.value) and "unreadable" not in str(exc.value)
        still_a_store(ro / "s.sqlite")                      # reading it is fine


def test_disk_full_during_export_names_the_file(tmp_path, capsys):
    from fastdiag.grokking.config import RunConfig
    from fastdiag.store import Store

    cfgs = [RunConfig(weight_decay=0.01 * (i + 1), seed=i, epochs=5, p=11) for i in range(40)]
    with Store(tmp_path / "s.sqlite") as st:
        st.add_runs(cfgs)
        for c in cfgs:
            st.record_done(c.run_id(), {"regime": "grok"}, [{"epoch": e, "pad": "x" * 200} for e in range(50)])
    with tmpfs(tmp_path / "full", "64k") as full:
        code, _, err = export(capsys, tmp_path / "s.sqlite", "--out", full / "runs.csv", "--trace-out", full / "t.csv")
        refused(code, err, f"No space left on device: {full / 't.csv'}")
        assert not [p.name for p in full.iterdir() if "tmp" in p.name]


@pytest.mark.parametrize("where, needle", [("nodir/x.json", "No such directory"), ("fifo", "not a regular file")])
def test_bench_json_target_refused_before_the_benchmark(tmp_path, capsys, where, needle):
    """Before, `bench --json nodir/x.json` failed only after the whole benchmark. Here nothing is
    asked to run, so any measurement first would end in "nothing to run" instead."""
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--device", "cpu", "--shapes", "", "--no-steps", "--no-archs", "--no-ensembles",
              "--json", str(tmp_path / where)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and "--json:" in err[0] and needle in err[0], err


# ----------------------------------------------------------------------------- Ctrl-C while loading

_INTERRUPT_WHILE_LOADING = textwrap.dedent('''
    import os, signal, sys

    class InterruptAtImport:
        """Ctrl-C exactly while the command line imports sys.argv[1]: no timing involved."""
        def find_spec(self, name, path=None, target=None):
            if name == sys.argv[1]:
                os.kill(os.getpid(), signal.SIGINT)
            return None

    command = sys.argv[2:]
    sys.argv[0] = os.path.join(os.path.dirname(sys.executable), "fastdiag")    # as the console script
    sys.meta_path.insert(0, InterruptAtImport())
    from fastdiag.cli import main
    sys.exit(main(command))
''')


@pytest.mark.parametrize("module, command", [
    ("click", ["analyze", "nothing.sqlite"]),
    # after main() started, while the command loads torch: an interrupt inside a library's import once
    # left numpy half loaded and gave an ImportError traceback (1 of 7 `export` trials). The commands
    # import torch and scipy in their bodies (their --help loads neither), under the same handler
    # (`app.loading`): sweep's grid loads torch (after its input is read: a bad grid never loads it),
    # analyze's statistics scipy
    ("torch", ["sweep", "--wd", "1", "--dry-run"]),
    ("scipy", ["analyze", "nothing.sqlite"]),
    ("fastdiag.cli.sweep", ["sweep", "--wd", "nan"]),
    ("fastdiag.cli.stores", ["export", "nothing.sqlite", "--out", "o.csv"]),
])
def test_ctrl_c_while_the_command_line_loads_is_one_line_and_130(tmp_path, module, command):
    r = subprocess.run([sys.executable, "-c", _INTERRUPT_WHILE_LOADING, module, *command], capture_output=True,
                       text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 130 and r.stderr == "fastdiag: error: interrupted\n", (r.returncode, r.stderr)


def test_ctrl_c_after_loading_still_unwinds(tmp_path):
    """The loading handler is gone once the command is loaded: Ctrl-C raises KeyboardInterrupt then, so every
    `finally` runs (a sweep stores what finished), and a program importing fastdiag.cli keeps its own."""
    import signal

    from fastdiag.cli import app
    assert signal.getsignal(signal.SIGINT) is not app._interrupted_while_loading    # pytest imported it
    script = ("import os, signal, sys; sys.argv[0] = 'fastdiag'; from fastdiag.cli import app; "
              "assert signal.getsignal(signal.SIGINT) is app._interrupted_while_loading; "
              "app.cli.command('probe')(lambda: print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)); "
              "app.main(['probe'])")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr
