"""Sweep grid parsing, sharding, resuming and failure handling (fast: fake trainers, no real training)."""
import functools
import io
import math
import random
from types import SimpleNamespace

import pytest

from fastdiag import sweep as sw
from fastdiag.analysis.groups import analyze_group, load_groups
from fastdiag.store import Lease, Store
from fastdiag.testing import dying_trainer

TINY = dict(preset="custom", n_layers=1, n_heads=2, d_model=32, d_ff=64, p=11, epochs=3)


# ------------------------------------------------------------------------------ parsing

def test_parse_wd_list_and_range():
    assert sw.parse_wd("1, 0.1,0,0.1") == [0.0, 0.1, 1.0]
    values = sw.parse_wd("1e-3:2:13")
    assert len(values) == 13 and values[0] == 1e-3 and values[-1] == 2.0
    ratios = [b / a for a, b in zip(values, values[1:])]
    assert max(ratios) / min(ratios) < 1.0001                       # log-spaced
    assert sw.parse_wd("0.5:0.5:1") == [0.5]


@pytest.mark.parametrize("spec,match", [
    ("", "empty"),
    ("0.1,,1", "empty item"),
    ("-0.1,1", ">= 0"),
    ("abc", "not a number"),
    ("1e-3:2:0", "count must be >= 1"),
    ("1e-3:2", "bad range"),
    ("1e-3:2:x", "bad range"),
    ("0:1:5", "START > 0"),
    ("nan", "not a number"),
    ("inf", "not a number"),
])
def test_parse_wd_rejects(spec, match):
    with pytest.raises(ValueError, match=match):
        sw.parse_wd(spec)


def test_parse_seeds_and_shard():
    assert sw.parse_seeds("3") == [0, 1, 2]
    assert sw.parse_seeds("7,3,3") == [3, 7]
    assert sw.parse_seeds("7,") == [7] and sw.parse_seeds(" 7 , ") == [7]
    assert sw.parse_seeds("9") == sw.parse_seeds("0-8") == list(range(9))     # a count, a range (inclusive)
    assert sw.parse_seeds("3-3") == [3] and sw.parse_seeds("0-2,7,1") == [0, 1, 2, 7]
    for bad in ("0", "-2", "a", "1,,2", "", "5-2", "0-", "1-2-3", "0-999999"):
        with pytest.raises(ValueError, match="^seeds: "):
            sw.parse_seeds(bad)
    assert sw.parse_shard("1/4") == (1, 4)
    for bad in ("4/4", "1/0", "x", "1-4"):
        with pytest.raises(ValueError, match="^shard: "):
            sw.parse_shard(bad)


def test_grid_unique_validated_and_sharded():
    grid = sw.build_grid(TINY, [0.01, 0.1, 1.0], [0, 1])
    assert len(grid) == 6 and len({c.run_id() for c in grid}) == 6
    shards = [sw.shard(grid, i, 4) for i in range(4)]
    ids = [c.run_id() for s in shards for c in s]
    assert sorted(ids) == sorted(c.run_id() for c in grid) and len(ids) == len(set(ids))
    assert [c.run_id() for c in sw.shard(list(reversed(grid)), 1, 4)] == [c.run_id() for c in shards[1]]
    with pytest.raises(ValueError, match="unknown architecture"):
        sw.build_grid(TINY, [0.1], [0], ["gpt5"])
    with pytest.raises(ValueError, match="n_heads"):          # the model zoo's check, before any run
        sw.build_grid({**TINY, "preset": "canonical"}, [0.1], [0], ["mlp"])
    with pytest.raises(ValueError, match="epochs"):
        sw.build_grid({**TINY, "epochs": 0}, [0.1], [0])


def test_plan_local_fits_cores_and_memory():
    grid = sw.build_grid(TINY, [0.1, 1.0], [0, 1, 2, 3])
    workers, threads = sw.plan_local(grid, cores=4, memory=64 * 2**30, load=0)
    assert workers == 4 and threads == 1
    workers, threads = sw.plan_local(grid, cores=8, memory=int(1.2 * 2**30), load=0)   # ~0.4 GiB per worker
    assert workers == 2 and threads == 1        # a tiny model: a second thread does not pay
    workers, threads = sw.plan_local(grid[:1], cores=8, memory=64 * 2**30, load=0)
    assert workers == 1 and threads == 1
    assert sw.plan_local(grid, workers=3, cores=8, load=0) == (3, 1)


