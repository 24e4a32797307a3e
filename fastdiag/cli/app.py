"""The `fastdiag` command line. Every error is one line on stderr and exit status 2."""
from __future__ import annotations

import os
import signal
import sys
import threading


def _interrupted_while_loading(signum, frame) -> None:
    os.write(2, b"fastdiag: error: interrupted\n")
    os._exit(130)


# Ctrl-C while the command line is still loading (click, the store: a tenth of a second, seconds on a
# loaded machine) ends it with the same one line and status as later, not a traceback from inside an
# import; Python's own handler is put back once the command's module is loaded (`_loaded`), and the
# commands import torch, scipy and matplotlib in their bodies under the same handler (`loading`). Only where
# this process is the `fastdiag` program (its script, or `python -m` finding fastdiag.cli), never in a
# program that imports fastdiag.cli.
_THE_PROGRAM = os.path.basename(sys.argv[0]) == "fastdiag" or sys.argv[0] == "-m"


def _arm() -> bool:
    """Install the loading handler where this is the program and Python's own handler is in place."""
    if _THE_PROGRAM and threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupted_while_loading)
        return True
    return False


_arm()


def _loaded() -> None:
    """The command's module is loaded (torch, the store, ...): Ctrl-C unwinds as usual from here on, so
    every `finally` runs. Until then it ends the program with one line: an interrupt inside a library's
    import (one that catches it and raises ImportError, or leaves a module half made) gave a traceback."""
    if threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGINT) is _interrupted_while_loading:
        signal.signal(signal.SIGINT, signal.default_int_handler)


import importlib  # noqa: E402 - after the handler: an interrupt in any import is one line
import sqlite3  # noqa: E402
from contextlib import contextmanager  # noqa: E402

import click  # noqa: E402

from fastdiag.cli.options import PARAM_FLAGS  # noqa: E402
from fastdiag.grokking.config import RunConfig  # noqa: E402
from fastdiag.store import Store, open_existing  # noqa: E402


@contextmanager
def loading():
    """Around a command's own imports of torch, scipy and the like (kept out of its module so that its
    --help loads none of them): Ctrl-C inside them ends the program with the start-up's one line and
    status 130, not a traceback from inside a library's import; Python's handler is back afterwards."""
    armed = _arm()
    try:
        yield
    finally:
        if armed:
            _loaded()


class CLIError(click.ClickException):
    """An error the user can fix: printed as one line, exit status 2."""

    exit_code = 2


class LazyGroup(click.Group):
    """A group whose commands' modules load when a command is run (or its help is asked for): they
    import torch, and ``fastdiag --help`` (the command listing) would otherwise wait seconds, tens of
    seconds on a loaded machine, for a torch it never uses. ``lazy``: command name → (module, the
    first words of its help, for the listing; tests/test_cli_run.py checks them against the command)."""

    lazy: dict[str, tuple[str, str]] = {}

    def list_commands(self, ctx) -> list[str]:
        return sorted(set(self.commands) | set(self.lazy))

    def get_command(self, ctx, name):
        if name not in self.commands and name in self.lazy:
            for command in importlib.import_module(self.lazy[name][0]).COMMANDS:
                self.add_command(command)
        _loaded()
        return self.commands.get(name)

    def format_commands(self, ctx, formatter) -> None:
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(map(len, names))
        rows = []
        for name in names:
            text = self.lazy[name][1] if name in self.lazy else self.commands[name].get_short_help_str(limit)
            if len(text) > limit:
                text = text[:limit - 3].rsplit(" ", 1)[0] + "..."
            rows.append((name, text))
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fastdiag", message="%(prog)s %(version)s")   # the installed metadata: no torch
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
