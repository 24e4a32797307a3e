"""`fastdiag merge` and `fastdiag export`: result stores combined and written out as tables. Torch-free
(the store and the run configuration only), so that their help and their work start at once."""
from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import click

from fastdiag.cli.app import CLIError, create_store, open_store
from fastdiag.store import STATUSES
from fastdiag.store.files import atomic_path, check_target


@click.command("merge")
@click.argument("out", type=click.Path())
@click.argument("inputs", nargs=-1, required=True, type=click.Path())
def merge_cmd(out, inputs):
    """Merge shard stores IN... into OUT (created if missing). Idempotent: no run is duplicated, and a
    finished run is never replaced by an unfinished copy."""
    sources = []
    for path in inputs:                       # check every input before touching OUT
        sources.append(open_store(path))
    target = create_store(out)
    total = {"added": 0, "updated": 0, "unchanged": 0, "differ": 0, "intervention_arms_added": 0}
    try:
        for src in sources:
            stats = target.merge_from(src)
            for k in total:
                total[k] += stats[k]
        counts = target.counts()
    finally:
        target.close()
        for src in sources:
            src.close()
    differ = (f"{total['differ']} finished in both with different results (the first store's copy kept: a "
              "packed and a single run of one configuration are different evidence), " if total["differ"] else "")
    click.echo(f"merge: {len(sources)} store(s) into {out}: {total['added']} runs added, "
               f"{total['updated']} updated, {total['unchanged']} unchanged, {differ}"
               f"{total['intervention_arms_added']} intervention arms added; now "
               + ", ".join(f"{k} {v}" for k, v in counts.items()))


def flatten_runs(runs: list[dict]) -> tuple[list[str], list[dict]]:
    """Runs table rows as flat dicts: bookkeeping, then config fields, then result fields."""
    head = ["run_id", "status", "error", "attempts", "created_at", "started_at", "finished_at", "worker"]
    config_cols: list[str] = []
    result_cols: list[str] = []
    for run in runs:
        for k in run["config"]:
            if k not in config_cols:
                config_cols.append(k)
    for run in runs:
        for k in (run["result"] or {}):
            if k in ("run_id", "config"):
                continue
            name = k if k not in head and k not in config_cols else f"result_{k}"
            if name not in result_cols:
                result_cols.append(name)
    rows = []
    for run in runs:
        row = {k: run[k] for k in head}
        row.update(run["config"])
        for k, v in (run["result"] or {}).items():
            if k in ("run_id", "config"):
                continue
            name = k if k not in head and k not in config_cols else f"result_{k}"
            row[name] = json.dumps(v) if isinstance(v, (dict, list)) else v
        rows.append(row)
    return head + config_cols + result_cols, rows


# A spreadsheet opening the CSV runs a cell that starts with one of these as a formula
# (=cmd|' /C calc'!A0): OWASP's CSV-injection advice is to prefix such text cells with a quote.
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def _csv_cell(value):
    """A CSV cell that a spreadsheet shows as text, never runs: store content is untrusted. Spreadsheets
    skip leading blanks and line breaks before a formula (" =cmd", "\n=1+1"), so those are looked past."""
    if value is None:
        return ""
    if isinstance(value, str) and (value.startswith(_FORMULA_STARTS) or value.lstrip().startswith(_FORMULA_STARTS)):
        return "'" + value
    return value


