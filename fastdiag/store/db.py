"""The result store of a sweep: one SQLite file (WAL mode).

Schema (``PRAGMA application_id`` = 0x46446967 "FDig" marks a fastdiag store, ``PRAGMA user_version``
is the schema version):

``meta(key TEXT PRIMARY KEY, value TEXT)``
    ``schema_version``, ``created_at``, ``fastdiag_version``.
``runs``
    ``run_id TEXT PRIMARY KEY`` (= ``RunConfig.run_id()``, a hash of the full configuration),
    ``config TEXT`` (JSON of ``RunConfig.to_dict()``), ``status`` (pending | running | done | failed),
    ``result TEXT`` (JSON, done runs), ``error TEXT`` (failed runs), ``attempts INTEGER``,
    ``created_at / started_at / finished_at REAL`` (unix seconds), ``worker TEXT``.
``trace(run_id, idx, epoch, step, row)``
    one row per evaluation of a done run, ``row`` the JSON of the trainer's trace row;
    primary key ``(run_id, idx)``.

``claims(run_id, owner, host, pid, expires)``
    which sweep process is training a run now (`Lease`); concurrent sweeps on one store skip runs
    claimed by a live sweep, so they share the grid instead of each training all of it.

A finished run's result and its trace are written in ONE transaction, so a crash (even ``kill -9``)
leaves either the whole finished run or none of it. Only sweep driver processes write. Readers
(``open_existing``) open the file read-only, and the content they read is checked: a damaged row
raises a StoreError that names the store and the run.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import sqlite3
import threading
import time
import urllib.parse
import uuid
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Iterable, Iterator

APPLICATION_ID = 0x46446967          # "FDig"
SCHEMA_VERSION = 1
STATUSES = ("pending", "running", "done", "failed")
_SQLITE_MAGIC = b"SQLite format 3\x00"
# When merging, a run's better state wins: a finished run is never replaced by an unfinished one.
_RANK = {"pending": 0, "running": 1, "failed": 2, "done": 3}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT
);
CREATE TABLE IF NOT EXISTS runs (
    run_id      TEXT PRIMARY KEY,
    config      TEXT NOT NULL,
    status      TEXT NOT NULL CHECK (status IN ('pending', 'running', 'done', 'failed')),
    result      TEXT,
    error       TEXT,
    attempts    INTEGER NOT NULL DEFAULT 0,
    created_at  REAL NOT NULL,
    started_at  REAL,
    finished_at REAL,
    worker      TEXT
);
CREATE INDEX IF NOT EXISTS runs_status ON runs (status);
CREATE TABLE IF NOT EXISTS trace (
    run_id TEXT NOT NULL REFERENCES runs (run_id),
    idx    INTEGER NOT NULL,
    epoch  INTEGER,
    step   INTEGER,
    row    TEXT NOT NULL,
    PRIMARY KEY (run_id, idx)
) WITHOUT ROWID;
"""
# Added to stores of any schema version by the first writer that opens them (readers ignore it).
_CLAIMS = """
CREATE TABLE IF NOT EXISTS claims (
    run_id  TEXT PRIMARY KEY,
    owner   TEXT NOT NULL,
    host    TEXT NOT NULL,
    pid     INTEGER NOT NULL,
    expires REAL NOT NULL
)
"""
LEASE_S = 60.0     # a claim not renewed for this long (its sweep hung or its host died) can be taken over


class StoreError(ValueError):
    """The file is not a usable fastdiag result store (the message says why, in one line)."""


class SQLiteFailure(StoreError):
    """SQLite failed on the store: disk full, damaged pages, a read-only file, a lock held too long."""


def _sqlite_error(path, exc: sqlite3.Error) -> StoreError:
    """Name the store: "store runs.sqlite: database or disk is full", not a bare sqlite3 traceback."""
    return SQLiteFailure(f"store {path}: {' '.join(str(exc).split())}")


