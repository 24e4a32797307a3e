"""Running a sweep into a result store.

``run_sweep`` registers the grid (`fastdiag.sweep.grid`) in a ``Store``, skips finished runs and
executes the rest on a backend (`fastdiag.sweep.backends`):

* ``local``: ``workers`` spawned processes with ``threads`` torch threads each (workers × threads ≤
  cores, `fastdiag.sweep.plan`); ``workers = 1`` runs in the calling process. A worker that dies costs
  only the run it held (retried up to ``max_retries`` times); the others go on.
* ``ray``: each run a Ray task (``num_gpus=1`` for CUDA runs, else ``num_cpus=1``) with ``max_retries``
  so a run on a lost worker is retried; results are written by the driver as tasks finish.

Either way only driver processes write the store; a finished run's result and trace land in one
transaction, so rerunning after a crash redoes only unfinished runs and never duplicates one. Each
run is claimed in the store right before it starts (`fastdiag.store.Lease`), so concurrent sweeps on
one store share the grid. A run whose trainer raises is recorded ``failed`` with its error; the
sweep goes on. An interrupt of the driver (SIGINT, SIGTERM) stores what finished, stops the workers
and propagates.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from fastdiag.grokking.build import resolve_device
from fastdiag.grokking.config import CHECKPOINT_EVERY_S, SWEEP_BACKENDS, RunConfig
from fastdiag.grokking.ensemble_train import describe_packs, pack_runs
from fastdiag.store import Lease, Store
from fastdiag.sweep.backends import run_local, run_ray
from fastdiag.sweep.checkpoints import SweepCheckpoints, checkpoint_dir
from fastdiag.sweep.plan import default_workers, plan_local, spread_packs
from fastdiag.sweep.progress import Progress


@dataclass
class SweepSummary:
    total: int = 0                 # runs in this (shard of the) grid
    skipped: int = 0               # already done before this invocation
    skipped_failed: int = 0        # failed before this invocation and not retried (retry_failed=False)
    done: int = 0                  # finished in this invocation
    failed: int = 0                # failed in this invocation (after retries)
    regimes: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)   # (run_id, error)
    elsewhere: int = 0             # unfinished, held by another live sweep on the same store
    resumed: int = 0               # runs that started from a checkpoint an interrupted sweep left
    wall_seconds: float = 0.0


def check_devices(configs: Sequence[RunConfig], backend: str = "local") -> None:
    """Raise ValueError (naming ``device``) before any work when a local sweep asks for a device this
    machine lacks, instead of recording every run as failed; a Ray cluster's nodes may have it."""
    if backend == "local":
        for device in sorted({c.device for c in configs}):
            resolve_device(device)


