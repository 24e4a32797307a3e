"""The Ray backend, on a local Ray started by the test: real tiny runs, and lost workers retried or
recorded as failed (never silently dropped)."""
import sys

import pytest

ray = pytest.importorskip("ray")

from fastdiag import sweep as sw  # noqa: E402
from fastdiag.store import Store  # noqa: E402
from fastdiag.testing import dying_trainer  # noqa: E402

TINY = dict(preset="custom", n_layers=1, n_heads=2, d_model=32, d_ff=64, p=11, epochs=3)


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    # Functions of this test module travel to the workers by value (the module is not importable there).
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.shutdown()


def test_ray_backend_real_runs_and_lost_workers(local_ray, tmp_path):
    grid = sw.build_grid(TINY, [0.1, 1.0], [0, 1])
    with Store(tmp_path / "ray.sqlite") as st:
        summary = sw.run_sweep(grid, st, backend="ray", progress=False)
        assert summary.done == 4 and summary.failed == 0
        for run in st.runs():
            assert run["status"] == "done" and run["result"]["n_params"] > 0
            assert len(st.trace(run["run_id"])) == 3
        # Rerunning skips everything.
        assert sw.run_sweep(grid, st, backend="ray", progress=False).skipped == 4

    marker_dir = str(tmp_path)

    def dying_here(cfg):
        return dying_trainer(cfg, marker_dir)

    with Store(tmp_path / "lost.sqlite") as st:
        summary = sw.run_sweep(grid, st, backend="ray", train_fn=dying_here, max_retries=1, progress=False)
        assert summary.done == 3 and summary.failed == 1
        (failed,) = st.runs("failed")
        assert (failed["config"]["weight_decay"], failed["config"]["seed"]) == (1.0, 1)
        assert "ray task failed after 1 retries" in failed["error"]
        assert st.counts() == {"pending": 0, "running": 0, "done": 3, "failed": 1}


def test_ray_backend_trains_ensembles(local_ray, tmp_path):
    grid = sw.build_grid(TINY, [0.1, 1.0], [0, 1])
    with Store(tmp_path / "ens.sqlite") as st:
        summary = sw.run_sweep(grid, st, backend="ray", ensemble=4, progress=False)
        assert summary.done == 4 and summary.failed == 0
        runs = st.runs("done")
        assert len(runs) == 4 and all(r["result"]["ensemble_size"] == 4 for r in runs)
        assert all(len(st.trace(r["run_id"])) == 3 for r in runs)
