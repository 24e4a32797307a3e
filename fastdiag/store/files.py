"""Writing files whole or not at all, and output directories proven writable before the work starts."""
from __future__ import annotations

import errno
import os
import stat
import tempfile
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Iterator


def check_target(path: Path) -> None:
    """Refuse to replace anything but a regular file (or nothing): a FIFO, a device or a socket at
    ``path`` is someone's, and replacing it with a file would break them (raises ValueError)."""
    with suppress(FileNotFoundError):
        mode = os.stat(path).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "is a directory", str(path))
        if not stat.S_ISREG(mode):
            raise ValueError(f"{path}: not a regular file (a FIFO, device or socket); refusing to replace it")


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path next to ``path`` to write to; on success it replaces ``path`` in one step (a
    reader never sees half a file), on failure (disk full, ...) it is removed. It keeps the suffix, so
    writers that pick the format from it (matplotlib) still can.

    The temporary file is created new (``O_EXCL``) under an unpredictable name, so a link planted at
    a guessable name cannot redirect the write, and ``path`` must be a regular file or absent."""
    path = Path(path)
    check_target(path)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=f".tmp{path.suffix}")
    tmp = Path(name)
    try:
        os.fchmod(fd, 0o666 & ~_umask())      # what a plain open() would have given the file
        os.close(fd)
        try:
            yield tmp
        except OSError as exc:
            # A full disk on write() or close() names no file ("No space left on device"), or names
            # the hidden temporary: the user should read the file they asked for.
            if exc.errno and exc.filename in (None, str(tmp), name):
                raise OSError(exc.errno, exc.strerror or os.strerror(exc.errno), str(path)) from None
            raise
        check_target(path)
        os.replace(tmp, path)
    finally:
        with suppress(OSError):
            tmp.unlink(missing_ok=True)


def _umask() -> int:
    # Read where the kernel shows it (Linux 4.7+): setting the umask to read it back would, for that
    # instant, give files created by other threads of this process mode 0666.
    with suppress(OSError, ValueError):
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def check_writable_file(path: str | os.PathLike) -> Path:
    """Prove now, before the work, that ``path`` can be written when the work ends: its directory
    exists and takes a new file, and nothing but a regular file is in its place (raises OSError:
    no such directory, read-only, permission denied, a directory; ValueError: a special file)."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, "Is a directory", str(path))
    if not path.parent.is_dir():
        raise FileNotFoundError(errno.ENOENT, "No such directory", str(path.parent))
    check_target(path)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".probe"):
        pass
    return path


def prepare_out_dir(out_dir: str | os.PathLike) -> Path:
    """Create ``out_dir`` and prove it writable now, so that a bad path fails before training, not
    after it (raises OSError: not a directory, read-only file system, permission denied, disk full)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out, prefix=".probe"):
        pass
    return out
