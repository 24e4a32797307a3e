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

import json
import os
import sqlite3
import stat
import time
import urllib.parse
from contextlib import contextmanager, suppress
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterable, Iterator

from fastdiag.store.checks import StoreError, check_result, check_trace_row, checked_config
from fastdiag.store.interventions import merge_tables
from fastdiag.store.rows import dumps

APPLICATION_ID = 0x46446967          # "FDig"
SCHEMA_VERSION = 1
# A run's status: the one home of these names (the schema's CHECK, `export --status`, counts).
STATUSES = ("pending", "running", "done", "failed")
_SQLITE_MAGIC = b"SQLite format 3\x00"
# When merging, a run's better state wins: a finished run is never replaced by an unfinished one.
_RANK = {status: rank for rank, status in enumerate(("pending", "running", "failed", "done"))}
if set(_RANK) != set(STATUSES):        # a new status needs its rank
    raise RuntimeError(f"_RANK and STATUSES differ: {sorted(set(_RANK) ^ set(STATUSES))}")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT
);
CREATE TABLE IF NOT EXISTS runs (
    run_id      TEXT PRIMARY KEY,
    config      TEXT NOT NULL,
    status      TEXT NOT NULL CHECK (status IN (%s)),
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
""" % ", ".join(f"'{status}'" for status in STATUSES)
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


def _may_hold_commits(wal: Path) -> bool:
    """A -wal file with any bytes may hold committed transactions the main file lacks (an empty one,
    left by a checkpoint that truncated it, holds none); one that cannot be looked at may too."""
    try:
        return os.stat(wal).st_size > 0
    except FileNotFoundError:
        return False
    except OSError:
        return True


_READ_ONLY = "cannot be written here (read-only file, directory or file system)"


def _why_unusable(sqlite_message: str) -> str:
    """What SQLite's message means to the user: a store on a full disk or a read-only file system is
    not "unreadable", and saying so sends them looking for damage that is not there."""
    text = sqlite_message.lower()
    if "readonly" in text or "read-only" in text:
        return _READ_ONLY
    if "full" in text:
        return "cannot be written: the disk is full"
    if "locked" in text or "busy" in text:
        return "locked by another process for too long"
    if "unable to open" in text:
        return "cannot be opened (its directory must be readable, and writable for a writer)"
    return "unreadable SQLite database"


def connect(path: Path, readonly: bool) -> _Connection:
    if readonly:
        # mode=ro never writes, and it reads the committed transactions still in the -wal. Where it
        # cannot open (a read-only mount with no -shm file, which it cannot create) the file is read
        # as immutable, which ignores the -wal: that is right only when there is no -wal at all (the
        # last writer closed cleanly, so everything is in the main file). A -wal means committed runs
        # may be in it (a writer killed, a disk that filled, a sweep running): refuse, never a stale read.
        # (A read-only mount that keeps the -shm file too is fine: mode=ro opens it and reads the -wal.)
        resolved = path.resolve()
        uri = f"file:{urllib.parse.quote(str(resolved))}?mode=ro"
        conn = sqlite3.connect(uri, uri=True, timeout=60.0, isolation_level=None, factory=_Connection)
        conn.store_path = path
        try:
            conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
        except SQLiteFailure as exc:
            conn.close()
            wal = Path(f"{resolved}-wal")
            if _may_hold_commits(wal):
                why = str(exc).removeprefix(f"store {path}: ")
                raise StoreError(
                    f"store {path}: cannot be opened read-only here ({why}) and committed runs may still be in "
                    f"{wal.name}; read it where its directory is writable, or copy {resolved.name} together "
                    f"with {wal.name} to a writable directory and read the copy") from None
            conn = sqlite3.connect(uri + "&immutable=1", uri=True, isolation_level=None, factory=_Connection)
    else:
        # Always a URI of the absolute path: the name itself is never read as ":memory:", a URI or its
        # parameters ("?mode=memory"), so the store is the file the user named (checked by `check_path`).
        uri = f"file:{urllib.parse.quote(str(path.resolve()))}?mode=rwc"
        conn = sqlite3.connect(uri, uri=True, timeout=60.0, isolation_level=None, factory=_Connection)
    conn.store_path = path
    return conn


def check_path(path: str | os.PathLike) -> Path:
    """A store is a regular file on disk, always: SQLite's in-memory names (``:memory:``, and ``""``,
    a temporary database) and URIs (``file:x?mode=memory``) would keep nothing, and a FIFO, a device or
    a socket is not a database (opening a FIFO blocks for ever). Raises StoreError saying which."""
    text = os.fspath(path)
    if not text or text.strip() == ":memory:" or text.startswith(":memory:"):
        raise StoreError(f"store {text!r}: an in-memory database keeps nothing; name a file on disk")
    if text.startswith("file:"):
        raise StoreError(f"store {text}: an SQLite URI, not a file name (a store is a regular file on disk; "
                         "write ./file:... for a file whose name starts with 'file:')")
    p = Path(text)
    try:
        mode = os.stat(p).st_mode
    except FileNotFoundError:
        return p
    except OSError as exc:
        raise StoreError(f"store {p}: cannot be looked at ({exc.strerror})") from None
    if stat.S_ISDIR(mode):
        raise StoreError(f"store {p}: is a directory, not a result store")
    if not stat.S_ISREG(mode):
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a special file")
        raise StoreError(f"store {p}: {kind}, not a regular file; a store is a regular file on disk")
    return p


class Store:
    """A fastdiag result store. ``Store(path)`` opens it, creating it when ``create`` is true.

    The store keeps run configurations as JSON objects and knows nothing of their fields: a reader
    passes ``check_config`` (e.g. ``RunConfig.check_stored``, which raises ValueError saying why a
    config is not valid) to have every config it reads checked, and ``identify`` (config → the run id
    it makes) to have it checked against its run id; a bad one raises a StoreError naming the store
    and the run.

    Raises ``FileNotFoundError`` (missing and not ``create``) or ``StoreError`` (not SQLite,
    corrupt, a foreign SQLite database, or a newer schema) with a one-line message.
    """

    def __init__(self, path: str | os.PathLike, create: bool = True, readonly: bool = False,
                 check_config: Callable[[dict], None] | None = None,
                 identify: Callable[[dict], str] | None = None):
        self.path = check_path(path)
        self.readonly = readonly
        self.check_config, self.identify = check_config, identify
        exists = self.path.exists() and self.path.stat().st_size > 0
        if not exists and not create:
            raise FileNotFoundError(f"store {self.path}: no such file")
        if exists:
            self._check_header()
        elif not self.path.parent.exists():
            raise FileNotFoundError(f"store {self.path}: directory {self.path.parent} does not exist")
        try:
            self.conn = connect(self.path, readonly)
            self.conn.execute("PRAGMA busy_timeout = 60000")
            self._init_or_check(create=not exists)
        except (sqlite3.DatabaseError, SQLiteFailure) as exc:
            message = str(exc).removeprefix(f"store {self.path}: ")
            why = _why_unusable(message)
            if not readonly and not (os.access(self.path.parent, os.W_OK) and
                                     (not self.path.exists() or os.access(self.path, os.W_OK))):
                why = _READ_ONLY          # SQLite says only "unable to open database file"
            raise StoreError(f"store {self.path}: {why} ({message})") from None

    # ------------------------------------------------------------------ opening
    def _check_header(self) -> None:
        try:
            # O_NONBLOCK: a FIFO put in the store's place since `check_path` must not block the open
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
            with os.fdopen(fd, "rb") as fh:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise StoreError(f"store {self.path}: not a regular file; a store is a regular file on disk")
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
                    version = metadata.version("fastdiag")
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
            self._refuse_foreign_objects()
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute(_CLAIMS)

    def _refuse_foreign_objects(self) -> None:
        """A store is data: a trigger or view in it (fastdiag creates none) would run its own SQL on our
        writes (a trigger deleting finished runs). A store opened for writing carries only our schema
        objects; readers (read-only connections) run no trigger and read tables, never views."""
        found = [f"{kind} {name}" for kind, name in self.conn.execute(
            "SELECT type, name FROM sqlite_master WHERE type IN ('trigger', 'view') ORDER BY type, name")]
        if found:
            shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
            raise StoreError(f"store {self.path}: carries schema objects fastdiag did not create ({shown}); "
                             "refusing to write to it: drop them (sqlite3 STORE 'DROP TRIGGER ...') or merge its "
                             "runs into a new store (fastdiag merge NEW STORE)")

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
    def add_runs(self, configs: Iterable) -> int:
        """Register runs as pending (those already known are left alone); returns how many are new.
        Each config has ``run_id()`` (its identity) and ``to_dict()`` (what is stored), like RunConfig."""
        now = time.time()
        rows = [(cfg.run_id(), dumps(cfg.to_dict()), now) for cfg in configs]
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
        with self.transaction() as conn:
            _replace_trace(conn, run_id, trace)
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
        config = checked_config(self._json(config, "config", run_id), self.path, run_id, self.check_config,
                                self.identify)
        result = self._json(result, "result", run_id) if result is not None else None
        if status == "done":
            check_result(result, self.path, run_id)
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
        check_trace_row(row, self.path, run_id, idx)
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
        a better state (done > failed > running > pending). Idempotent; never duplicates.

        A run finished in both stores with different results (trained packed in an ensemble in one and
        alone in the other, on another device, or simply not reproducible) is not "unchanged": it is
        counted in ``differ``, and this store keeps its own copy."""
        if other.path.resolve() == self.path.resolve():
            raise StoreError(f"merge: {other.path} is the output store itself")
        mine = self.status_of()
        stats = {"added": 0, "updated": 0, "unchanged": 0, "differ": 0}
        for run in other.runs():
            rid = run["run_id"]
            here = mine.get(rid)
            if here is not None and _RANK[run["status"]] <= _RANK[here]:
                same = True
                if here == "done" and run["status"] == "done":
                    same = _evidence(self.get(rid)["result"]) == _evidence(run["result"])
                stats["unchanged" if same else "differ"] += 1
                continue
            trace = other.trace(rid) if run["status"] == "done" else []
            with self.transaction() as conn:
                conn.execute(
                    f"INSERT OR REPLACE INTO runs ({self._COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (rid, dumps(run["config"]), run["status"],
                     dumps(run["result"]) if run["result"] is not None else None, run["error"],
                     run["attempts"], run["created_at"], run["started_at"], run["finished_at"], run["worker"]))
                _replace_trace(conn, rid, trace)
            stats["added" if here is None else "updated"] += 1
            mine[rid] = run["status"]
        stats["intervention_arms_added"] = merge_tables(self, other)   # experiments keep their own tables
        return stats