def run_sweep(configs: Sequence[RunConfig], store: Store, *, backend: str = "local",
              workers: int | None = None, threads: int | None = None, address: str | None = None,
              max_retries: int = 2, retry_failed: bool = True, ensemble: int | None = 1,
              train_fn: Callable | None = None, progress: bool | Progress = True,
              checkpoint_every: tuple[float | None, int | None] | None = (CHECKPOINT_EVERY_S, None)) -> SweepSummary:
    """Register ``configs`` in ``store`` and run those not finished yet. Returns a SweepSummary.

    ``ensemble`` > 1 trains compatible runs (same everything but seed and λ, an architecture that
    vectorises) as vectorised ensembles of up to that many members (`fastdiag.grokking.ensemble_train`; None: the
    size `default_ensemble_size` picks per group); the others, and the members of an ensemble whose
    worker died, run one by one as usual.

    Each run is claimed in the store (`Lease`) right before it starts, so sweeps running at the same
    time on one store share the grid; runs a live sweep holds are left to it (``summary.elsewhere``).
    An interrupt (KeyboardInterrupt, SystemExit) stops the workers, keeps every finished run and
    frees the claims of the unfinished ones, then propagates.

    ``checkpoint_every`` (`fastdiag.grokking.config.parse_cadence`: (seconds, None), (None,
    epochs), or None for no checkpoints): on the local backend each run and pack keeps a checkpoint
    in ``<store>.checkpoints/`` (`fastdiag.sweep.checkpoints`), so a rerun after a kill resumes the
    unfinished runs where they were; the files go as their runs end."""
    if backend not in SWEEP_BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(SWEEP_BACKENDS)}, got {backend!r}")
    if max_retries < 0:
        raise ValueError(f"max_retries: must be >= 0, got {max_retries}")
    if train_fn is None:
        check_devices(configs, backend)
    started = time.time()
    by_id = {c.run_id(): c for c in configs}
    store.add_runs(by_id.values())
    status = store.status_of(by_id)
    redo = ("pending", "running", "failed") if retry_failed else ("pending", "running")
    todo = [by_id[rid] for rid in sorted(by_id) if status.get(rid) in redo]
    skipped_failed = 0 if retry_failed else sum(1 for rid in by_id if status.get(rid) == "failed")
    summary = SweepSummary(total=len(by_id), skipped=len(by_id) - len(todo) - skipped_failed,
                           skipped_failed=skipped_failed)
    regimes_so_far: dict = {}
    for run in store.runs("done"):
        if run["run_id"] in by_id and run["result"]:
            r = run["result"].get("regime")
            regimes_so_far[r] = regimes_so_far.get(r, 0) + 1
    if isinstance(progress, Progress):
        bar = progress
    else:
        bar = Progress(summary.total, summary.skipped + skipped_failed, enabled=bool(progress), regimes=regimes_so_far)
    bar.reset_counts(summary.total, summary.skipped + skipped_failed)   # the bar: runs not to train now

    def finish(cfg: RunConfig, out: dict) -> None:
        rid = cfg.run_id()
        if out.get("ok"):
            store.record_done(rid, out["result"], out["trace"], started_at=out.get("started"),
                              finished_at=out.get("finished"), worker=out.get("worker"))
            regime = out["result"].get("regime")
            summary.done += 1
            summary.regimes[regime] = summary.regimes.get(regime, 0) + 1
            bar.update(regime, run_id=rid)
        else:
            store.record_failed(rid, out["error"])
            summary.failed += 1
            summary.failures.append((rid, out["error"]))
            bar.update(failed=True, run_id=rid)

    checkpoints = None
    if checkpoint_every is not None and backend == "local" and train_fn is None:
        checkpoints = SweepCheckpoints(checkpoint_dir(store.path), checkpoint_every)
    with Lease(store) as lease:
        try:
            tasks = [[c] for c in todo]
            if todo and ensemble != 1 and train_fn is None:
                resumed, fresh = checkpoints.regroup(todo) if checkpoints is not None else ([], todo)
                packs = pack_runs(fresh, ensemble) if fresh else []
                if backend == "local":    # every worker a pack: one pack on two cores idles one
                    # (resumed packs are never split: their members resume from one file together)
                    packs = spread_packs(packs, plan_local(todo, default_workers(todo, workers))[0] - len(resumed))
                tasks = resumed + packs
                for line in describe_packs(tasks):
                    bar.note(line)
            if backend == "local" and workers is not None and 0 < len(tasks) < workers:
                bar.note(f"workers: {len(tasks)} of the {workers} asked for: only {len(tasks)} "
                         f"task(s) to run ({len(todo)} run(s))")
            if backend == "ray":
                run_ray(tasks, lease, finish, redo=redo, address=address, max_retries=max_retries,
                         train_fn=train_fn)
            else:
                run_local(tasks, lease, finish, redo=redo, workers=workers, threads=threads,
                           max_retries=max_retries, train_fn=train_fn, report=bar.epoch, checkpoints=checkpoints)
            unfinished = [rid for rid, st in store.status_of(by_id).items() if st in redo]
            summary.elsewhere = len(lease.held_elsewhere(unfinished))
            if checkpoints is not None:
                checkpoints.tidy(rid for rid, st in store.status_of().items() if st != "done")
        finally:
            if checkpoints is not None:
                summary.resumed = len(checkpoints.resuming)
            bar.show(force=True)
            bar.close()
    summary.wall_seconds = time.time() - started
    return summary
