"""fastdiag.grokking.train: the grokking phenomenon end to end, determinism, diagnostics, regimes, outputs."""
import csv
import json
import math

import pytest
import torch

import fastdiag
import fastdiag.core.stats
from fastdiag.grokking.config import RunConfig
from fastdiag.grokking.config import REGIMES
from fastdiag.grokking.train import train_run
from fastdiag.models.transformer import CausalSelfAttention
from fastdiag.plots.run import write_outputs

TINY = dict(preset="custom", n_layers=1, n_heads=2, d_model=16, d_ff=32, p=7, train_frac=0.6,
            batch_size=8, epochs=3, eval_every=1, diag_every=2, device="cpu")


def test_weight_decay_groks_and_no_weight_decay_memorises(small_grok_runs):
    grok, mem = small_grok_runs
    r = grok.result
    assert r["regime"] == "grok", r
    assert r["t_mem_epoch"] is not None and r["t_grok_epoch"] > r["t_mem_epoch"]
    assert r["t_grok_step"] == r["t_grok_epoch"] * 6 and r["t_mem_step"] == r["t_mem_epoch"] * 6
    assert r["epochs_run"] == r["t_grok_epoch"] + 20, "stop at grok after `patience` epochs"
    at_grok = next(row for row in grok.trace if row["epoch"] == r["t_grok_epoch"])
    assert at_grok["test_acc"] >= 0.99 and at_grok["train_acc"] >= 0.99
    assert r["has_attention"] and 0 < r["peak_s_bar"] <= 1 + 1e-9 and r["peak_sigma_h"] > 0

    mem = mem.result
    assert mem["regime"] == "memorization", mem
    assert mem["t_mem_epoch"] is not None and mem["t_grok_epoch"] is None
    assert mem["epochs_run"] == small_grok_runs[1].config.epochs
    assert mem["final_train_acc"] >= 0.99 and mem["final_test_acc"] < 0.9


def test_same_seed_same_trace():
    rows = []
    a = train_run(RunConfig(**TINY, seed=5), progress=rows.append)
    b = train_run(RunConfig(**TINY, seed=5))
    assert a.trace == b.trace and len(a.trace) == 3
    assert rows == a.trace, "progress receives every trace row"
    c = train_run(RunConfig(**TINY, seed=6))
    assert c.trace != a.trace
    for key in ("run_id", "regime", "t_mem_epoch", "final_test_acc", "steps"):
        assert a.result[key] == b.result[key]


def test_trace_rows_and_result_fields():
    out = train_run(RunConfig(**TINY))
    n_train = round(0.6 * 49)
    steps_per_epoch = math.ceil(n_train / 8)
    for i, row in enumerate(out.trace, start=1):
        assert row["epoch"] == i and row["step"] == i * steps_per_epoch
        for key in ("train_loss", "train_acc", "test_loss", "test_acc", "s_bar", "sigma_h", "weight_norm",
                    "sync/blocks.0.attn", "spread/blocks.0.attn"):
            assert isinstance(row[key], float), key
    r = out.result
    assert r["regime"] in REGIMES and r["has_attention"] is True
    assert r["epochs_run"] == 3 and r["steps"] == 3 * steps_per_epoch and r["device"] == "cpu"
    assert r["run_id"] == RunConfig(**TINY).run_id() and r["config"] == RunConfig(**TINY).to_dict()
    json.dumps(r, allow_nan=False)
    json.dumps(out.trace, allow_nan=False)


def test_diagnostics_merge_every_diag_step_since_the_last_evaluation(monkeypatch):
    seen = []
    original = fastdiag.core.stats.summarize

    def spy(stats_by_layer):
        seen.append({name: int(s.rows) for name, s in stats_by_layer.items()})
        return original(stats_by_layer)

    monkeypatch.setattr(fastdiag.core.stats, "summarize", spy)
    cfg = RunConfig(**{**TINY, "n_layers": 2, "diag_every": 1, "epochs": 2})
    train_run(cfg)
    n_train = round(0.6 * 49)
    # every training example went through one recorded forward per epoch, 3 query rows each
    assert seen == [{"blocks.0.attn": 3 * n_train, "blocks.1.attn": 3 * n_train}] * 2


