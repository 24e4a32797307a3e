"""Round four of hostile inputs (issue 40): stores that keep nothing or are not files, stores carrying
foreign triggers/views, numeric options out of range, exports into symlink loops and CSV formulas
behind a blank. Real SQLite, real FIFOs and devices, the real command line in this process."""
import csv
import os
import sqlite3

import pytest

from fastdiag.store import Store, StoreError
from tests.helpers import cli_in_process, refused, small_store

TINY = ["--preset", "custom", "--layers", "1", "--heads", "2", "--d-model", "16", "--d-ff", "32", "--p", "7",
        "--batch", "8", "--train-frac", "0.6", "--device", "cpu", "--epochs", "1", "--ensemble", "1"]


# ----------------------------------------------------------------------------- stores are regular files

NOT_FILES = {":memory:": "in-memory", "file:x.sqlite?mode=memory": "SQLite URI", "": "in-memory"}


@pytest.mark.parametrize("name", list(NOT_FILES))
def test_sweep_into_a_store_that_keeps_nothing_is_refused_before_training(tmp_path, capsys, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    code, _, err = cli_in_process(capsys, "sweep", "--wd", "1", "--quiet", "--store", name, *TINY)
    refused(code, err, NOT_FILES[name])
    assert "epoch" not in err and os.listdir(tmp_path) == []


@pytest.mark.parametrize("name", [":memory:", "file:x.sqlite?mode=memory"])
def test_merge_into_or_from_a_store_that_keeps_nothing_is_refused(tmp_path, capsys, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    small_store(tmp_path / "a.sqlite")
    refused(*cli_in_process(capsys, "merge", name, "a.sqlite")[::2], NOT_FILES[name])
    refused(*cli_in_process(capsys, "merge", "out.sqlite", name)[::2], NOT_FILES[name])


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
    refused(*cli_in_process(capsys, *args)[::2], "a FIFO, not a regular file")
    assert os.path.exists(fifo) and not os.path.exists(tmp_path / "o.sqlite")


@pytest.mark.parametrize("command", ["sweep", "merge-target", "export"])
def test_a_device_store_is_refused(tmp_path, capsys, command):
    small_store(tmp_path / "a.sqlite")
    args = {"sweep": ["sweep", "--wd", "1", "--quiet", "--store", "/dev/null", *TINY],
            "merge-target": ["merge", "/dev/full", tmp_path / "a.sqlite"],
            "export": ["export", "/dev/zero", "--out", tmp_path / "o.csv"]}[command]
    refused(*cli_in_process(capsys, *args)[::2], "a device, not a regular file")


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
    refused(*cli_in_process(capsys, "merge", store, tmp_path / "other.sqlite")[::2], f"did not create ({kind} ")
    refused(*cli_in_process(capsys, "sweep", "--wd", "1", "--quiet", "--store", store, *TINY)[::2], "did not create")
    # reading it is fine (no trigger runs on a read-only connection), and nothing was deleted
    code, out, err = cli_in_process(capsys, "merge", tmp_path / "copy.sqlite", store)
    assert code == 0 and "3 runs added" in out, err
    conn = sqlite3.connect(store)
    assert conn.execute("SELECT COUNT(*) FROM runs WHERE status = 'done'").fetchone()[0] == 3
    conn.close()


# ----------------------------------------------------------------------------- numeric options, one table

def _every_numeric_option():
    import click

    from fastdiag.cli import cli
    ctx = click.Context(cli)
    for name in cli.list_commands(ctx):
        for param in cli.get_command(ctx, name).params:
            if isinstance(param.type, (click.types.IntParamType, click.types.FloatParamType, click.IntRange,
                                       click.FloatRange)) or type(param.type).__name__ == "Ranged":
                yield name, param


def test_every_numeric_option_is_range_checked_by_the_one_table_or_its_settings():
    """A numeric option is a RunConfig / InterventionSettings field (checked by their `validate`,
    named) or takes its type from OPTION_RANGES: nothing is left unchecked, and an option has one
    range in every command."""
    import dataclasses

    from fastdiag.cli.options import OPTION_RANGES
    from fastdiag.grokking.config import RunConfig
    from fastdiag.grokking.intervention_settings import InterventionSettings
    settings = {f.name for cls in (RunConfig, InterventionSettings) for f in dataclasses.fields(cls)}
    unchecked = []
    for command, param in _every_numeric_option():
        if command == "bench":                  # bench's own IntRanges (its sizes); not a store command
            continue
        if param.name in OPTION_RANGES and param.type is OPTION_RANGES[param.name]:
            continue
        if param.name in settings and command not in ("analyze", "plot"):
            continue
        unchecked.append(f"{command} {param.opts[0]}")
    assert not unchecked


@pytest.mark.parametrize("args", [
    ["analyze", "S", "--retention-threshold", "nan"], ["analyze", "S", "--retention-threshold", "-1"],
    ["analyze", "S", "--retention-threshold", "1e308"], ["analyze", "S", "--n-boot", "1e20"],
    ["analyze", "S", "--n-boot", "100000000000000000000"], ["analyze", "S", "--n-boot", "0"],
    ["analyze", "S", "--seed", "-1"], ["analyze", "S", "--split-seed", "-5"], ["analyze", "S", "--t0", "inf"],
    ["analyze", "S", "--t0", "nan"], ["analyze", "S", "--test-frac", "1"], ["analyze", "S", "--fit-max-lambda", "0"],
    ["plot", "S", "--out", "figs", "--n-band", "0"], ["plot", "S", "--out", "figs", "--n-boot", "-3"],
    ["headdim", "--store", "h.sqlite", "--workers", "-1"],
    ["headdim", "--store", "h.sqlite", "--d-model", "16", "--heads", "3", "--workers", "-1"],   # no work at all
    ["headdim", "--store", "h.sqlite", "--ff-mult", "100000"],
    ["sweep", "--wd", "1", "--dry-run", "--max-retries", "100000000000"],
    ["sweep", "--wd", "1", "--dry-run", "--workers", "0"], ["run", "--threads", "0"],
], ids=lambda a: " ".join(a[:1] + a[-2:]))
def test_numeric_options_out_of_range_are_one_line_before_anything(tmp_path, capsys, monkeypatch, args):
    monkeypatch.chdir(tmp_path)
    small_store(tmp_path / "S")
    before = sorted(os.listdir(tmp_path))
    refused(*cli_in_process(capsys, *args)[::2], f"'{args[-2]}'")
    assert sorted(os.listdir(tmp_path)) == before            # no store, no figure, no output


# ----------------------------------------------------------------------------- export

def test_export_out_naming_a_symlink_loop_is_one_line(tmp_path, capsys):
    small_store(tmp_path / "s.sqlite")
    os.symlink(tmp_path / "b", tmp_path / "a")
    os.symlink(tmp_path / "a", tmp_path / "b")
    for flag in ("--out", "--trace-out"):
        extra = ["--out", tmp_path / "ok.csv"] if flag == "--trace-out" else []
        refused(*cli_in_process(capsys, "export", tmp_path / "s.sqlite", *extra, flag, tmp_path / "a")[::2],
                f"{flag}: cannot write {tmp_path / 'a'}: Too many levels of symbolic links")
    refused(*cli_in_process(capsys, "export", tmp_path / "a", "--out", tmp_path / "ok.csv")[::2], "symbolic links")
    assert not (tmp_path / "ok.csv").exists()


def test_csv_formulas_behind_blanks_or_line_breaks_are_quoted(tmp_path, capsys):
    from fastdiag.grokking.config import RunConfig
    sneaky = [" =cmd|' /C calc'!A0", "\n=1+1", "  \t+SUM(A1)", "\r\n@x", " -2+3"]
    cfgs = [RunConfig(weight_decay=0.1 * (i + 1), seed=i, epochs=5, p=11) for i in range(len(sneaky))]
    with Store(tmp_path / "s.sqlite") as st:
        st.add_runs(cfgs)
        for cfg, text in zip(cfgs, sneaky):
            st.record_failed(cfg.run_id(), text)
    code, _, err = cli_in_process(capsys, "export", tmp_path / "s.sqlite", "--out", tmp_path / "runs.csv")
    assert code == 0, err
    errors = {r["run_id"]: r["error"] for r in csv.DictReader(open(tmp_path / "runs.csv", newline=""))}
    assert [errors[c.run_id()] for c in cfgs] == ["'" + text for text in sneaky]
