"""Weight-decay sweeps: the grid (``grid``), resources (``plan``), executing runs in workers
(``execute``) on local processes or Ray (``backends``), the progress bar (``progress``), and
``run_sweep`` tying them to a result store (``run``)."""
from fastdiag.grokking.sweep_spec import MAX_GRID_RUNS, parse_list, parse_seeds, parse_shard, parse_wd
from fastdiag.sweep.grid import build_grid, shard
from fastdiag.sweep.plan import available_cores, plan_local, plan_packs
from fastdiag.sweep.progress import Progress, RunProgress
from fastdiag.sweep.run import SweepSummary, run_sweep

__all__ = ["MAX_GRID_RUNS", "Progress", "RunProgress", "SweepSummary", "available_cores", "build_grid",
           "parse_list", "parse_seeds", "parse_shard", "parse_wd", "plan_local", "plan_packs", "run_sweep", "shard"]
