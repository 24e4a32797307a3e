"""benchmarks/gpu_check.sh --dry-run: every stage of the GPU script runs here on CPU (tiny shapes,
kernels interpreted) and writes its JSON lines, so a lent GPU's few minutes are not spent finding a
broken script. The numbers of a dry run mean nothing; that each stage produced them does."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the dry run interprets the Triton kernels")
ROOT = Path(__file__).resolve().parent.parent


DEFAULT_STAGES = re.search(r'DEFAULT_STAGES="([^"]*)"', (ROOT / "benchmarks" / "gpu_check.sh").read_text()).group(1)
EXTRA_STAGES = "tune:60 probe:30 ncu:60 experiments:240"


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """One dry run of every stage, the default ones and the extra ones (tune, probe, ncu, experiments),
    shared by the tests below: each dry run repeats the machine and tests stages (a third of its time),
    so one run checks what two did. Returns (the finished process, its JSON lines)."""
    out = tmp_path_factory.mktemp("gpu_check")
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, STAGES=f"{DEFAULT_STAGES} {EXTRA_STAGES}")
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=840)
    lines = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()] if done.returncode == 0 else []
    return done, lines


@pytest.mark.slow
def test_gpu_check_dry_run_runs_every_stage(dry_run):
    done, lines = dry_run
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-2000:])
    assert all(x["dry_run"] is True and "error" not in x for x in lines), lines
    stages = [x["stage"] for x in lines]
    assert stages[0] == "machine" and stages[-1] == "machine" and "clocks_after" in lines[-1]
    assert {"tests", "kernels", "accuracy", "attach", "int64"} <= set(stages)
    kernels = [x for x in lines if x["stage"] == "kernels"]
    assert {x["kernel"] for x in kernels} == {"head_stats", "qk pass 1 + 2", "qk fp32"}
    assert all(x["kernel_ms"] > 0 and x["copy_ms"] > 0 for x in kernels if x["kernel"] == "head_stats")
    accuracy = [x for x in lines if x["stage"] == "accuracy"]
    assert all(x["gram"] <= 1e-5 and x["entropy"] <= 1e-5 for x in accuracy), accuracy
    assert {x["model"] for x in lines if x["stage"] == "attach"} == {"hf-gpt2-small-sdpa", "nanogpt-sdpa"}


def test_gpu_check_refuses_unknown_arguments(tmp_path):
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--fast"], capture_output=True,
                          text=True, env=dict(os.environ, OUT=str(tmp_path)), timeout=30)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "--dry-run" in done.stderr


def test_stage_timeouts_fit_eight_minutes():
    """Stage timeouts add to ≤ 480 s: a lent GPU allows 600 s per command and a start of a minute or two."""
    text = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    commands = [int(x) for x in re.findall(r"timeout (\d+) \$PY", text)]         # machine, tests
    clocks = int(re.search(r"timeout (\d+) nvidia-smi", text).group(1))        # before and after
    stages = [int(x) for x in re.findall(r"\w+:(\d+)", text.split("DEFAULT_STAGES=", 1)[1].split("\n", 1)[0])]
    assert len(commands) == 2 and len(stages) == 4
    assert sum(commands) + 2 * clocks + sum(stages) <= 480, (commands, clocks, stages)


@pytest.mark.slow
def test_gpu_check_dry_run_of_the_extra_and_experiments_stages(dry_run):
    """tune, probe and ncu (STAGES=...) run here too, so a second lent-GPU run can take them; and the
    experiments stage: canonical step eager / graphed / bare, packs, Mamba against the matched
    transformer, each a JSON line, here on CPU with a tiny model (the same dry run as above)."""
    done, lines = dry_run
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-2000:])
    assert {"tune", "probe", "ncu", "experiments"} <= {x["stage"] for x in lines}
    assert all("error" not in x and "failed" not in x for x in lines), lines
    tuned = {x.get("launcher") for x in lines if x["stage"] == "tune"}
    assert {"chosen", "materialised P", "materialised P 32 MB chunks"} <= tuned, tuned
    got = [x for x in lines if x["stage"] == "experiments"]
    assert [x["what"] for x in got] == ["canonical_step"] + ["ensemble"] * 4 + ["mamba_step"], got
    assert all(x["eager_ms"] > 0 and x["graphed_ms"] > 0 and x["bare_loop_ms"] > 0 for x in got[:1])
    assert [x["members"] for x in got[1:5]] == [1, 2, 4, 8] and all(x["runs_per_hour"] > 0 for x in got[1:5])
    assert got[5]["mamba_triton_graphed_ms"] > 0 and got[5]["matched_transformer_graphed_ms"] > 0
