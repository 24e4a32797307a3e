"""Resources of a sweep: how many worker processes and torch threads the cores and the memory hold.

Threads: an OpenMP team waits at a barrier after every op for its slowest thread; on a busy machine
that thread is descheduled and, with OpenMP's default spinning, the others burn the cores it needs
(load 6-8 on 2 cores: a canonical epoch 41.6 s at two spinning threads against 9.7 s at one, the README
sweep's small model 2.63 s against 0.17 s; benchmarks/RESULTS.md, "threads"). With passive waiting the
same two threads took 5.0 s and 0.14 s. So the command line and the sweep workers wait passively
(`fastdiag.cli`, `fastdiag.sweep.execute.passive_openmp`), and a process gets a second thread only
where the work is large enough for it to pay: all the cores' share when threads wait passively, which
paid even on that loaded machine, else only the cores the load average leaves free."""
from __future__ import annotations

import math
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


# A second torch thread pays from this many parameters × ensemble members per process: the canonical
# model (0.82 M) ran 1.9x faster on two passive threads under load, the README sweep's 0.10 M model
# only 1.2x, within the minute-to-minute noise of a loaded machine (benchmarks/RESULTS.md, "threads").
TWO_THREADS_FROM = 500_000


def free_cores(cores: int | None = None, load: float | None = None) -> int:
    """The cores other processes leave free now: cores less the 1-minute load average, at least 1."""
    cores = cores or available_cores()
    load = os.getloadavg()[0] if load is None else load
    if not math.isfinite(load) or load < 0:
        raise ValueError(f"load: must be a finite number >= 0, got {load}")
    return max(1, min(cores, cores - math.floor(load + 0.5)))


def waits_passively() -> bool:
    """Whether this process's OpenMP threads wait passively: set by the command line before torch loads
    (and given to every sweep worker) unless the user chose a policy."""
    return os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"


def plan_threads(configs: Sequence[RunConfig], workers: int = 1, members: int = 1, cores: int | None = None,
                 load: float | None = None, passive: bool | None = None) -> int:
    """Torch threads for each of ``workers`` processes training ``configs`` (``members`` runs at a time
    in a vectorised ensemble): 1 where a second thread does not pay, else the worker's share of the
    cores (``passive`` waiting, default `waits_passively`) or of the free cores (spinning threads)."""
    if workers < 1:
        raise ValueError(f"workers: must be >= 1, got {workers}")
    if members < 1:
        raise ValueError(f"members: must be >= 1, got {members}")
    if any(uses_cuda(c) for c in configs):   # the host thread only launches kernels
        return 1
    work = max((parameter_count(c) or 1_000_000 for c in configs), default=0) * members
    if work < TWO_THREADS_FROM:
        return 1
    passive = waits_passively() if passive is None else passive
    return max(1, (cores or available_cores() if passive else free_cores(cores, load)) // workers)


def memory_per_run(cfg: RunConfig) -> int:
    """Rough bytes one worker needs: the torch runtime plus parameters, gradients and AdamW state."""
    n = parameter_count(cfg) or 1_000_000
    return 400 * 2**20 + 6 * 4 * n


def plan_local(configs: Sequence[RunConfig], workers: int | None = None, cores: int | None = None,
               memory: int | None = None, load: float | None = None) -> tuple[int, int]:
    """(workers, torch threads per worker): workers ≤ cores and what the memory estimate holds;
    threads from `plan_threads` (1 for small models, whatever the cores)."""
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
    return workers, plan_threads(configs, workers, cores=cores, load=load)


def default_workers(configs: Sequence[RunConfig], workers: int | None) -> int | None:
    """On CUDA one worker per GPU unless told otherwise (CPU: decided by `plan_local`)."""
    if workers is None and any(uses_cuda(c) for c in configs):
        return max(1, torch.cuda.device_count())
    return workers


def spread_packs(tasks: list[list[RunConfig]], workers: int) -> list[list[RunConfig]]:
    """Split the largest ensembles in halves until every one of ``workers`` processes has a task (or
    every task is one run): one ensemble of 8 small models on 2 cores would get one process and one
    thread (`plan_threads`), leaving the second core idle."""
    tasks = [list(t) for t in tasks]
    while len(tasks) < workers:
        largest = max(range(len(tasks)), key=lambda i: len(tasks[i]), default=None)
        if largest is None or len(tasks[largest]) < 2:
            break
        task = tasks.pop(largest)
        tasks[largest:largest] = [task[:(len(task) + 1) // 2], task[(len(task) + 1) // 2:]]
    return tasks


def plan_packs(configs: Sequence[RunConfig], n_packs: int, workers: int | None = None,
               threads: int | None = None, cores: int | None = None, members: int = 1,
               load: float | None = None) -> tuple[int, int]:
    """(workers, threads) for ``n_packs`` tasks of up to ``members`` runs each: one process per task at
    most; threads from `plan_threads` unless given."""
    cores = cores or available_cores()
    n_workers = max(1, min(plan_local(configs, default_workers(configs, workers), cores, load=load)[0], n_packs))
    if threads is None:
        threads = plan_threads(configs, n_workers, members=members, cores=cores, load=load)
    return n_workers, threads
