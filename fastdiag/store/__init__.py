"""The result store of a sweep: one SQLite file (``db``; claims of running sweeps in ``lease``), the
tables of the intervention experiments (``interventions``), and files written whole or not at all
(``files``). It imports nothing else of fastdiag, so every layer may read and write results."""
from fastdiag.store.checks import StoreError
from fastdiag.store.db import APPLICATION_ID, SCHEMA_VERSION, STATUSES, SQLiteFailure, Store, open_existing
from fastdiag.store.lease import LEASE_S, Lease
from fastdiag.store.rows import dumps

__all__ = ["APPLICATION_ID", "LEASE_S", "SCHEMA_VERSION", "STATUSES", "Lease", "SQLiteFailure", "Store",
           "StoreError", "dumps", "open_existing"]