def test_plan_packs_one_process_per_pack():
    grid = sw.build_grid(TINY, [0.1, 1.0], [0, 1, 2, 3])
    assert sw.plan_packs(grid, n_packs=1, cores=2, members=8, load=0) == (1, 1)
    assert sw.plan_packs(grid, n_packs=3, cores=2, load=0) == (2, 1)
    assert sw.plan_packs(grid, n_packs=3, cores=8, load=0) == (3, 1)
    assert sw.plan_packs(grid, n_packs=3, workers=1, cores=8, load=0) == (1, 1)
    assert sw.plan_packs(grid, n_packs=3, threads=2, cores=8, load=0) == (3, 2)    # the user's choice stands


# ------------------------------------------------------------------------------ running (fake trainers)

def fake_train(cfg):
    """Grokking probability logistic in log10 λ (λ_c = 0.02, k = 4), t_grok = 50 (λ − λ_c)^-0.75,
    collapse for λ ≥ 5; deterministic per (λ, seed)."""
    rng = random.Random(f"{cfg.weight_decay}/{cfg.seed}/{cfg.arch}")
    lam, lc = cfg.weight_decay, 0.02
    t_grok = None
    if lam >= 5:
        regime = "collapse"
    else:
        p = 0.0 if lam == 0 else 1 / (1 + math.exp(-4 * (math.log10(lam) - math.log10(lc))))
        if rng.random() < p:
            regime = "grok"
            t_grok = 50 * (lam - lc) ** -0.75 * math.exp(rng.gauss(0, 0.05)) if lam > lc else 900.0
        else:
            regime = "memorization"
    trace = [{"epoch": e, "step": e, "train_acc": 1.0, "test_acc": 1.0 if t_grok and e >= t_grok else 0.1,
              "s_bar": 0.9 + 0.001 * e, "sigma_h": 0.05} for e in (1, 10, 100, 1000)]
    result = {"run_id": cfg.run_id(), "regime": regime, "t_grok_epoch": t_grok, "n_params": 12345}
    return SimpleNamespace(config=cfg, result=result, trace=trace)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_local_sweep_refuses_a_missing_device_before_registering_runs(tmp_path):
    grid = sw.build_grid({**TINY, "device": "cuda"}, [0.1], [0, 1])
    with Store(tmp_path / "s.sqlite") as st:
        with pytest.raises(ValueError, match="^device: 'cuda' requested but CUDA is not available"):
            sw.run_sweep(grid, st, workers=1, progress=False)
        assert st.status_of({c.run_id(): c for c in grid}) == {}


def test_resume_skips_done_and_redoes_unfinished(tmp_path):
    grid = sw.build_grid(TINY, [0.01, 0.1, 1.0], [0, 1])
    calls = []

    def counting(cfg):
        calls.append(cfg.run_id())
        return fake_train(cfg)

    with Store(tmp_path / "s.sqlite") as st:
        s1 = sw.run_sweep(grid[:4], st, workers=1, train_fn=counting, progress=False)
        assert (s1.total, s1.done, s1.skipped) == (4, 4, 0)
        # A crash mid-way leaves a run 'running': it is redone, the finished ones are not.
        st.add_runs([grid[4]])
        with Lease(st) as lease:                 # its sweep stopped: claim freed, run redone
            lease.claim([grid[4].run_id()])
        before = {r["run_id"]: r["finished_at"] for r in st.runs("done")}
        calls.clear()
        s2 = sw.run_sweep(grid, st, workers=1, train_fn=counting, progress=False)
        assert sorted(calls) == sorted(c.run_id() for c in grid[4:])
        assert (s2.total, s2.done, s2.skipped) == (6, 2, 4)
        after = {r["run_id"]: r["finished_at"] for r in st.runs("done")}
        assert all(after[k] == v for k, v in before.items())
        assert st.counts() == {"pending": 0, "running": 0, "done": 6, "failed": 0}
        assert st.conn.execute("SELECT COUNT(*) FROM trace").fetchone()[0] == 6 * 4


