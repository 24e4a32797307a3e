"""Writing files whole or not at all, and output directories proven writable before the work starts."""
from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Iterator


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path next to ``path`` to write to; on success it replaces ``path`` in one step (a
    reader never sees half a file), on failure (disk full, ...) it is removed. It keeps the suffix, so
    writers that pick the format from it (matplotlib) still can."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        with suppress(OSError):
            tmp.unlink(missing_ok=True)


def prepare_out_dir(out_dir: str | os.PathLike) -> Path:
    """Create ``out_dir`` and prove it writable now, so that a bad path fails before training, not
    after it (raises OSError: not a directory, read-only file system, permission denied, disk full)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out, prefix=".probe"):
        pass
    return out
