"""The tables of the intervention experiments, kept beside the sweep's ``runs`` so that the runs table
and everything that reads it are unchanged: ``intervention_runs`` (one row per arm of a seed) and
``intervention_trace`` (its evaluations)."""
from __future__ import annotations

import json
import math

from fastdiag.store.checks import StoreError, checked_config
from fastdiag.store.rows import dumps

_SCHEMA = """
CREATE TABLE IF NOT EXISTS intervention_runs (
    arm_id       TEXT PRIMARY KEY,
    experiment   TEXT NOT NULL,
    seed         INTEGER NOT NULL,
    arm          TEXT NOT NULL,
    branch_of    TEXT NOT NULL,
    branch_epoch INTEGER,
    config       TEXT NOT NULL,
    settings     TEXT NOT NULL,
    intervention TEXT NOT NULL,
    result       TEXT NOT NULL,
    metrics      TEXT NOT NULL,
    created_at   REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS intervention_trace (
    arm_id TEXT NOT NULL,
    idx    INTEGER NOT NULL,
    epoch  INTEGER,
    step   INTEGER,
    row    TEXT NOT NULL,
    PRIMARY KEY (arm_id, idx)
) WITHOUT ROWID;
"""

_COLUMNS = ("arm_id", "experiment", "seed", "arm", "branch_of", "branch_epoch", "config", "settings",
            "intervention", "result", "metrics", "created_at")
_PLAIN = ("arm_id", "experiment", "seed", "arm", "branch_of", "branch_epoch", "created_at")   # not JSON


def ensure_tables(store) -> None:
    with store.transaction() as conn:
        for statement in _SCHEMA.split(";"):
            if statement.strip():
                conn.execute(statement)


def has_tables(store) -> bool:
    names = {r[0] for r in store.conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    return "intervention_runs" in names


def stored_seeds(store, experiment: str, n_arms: int) -> set[int]:
    """The seeds of ``experiment`` stored with all their ``n_arms`` arms."""
    if not has_tables(store):
        return set()
    rows = store.conn.execute("SELECT seed, COUNT(*) FROM intervention_runs WHERE experiment = ? GROUP BY seed",
                              (experiment,)).fetchall()
    return {seed for seed, n in rows if n == n_arms}


def record_arms(store, arms: list[dict], traces: list[list[dict]]) -> None:
    """Write the arms of one seed (``intervention_runs`` rows as dicts of their columns, values not
    yet encoded) and their traces in one transaction, replacing earlier versions of those arms."""
    ensure_tables(store)
    with store.transaction() as conn:
        for arm, trace in zip(arms, traces):
            conn.execute("DELETE FROM intervention_trace WHERE arm_id = ?", (arm["arm_id"],))
            values = [arm[c] if c in _PLAIN else dumps(arm[c]) for c in _COLUMNS]
            conn.execute(f"INSERT OR REPLACE INTO intervention_runs ({', '.join(_COLUMNS)}) "
                         f"VALUES ({', '.join('?' * len(_COLUMNS))})", values)
            conn.executemany("INSERT INTO intervention_trace (arm_id, idx, epoch, step, row) VALUES (?, ?, ?, ?, ?)",
                             [(arm["arm_id"], i, r.get("epoch"), r.get("step"), dumps(r)) for i, r in enumerate(trace)])


def merge_tables(dst, src) -> int:
    """Copy the intervention arms of store ``src`` missing from ``dst`` (with their traces); idempotent.
    Returns how many arms were added."""
    if not has_tables(src):
        return 0
    ensure_tables(dst)
    have = {r[0] for r in dst.conn.execute("SELECT arm_id FROM intervention_runs")}
    # The input's column names are untrusted text: copy only the columns this schema has, quoted.
    known = [r[1] for r in dst.conn.execute("PRAGMA table_info(intervention_runs)")]
    present = {r[1] for r in src.conn.execute("PRAGMA table_info(intervention_runs)")}
    cols = [c for c in known if c in present]
    quoted = ", ".join('"' + c.replace('"', '""') + '"' for c in cols)
    added = 0
    for row in src.conn.execute(f"SELECT {quoted} FROM intervention_runs").fetchall():
        arm_id = row[cols.index("arm_id")]
        if arm_id in have:
            continue
        checked_arm(src, dict(zip(cols, row)))     # a damaged arm is refused, not copied on
        trace = src.conn.execute("SELECT arm_id, idx, epoch, step, row FROM intervention_trace WHERE arm_id = ?",
                                 (arm_id,)).fetchall()
        with dst.transaction() as conn:
            conn.execute(f"INSERT INTO intervention_runs ({quoted}) VALUES ({', '.join('?' * len(cols))})", row)
            conn.executemany("INSERT INTO intervention_trace (arm_id, idx, epoch, step, row) VALUES (?, ?, ?, ?, ?)", trace)
        added += 1
    return added


_JSON = ("config", "settings", "intervention", "result", "metrics")
_LOADED = ("arm_id", "experiment", "seed", "arm", "branch_of", "branch_epoch") + _JSON


def _json_object(store, text, what: str):
    try:
        value = json.loads(text)
    except (TypeError, ValueError) as exc:
        raise StoreError(f"store {store.path}: {what} (invalid JSON: {exc})") from None
    if not isinstance(value, dict):
        raise StoreError(f"store {store.path}: {what} (a JSON {type(value).__name__}, not an object)")
    return value


def checked_arm(store, row: dict) -> dict:
    """An ``intervention_runs`` row (columns → stored values) with its JSON parsed and checked, as
    analysis and plots read it: store content is untrusted, and a damaged arm raises a StoreError
    naming the store and the arm, never a KeyError or AttributeError further on."""
    arm_id = row.get("arm_id")
    where = f"intervention arm {arm_id!r}"
    for key, kind in (("arm_id", str), ("experiment", str), ("arm", str), ("seed", int)):
        if not isinstance(row.get(key), kind) or isinstance(row.get(key), bool):
            raise StoreError(f"store {store.path}: {where}: damaged {key} ({row.get(key)!r}, expected {kind.__name__})")
    out = dict(row)
    for key in _JSON:
        out[key] = _json_object(store, row.get(key), f"{where}: damaged {key}")
    out["config"] = checked_config(out["config"], store.path, arm_id, store.check_config, label=where)
    for name, value in out["metrics"].items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            raise StoreError(f"store {store.path}: {where}: damaged metrics ({name} is {value!r}, "
                             "expected a finite number or null)")
    return out


def load_experiments(store) -> dict[str, list[dict]]:
    """experiment id → arm rows (dicts with parsed, checked JSON), ordered by seed and arm."""
    if not has_tables(store):
        return {}
    out: dict[str, list[dict]] = {}
    for row in store.conn.execute(f"SELECT {', '.join(_LOADED)} FROM intervention_runs ORDER BY experiment, seed, arm"):
        d = checked_arm(store, dict(zip(_LOADED, row)))
        out.setdefault(d["experiment"], []).append(d)
    return out


def arm_trace(store, arm_id: str) -> list[dict]:
    return [_json_object(store, text, f"intervention arm {arm_id!r}: damaged trace row {idx}")
            for idx, text in store.conn.execute(
                "SELECT idx, row FROM intervention_trace WHERE arm_id = ? ORDER BY idx", (arm_id,))]