def _evidence(result: dict | None) -> dict | None:
    """What a finished run shows, for comparing two copies of it: its result less the wall time. How it
    was trained (``ensemble_size`` when packed) stays part of it."""
    if not isinstance(result, dict):
        return result
    evidence = {k: v for k, v in result.items() if k != "wall_seconds"}
    evidence.setdefault("ensemble_size", 1)
    return evidence


def _replace_trace(conn, run_id: str, trace: list[dict]) -> None:
    """A run's trace rows, replacing any it had (inside the caller's transaction): the one place the
    trace table is written."""
    conn.execute("DELETE FROM trace WHERE run_id = ?", (run_id,))
    conn.executemany("INSERT INTO trace (run_id, idx, epoch, step, row) VALUES (?, ?, ?, ?, ?)",
                     [(run_id, i, row.get("epoch"), row.get("step"), dumps(row)) for i, row in enumerate(trace)])


def open_existing(path: str | os.PathLike, check_config: Callable[[dict], None] | None = None,
                  identify: Callable[[dict], str] | None = None) -> Store:
    """Open a store that must already exist, read-only (analyze, plot, export, merge inputs): it may
    sit on a read-only mount or belong to another user, and a reader never changes it."""
    p = check_path(path)
    if not p.exists():
        raise FileNotFoundError(f"store {p}: no such file")
    if p.is_file() and p.stat().st_size == 0:
        raise StoreError(f"store {p}: empty file, not a fastdiag result store")
    return Store(p, create=False, readonly=True, check_config=check_config, identify=identify)