def _write_table(columns: list[str], rows: list[dict], path: Path, fmt: str) -> None:
    if fmt == "csv":
        with atomic_path(path) as tmp, open(tmp, "w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow([_csv_cell(k) for k in columns])
            for row in rows:
                writer.writerow([_csv_cell(row.get(k)) for k in columns])
    else:
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise CLIError("export --format parquet: needs pyarrow (pip install pyarrow)") from None
        data = {}
        for col in columns:
            values = [row.get(col) for row in rows]
            kinds = {type(v) for v in values if v is not None}
            if kinds <= {int, bool} and bool in kinds and int not in kinds:
                data[col] = pa.array(values, type=pa.bool_())
            elif kinds <= {int}:
                data[col] = pa.array(values, type=pa.int64())
            elif kinds <= {int, float}:
                data[col] = pa.array([None if v is None else float(v) for v in values], type=pa.float64())
            else:
                data[col] = pa.array([None if v is None else str(v) for v in values], type=pa.string())
        with atomic_path(path) as tmp:
            pq.write_table(pa.table(data), tmp)


def _resolved(path: Path) -> Path:
    """``path`` with its links followed, or as it is where they cannot be (a symlink loop)."""
    try:
        return path.resolve()
    except (OSError, RuntimeError):
        return path.absolute()


def _same_file(a: Path, b: Path) -> bool:
    """The same file, by any spelling (a relative path, a symlink, a hard link) or, before it exists,
    the same absolute path."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return _resolved(a) == _resolved(b)


@click.command("export")
@click.argument("store_path", metavar="STORE", type=click.Path())
@click.option("--format", "fmt", type=click.Choice(["csv", "parquet"]), default="csv", show_default=True)
@click.option("--out", "out", required=True, type=click.Path(), help="Output file of the runs table.")
@click.option("--trace-out", default=None, type=click.Path(),
              help="Also write the trace rows (run_id, one column per trace field) to this file.")
@click.option("--status", default=None, type=click.Choice(STATUSES),
              help="Only runs with this status (default: all).")
def export_cmd(store_path, fmt, out, trace_out, status):
    """Export a store's runs table (config and result flattened into columns), optionally its traces."""
    outputs = [("--out", Path(out))] + ([("--trace-out", Path(trace_out))] if trace_out else [])
    # SQLite keeps its -wal/-shm next to the link's target when the store is reached through a symlink
    store_files = [Path(f"{base}{tail}") for base in {Path(store_path), _resolved(Path(store_path))}
                   for tail in ("", "-wal", "-shm", "-journal")]
    for flag, path in outputs:               # before reading anything: no half-done export
        try:
            os.stat(path)
        except FileNotFoundError:
            pass
        except OSError as exc:               # a symlink loop, a path through a file, no permission
            raise CLIError(f"{flag}: cannot write {path}: {exc.strerror}") from None
        if path.is_dir():
            raise CLIError(f"{flag}: {path} is a directory; expected a file name")
        if not path.parent.is_dir():
            raise CLIError(f"{flag}: directory {path.parent} does not exist")
        if any(_same_file(path, f) for f in store_files):
            raise CLIError(f"{flag}: {path} is the store being exported; choose another file name")
        try:
            check_target(path)
        except ValueError:
            raise CLIError(f"{flag}: {path} is not a regular file (a FIFO, device or socket); "
                           "refusing to replace it") from None
    if trace_out and _same_file(outputs[0][1], outputs[1][1]):
        raise CLIError(f"--trace-out: {trace_out} is also --out; the traces would overwrite the runs table")
    out_path = outputs[0][1]
    with open_store(store_path) as store:
        runs = store.runs(status)
        columns, rows = flatten_runs(runs)
        _write_table(columns, rows, out_path, fmt)
        n_trace = 0
        if trace_out:
            trace_path = outputs[1][1]
            wanted = {r["run_id"] for r in runs}
            trace_rows, trace_cols = [], ["run_id", "idx"]
            for rid, idx, row in store.traces():
                if rid not in wanted:
                    continue
                for k in row:
                    if k not in trace_cols:
                        trace_cols.append(k)
                trace_rows.append({"run_id": rid, "idx": idx, **row})
            _write_table(trace_cols, trace_rows, trace_path, fmt)
            n_trace = len(trace_rows)
    click.echo(f"export: {len(rows)} runs ({len(columns)} columns) to {out_path}"
               + (f"; {n_trace} trace rows to {trace_out}" if trace_out else ""))


COMMANDS = [merge_cmd, export_cmd]