def test_rows_without_a_diagnostic_step_have_no_diagnostics():
    out = train_run(RunConfig(**{**TINY, "diag_every": 1000}))
    assert out.trace[0]["s_bar"] is not None  # step 0 is a diagnostic step
    assert all(row["s_bar"] is None and row["sync/blocks.0.attn"] is None for row in out.trace[1:])


@pytest.mark.parametrize("arch, kw", [("mlp", dict(d_model=32, n_layers=2)), ("lstm", dict(d_model=16, n_layers=1)),
                                      ("mamba", dict(d_model=16, n_layers=1))])
def test_architectures_without_attention(arch, kw):
    cfg = RunConfig(arch=arch, p=7, train_frac=0.6, batch_size=16, epochs=2, device="cpu", **kw)
    out = train_run(cfg)
    assert out.result["has_attention"] is False
    assert out.result["peak_s_bar"] is None and out.result["peak_sigma_h"] is None
    assert all(row["s_bar"] is None and row["sigma_h"] is None for row in out.trace)
    assert not any(key.startswith("sync/") for key in out.trace[0])


def test_non_finite_loss_is_recorded_as_diverged():
    out = train_run(RunConfig(**{**TINY, "lr": 1e30, "epochs": 50}))
    r = out.result
    assert r["regime"] == "diverged"
    assert r["epochs_run"] < 50, "a diverged run stops at once"
    json.dumps(r, allow_nan=False)


def test_stop_at_grok_off_runs_to_the_horizon():
    # train_frac 0.9 of a + b mod 5: test is 2-3 pairs; whatever happens, the run goes to the horizon
    out = train_run(RunConfig(**{**TINY, "p": 5, "stop_at_grok": False, "epochs": 4}))
    assert out.result["epochs_run"] == 4 and len(out.trace) == 4


def test_eval_every_and_final_epoch():
    out = train_run(RunConfig(**{**TINY, "epochs": 5, "eval_every": 2}))
    assert [row["epoch"] for row in out.trace] == [2, 4, 5]


def test_bad_config_is_a_value_error():
    with pytest.raises(ValueError, match="prime"):
        train_run(RunConfig(**{**TINY, "op": "/", "p": 8}))
    with pytest.raises(ValueError, match="weight_decay"):
        train_run(RunConfig(**TINY, weight_decay=-1.0))
    with pytest.raises(ValueError, match="device"):
        train_run(RunConfig(**{**TINY, "device": "nonsense"}))


def test_write_outputs(tmp_path):
    out = train_run(RunConfig(**TINY))
    paths = write_outputs(out, tmp_path / "run")
    assert json.loads(paths["result"].read_text())["run_id"] == out.result["run_id"]
    with open(paths["trace"]) as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 3 and float(rows[-1]["test_acc"]) == out.trace[-1]["test_acc"]
    assert "sync/blocks.0.attn" in rows[0]
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_write_outputs_without_attention(tmp_path):
    out = train_run(RunConfig(arch="mlp", d_model=16, n_layers=1, p=7, epochs=2, device="cpu"))
    paths = write_outputs(out, tmp_path)
    with open(paths["trace"]) as fh:
        rows = list(csv.DictReader(fh))
    assert rows[0]["s_bar"] == "" and paths["plot"].stat().st_size > 0


