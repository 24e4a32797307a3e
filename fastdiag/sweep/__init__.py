"""Weight-decay sweeps: the grid, resource planning, executing runs on local workers or Ray, the
progress display, and ``run_sweep`` tying them to a result store."""
from fastdiag.sweep.run import (BACKENDS, GROKKED, MAX_GRID_RUNS, REGIMES, Group, Progress, SweepSummary,
                                analyze_group, available_cores, build_grid, check_buildable, file_safe,
                                in_fit_range, load_groups, memory_per_run, parameter_count, parse_list,
                                parse_seeds, parse_shard, parse_wd, plan_local, plan_packs, run_sweep, shard)
