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
from collections import Counter
from typing import Callable, Sequence

import torch

from fastdiag.grokking.build import parameter_count, resolve_device, uses_cuda
from fastdiag.grokking.config import RunConfig
from fastdiag.grokking.ensemble_train import measure_pack, pack_runs, release_cuda_memory
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


# Spin rounds (libgomp's GOMP_SPINCOUNT) short enough that a waiting thread sleeps about as soon as a
# passive one: the command line's bounded spin (fastdiag/cli/threads.py, 1,000 rounds) is one.
BOUNDED_SPIN = 10_000


def waits_passively() -> bool:
    """Whether this process's OpenMP threads wait passively or nearly (``OMP_WAIT_POLICY=PASSIVE``, or
    no policy and a bounded ``GOMP_SPINCOUNT``): set by the command line before torch loads (and given
    to every sweep worker) unless the user chose a policy."""
    policy = os.environ.get("OMP_WAIT_POLICY", "").strip().upper()
    if policy:
        return policy == "PASSIVE"
    spins = os.environ.get("GOMP_SPINCOUNT", "").strip()
    return spins.isdigit() and int(spins) <= BOUNDED_SPIN


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


# ---- how long a sweep will take (`fastdiag sweep --dry-run`) --------------------------------------

# From this λ on a run collapses (the paper's λ = 10: never fits) and trains to its horizon.
COLLAPSE_FROM = 10.0
_LAW_SETUP = RunConfig()     # the setup the paper's law was measured in (lr, batch, p, operation, split, model)
# Timed steps of the calibration where the user does not say: a GPU step is ~1 ms and noisy at first;
# a CPU step of a canonical pack is ~0.1-1 s.
CALIBRATION_STEPS = {"cuda": 200, "cpu": 10}


def law_applies(cfg: RunConfig) -> bool:
    """Whether the paper's law of t_grok is about ``cfg``: the canonical transformer in the paper's
    setup (any seed, λ, horizon, evaluation interval)."""
    same = ("arch", "preset", "n_layers", "n_heads", "d_model", "d_ff", "op", "p", "lr", "batch_size", "train_frac")
    return all(getattr(cfg, k) == getattr(_LAW_SETUP, k) for k in same)


def expected_epochs(cfg: RunConfig, t_grok_of: Callable[[float], float] | None) -> tuple[float, str]:
    """(epochs run ``cfg`` is expected to train, "law" or "horizon"): ``t_grok_of(λ)`` (the paper's law,
    `fastdiag.analysis.paper_data.predicted_t_grok`; inf: never groks) rounded up to an evaluation, plus
    the patience, capped at the horizon, where the law is about ``cfg`` and the run stops at grokking;
    else the horizon (an upper bound for a run that stops at grokking)."""
    if t_grok_of is not None and cfg.stop_at_grok and law_applies(cfg) and cfg.weight_decay < COLLAPSE_FROM:
        t = t_grok_of(cfg.weight_decay)
        if math.isfinite(t):
            return min(float(cfg.epochs), math.ceil(t / cfg.eval_every) * cfg.eval_every + cfg.patience), "law"
    return float(cfg.epochs), "horizon"


def steps_per_epoch(cfg: RunConfig) -> int:
    pairs = cfg.p * (cfg.p - 1) if cfg.op == "/" else cfg.p * cfg.p
    return math.ceil(int(round(cfg.train_frac * pairs)) / cfg.batch_size)