def test_failing_run_is_recorded_and_sweep_goes_on(tmp_path):
    grid = sw.build_grid(TINY, [0.1, 1.0], [0, 1])

    def flaky(cfg):
        if cfg.weight_decay == 1.0 and cfg.seed == 1:
            raise RuntimeError("CUDA out of memory (simulated)")
        return fake_train(cfg)

    with Store(tmp_path / "s.sqlite") as st:
        summary = sw.run_sweep(grid, st, workers=1, train_fn=flaky, progress=False)
        assert summary.done == 3 and summary.failed == 1
        (failed,) = st.runs("failed")
        assert "RuntimeError: CUDA out of memory (simulated)" in failed["error"]
        # --skip-failed leaves it; the default retries it.
        assert sw.run_sweep(grid, st, workers=1, train_fn=flaky, retry_failed=False, progress=False).failed == 0
        summary = sw.run_sweep(grid, st, workers=1, train_fn=fake_train, progress=False)
        assert summary.done == 1 and st.counts()["done"] == 4


def test_local_pool_retries_lost_worker_and_records_failure(tmp_path):
    grid = sw.build_grid(TINY, [0.1, 1.0], [0, 1])
    dying = functools.partial(dying_trainer, marker_dir=str(tmp_path))     # importable in spawned workers
    with Store(tmp_path / "s.sqlite") as st:
        summary = sw.run_sweep(grid, st, workers=2, threads=1, train_fn=dying, progress=False,
                               max_retries=1)
        (failed,) = st.runs("failed")                   # only the culprit, never an innocent neighbour
        assert (failed["config"]["weight_decay"], failed["config"]["seed"]) == (1.0, 1)
        assert "worker process died" in failed["error"] and "2 attempts" in failed["error"]
        assert summary.failed == 1 and summary.done == 3 and st.counts()["done"] == 3


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _last_frame(text: str) -> str:
    return text.replace("\r", "\n").strip().splitlines()[-1]


def test_progress_bar_on_a_terminal_has_rate_eta_and_the_status():
    out = _Terminal()
    bar = sw.Progress(total=4, skipped=1, stream=out)
    bar.update("grok", force=True)
    bar.update(failed=True, force=True)
    bar.close()
    last = _last_frame(out.getvalue())
    assert last.startswith("sweep: 3/4 runs | 1 failed | grok 1") and " 75%|" in last
    assert "run/s]" in last and "<" in last                          # rate, elapsed<remaining


def test_progress_in_a_log_is_a_line_at_the_start_then_every_interval():
    """Not a terminal (a log, a pipe): no bar, but plain status lines, the first at once and then at
    most one per interval, so that a long sweep's log shows it is alive and how far it got."""
    now = [0.0]
    out = io.StringIO()
    bar = sw.Progress(total=4, stream=out, every_s=30, clock=lambda: now[0])
    bar.reset_counts(4, 0)
    bar.epoch("a", 10, 100)                              # within the interval: no line
    now[0] = 31.0
    bar.update("grok", run_id="a")
    now[0] = 40.0
    bar.epoch("b", 50, 100)
    bar.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "sweep: 0/4 runs  0s"
    assert lines[1] == "sweep: 1/4 runs | grok 1 | ~93s left  31s"
    assert lines[2].startswith("sweep: 1/4 runs | grok 1 | running: epoch 50/100") and lines[2].endswith("40s")
    assert len(lines) == 3 and "%|" not in out.getvalue()
    assert sw.Progress(total=4, stream=out, enabled=False).log is None            # progress=False: silent

    out = io.StringIO()
    run = sw.RunProgress(300, stream=out, every_s=30, clock=lambda: now[0])
    row = {"train_acc": 0.5, "test_acc": 0.1, "s_bar": 0.9, "sigma_h": 0.01}
    for epoch, now[0] in ((1, 41.0), (2, 60.0), (3, 71.0)):
        run({**row, "epoch": epoch})
    run.close()
    assert out.getvalue().splitlines() == ["epoch 1/300  train 0.500  test 0.100  s̄ 0.900  σ_H 0.010  1s",
                                           "epoch 3/300  train 0.500  test 0.100  s̄ 0.900  σ_H 0.010  31s"]
    out = io.StringIO()
    bar = sw.Progress(total=4, stream=out)
    bar.note("ensembles: 4 runs as 1 vectorised ensemble(s) of 4 members")      # notes are lines of their own
    assert out.getvalue().strip() == "ensembles: 4 runs as 1 vectorised ensemble(s) of 4 members"


def test_run_progress_on_a_terminal():
    out = _Terminal()
    run = sw.RunProgress(3, stream=out)
    run({"epoch": 1, "train_acc": 0.5, "test_acc": 0.1, "s_bar": 0.9, "sigma_h": None})
    run.close()
    last = _last_frame(out.getvalue())
    assert "epoch 1/3" in last and "s̄ 0.900" in last and "σ_H –" in last and "epoch/s" in last