class _Cursor(sqlite3.Cursor):
    """Rows are read lazily: a damaged page can fail at any fetch, not only at execute."""

    def __next__(self):
        try:
            return super().__next__()
        except sqlite3.DatabaseError as exc:
            raise _sqlite_error(self.connection.store_path, exc) from None

    def fetchone(self):
        try:
            return super().fetchone()
        except sqlite3.DatabaseError as exc:
            raise _sqlite_error(self.connection.store_path, exc) from None

    def fetchall(self):
        try:
            return super().fetchall()
        except sqlite3.DatabaseError as exc:
            raise _sqlite_error(self.connection.store_path, exc) from None


class _Connection(sqlite3.Connection):
    """An SQLite connection whose errors (disk full, damaged pages, read-only file) name the store."""

    store_path = None

    def execute(self, sql, parameters=()):
        try:
            return self.cursor(_Cursor).execute(sql, parameters)
        except sqlite3.DatabaseError as exc:
            raise _sqlite_error(self.store_path, exc) from None

    def executemany(self, sql, seq_of_parameters):
        try:
            return self.cursor(_Cursor).executemany(sql, seq_of_parameters)
        except sqlite3.DatabaseError as exc:
            raise _sqlite_error(self.store_path, exc) from None


def _connect(path: Path, readonly: bool) -> _Connection:
    if readonly:
        # mode=ro never writes. A WAL store on a read-only mount has no -shm file and cannot get one;
        # there nothing can change the file either, so it is opened as immutable.
        uri = f"file:{urllib.parse.quote(str(path.resolve()))}?mode=ro"
        conn = sqlite3.connect(uri, uri=True, timeout=60.0, isolation_level=None, factory=_Connection)
        conn.store_path = path
        try:
            conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
        except SQLiteFailure:
            conn.close()
            conn = sqlite3.connect(uri + "&immutable=1", uri=True, isolation_level=None, factory=_Connection)
    else:
        conn = sqlite3.connect(str(path), timeout=60.0, isolation_level=None, factory=_Connection)
    conn.store_path = path
    return conn


