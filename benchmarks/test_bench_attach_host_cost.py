"""The host-cost targets of a measured step (issue 37), counted by `attach_host_cost.py` (its own
process: the Triton interpreter must be chosen before triton is imported): per measured layer of a
tiny HF GPT-2, at most 16 aten ops added (Triton backend, launches as one op) and 600 Python calls
(torch backend). Counts are deterministic: no timing here."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")


def test_a_lean_measured_layer_adds_at_most_16_aten_ops_and_600_python_calls():
    script = Path(__file__).with_name("attach_host_cost.py")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, str(script), "--models", "gpt2", "--no-syncs"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    found = re.search(r"gpt2: \+([\d.]+) aten ops .* \+(-?\d+) Python calls", done.stdout)
    assert found, done.stdout
    ops, calls = float(found[1]), int(found[2])
    assert ops <= 16, done.stdout
    assert calls <= 600, done.stdout
