"""The `fastdiag` command line. Every error is one line on stderr and exit status 2."""
from __future__ import annotations

import signal
import sqlite3
import sys
import threading
from contextlib import contextmanager

import click

from fastdiag.cli.options import PARAM_FLAGS
from fastdiag.grokking.config import RunConfig
from fastdiag.store import Store, open_existing


class CLIError(click.ClickException):
    """An error the user can fix: printed as one line, exit status 2."""

    exit_code = 2


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """fastdiag: cheap, exact, online diagnostics of attention heads."""


@contextmanager
def option_errors(flags: dict[str, str] = PARAM_FLAGS):
    """Library errors name parameters ("weight_decay: must be finite"); the user typed flags. Re-raise
    a ValueError/TypeError whose message starts with a parameter in ``flags`` as a CLIError naming the
    flag ("--wd: must be finite")."""
    try:
        yield
    except (ValueError, TypeError) as exc:
        message = _one_line(exc)
        name, sep, rest = message.partition(":")
        if sep and name in flags:
            raise CLIError(f"{flags[name]}:{rest}") from None
        raise


def run_id_of(config: dict) -> str:
    """The run id a stored (already checked) config makes."""
    return RunConfig.from_dict(config).run_id()


def open_store(path) -> Store:
    """An existing store, read-only, every run config it holds checked against RunConfig and its run id."""
    return open_existing(path, check_config=RunConfig.check_stored, identify=run_id_of)


def create_store(path) -> Store:
    """A store to write into (created if missing), every run config it holds checked against RunConfig
    and its run id."""
    return Store(path, create=True, check_config=RunConfig.check_stored, identify=run_id_of)


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that every `finally` runs (a sweep stores what finished)."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


def _one_line(message) -> str:
    return " ".join(str(message).split())


def os_error_text(exc: OSError) -> str:
    """"No space left on device: /data/run" rather than "[Errno 28] ..." with a traceback."""
    where = f": {exc.filename}" if exc.filename else ""
    return f"{exc.strerror or type(exc).__name__}{where}" if exc.strerror else _one_line(exc)


def _fail(message: str, status: int = 2) -> None:
    click.echo(f"fastdiag: error: {_one_line(message)}", err=True)
    sys.exit(status)


def main(argv: list[str] | None = None) -> None:
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if main_thread else None
    try:
        cli.main(args=argv, prog_name="fastdiag", standalone_mode=False)
    except click.exceptions.Abort as exc:    # click turns Ctrl-C (KeyboardInterrupt) into Abort
        _fail("interrupted" if isinstance(exc.__context__, KeyboardInterrupt) else "aborted",
              130 if isinstance(exc.__context__, KeyboardInterrupt) else 2)
    except click.ClickException as exc:  # usage errors, bad options, CLIError
        _fail(exc.format_message())
    except (ValueError, TypeError) as exc:  # StoreError is a ValueError
        _fail(exc)
    except OSError as exc:                   # disk full, read-only file system, permissions, ...
        _fail(os_error_text(exc))
    except sqlite3.Error as exc:             # what the store did not name itself
        _fail(f"result store: {exc}")
    except KeyboardInterrupt:
        _fail("interrupted", 130)
    except Terminated:
        _fail("terminated", 143)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
