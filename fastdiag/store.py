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

A finished run's result and its trace are written in ONE transaction, so a crash (even ``kill -9``)
leaves either the whole finished run or none of it. Only the sweep's driver process writes.
"""
from __future__ import annotations

import json
import math
import os
import socket
import sqlite3
import time
from contextlib import contextmanager
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


class StoreError(ValueError):
    """The file is not a usable fastdiag result store (the message says why, in one line)."""


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
            self.conn = sqlite3.connect(str(self.path), timeout=60.0, isolation_level=None)
            self.conn.execute("PRAGMA busy_timeout = 60000")
            self._init_or_check(create=not exists)
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"store {self.path}: unreadable SQLite database ({exc})") from None

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
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    # ------------------------------------------------------------------ writing
    def add_runs(self, configs: Iterable[dict]) -> int:
        """Register runs as pending (those already known are left alone); returns how many are new."""
        now = time.time()
        rows = []
        for cfg in configs:
            from fastdiag.config import RunConfig  # noqa: PLC0415
            rid = RunConfig.from_dict(cfg).run_id()
            rows.append((rid, dumps(cfg), now))
        with self.transaction() as conn:
            before = conn.total_changes
            conn.executemany(
                "INSERT OR IGNORE INTO runs (run_id, config, status, created_at) VALUES (?, ?, 'pending', ?)",
                rows)
            return conn.total_changes - before

    def mark_running(self, run_ids: Iterable[str], worker: str | None = None) -> None:
        now = time.time()
        worker = worker or socket.gethostname()
        with self.transaction() as conn:
            conn.executemany(
                "UPDATE runs SET status = 'running', started_at = ?, attempts = attempts + 1, worker = ?, "
                "error = NULL WHERE run_id = ? AND status != 'done'",
                [(now, worker, rid) for rid in run_ids])

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

    def record_failed(self, run_id: str, error: str) -> None:
        with self.transaction() as conn:
            conn.execute(
                "UPDATE runs SET status = 'failed', error = ?, finished_at = ? WHERE run_id = ? AND status != 'done'",
                (str(error), time.time(), run_id))

    # ------------------------------------------------------------------ reading
    @staticmethod
    def _run_dict(row: sqlite3.Row | tuple) -> dict:
        (run_id, config, status, result, error, attempts, created, started, finished, worker) = row
        return {
            "run_id": run_id, "config": json.loads(config), "status": status,
            "result": json.loads(result) if result else None, "error": error, "attempts": attempts,
            "created_at": created, "started_at": started, "finished_at": finished, "worker": worker,
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

    def trace(self, run_id: str) -> list[dict]:
        return [json.loads(r[0]) for r in
                self.conn.execute("SELECT row FROM trace WHERE run_id = ? ORDER BY idx", (run_id,))]

    def traces(self) -> Iterator[tuple[str, int, dict]]:
        """(run_id, idx, row) for every trace row, ordered."""
        for rid, idx, row in self.conn.execute("SELECT run_id, idx, row FROM trace ORDER BY run_id, idx"):
            yield rid, idx, json.loads(row)

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
        from .exp_intervene import merge_tables   # experiments keep their own tables

        stats["intervention_arms_added"] = merge_tables(self, other)
        return stats


def open_existing(path: str | os.PathLike) -> Store:
    """Open a store that must already exist (analyze, plot, export, merge inputs)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"store {p}: no such file")
    if p.is_file() and p.stat().st_size == 0:
        raise StoreError(f"store {p}: empty file, not a fastdiag result store")
    return Store(p, create=False)
