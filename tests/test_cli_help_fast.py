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
result = CliRunner().invoke(cli, sys.argv[1:])
print(json.dumps({"exit": result.exit_code, "usage": result.output.startswith("Usage:"),
                  "loaded": sorted(m for m in %r if m in sys.modules)}))
""" % (HEAVY,)


def _probe(*argv) -> dict:
    r = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_loads_no_heavy_library(command):
    seen = _probe(*command, "--help")
    assert seen["exit"] == 0 and seen["usage"], seen
    assert not seen["loaded"], f"`fastdiag {' '.join(command)} --help` loaded {seen['loaded']}"


@pytest.mark.parametrize("grid", [["--wd", "nan"], ["--wd", "1e-3:1:0"], ["--wd", "1", "--seeds", "2-1"],
                                  ["--wd", "1", "--shard", "4/4"], ["--wd", "1", "--arch", "mlp,"]])
def test_a_bad_sweep_grid_is_refused_before_torch_loads(grid):
    """The grid's spelling is read torch-free (fastdiag.grokking.sweep_spec): a typo is answered at once."""
    seen = _probe("sweep", *grid)
    assert seen["exit"] == 2 and not seen["loaded"], seen


def test_the_attach_stack_imports_without_torch_dynamo():
    """`fastdiag.core.monitor` (imported by every command that trains) leaves torch._dynamo unloaded until a
    monitor is attached: the root hooks' `torch.compiler.disable` imports it (1.3 s), and it once ran at import,
    so every refused `fastdiag run` paid it (3.9 s to start, now 2.0 s)."""
    probe = ("import sys, torch, fastdiag.core.monitor as m; before = 'torch._dynamo' in sys.modules; "
             "model = torch.nn.MultiheadAttention(8, 2); m.attach(model).detach(); "
             "print(before, 'torch._dynamo' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "True"], r.stdout
