"""The grid of a sweep: weight decays, seeds, architectures and sizes (as `fastdiag.grokking.sweep_spec`
parses them) combined into validated ``RunConfig``s (one per distinct run_id), and deterministic shards
of it for job arrays."""
from __future__ import annotations

from typing import Sequence

from fastdiag.grokking.build import check_buildable
from fastdiag.grokking.config import ARCHS, RunConfig
from fastdiag.grokking.sweep_spec import MAX_GRID_RUNS

def build_grid(base: dict, weight_decays: Sequence[float], seeds: Sequence[int],
               archs: Sequence[str] | None = None, presets: Sequence[str] | None = None) -> list[RunConfig]:
    """Every (arch, preset, λ, seed) combination on top of ``base`` (RunConfig fields), validated,
    one per distinct run_id, ordered by run_id."""
    archs = list(archs) if archs else [base.get("arch", "transformer")]
    presets = list(presets) if presets else [base.get("preset", "canonical")]
    if not weight_decays or not seeds:
        raise ValueError("weight_decays, seeds: empty grid (no weight decays or no seeds)")
    size = len(archs) * len(presets) * len(weight_decays) * len(seeds)
    if size > MAX_GRID_RUNS:
        raise ValueError(f"weight_decays, seeds: a grid of {size} runs is more than {MAX_GRID_RUNS}; "
                         "split it into sweeps of fewer runs")
    for arch in archs:
        if arch not in ARCHS:
            raise ValueError(f"archs: unknown architecture {arch!r}; expected one of {', '.join(ARCHS)}")
    configs: dict[str, RunConfig] = {}
    for arch in archs:
        for preset in presets:
            for wd in weight_decays:
                for seed in seeds:
                    cfg = RunConfig.from_dict({**base, "arch": arch, "preset": preset,
                                               "weight_decay": float(wd), "seed": int(seed)})
                    check_buildable(cfg)
                    configs.setdefault(cfg.run_id(), cfg)
    if not configs:
        raise ValueError("weight_decays, seeds: empty grid")
    return [configs[k] for k in sorted(configs)]


def shard(configs: Sequence[RunConfig], index: int, count: int) -> list[RunConfig]:
    """The ``index``-th of ``count`` deterministic shards: runs ordered by run_id, every count-th."""
    ordered = sorted(configs, key=lambda c: c.run_id())
    return ordered[index::count]