def _clean(value):
    """JSON-able copy with non-finite floats turned into None (JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and callable(value.item):      # numpy / torch scalars
        try:
            return _clean(value.item())
        except (TypeError, ValueError):
            pass
    return value


def dumps(value) -> str:
    return json.dumps(_clean(value), allow_nan=False, separators=(",", ":"))


class Store:
    """A fastdiag result store. ``Store(path)`` opens it, creating it when ``create`` is true.

    Raises ``FileNotFoundError`` (missing and not ``create``) or ``StoreError`` (not SQLite,
    corrupt, a foreign SQLite database, or a newer schema) with a one-line message.
    """

    def __init__(self, path: str | os.PathLike, create: bool = True, readonly: bool = False):
        self.path = Path(path)
        self.readonly = readonly
        if self.path.is_dir():
            raise StoreError(f"store {self.path}: is a directory, not a result store")
        exists = self.path.exists() and self.path.stat().st_size > 0
        if not exists and not create:
            raise FileNotFoundError(f"store {self.path}: no such file")
        if exists:
            self._check_header()
        elif not self.path.parent.exists():
            raise FileNotFoundError(f"store {self.path}: directory {self.path.parent} does not exist")
        try:
            self.conn = _connect(self.path, readonly)
            self.conn.execute("PRAGMA busy_timeout = 60000")
            self._init_or_check(create=not exists)
        except (sqlite3.DatabaseError, SQLiteFailure) as exc:
            message = str(exc).removeprefix(f"store {self.path}: ")
            raise StoreError(f"store {self.path}: unreadable SQLite database ({message})") from None

    # ------------------------------------------------------------------ opening
    def _check_header(self) -> None:
        try:
            with open(self.path, "rb") as fh:
                head = fh.read(len(_SQLITE_MAGIC))
        except OSError as exc:
            raise StoreError(f"store {self.path}: cannot read ({exc.strerror})") from None
        if head != _SQLITE_MAGIC:
            raise StoreError(f"store {self.path}: not a fastdiag result store (not an SQLite database)")

    def _init_or_check(self, create: bool) -> None:
        conn = self.conn
        app_id = conn.execute("PRAGMA application_id").fetchone()[0]
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        if app_id == 0 and not tables:
            create = True                       # an empty SQLite file: make it a store
        elif app_id != APPLICATION_ID:
            shown = ", ".join(sorted(tables)[:5]) or "none"
            raise StoreError(
                f"store {self.path}: a foreign SQLite database, not a fastdiag result store "
                f"(application_id {app_id:#x}, tables: {shown})")
        if create:
            if self.readonly:
                raise StoreError(f"store {self.path}: empty, not a fastdiag result store")
            conn.execute("PRAGMA journal_mode = WAL")
            with self.transaction():
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        conn.execute(statement)
                conn.execute(_CLAIMS)
                conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                try:
                    from importlib.metadata import version as _version  # noqa: PLC0415
                    version = _version("fastdiag")
                except Exception:  # noqa: BLE001 - not installed: still a valid store
                    version = "unknown"
                conn.executemany("INSERT OR IGNORE INTO meta (key, value) VALUES (?, ?)", [
                    ("schema_version", str(SCHEMA_VERSION)),
                    ("created_at", str(time.time())),
                    ("fastdiag_version", str(version)),
                ])
            return
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise StoreError(f"store {self.path}: schema version {version} is newer than this fastdiag "
                             f"understands ({SCHEMA_VERSION}); upgrade fastdiag")
        missing = {"runs", "trace", "meta"} - set(tables)
        if missing:
            raise StoreError(f"store {self.path}: damaged fastdiag store (missing tables {sorted(missing)})")
        if not self.readonly:
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute(_CLAIMS)

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE … COMMIT (ROLLBACK on error): all of it lands, or none."""
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield self.conn
        except BaseException:
            # SQLite may have rolled back already (a full disk does): then ROLLBACK would fail with
            # "cannot rollback - no transaction is active" and hide the real error.
            if self.conn.in_transaction:
                with suppress(sqlite3.Error, StoreError):
                    self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    # ------------------------------------------------------------------ writing
    def add_runs(self, configs: Iterable[dict]) -> int:
        """Register runs as pending (those already known are left alone); returns how many are new."""
        now = time.time()
        rows = []
        for cfg in configs:
            from fastdiag.grokking.config import RunConfig  # noqa: PLC0415
            rid = RunConfig.from_dict(cfg).run_id()
            rows.append((rid, dumps(cfg), now))
        with self.transaction() as conn:
            before = conn.total_changes
            conn.executemany(
                "INSERT OR IGNORE INTO runs (run_id, config, status, created_at) VALUES (?, ?, 'pending', ?)",
                rows)
            return conn.total_changes - before

    def record_done(self, run_id: str, result: dict, trace: list[dict], started_at: float | None = None,
                    finished_at: float | None = None, worker: str | None = None) -> None:
        """Write a finished run's result and trace in one transaction (replacing any partial trace)."""
        finished_at = time.time() if finished_at is None else finished_at
        rows = [(run_id, i, row.get("epoch"), row.get("step"), dumps(row)) for i, row in enumerate(trace)]
        with self.transaction() as conn:
            conn.execute("DELETE FROM trace WHERE run_id = ?", (run_id,))
            conn.executemany("INSERT INTO trace (run_id, idx, epoch, step, row) VALUES (?, ?, ?, ?, ?)", rows)
            cur = conn.execute(
                "UPDATE runs SET status = 'done', result = ?, error = NULL, finished_at = ?, "
                "started_at = COALESCE(?, started_at), worker = COALESCE(?, worker) WHERE run_id = ?",
                (dumps(result), finished_at, started_at, worker, run_id))
            if cur.rowcount != 1:
                raise KeyError(f"run {run_id}: not registered in store {self.path}")
            conn.execute("DELETE FROM claims WHERE run_id = ?", (run_id,))

    def record_failed(self, run_id: str, error: str) -> None:
        with self.transaction() as conn:
            conn.execute(
                "UPDATE runs SET status = 'failed', error = ?, finished_at = ? WHERE run_id = ? AND status != 'done'",
                (str(error), time.time(), run_id))
            conn.execute("DELETE FROM claims WHERE run_id = ?", (run_id,))

    # ------------------------------------------------------------------ reading
    def _json(self, text, what: str, run_id: str):
        try:
            return json.loads(text)
        except (TypeError, ValueError) as exc:
            raise StoreError(f"store {self.path}: run {run_id}: damaged {what} (invalid JSON: {exc})") from None

    def _run_dict(self, row: tuple) -> dict:
        """A runs row as a dict, its JSON parsed and checked: store content is untrusted."""
        (run_id, config, status, result, error, attempts, created, started, finished, worker) = row
        config = _checked_config(self._json(config, "config", run_id), self.path, run_id)
        result = self._json(result, "result", run_id) if result is not None else None
        if status == "done":
            _check_result(result, self.path, run_id)
        return {
            "run_id": run_id, "config": config, "status": status, "result": result, "error": error,
            "attempts": attempts, "created_at": created, "started_at": started, "finished_at": finished,
            "worker": worker,
        }

    _COLUMNS = "run_id, config, status, result, error, attempts, created_at, started_at, finished_at, worker"

    def runs(self, status: str | Iterable[str] | None = None) -> list[dict]:
        """All runs (ordered by run_id), optionally only those with the given status(es)."""
        sql = f"SELECT {self._COLUMNS} FROM runs"
        args: tuple = ()
        if status is not None:
            wanted = (status,) if isinstance(status, str) else tuple(status)
            sql += f" WHERE status IN ({', '.join('?' * len(wanted))})"
            args = wanted
        return [self._run_dict(r) for r in self.conn.execute(sql + " ORDER BY run_id", args)]

    def get(self, run_id: str) -> dict | None:
        row = self.conn.execute(f"SELECT {self._COLUMNS} FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return self._run_dict(row) if row else None

    def status_of(self, run_ids: Iterable[str] | None = None) -> dict[str, str]:
        rows = self.conn.execute("SELECT run_id, status FROM runs").fetchall()
        if run_ids is None:
            return dict(rows)
        wanted = set(run_ids)
        return {rid: st for rid, st in rows if rid in wanted}

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(STATUSES, 0)
        for status, n in self.conn.execute("SELECT status, COUNT(*) FROM runs GROUP BY status"):
            out[status] = n
        return out

    def _trace_row(self, text, run_id: str, idx: int) -> dict:
        row = self._json(text, f"trace row {idx}", run_id)
        if not isinstance(row, dict):
            raise StoreError(f"store {self.path}: run {run_id}: damaged trace row {idx} (not a JSON object)")
        return row

    def trace(self, run_id: str) -> list[dict]:
        return [self._trace_row(row, run_id, idx) for idx, row in
                self.conn.execute("SELECT idx, row FROM trace WHERE run_id = ? ORDER BY idx", (run_id,))]

    def traces(self) -> Iterator[tuple[str, int, dict]]:
        """(run_id, idx, row) for every trace row, ordered."""
        for rid, idx, row in self.conn.execute("SELECT run_id, idx, row FROM trace ORDER BY run_id, idx"):
            yield rid, idx, self._trace_row(row, rid, idx)

    # ------------------------------------------------------------------ merging
    def merge_from(self, other: "Store") -> dict[str, int]:
        """Copy runs from ``other``: a run absent here is added; a run present here is replaced only by
        a better state (done > failed > running > pending). Idempotent; never duplicates."""
        if other.path.resolve() == self.path.resolve():
            raise StoreError(f"merge: {other.path} is the output store itself")
        mine = self.status_of()
        stats = {"added": 0, "updated": 0, "unchanged": 0}
        for run in other.runs():
            rid = run["run_id"]
            here = mine.get(rid)
            if here is not None and _RANK[run["status"]] <= _RANK[here]:
                stats["unchanged"] += 1
                continue
            trace = other.trace(rid) if run["status"] == "done" else []
            with self.transaction() as conn:
                conn.execute("DELETE FROM trace WHERE run_id = ?", (rid,))
                conn.execute(
                    f"INSERT OR REPLACE INTO runs ({self._COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (rid, dumps(run["config"]), run["status"],
                     dumps(run["result"]) if run["result"] is not None else None, run["error"],
                     run["attempts"], run["created_at"], run["started_at"], run["finished_at"], run["worker"]))
                conn.executemany("INSERT INTO trace (run_id, idx, epoch, step, row) VALUES (?, ?, ?, ?, ?)",
                                 [(rid, i, r.get("epoch"), r.get("step"), dumps(r)) for i, r in enumerate(trace)])
            stats["added" if here is None else "updated"] += 1
            mine[rid] = run["status"]
        from fastdiag.grokking.interventions import merge_tables   # experiments keep their own tables

        stats["intervention_arms_added"] = merge_tables(self, other)
        return stats


