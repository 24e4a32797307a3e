"""The result store of a sweep: one SQLite file (``db``), the tables of the intervention
experiments, and merging stores. Imports nothing else of fastdiag, so any layer may read a store."""
from fastdiag.store.db import (APPLICATION_ID, LEASE_S, SCHEMA_VERSION, STATUSES, Lease, SQLiteFailure, Store,
                               StoreError, dumps, open_existing)

__all__ = ["APPLICATION_ID", "LEASE_S", "SCHEMA_VERSION", "STATUSES", "Lease", "SQLiteFailure", "Store",
           "StoreError", "dumps", "open_existing"]
