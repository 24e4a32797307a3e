"""The SQLite result store: schema marks, foreign/corrupt files, atomic finished runs, merging."""
import sqlite3

import pytest

from fastdiag.grokking.config import RunConfig
from fastdiag.store import APPLICATION_ID, SCHEMA_VERSION, Lease, Store, StoreError, open_existing

from tests.helpers import insert_arms


def _cfgs(n=3):
    return [RunConfig(weight_decay=0.1 * (i + 1), seed=i, epochs=5, p=11) for i in range(n)]


def test_new_store_is_marked_and_wal(tmp_path):
    path = tmp_path / "s.sqlite"
    with Store(path) as st:
        assert st.add_runs(_cfgs()) == 3
        assert st.add_runs(_cfgs()) == 0          # known runs left alone
        assert st.counts() == {"pending": 3, "running": 0, "done": 0, "failed": 0}
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()


def test_done_run_roundtrip_and_nan_cleaned(tmp_path):
    cfg = _cfgs(1)[0]
    with Store(tmp_path / "s.sqlite") as st:
        st.add_runs([cfg])
        with Lease(st) as lease:
            assert lease.claim([cfg.run_id()]) == [cfg.run_id()]
        trace = [{"epoch": 1, "step": 1, "test_loss": float("nan"), "s_bar": 0.9},
                 {"epoch": 2, "step": 2, "test_loss": 1.0, "s_bar": None}]
        st.record_done(cfg.run_id(), {"regime": "grok", "x": float("inf")}, trace)
        run = st.get(cfg.run_id())
        assert run["status"] == "done" and run["attempts"] == 1
        assert run["result"] == {"regime": "grok", "x": None}
        assert run["config"] == cfg.to_dict()
        assert st.trace(cfg.run_id()) == [{"epoch": 1, "step": 1, "test_loss": None, "s_bar": 0.9},
                                         {"epoch": 2, "step": 2, "test_loss": 1.0, "s_bar": None}]


def test_finished_run_is_one_transaction(tmp_path):
    cfg = _cfgs(1)[0]
    with Store(tmp_path / "s.sqlite") as st:
        st.add_runs([cfg])
        bad_trace = [{"epoch": 1, "step": 1}, {"epoch": 2, "step": 2, "oops": object()}]
        with pytest.raises(TypeError):
            st.record_done(cfg.run_id(), {"regime": "grok"}, bad_trace)
        assert st.get(cfg.run_id())["status"] == "pending"      # nothing of it landed
        assert st.trace(cfg.run_id()) == []


def test_text_file_is_refused(tmp_path):
    path = tmp_path / "notes.sqlite"
    path.write_text("hello, this is not a database\n")
    with pytest.raises(StoreError, match="not an SQLite database"):
        Store(path)
    with pytest.raises(StoreError, match="not an SQLite database"):
        open_existing(path)


def test_foreign_sqlite_is_refused(tmp_path):
    path = tmp_path / "other.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE customers (id INTEGER)")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match="foreign SQLite database.*customers"):
        Store(path)


def test_corrupt_store_is_refused(tmp_path):
    path = tmp_path / "s.sqlite"
    Store(path).close()
    data = bytearray(path.read_bytes())
    data[100:] = b"\xff" * (len(data) - 100)
    path.write_bytes(bytes(data))
    for name in ("s.sqlite-wal", "s.sqlite-shm"):
        (tmp_path / name).unlink(missing_ok=True)
    with pytest.raises(StoreError):
        Store(path)