def test_progress_line_shows_runs_in_flight():
    import io

    out = io.StringIO()
    bar = sw.Progress(total=5, stream=out)
    bar.epoch("a", 3400, 10000)
    assert bar.line().endswith("running: epoch 3400/10000")
    bar.epoch("b", 1200, 10000)
    assert bar.line().endswith("running: epoch 1200/10000, 3400/10000")
    bar.epoch("c", 500, 1000)
    assert bar.line().endswith("3 running, median at 34% of their epochs")
    assert bar.bar.n == pytest.approx(0.34 + 0.12 + 0.5)      # the rate and ETA count the epochs in flight
    bar.update("grok", run_id="c")
    bar.update(failed=True, run_id="b")
    assert bar.line().endswith("running: epoch 3400/10000") and "2/5 runs" in bar.line()


def test_epoch_reports_reach_the_progress_line_in_process(tmp_path, monkeypatch):
    """workers = 1 trains in this process: the real trainer's epochs reach the bar as they happen."""
    monkeypatch.setattr("fastdiag.sweep.execute.EPOCH_REPORT_S", 0.0)
    seen = []

    class Recording(sw.Progress):
        def epoch(self, run_id, epoch, epochs):
            seen.append((run_id, epoch, epochs))
            super().epoch(run_id, epoch, epochs)

    bar = Recording(total=1, stream=io.StringIO())
    grid = sw.build_grid({**TINY, "epochs": 6, "stop_at_grok": False}, [1.0], [0])
    with Store(tmp_path / "p.sqlite") as st:
        sw.run_sweep(grid, st, workers=1, threads=1, ensemble=1, progress=bar)
    assert [e for _, e, _ in seen] == [1, 2, 3, 4, 5, 6] and {r for r, _, _ in seen} == {grid[0].run_id()}
    assert bar.running == {}                                    # the finished run left the line


# ------------------------------------------------------------------------------ analysis of a store

def test_analyze_group_recovers_lambda_c_and_nu(tmp_path):
    grid = sw.build_grid(TINY, [0, 0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.3, 1, 3, 10], range(8))
    with Store(tmp_path / "s.sqlite") as st:
        sw.run_sweep(grid, st, workers=1, train_fn=fake_train, progress=False)
        groups, counts = load_groups(st)
    assert counts["done"] == len(grid) and len(groups) == 1
    report = analyze_group(groups[0], n_boot=200, seed=0)
    assert report["n_zero_lambda"] == 8 and "λ = 0" in report["notes"][0]
    lc = report["lambda_c"]
    assert lc["ci"][0] < lc["lambda_c"] < lc["ci"][1] and 0.005 < lc["lambda_c"] < 0.08
    assert lc["n_runs"] == len(grid) - 8
    for key in ("nu", "nu_joint"):
        assert 0.3 < report[key]["nu"] < 1.2           # plumbing, not statistics: the fake is crude
    assert report["nu_joint"]["ci"][1] - report["nu_joint"]["ci"][0] >= \
        report["nu"]["ci"][1] - report["nu"]["ci"][0] - 1e-9
    rows = {r["lambda"]: r for r in report["regimes"]}
    assert rows[10.0]["collapse"] == 8 and rows[1.0]["grok"] == 8 and rows[1.0]["median_t_grok"] > 0


def test_analyze_group_too_little_data_says_why(tmp_path):
    grid = sw.build_grid(TINY, [0.1, 1.0], [0, 1])
    with Store(tmp_path / "s.sqlite") as st:
        sw.run_sweep(grid, st, workers=1, train_fn=fake_train, progress=False)
        (group,), _ = load_groups(st)
    report = analyze_group(group, n_boot=50)
    assert "lambda_c" not in report["lambda_c"] and "3 distinct weight decays" in report["lambda_c"]["error"]
    assert "nu" not in report["nu"] and "error" in report["nu_joint"]


def test_a_sweep_says_when_workers_asked_for_cannot_be_used(tmp_path):
    notes = []

    class Recording(sw.Progress):
        def note(self, message):
            notes.append(message)

    grid = sw.build_grid(TINY, [0.1], [0])
    with Store(tmp_path / "s.sqlite") as st:
        sw.run_sweep(grid, st, workers=2, train_fn=fake_train, progress=Recording(total=1, enabled=False))
    assert notes == ["workers: 1 of the 2 asked for: only 1 task(s) to run (1 run(s))"]