def _claim_is_live(host: str, pid: int, expires: float, now: float) -> bool:
    """A claim holds while it is renewed; on this host also only while its process exists (so a
    sweep killed with ``kill -9`` frees its runs at once, not after the lease)."""
    if expires < now:
        return False
    if host != socket.gethostname():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:      # exists, another user's
        return True
    return True


class Lease:
    """This process's claims on runs of a store, renewed by a heartbeat thread while it is open.

    ``claim`` takes the runs no live sweep holds and marks them running (one more attempt each: a
    claim is taken right before a run starts). Finishing a run (`Store.record_done`/`record_failed`)
    drops its claim; closing the lease drops the rest, so an interrupted sweep's runs are free again.
    A claim whose process died (same host) or that was not renewed for ``lease_s`` (another host) is
    taken over."""

    def __init__(self, store: Store, lease_s: float = LEASE_S):
        self.store, self.lease_s = store, lease_s
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.owner = f"{self.host}:{self.pid}:{uuid.uuid4().hex[:8]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, name="fastdiag-lease", daemon=True)

    def __enter__(self) -> "Lease":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        with suppress(StoreError):      # a full disk must not hide the error that ended the sweep
            with self.store.transaction() as conn:
                conn.execute("DELETE FROM claims WHERE owner = ?", (self.owner,))

    def _heartbeat(self) -> None:
        conn = _connect(self.store.path, readonly=False)     # a connection is not shared between threads
        try:
            while not self._stop.wait(self.lease_s / 4):
                with suppress(StoreError):  # missed beats only let another sweep take over later
                    conn.execute("UPDATE claims SET expires = ? WHERE owner = ?",
                                 (time.time() + self.lease_s, self.owner))
        finally:
            conn.close()

    def claim(self, run_ids: Iterable[str], statuses: Iterable[str] = ("pending", "running", "failed"),
              worker: str | None = None) -> list[str]:
        """Claim those of ``run_ids`` whose status is in ``statuses`` and that no live sweep holds;
        returns the ids claimed (in the given order)."""
        now, wanted, got = time.time(), tuple(statuses), []
        with self.store.transaction() as conn:
            for rid in run_ids:
                row = conn.execute("SELECT status FROM runs WHERE run_id = ?", (rid,)).fetchone()
                if row is None or row[0] not in wanted:
                    continue
                held = conn.execute("SELECT owner, host, pid, expires FROM claims WHERE run_id = ?", (rid,)).fetchone()
                if held is not None and held[0] != self.owner and _claim_is_live(*held[1:], now):
                    continue
                got.append(rid)
            conn.executemany("INSERT OR REPLACE INTO claims (run_id, owner, host, pid, expires) VALUES (?, ?, ?, ?, ?)",
                             [(rid, self.owner, self.host, self.pid, now + self.lease_s) for rid in got])
            conn.executemany("UPDATE runs SET status = 'running', started_at = ?, attempts = attempts + 1, "
                             "worker = ?, error = NULL WHERE run_id = ?",
                             [(now, worker or self.host, rid) for rid in got])
        return got

    def held_elsewhere(self, run_ids: Iterable[str]) -> dict[str, str]:
        """run id → owner, for those of ``run_ids`` a live sweep other than this one holds."""
        now, out = time.time(), {}
        for rid in run_ids:
            held = self.store.conn.execute("SELECT owner, host, pid, expires FROM claims WHERE run_id = ?",
                                           (rid,)).fetchone()
            if held is not None and held[0] != self.owner and _claim_is_live(*held[1:], now):
                out[rid] = held[0]
        return out