def test_missing_store_for_reading(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        open_existing(tmp_path / "nope.sqlite")


def test_empty_sqlite_file_becomes_a_store(tmp_path):
    path = tmp_path / "empty.sqlite"
    sqlite3.connect(path).close()
    with Store(path) as st:
        assert st.counts()["done"] == 0


def test_merge_is_idempotent_and_prefers_done(tmp_path):
    a, b, c = _cfgs(3)
    with Store(tmp_path / "a.sqlite") as sa, Store(tmp_path / "b.sqlite") as sb, \
            Store(tmp_path / "out.sqlite") as out:
        sa.add_runs([a, b])
        sa.record_done(a.run_id(), {"regime": "grok"}, [{"epoch": 1, "step": 1}])
        sb.add_runs([b, c])
        sb.record_done(b.run_id(), {"regime": "collapse"}, [{"epoch": 1, "step": 1}, {"epoch": 2, "step": 2}])
        sb.record_failed(c.run_id(), "boom")
        first = out.merge_from(sa)
        out.merge_from(sb)
        assert first["added"] == 2
        again = out.merge_from(sa), out.merge_from(sb)
        assert all(s["added"] == 0 and s["updated"] == 0 for s in again)
        status = out.status_of()
        assert status == {a.run_id(): "done", b.run_id(): "done", c.run_id(): "failed"}
        assert len(out.trace(b.run_id())) == 2 and len(out.trace(a.run_id())) == 1
        n_trace = out.conn.execute("SELECT COUNT(*) FROM trace").fetchone()[0]
        assert n_trace == 3
        with pytest.raises(StoreError, match="output store itself"):
            out.merge_from(out)


def test_merge_tells_a_packed_copy_from_a_single_one(tmp_path):
    """The same configuration finished in two stores — packed in an ensemble in one, alone in the
    other, with another outcome — is different evidence, not "unchanged"; a copy equal up to its wall
    time is unchanged."""
    (a,) = _cfgs(1)
    rid = a.run_id()
    single = {"regime": "memorization", "t_grok_epoch": None, "wall_seconds": 10.0}
    packed = {"regime": "grok", "t_grok_epoch": 100, "wall_seconds": 3.0, "ensemble_size": 4}
    with Store(tmp_path / "one.sqlite") as s1, Store(tmp_path / "pack.sqlite") as s2, \
            Store(tmp_path / "again.sqlite") as s3, Store(tmp_path / "out.sqlite") as out:
        for st, result in ((s1, single), (s2, packed), (s3, dict(single, wall_seconds=99.0))):
            st.add_runs([a])
            st.record_done(rid, result, [{"epoch": 1, "step": 1}])
        assert out.merge_from(s1)["added"] == 1
        stats = out.merge_from(s2)
        assert stats["differ"] == 1 and stats["unchanged"] == 0
        assert out.get(rid)["result"]["regime"] == "memorization"            # the first copy kept
        assert out.merge_from(s3) == {"added": 0, "updated": 0, "unchanged": 1, "differ": 0,
                                      "intervention_arms_added": 0}


def test_merge_copies_intervention_arms_once(tmp_path):
    with Store(tmp_path / "a.sqlite") as sa, Store(tmp_path / "out.sqlite") as out:
        insert_arms(sa, "x", arms=("control", "reinit", "clip"), trace_rows=4)
        assert out.merge_from(sa)["intervention_arms_added"] == 3
        assert out.merge_from(sa)["intervention_arms_added"] == 0
        assert out.conn.execute("SELECT COUNT(*) FROM intervention_runs").fetchone()[0] == 3
        assert out.conn.execute("SELECT COUNT(*) FROM intervention_trace").fetchone()[0] == 12


@pytest.mark.parametrize("jump_s", [90.0, 300.0, -3600.0])
def test_a_live_sweeps_claims_survive_a_clock_jump_on_its_host(tmp_path, monkeypatch, jump_s):
    """The wall clock steps (NTP, a resumed VM, a hand-set clock) between a sweep's claim and another
    sweep's look at it: forward past the lease, the claim looked expired; back, or a claim whose expiry
    lies far ahead, it looked not credible -- either way a live sweep's run was taken over and trained
    twice. On this host the claim's process decides; a process gone frees it whatever the clock says."""
    import subprocess
    import time

    from fastdiag.store import lease as lease_module
    cfgs = _cfgs(2)
    ids = [c.run_id() for c in cfgs]
    with Store(tmp_path / "s.sqlite") as st:
        st.add_runs(cfgs)
        with Lease(st) as first:
            assert first.claim(ids[:1]) == ids[:1]
            wall = time.time
            monkeypatch.setattr(lease_module.time, "time", lambda: wall() + jump_s)
            with Lease(st) as second:
                assert second.claim(ids) == ids[1:]
                assert second.held_elsewhere(ids) == {ids[0]: first.owner}
            gone = subprocess.Popen(["true"])
            gone.wait()
            with st.transaction() as conn:          # the same claim, its process gone (killed -9)
                conn.execute("UPDATE claims SET pid = ?, owner = 'x:1:dead' WHERE run_id = ?", (gone.pid, ids[0]))
            with Lease(st) as third:
                assert third.claim(ids[:1]) == ids[:1]
