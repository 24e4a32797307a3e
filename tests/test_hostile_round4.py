"""Round four of hostile inputs (issue 40): stores that keep nothing or are not files, stores carrying
foreign triggers/views, numeric options out of range, exports into symlink loops and CSV formulas
behind a blank. Real SQLite, real FIFOs and devices, the real command line in this process."""
import csv
import os
import sqlite3

import pytest

from fastdiag.cli import main
from fastdiag.store import Store, StoreError
from tests.test_hostile import small_store

TINY = ["--preset", "custom", "--layers", "1", "--heads", "2", "--d-model", "16", "--d-ff", "32", "--p", "7",
        "--batch", "8", "--train-frac", "0.6", "--device", "cpu", "--epochs", "1", "--ensemble", "1"]


def fastdiag(capsys, *args):
    """``fastdiag ARGS`` in this process: (exit status, stdout, stderr)."""
    try:
        main([*map(str, args)])
        code = 0
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def refused(code, err, needle):
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("fastdiag: error:") and needle in lines[0], err


# ----------------------------------------------------------------------------- stores are regular files

NOT_FILES = {":memory:": "in-memory", "file:x.sqlite?mode=memory": "SQLite URI", "": "in-memory"}


@pytest.mark.parametrize("name", list(NOT_FILES))
def test_sweep_into_a_store_that_keeps_nothing_is_refused_before_training(tmp_path, capsys, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    code, _, err = fastdiag(capsys, "sweep", "--wd", "1", "--quiet", "--store", name, *TINY)
    refused(code, err, NOT_FILES[name])
    assert "epoch" not in err and os.listdir(tmp_path) == []


@pytest.mark.parametrize("name", [":memory:", "file:x.sqlite?mode=memory"])
def test_merge_into_or_from_a_store_that_keeps_nothing_is_refused(tmp_path, capsys, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    small_store(tmp_path / "a.sqlite")
    refused(*fastdiag(capsys, "merge", name, "a.sqlite")[::2], NOT_FILES[name])
    refused(*fastdiag(capsys, "merge", "out.sqlite", name)[::2], NOT_FILES[name])


def test_library_store_names_no_memory_database():
    for name in (":memory:", "file::memory:", "file:x?mode=memory&cache=shared"):
        with pytest.raises(StoreError, match="in-memory|URI"):
            Store(name)


def test_a_store_name_with_uri_characters_is_a_file_of_that_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with Store("odd?mode=memory#x.sqlite") as st:
        st.add_runs([])
    assert (tmp_path / "odd?mode=memory#x.sqlite").stat().st_size > 0


@pytest.mark.parametrize("command", ["sweep", "merge-target", "merge-source", "export", "analyze"])
def test_a_fifo_store_is_refused_at_once(tmp_path, capsys, command):
    fifo = tmp_path / "s.sqlite"
    os.mkfifo(fifo)
    small_store(tmp_path / "a.sqlite")
    args = {"sweep": ["sweep", "--wd", "1", "--quiet", "--store", fifo, *TINY],
            "merge-target": ["merge", fifo, tmp_path / "a.sqlite"],
            "merge-source": ["merge", tmp_path / "o.sqlite", fifo],
            "export": ["export", fifo, "--out", tmp_path / "o.csv"],
            "analyze": ["analyze", fifo]}[command]
    refused(*fastdiag(capsys, *args)[::2], "a FIFO, not a regular file")
    assert os.path.exists(fifo) and not os.path.exists(tmp_path / "o.sqlite")


@pytest.mark.parametrize("command", ["sweep", "merge-target", "export"])
def test_a_device_store_is_refused(tmp_path, capsys, command):
    small_store(tmp_path / "a.sqlite")
    args = {"sweep": ["sweep", "--wd", "1", "--quiet", "--store", "/dev/null", *TINY],
            "merge-target": ["merge", "/dev/full", tmp_path / "a.sqlite"],
            "export": ["export", "/dev/zero", "--out", tmp_path / "o.csv"]}[command]
    refused(*fastdiag(capsys, *args)[::2], "a device, not a regular file")


# ----------------------------------------------------------------------------- foreign schema objects

FOREIGN = {"trigger": "CREATE TRIGGER wipe AFTER UPDATE ON runs BEGIN DELETE FROM runs WHERE run_id != NEW.run_id; END",
           "view": "CREATE VIEW peek AS SELECT run_id FROM runs"}


@pytest.mark.parametrize("kind", list(FOREIGN))
def test_a_store_with_foreign_triggers_or_views_is_not_written(tmp_path, capsys, kind):
    store = tmp_path / "s.sqlite"
    small_store(store)
    conn = sqlite3.connect(store)
    conn.execute(FOREIGN[kind])
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match=f"{kind} (wipe|peek)"):
        Store(store)
    small_store(tmp_path / "other.sqlite")
    refused(*fastdiag(capsys, "merge", store, tmp_path / "other.sqlite")[::2], f"did not create ({kind} ")
    refused(*fastdiag(capsys, "sweep", "--wd", "1", "--quiet", "--store", store, *TINY)[::2], "did not create")
    # reading it is fine (no trigger runs on a read-only connection), and nothing was deleted
    code, out, err = fastdiag(capsys, "merge", tmp_path / "copy.sqlite", store)
    assert code == 0 and "3 runs added" in out, err
    conn = sqlite3.connect(store)
    assert conn.execute("SELECT COUNT(*) FROM runs WHERE status = 'done'").fetchone()[0] == 3
    conn.close()