def open_existing(path: str | os.PathLike) -> Store:
    """Open a store that must already exist, read-only (analyze, plot, export, merge inputs): it may
    sit on a read-only mount or belong to another user, and a reader never changes it."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"store {p}: no such file")
    if p.is_file() and p.stat().st_size == 0:
        raise StoreError(f"store {p}: empty file, not a fastdiag result store")
    return Store(p, create=False, readonly=True)


# ---------------------------------------------------------------------- checking what was read

def _config_types() -> dict[str, tuple[type, ...]]:
    from fastdiag.grokking.config import RunConfig  # noqa: PLC0415

    types = {}
    for f in dataclasses.fields(RunConfig):
        default = f.default
        if default is None:
            types[f.name] = (int, type(None))
        elif isinstance(default, bool):
            types[f.name] = (bool,)
        elif isinstance(default, float):
            types[f.name] = (int, float)
        else:
            types[f.name] = (type(default),)
    return types


def _checked_config(config, path, run_id: str) -> dict:
    """The config of a stored run: every RunConfig field, of its type, valid (else StoreError)."""
    def damaged(why: str) -> StoreError:
        return StoreError(f"store {path}: run {run_id}: damaged config ({why})")

    if not isinstance(config, dict):
        raise damaged(f"a JSON {type(config).__name__}, not an object")
    types = _config_types()
    missing = sorted(set(types) - set(config))
    if missing:
        raise damaged(f"missing key(s) {', '.join(missing)}")
    for key, value in config.items():
        allowed = types.get(key)
        if allowed is None:
            raise damaged(f"unknown key {key!r}")
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            raise damaged(f"{key} is {value!r}, expected {' or '.join(t.__name__ for t in allowed)}")
    from fastdiag.grokking.config import RunConfig  # noqa: PLC0415

    try:
        RunConfig.from_dict(config).validate()
    except ValueError as exc:
        raise damaged(str(exc)) from None
    return config


# Result fields that analysis reads, and what they must be.
_RESULT_NUMBERS = ("t_grok_epoch", "t_grok_step", "t_mem_epoch", "t_mem_step", "anti_grok_epoch", "n_params",
                   "final_train_acc", "final_test_acc", "peak_s_bar", "peak_sigma_h", "epochs_run", "steps")


def _check_result(result, path, run_id: str) -> None:
    if result is None:
        raise StoreError(f"store {path}: run {run_id}: damaged result (a done run with no result)")
    if not isinstance(result, dict):
        raise StoreError(f"store {path}: run {run_id}: damaged result (a JSON {type(result).__name__}, not an object)")
    if not isinstance(result.get("regime"), str):
        raise StoreError(f"store {path}: run {run_id}: damaged result (regime is {result.get('regime')!r}, "
                         "expected a string)")
    for key in _RESULT_NUMBERS:
        value = result.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise StoreError(f"store {path}: run {run_id}: damaged result ({key} is {value!r}, expected a number)")
