"""`fastdiag COMMAND --help` loads no statistics, figures or torch (issue 41: a command's help
took 3-11 s under load while the command listing took 0.5 s): what a fresh interpreter has imported after
asking for the help, not a timing. The command modules import those in the bodies that use them.

Every option's default and help comes from a torch-free module (fastdiag.grokking.config, the
intervention settings, fastdiag.bench_workloads, fastdiag.cli.options), so no help loads torch.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fastdiag.cli import cli
from fastdiag.cli.paper import paper_cmd

HEAVY = ("torch", "scipy", "matplotlib")
COMMANDS = [[name] for name in sorted(cli.lazy)] + [["paper", name] for name in sorted(paper_cmd.commands)]

_PROBE = """
import json, sys
from click.testing import CliRunner
from fastdiag.cli import cli
result = CliRunner().invoke(cli, sys.argv[1:] + ["--help"])
print(json.dumps({"exit": result.exit_code, "usage": result.output.startswith("Usage:"),
                  "loaded": sorted(m for m in %r if m in sys.modules)}))
""" % (HEAVY,)


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_loads_no_heavy_library(command):
    r = subprocess.run([sys.executable, "-c", _PROBE, *command], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen["exit"] == 0 and seen["usage"], seen
    assert not seen["loaded"], f"`fastdiag {' '.join(command)} --help` loaded {seen['loaded']}"
