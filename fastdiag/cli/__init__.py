"""The `fastdiag` command line: the only layer that knows flags and prints.

``app`` holds the click group, the error handling (one line on stderr, exit status 2) and the
mapping from library parameter names to flags; each command lives in its own module and is
registered here, so a command module that fails to import fails loudly instead of vanishing from
``fastdiag --help``.
"""
import os

# OpenMP reads its wait policy once, when torch loads it, so it is set before anything below can load
# torch: threads that spin at every op's barrier burn the cores a descheduled teammate needs on a busy
# machine (two threads 4-16x slower than one at load 6-8; passive, 0.5-0.84x: benchmarks/RESULTS.md,
# "threads"). A user's own OMP_WAIT_POLICY stands.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from fastdiag.cli import analyze, bench, intervene, plot, run, sweep  # noqa: E402 - after the policy
from fastdiag.cli.app import CLIError, cli, main

for _module in (run, sweep, analyze, plot, bench, intervene):
    for _command in _module.COMMANDS:
        cli.add_command(_command)

__all__ = ["CLIError", "cli", "main"]