def test_the_figure_process_draws_what_the_caller_would_and_the_caller_draws_without_it(tmp_path):
    """`fastdiag run` draws its figure in a process started before torch loads: the same PNG, byte for
    byte, as drawn in the caller; with that process gone, the caller draws it; a figure that cannot be
    written raises the caller's OSError, as before."""
    from fastdiag.plots.background import FigureProcess
    from fastdiag.plots.run import plot_trajectory

    out = train_run(RunConfig(**TINY))
    plot_trajectory(out.trace, tmp_path / "here.png", result=out.result)
    with FigureProcess(fallback=plot_trajectory) as figure:
        assert figure._proc is not None
        figure.plot(out.trace, tmp_path / "there.png", result=out.result)
    assert (tmp_path / "there.png").read_bytes() == (tmp_path / "here.png").read_bytes()
    with FigureProcess(fallback=plot_trajectory) as figure:
        figure._proc.kill()
        figure.plot(out.trace, tmp_path / "fallback.png", result=out.result)
    assert (tmp_path / "fallback.png").read_bytes() == (tmp_path / "here.png").read_bytes()
    with FigureProcess(fallback=plot_trajectory) as figure, pytest.raises(OSError):
        figure.plot(out.trace, tmp_path / "no" / "such" / "dir.png", result=out.result)


def test_auto_device_picks_cuda_when_available():
    from fastdiag.grokking.build import resolve_device

    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu").type == "cpu"


def test_the_trainers_monitor_records_due_passes_only_and_merges_them():
    """The trainer's path (`fastdiag.attach` on the zoo's attention): ``record`` is set for a due pass
    only and put back, also when the pass raises; `Monitor.merged_stats` sums the measured passes
    until a reset; `Monitor.set_step` moves the step count (a resumed run)."""
    attn = CausalSelfAttention(16, 4)
    x = torch.randn(2, 5, 16)
    monitor = fastdiag.attach(torch.nn.Sequential(attn), every=2)
    monitor.model(x)                              # step 0: measured
    assert attn.record is False and attn.stats is not None
    first = monitor.merged_stats()["0"]
    monitor.model(x)                              # step 1: not measured
    assert torch.equal(monitor.merged_stats()["0"].gram, first.gram)
    try:
        monitor.model(torch.randn(2, 5, 7))       # step 2 due, wrong width: the pass raises
    except RuntimeError:
        pass
    assert attn.record is False
    monitor.model(x)                              # step 2 again: measured
    merged = monitor.merged_stats(reset=True)
    assert torch.allclose(merged["0"].gram, 2 * first.gram) and monitor.merged_stats() == {}
    monitor.set_step(5)
    monitor.model(x)                              # step 5: not measured
    assert monitor.merged_stats() == {}
    monitor.model(x)                              # step 6: measured
    assert list(monitor.merged_stats()) == ["0"] and monitor.step == 7
    monitor.detach()


def test_keep_records_false_merges_without_a_record_per_pass():
    """The trainers attach with ``keep_records=False``: the merged statistics equal those of a monitor
    keeping records, but no per-pass record (summary) is built or kept, and a logger is refused."""
    torch.manual_seed(3)
    attn = CausalSelfAttention(16, 4)
    xs = [torch.randn(2, 5, 16) for _ in range(3)]
    merged = {}
    for keep in (True, False):
        monitor = fastdiag.attach(torch.nn.Sequential(attn), every=1, keep_records=keep)
        for x in xs:
            monitor.model(x)
        merged[keep] = monitor.merged_stats(reset=True)["0"]
        assert monitor.num_records == (3 if keep else 0)
        assert (monitor.latest() is None) is (not keep) and monitor.latest_stats() is not None
        monitor.detach()
    assert torch.equal(merged[True].gram, merged[False].gram)
    assert torch.equal(merged[True].entropy_sum, merged[False].entropy_sum)
    with pytest.raises(ValueError, match="log"):
        fastdiag.attach(torch.nn.Sequential(attn), keep_records=False, log=lambda step, values: None)
    with pytest.raises(TypeError, match="keep_records"):
        fastdiag.attach(torch.nn.Sequential(attn), keep_records=1)
