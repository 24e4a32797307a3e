"""The `fastdiag` command line: the only layer that knows flags and prints.

``app`` holds the click group, the error handling (one line on stderr, exit status 2) and the
mapping from library parameter names to flags; each command lives in its own module and is
registered here, so a command module that fails to import fails loudly instead of vanishing from
``fastdiag --help``.
"""
from fastdiag.cli import analyze, bench, intervene, plot, run, sweep
from fastdiag.cli.app import CLIError, cli, main

for _module in (run, sweep, analyze, plot, bench, intervene):
    for _command in _module.COMMANDS:
        cli.add_command(_command)

__all__ = ["CLIError", "cli", "main"]