def estimate_sweep(configs: Sequence[RunConfig], ensemble: int | None, workers: int | None = None,
                   threads: int | None = None, steps: int | None = None,
                   t_grok_of: Callable[[float], float] | None = None, law: str = "") -> dict:
    """How long ``configs`` take as `fastdiag sweep` would run them here: packed as it packs them
    (``ensemble``: K or None for auto), on its workers. Measured: a step and an evaluation of the
    largest pack and of a single run (`measure_pack`, ``steps`` timed steps, default
    `CALIBRATION_STEPS`), on this machine now. Extrapolated: every run's length (`expected_epochs`
    with ``t_grok_of``, described to the user as ``law``),
    a pack's step time for fewer live members (linear between the two measured sizes), and the
    workers sharing the packs evenly."""
    if not configs:
        raise ValueError("configs: expected at least one run configuration")
    device = resolve_device(configs[0].device)
    steps = CALIBRATION_STEPS[device.type] if steps is None else steps
    if steps < 1:
        raise ValueError(f"steps: must be >= 1, got {steps}")
    packs = pack_runs(configs, ensemble)
    if device.type == "cpu":      # as the local backend does: every worker a pack
        packs = spread_packs(packs, plan_local(configs, workers)[0])
    n_workers, n_threads = plan_packs(configs, len(packs), default_workers(configs, workers), threads,
                                      members=max(map(len, packs)))
    largest = max(packs, key=len)
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(n_threads)
    try:
        measured = [measure_pack(largest, steps)]
        if len(largest) > 1:
            measured.append(measure_pack(largest[:1], steps))
    finally:
        torch.set_num_threads(saved_threads)
        if device.type == "cuda":
            release_cuda_memory()
    by_size = {m["members"]: m for m in measured}

    def cost(live: int, what: str) -> float:        # seconds of a step / an evaluation of ``live`` members
        if len(by_size) == 1 or live >= len(largest):
            return by_size[len(largest) if live >= len(largest) else 1][what]
        big, one = by_size[len(largest)][what], by_size[1][what]
        return one + (big - one) * (live - 1) / (len(largest) - 1)

    seconds = member_steps = 0.0
    how = Counter()
    for pack in packs:
        ends = sorted(expected_epochs(c, t_grok_of) for c in pack)
        how.update(kind for _, kind in ends)
        start = 0.0
        for i, (end, _) in enumerate(ends):       # the members still training between two finishes
            live = len(pack) - i
            epochs = end - start
            per_epoch = steps_per_epoch(pack[0])
            seconds += epochs * (per_epoch * cost(live, "step_seconds") + cost(live, "eval_seconds") / pack[0].eval_every)
            member_steps += epochs * per_epoch * live
            start = end
    return {"device": str(device), "runs": len(configs), "packs": len(packs), "pack_sizes": sorted({len(p) for p in packs}),
            "workers": n_workers, "threads": n_threads, "measured": measured, "member_steps": member_steps,
            "runs_by_law": how["law"], "runs_to_horizon": how["horizon"], "seconds": seconds / n_workers,
            "law": law, "load": os.getloadavg()[0]}


def describe_estimate(est: dict) -> list[str]:
    """The estimate as lines for the user: the total, what was measured, what was extrapolated."""
    hours = est["seconds"] / 3600
    total = (f"{hours:,.1f} h" if hours >= 1 else f"{est['seconds'] / 60:,.1f} min" if est["seconds"] >= 60
             else f"{est['seconds']:.1f} s")
    where = (f"{est['workers']} worker(s) × {est['threads']} thread(s)" if est["device"] == "cpu"
             else f"{est['workers']} GPU worker(s)")
    lines = [f"estimate: {total} on {est['device']} ({where}; {est['runs']} runs in {est['packs']} pack(s) of "
             f"{'/'.join(map(str, est['pack_sizes']))})"]
    for m in est["measured"]:
        lines.append(f"  measured: a step of {m['members']} member(s) {1e3 * m['step_seconds']:,.2f} ms, an evaluation "
                     f"{1e3 * m['eval_seconds']:,.1f} ms ({m['steps']} timed steps on {m['device']} now, load "
                     f"{est['load']:.1f}" + (f", peak {m['peak_bytes'] / 2**30:.2f} GiB" if m["peak_bytes"] else "") + ")")
    law = f"{est['runs_by_law']} run(s) from {est['law'] or 'the law of t_grok'}, " if est["runs_by_law"] else ""
    lines.append(f"  extrapolated: {est['member_steps']:,.0f} member-steps; run lengths: {law}{est['runs_to_horizon']} "
                 "run(s) to the horizon (an upper bound for a run that stops at grokking); fewer live members "
                 "interpolated linearly between the measured sizes; the workers sharing the packs evenly")
    return lines
