"""The sweep-level benchmark runs real sweeps (worker processes, a store) both ways."""
import pytest
import torch

from fastdiag import bench
from fastdiag.cli import main


def test_bench_ensemble_times_two_real_sweeps():
    r = bench.bench_ensemble(torch.device("cpu"), "small", members=2, runs=2, epochs=2, progress=lambda _: None)
    assert (r.workload, r.runs, r.members, r.epochs) == ("small", 2, 2, 2)
    assert r.one_by_one_s > 0 and r.ensemble_s > 0
    assert r.speedup == pytest.approx(r.one_by_one_s / r.ensemble_s)
    assert r.runs_per_hour_ensemble == pytest.approx(3600 * 2 / r.ensemble_s)
    table = bench.format_ensemble_table([r.__dict__])
    assert "small" in table and f"{r.speedup:.2f}" in table


def test_bench_rejects_unknown_workload(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--device", "cpu", "--shapes", "", "--no-steps", "--workloads", "huge"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--workloads" in err[0] and "canonical" in err[0]
