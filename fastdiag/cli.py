"""The `fastdiag` command line. Every error is one line on stderr and exit status 2."""
from __future__ import annotations

import sys

import click


class CLIError(click.ClickException):
    """An error the user can fix: printed as one line, exit status 2."""

    exit_code = 2


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """fastdiag: cheap, exact, online diagnostics of attention heads."""


def _register_commands() -> None:
    # Each command lives in its own module; importing them here keeps `fastdiag --help` complete.
    import importlib

    for module in ("run", "sweep", "analyze", "plot", "bench", "intervene"):
        try:
            mod = importlib.import_module(f"fastdiag.cmd_{module}")
        except ModuleNotFoundError as exc:
            if exc.name == f"fastdiag.cmd_{module}":
                continue
            raise
        for command in getattr(mod, "COMMANDS", ()):
            cli.add_command(command)


def _one_line(message: str) -> str:
    return " ".join(str(message).split())


def main(argv: list[str] | None = None) -> None:
    _register_commands()
    try:
        cli.main(args=argv, prog_name="fastdiag", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("fastdiag: error: aborted", err=True)
        sys.exit(2)
    except click.ClickException as exc:  # usage errors, bad options, CLIError
        click.echo(f"fastdiag: error: {_one_line(exc.format_message())}", err=True)
        sys.exit(2)
    except (ValueError, TypeError, FileNotFoundError, PermissionError) as exc:
        click.echo(f"fastdiag: error: {_one_line(exc)}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        click.echo("fastdiag: error: interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
