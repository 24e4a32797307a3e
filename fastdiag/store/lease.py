"""Claims on the runs of a store, so that sweeps running at the same time on one store share its grid."""
from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from contextlib import suppress
from typing import Iterable

from fastdiag.store.checks import StoreError
from fastdiag.store.db import Store, connect

LEASE_S = 60.0     # a claim not renewed for this long (its sweep hung or its host died) can be taken over


# A renewal sets a claim's expiry one lease ahead; one further ahead than this was not written by a
# renewing sweep (a hand edit, a clock far off) and would block its run for ever: it is not honoured.
_CREDIBLE_AHEAD_S = 2 * LEASE_S
# On this host a claim's process is looked at directly, so its expiry (wall-clock time, which jumps:
# NTP steps, a VM resumed, a hand-set clock) only has to catch a sweep that hangs: one not renewed for
# this long. A clock stepped forward by less, or back by any amount, does not free a live sweep's runs.
_STALE_HERE_S = 10 * LEASE_S


def _claim_is_live(host: str, pid: int, expires: float, now: float, lease_s: float = LEASE_S) -> bool:
    """A claim holds while it is renewed. On this host it holds exactly while its process exists (a
    sweep killed with ``kill -9`` frees its runs at once, not after the lease; a wall-clock jump frees
    nothing), unless it has not been renewed for `_STALE_HERE_S` (a hung sweep); on another host, while
    its expiry lies ahead, but not further ahead than a renewal writes (clocks of two hosts differ)."""
    if host != socket.gethostname():
        return now <= expires <= now + max(_CREDIBLE_AHEAD_S, 2 * lease_s)
    if expires < now - max(_STALE_HERE_S, 10 * lease_s):
        return False
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
    drops its claim; closing the lease drops the rest and makes their runs pending again, so an
    interrupted sweep's runs are free again.
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
                # runs claimed and not finished (the sweep was interrupted) are pending again, not
                # "running" after the sweep has gone
                conn.execute("UPDATE runs SET status = 'pending' WHERE status = 'running' AND run_id IN "
                             "(SELECT run_id FROM claims WHERE owner = ?)", (self.owner,))
                conn.execute("DELETE FROM claims WHERE owner = ?", (self.owner,))

    def _heartbeat(self) -> None:
        conn = connect(self.store.path, readonly=False)     # a connection is not shared between threads
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
                if held is not None and held[0] != self.owner and _claim_is_live(*held[1:], now, self.lease_s):
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
            if held is not None and held[0] != self.owner and _claim_is_live(*held[1:], now, self.lease_s):
                out[rid] = held[0]
        return out
