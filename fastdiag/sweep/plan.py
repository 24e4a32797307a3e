"""Resources of a sweep: how many worker processes and torch threads the cores and the memory hold."""
from __future__ import annotations

import os
from typing import Sequence

import torch

from fastdiag.grokking.build import parameter_count, uses_cuda
from fastdiag.grokking.config import RunConfig
from fastdiag.grokking.tasks import available_memory


def available_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def memory_per_run(cfg: RunConfig) -> int:
    """Rough bytes one worker needs: the torch runtime plus parameters, gradients and AdamW state."""
    n = parameter_count(cfg) or 1_000_000
    return 400 * 2**20 + 6 * 4 * n


def plan_local(configs: Sequence[RunConfig], workers: int | None = None, cores: int | None = None,
               memory: int | None = None) -> tuple[int, int]:
    """(workers, torch threads per worker) with workers × threads ≤ cores and the memory estimate."""
    cores = cores or available_cores()
    if workers is None:
        workers = min(cores, max(1, len(configs)))
        memory = available_memory() if memory is None else memory
        if memory and configs:
            per_run = max(memory_per_run(c) for c in {(c.arch, c.preset, c.n_layers, c.d_model): c
                                                       for c in configs}.values())
            workers = max(1, min(workers, int(0.8 * memory) // per_run))
    if workers < 1:
        raise ValueError(f"workers: must be >= 1, got {workers}")
    threads = max(1, cores // workers)
    return workers, threads


def default_workers(configs: Sequence[RunConfig], workers: int | None) -> int | None:
    """On CUDA one worker per GPU unless told otherwise (CPU: decided by `plan_local`)."""
    if workers is None and any(uses_cuda(c) for c in configs):
        return max(1, torch.cuda.device_count())
    return workers


def plan_packs(configs: Sequence[RunConfig], n_packs: int, workers: int | None = None,
               threads: int | None = None, cores: int | None = None) -> tuple[int, int]:
    """(workers, threads) for ``n_packs`` ensembles: one process per pack at most, so that with
    fewer packs than cores each pack gets more threads instead of cores idling."""
    cores = cores or available_cores()
    n_workers = min(plan_local(configs, default_workers(configs, workers), cores)[0], n_packs)
    return n_workers, threads if threads is not None else max(1, cores // n_workers)
