"""Threads and packs of a local sweep (`fastdiag.sweep.plan`): a second torch thread only where it pays
and a core is free, and never fewer processes than one by one would use because runs were packed."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fastdiag.grokking.config import RunConfig
from fastdiag.sweep.plan import TWO_THREADS_FROM, free_cores, plan_threads, spread_packs, waits_passively

SMALL = RunConfig(preset="custom", n_layers=2, n_heads=4, d_model=64, d_ff=256, p=31, device="cpu")   # ~0.1 M
LARGE = RunConfig(preset="19m", device="cpu")


def test_free_cores_subtracts_the_load():
    assert free_cores(cores=2, load=0.0) == 2
    assert free_cores(cores=2, load=0.4) == 2
    assert free_cores(cores=2, load=1.0) == 1
    assert free_cores(cores=2, load=13.0) == 1      # never below one
    assert free_cores(cores=16, load=3.6) == 12
    with pytest.raises(ValueError, match="load"):
        free_cores(cores=2, load=float("nan"))


def test_plan_threads_one_for_small_models_whatever_the_cores():
    assert plan_threads([SMALL], cores=16, load=0) == 1
    assert plan_threads([SMALL], members=4, cores=16, load=0) == 1                   # a pack of 4: 0.4 M
    assert plan_threads([SMALL], members=8, cores=16, load=0, passive=True) == 16    # a pack of 8: 0.8 M


def test_plan_threads_larger_models_share_the_cores():
    canonical = RunConfig(device="cpu")                                              # 0.82 M
    assert plan_threads([canonical], cores=2, load=0, passive=False) == 2
    assert plan_threads([LARGE], cores=8, load=0, passive=False) == 8
    assert plan_threads([LARGE], workers=2, cores=8, load=0, passive=False) == 4
    assert plan_threads([LARGE], workers=3, cores=2, load=0, passive=False) == 1
    with pytest.raises(ValueError, match="workers"):
        plan_threads([LARGE], workers=0)
    assert 104_384 < TWO_THREADS_FROM < 818_816           # between the README sweep's model and canonical


def test_plan_threads_under_load_depends_on_how_threads_wait():
    """Spinning threads on busy cores crawl, so they get only the free cores; passive threads paid
    even at load 6-8 on 2 cores (benchmarks/RESULTS.md, "threads"), so they get the cores."""
    canonical = RunConfig(device="cpu")
    assert plan_threads([canonical], cores=2, load=2.5, passive=False) == 1     # two CPU hogs beside it
    assert plan_threads([canonical], cores=2, load=2.5, passive=True) == 2
    assert plan_threads([LARGE], cores=8, load=6, passive=False) == 2
    assert plan_threads([LARGE], cores=8, load=6, passive=True) == 8


def test_waits_passively_reads_the_policy(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    assert waits_passively()
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert not waits_passively()
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert not waits_passively()
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")          # the command line's bounded spin
    assert waits_passively()
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")        # libgomp's default: milliseconds of spinning
    assert not waits_passively()


def test_spread_packs_gives_every_worker_a_pack():
    runs = [RunConfig(preset="custom", n_layers=1, n_heads=2, d_model=32, d_ff=64, p=11, seed=s) for s in range(8)]
    assert [len(t) for t in spread_packs([runs], 2)] == [4, 4]
    assert [len(t) for t in spread_packs([runs], 3)] == [2, 2, 4]
    assert [len(t) for t in spread_packs([runs[:1]], 2)] == [1]                      # nothing to split
    assert [len(t) for t in spread_packs([runs[:3], runs[3:4]], 2)] == [3, 1]        # enough already
    spread = spread_packs([runs], 16)
    assert [len(t) for t in spread] == [1] * 8
    assert [c.seed for t in spread for c in t] == list(range(8))                     # every run once


def test_the_cli_spins_briefly_and_keeps_a_users_choice():
    code = "import os, fastdiag.cli; print([os.environ.get(k) for k in ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT', 'KMP_BLOCKTIME')])"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[None, '1000', '0']"
    for chosen in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "0"}, {"KMP_BLOCKTIME": "200"}):
        out = subprocess.run([sys.executable, "-c", code], env={**env, **chosen}, capture_output=True, text=True,
                             check=True)
        assert out.stdout.strip() == str([chosen.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")])


# ---- the dry run's time estimate -------------------------------------------------------------------

from fastdiag.analysis.paper_data import PAPER, predicted_t_grok  # noqa: E402
from fastdiag.sweep.plan import describe_estimate, estimate_sweep, expected_epochs, steps_per_epoch  # noqa: E402

TINY = dict(preset="custom", n_layers=1, n_heads=2, d_model=16, d_ff=32, p=11, epochs=40, eval_every=5,
            device="cpu")


def test_run_lengths_come_from_the_papers_law_only_where_it_applies():
    law = predicted_t_grok
    t1, how = expected_epochs(RunConfig(weight_decay=1.0, epochs=20000, eval_every=10), law)
    assert how == "law" and t1 == PAPER["t_grok_lambda1"] == 130     # the law's own reference point
    t01, _ = expected_epochs(RunConfig(weight_decay=0.1, epochs=20000, eval_every=10), law)
    assert t01 == 10 * -(-law(0.1) // 10) == 840     # the law gives 836 (t(0.1) / t(1) = 6.43), to the evaluation
    assert expected_epochs(RunConfig(weight_decay=0.1, epochs=500), law) == (500, "law")     # capped at the horizon
    assert expected_epochs(RunConfig(weight_decay=1.0, epochs=20000, patience=7), law) == (137, "law")
    assert expected_epochs(RunConfig(weight_decay=1.0, epochs=900), None) == (900, "horizon")  # no law given
    for cfg in (RunConfig(weight_decay=0.01, epochs=900), RunConfig(weight_decay=10.0, epochs=900),
                RunConfig(weight_decay=1.0, epochs=900, stop_at_grok=False), RunConfig(weight_decay=1.0, epochs=900, p=31),
                RunConfig(arch="mlp", weight_decay=1.0, epochs=900)):
        assert expected_epochs(cfg, law) == (900, "horizon"), cfg
    assert steps_per_epoch(RunConfig()) == 10                 # 4,704 training pairs at batch 512
    assert steps_per_epoch(RunConfig(op="/", p=7, train_frac=0.5, batch_size=4)) == 6   # 7·6 pairs, 21 train


def test_estimate_measures_the_largest_pack_and_a_single_run(one_thread):
    configs = [RunConfig(**TINY, weight_decay=w, seed=s) for w in (0.1, 1.0) for s in range(3)]
    est = estimate_sweep(configs, ensemble=None, workers=1, steps=3)
    assert est["runs"] == 6 and est["packs"] == 1 and est["pack_sizes"] == [6] and est["workers"] == 1
    assert [m["members"] for m in est["measured"]] == [6, 1]
    assert all(m["step_seconds"] > 0 and m["eval_seconds"] > 0 and m["steps"] == 3 for m in est["measured"])
    assert est["member_steps"] == 6 * 40 * steps_per_epoch(configs[0]) and est["runs_to_horizon"] == 6
    big, one = est["measured"]
    per_epoch = steps_per_epoch(configs[0])
    want = 40 * (per_epoch * big["step_seconds"] + big["eval_seconds"] / 5)       # every member to the horizon
    assert est["seconds"] == pytest.approx(want, rel=1e-9)
    lines = describe_estimate(est)
    assert lines[0].startswith("estimate: ") and "on cpu" in lines[0]
    assert sum(line.lstrip().startswith("measured: a step of") for line in lines) == 2
    assert "extrapolated:" in lines[-1] and "to the horizon" in lines[-1]
    one_by_one = estimate_sweep(configs, ensemble=1, workers=2, steps=2)
    assert one_by_one["packs"] == 6 and [m["members"] for m in one_by_one["measured"]] == [1]
    with pytest.raises(ValueError, match="steps"):
        estimate_sweep(configs, ensemble=None, steps=0)


def test_sweep_dry_run_prints_the_estimate(tmp_path):
    from click.testing import CliRunner

    from fastdiag.cli import cli

    args = ["sweep", "--wd", "0.3,1", "--seeds", "2", "--preset", "custom", "--layers", "1", "--heads", "2",
            "--d-model", "16", "--d-ff", "32", "--p", "11", "--epochs", "20", "--device", "cpu", "--threads", "1", "--workers", "2",
            "--store", str(tmp_path / "s.sqlite"), "--dry-run"]
    done = CliRunner().invoke(cli, [*args, "--calibrate-steps", "2"])
    assert done.exit_code == 0, done.output
    # 4 runs in one pack of 4, split in two as the local backend splits it for two workers
    assert "estimate: " in done.output and "measured: a step of 2 member(s)" in done.output, done.output
    assert "extrapolated:" in done.output and not (tmp_path / "s.sqlite").exists()
    done = CliRunner().invoke(cli, [*args, "--calibrate-steps", "0"])
    assert done.exit_code == 0 and "estimate" not in done.output
    done = CliRunner().invoke(cli, [*args, "--calibrate-steps", "-1"])
    assert done.exit_code == 2 and "'--calibrate-steps': expected an integer in [0, " in done.output
