"""Absurd sizes are refused before anything is allocated: one line, exit status 2, in seconds (the
time to import torch), not minutes of growing memory toward an out-of-memory kill."""
import subprocess
import sys
import time

import pytest


def fastdiag(*args):
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "fastdiag.cli", *args], capture_output=True, text=True, timeout=300)
    return proc, time.monotonic() - started


@pytest.mark.parametrize("args", [
    ["--members", "100000000"],                                   # the quick default: ensembles off
    ["--members", "100000000", "--ensembles", "--no-steps", "--no-archs", "--shapes", ""],
    ["--members", "40000", "--ensembles", "--no-steps", "--no-archs", "--shapes", "", "--workloads", "canonical"],
])
def test_bench_refuses_an_absurd_ensemble_size_at_once(args):
    proc, seconds = fastdiag("bench", "--device", "cpu", *args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("fastdiag: error: --members:"), proc.stderr
    assert proc.stdout == ""
    assert seconds < 120


@pytest.mark.parametrize("args, flag", [
    (["--layers", "100000000"], "--layers"),
    (["--d-model", "1000000"], "--d-model"),
    (["--d-ff", "100000000"], "--d-ff"),
    (["--p", "1000000007"], "--p"),
    (["--layers", "10000", "--d-model", "4096"], "--d-model"),
])
def test_run_refuses_absurd_sizes_at_once(tmp_path, args, flag):
    proc, seconds = fastdiag("run", "--device", "cpu", "--quiet", "--out", str(tmp_path / "o"), *args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith(f"fastdiag: error: {flag}:"), proc.stderr
    assert not (tmp_path / "o").exists()
    assert seconds < 120
