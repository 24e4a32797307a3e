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


def test_the_cli_waits_passively_and_keeps_a_users_choice():
    code = "import os, fastdiag.cli; print(os.environ['OMP_WAIT_POLICY'])"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "PASSIVE"
    out = subprocess.run([sys.executable, "-c", code], env={**env, "OMP_WAIT_POLICY": "ACTIVE"},
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ACTIVE"
