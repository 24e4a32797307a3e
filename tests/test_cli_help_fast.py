"""`fastdiag COMMAND --help` loads no statistics, figures or (where it can) torch (issue 41: a command's help
took 3-11 s under load while the command listing took 0.5 s): what a fresh interpreter has imported after
asking for the help, not a timing. The command modules import those in the bodies that use them.

Some commands' options still take their defaults or help from a module that imports torch, so their help
loads torch (listed in TORCH_FOR_OPTIONS with the reason); they must still not load scipy or matplotlib.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fastdiag.cli import cli
from fastdiag.cli.paper import paper_cmd

HEAVY = ("torch", "scipy", "matplotlib")
# command → why its help needs torch (the module named holds an option's default or help and imports torch)
TORCH_FOR_OPTIONS = {
    "run": "--checkpoint-every's default and help: fastdiag.grokking.checkpoint",
    "sweep": "--seeds' help, --backend's choices: fastdiag.sweep",
    "bench": "the kernel shapes and workloads: fastdiag.bench",
    "intervene": "InterventionSettings: fastdiag.grokking.interventions",
    "headdim": "lives in cli/intervene.py with intervene; --seeds' help: fastdiag.sweep",
}
COMMANDS = [[name] for name in sorted(cli.lazy)] + [["paper", name] for name in sorted(paper_cmd.commands)]

_PROBE = """
import json, sys
from click.testing import CliRunner
from fastdiag.cli import cli
result = CliRunner().invoke(cli, sys.argv[1:] + ["--help"])
print(json.dumps({"exit": result.exit_code, "usage": result.output.startswith("Usage:"),
                  "loaded": sorted(m for m in %r if m in sys.modules)}))
""" % (HEAVY,)


def test_the_exceptions_are_commands():
    assert set(TORCH_FOR_OPTIONS) <= set(cli.lazy)


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_loads_no_heavy_library(command):
    r = subprocess.run([sys.executable, "-c", _PROBE, *command], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen["exit"] == 0 and seen["usage"], seen
    allowed = {"torch"} if command[0] in TORCH_FOR_OPTIONS else set()
    assert set(seen["loaded"]) <= allowed, f"`fastdiag {' '.join(command)} --help` loaded {seen['loaded']}"
