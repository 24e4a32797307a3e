"""Weight-decay sweeps: the grid, its shards, and running it into a result store.

``build_grid`` turns the sweep options into validated ``RunConfig``s (one per distinct run_id);
``shard`` splits a grid deterministically (by run_id) for Slurm job arrays; ``run_sweep`` registers
the grid in a ``Store``, skips finished runs and executes the rest on a backend:

* ``local``: ``workers`` spawned processes (`_WorkerPool`) with ``threads`` torch threads each
  (workers × threads ≤ cores); ``workers = 1`` runs in the calling process. A worker that dies costs
  only the run it held (retried up to ``max_retries`` times); the others go on.
* ``ray``: each run a Ray task (``num_gpus=1`` for CUDA runs, else ``num_cpus=1``) with ``max_retries``
  so a run on a lost worker is retried; results are written by the driver as tasks finish.

Either way only driver processes write the store; a finished run's result and trace land in one
transaction, so rerunning after a crash redoes only unfinished runs and never duplicates one. Each
run is claimed in the store right before it starts (`fastdiag.store.Lease`), so concurrent sweeps on
one store share the grid. A run whose trainer raises is recorded ``failed`` with its error; the
sweep goes on. An interrupt of the driver (SIGINT, SIGTERM) stores what finished, stops the workers
and propagates.

``load_groups`` / ``analyze_group`` read a store back for ``fastdiag analyze`` and ``fastdiag plot``.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import math
import os
import re
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Sequence

from fastdiag.grokking.config import ARCHS, RunConfig
from fastdiag.store import Lease, Store
from fastdiag.grokking.tasks import available_memory, check_task

REGIMES = ("grok", "memorization", "collapse", "anti-grok", "diverged")
GROKKED = ("grok", "anti-grok")          # reached t_grok within the horizon
BACKENDS = ("local", "ray")


# =============================================================================== the grid

_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"


# A grid larger than this is a typo (1e-3:1:100000000), not an experiment: refuse it before building it.
MAX_GRID_RUNS = 100_000


def parse_wd(spec: str) -> list[float]:
    """``"0.01,0.1,1"`` → those values; ``"1e-3:2:13"`` → 13 log-spaced values from 1e-3 to 2."""
    text = str(spec).strip()
    if not text:
        raise ValueError("weight_decays: empty weight-decay grid")
    if ":" in text:
        parts = text.split(":")
        if len(parts) != 3 or not all(re.fullmatch(_NUMBER, s.strip()) for s in parts[:2]) \
                or not re.fullmatch(r"[-+]?\d+", parts[2].strip()):
            raise ValueError(f"weight_decays: bad range {text!r}; expected START:STOP:COUNT, e.g. 1e-3:2:13 "
                             "(COUNT log-spaced values from START to STOP)")
        start, stop, count = float(parts[0]), float(parts[1]), int(parts[2])
        if not 1 <= count <= MAX_GRID_RUNS:
            raise ValueError(f"weight_decays: range count must be >= 1 and at most {MAX_GRID_RUNS}, got {count}")
        if not (start > 0 and stop > 0 and math.isfinite(start) and math.isfinite(stop)):
            raise ValueError(f"weight_decays: a log-spaced range needs START > 0 and STOP > 0, got "
                             f"{start:g}:{stop:g}; list 0 explicitly (e.g. 0,0.01,0.1) if you want it")
        if count == 1:
            if start != stop:
                raise ValueError(f"weight_decays: a range of 1 value needs START = STOP, got {start:g}:{stop:g}")
            return [start]
        a, b = math.log10(start), math.log10(stop)
        values = [10.0 ** (a + (b - a) * i / (count - 1)) for i in range(count)]
        values[0], values[-1] = start, stop          # the end points exactly as written
        return [float(f"{v:.6g}") for v in values]
    values = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            raise ValueError(f"weight_decays: empty item in {text!r}")
        if not re.fullmatch(_NUMBER, item):
            raise ValueError(f"weight_decays: {item!r} is not a number")
        value = float(item)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"weight_decays: weight decay must be a finite number >= 0, got {item}")
        values.append(value)
    return sorted(set(values))


def parse_seeds(spec: str | int) -> list[int]:
    """``"5"`` → seeds 0..4; ``"0,3,7"`` → those seeds."""
    text = str(spec).strip()
    if not text:
        raise ValueError("seeds: empty")
    if "," not in text:
        if not re.fullmatch(r"[-+]?\d+", text):
            raise ValueError(f"seeds: expected a count N (seeds 0..N-1) or a comma list, got {text!r}")
        n = int(text)
        if not 1 <= n <= MAX_GRID_RUNS:
            raise ValueError(f"seeds: the count must be >= 1 and at most {MAX_GRID_RUNS}, got {n}")
        return list(range(n))
    seeds = []
    for item in text.split(","):
        item = item.strip()
        if not re.fullmatch(r"\d+", item):
            raise ValueError(f"seeds: {item!r} is not a seed (an integer >= 0)")
        seeds.append(int(item))
    return sorted(set(seeds))


def parse_list(spec: str, name: str) -> list[str]:
    items = [s.strip() for s in str(spec).split(",")]
    if not items or any(not s for s in items):
        raise ValueError(f"{name}: empty item in {spec!r}")
    return list(dict.fromkeys(items))


def parse_shard(spec: str | None) -> tuple[int, int] | None:
    """``"i/n"`` (0 ≤ i < n) → (i, n); None → None."""
    if spec is None:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(spec))
    if not m:
        raise ValueError(f"shard: expected I/N with 0 <= I < N (e.g. 0/4), got {spec!r}")
    i, n = int(m.group(1)), int(m.group(2))
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"shard: expected I/N with 0 <= I < N, got {spec!r}")
    return i, n


def check_buildable(cfg: RunConfig) -> None:
    """Raise ValueError now (not in a worker an hour later) for a config that cannot train: bad values,
    a task that cannot be built (÷ with a composite p, more pairs than memory holds) or a model the
    zoo rejects (unknown preset, heads not dividing the width, settings of another architecture)."""
    cfg.validate()
    check_task(cfg.op, cfg.p)
    _check_model(cfg.arch, cfg.preset, cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_ff, cfg.p)


@functools.lru_cache(maxsize=256)
def _check_model(arch, preset, n_layers, n_heads, d_model, d_ff, p) -> None:
    """Build the model on the meta device (no memory, no time): the zoo's own checks, once per shape."""
    import torch

    from fastdiag.models import build_from_run_config

    cfg = RunConfig(arch=arch, preset=preset, n_layers=n_layers, n_heads=n_heads, d_model=d_model, d_ff=d_ff, p=p)
    try:
        with torch.device("meta"):
            build_from_run_config(cfg, p + 1, 3, device=torch.device("meta"))
    except TypeError as exc:
        raise ValueError(str(exc)) from None


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


# =============================================================================== resources


def available_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def parameter_count(cfg: RunConfig) -> int | None:
    try:
        import torch

        from fastdiag.models import build_from_run_config, count_parameters
        with torch.device("meta"):
            model = build_from_run_config(cfg, cfg.p + 1, 3, device=torch.device("meta"))
        return int(count_parameters(model))
    except Exception:  # noqa: BLE001 - only an estimate for sizing the pool
        return None


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


def _default_workers(configs: Sequence[RunConfig], workers: int | None) -> int | None:
    """On CUDA one worker per GPU unless told otherwise (CPU: decided by `plan_local`)."""
    if workers is None and any(_uses_cuda(c) for c in configs):
        import torch
        return max(1, torch.cuda.device_count())
    return workers


def plan_packs(configs: Sequence[RunConfig], n_packs: int, workers: int | None = None,
               threads: int | None = None, cores: int | None = None) -> tuple[int, int]:
    """(workers, threads) for ``n_packs`` ensembles: one process per pack at most, so that with
    fewer packs than cores each pack gets more threads instead of cores idling."""
    cores = cores or available_cores()
    n_workers = min(plan_local(configs, _default_workers(configs, workers), cores)[0], n_packs)
    return n_workers, threads if threads is not None else max(1, cores // n_workers)


# =============================================================================== executing


EPOCH_REPORT_S = 2.0   # how often a run in flight tells the driver its epoch
HELD_RETRY_S = 5.0     # how often runs another sweep held are looked at again


def _epoch_reporter(report: Callable[[str, int, int], None], run_id: str, epochs: int) -> Callable[[dict], None]:
    """A trainer progress callback that passes (run id, epoch, horizon) on every EPOCH_REPORT_S at most."""
    last = [-math.inf]

    def on_row(row: dict) -> None:
        now = time.monotonic()
        if now - last[0] >= EPOCH_REPORT_S:
            last[0] = now
            report(run_id, int(row["epoch"]), epochs)
    return on_row


def _execute(cfg_dict: dict, train_fn: Callable | None = None,
             report: Callable[[str, int, int], None] | None = None) -> dict:
    """Run one config; never raises for a failing run (the error comes back as data). ``report``
    receives (run id, epoch, horizon) of the real trainer now and then."""
    started = time.time()
    try:
        cfg = RunConfig.from_dict(cfg_dict)
        if train_fn is None:
            from fastdiag.grokking.train import train_run

            outcome = train_run(cfg, _epoch_reporter(report, cfg.run_id(), cfg.epochs) if report else None)
        else:
            outcome = train_fn(cfg)
        result = dict(outcome.result)
        result.setdefault("run_id", cfg.run_id())
        if result.get("n_params") is None:
            n = parameter_count(cfg)
            if n is not None:
                result["n_params"] = n
        return {"ok": True, "result": result, "trace": list(outcome.trace), "started": started,
                "finished": time.time(), "worker": f"{_hostname()}:{os.getpid()}"}
    except Exception as exc:  # noqa: BLE001 - recorded as a failed run, the sweep goes on
        tb = traceback.extract_tb(exc.__traceback__)
        where = f" at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno}" if tb else ""
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}{where}", "started": started,
                "finished": time.time(), "worker": f"{_hostname()}:{os.getpid()}"}


def _hostname() -> str:
    import socket
    return socket.gethostname()


def _die_with_parent() -> None:
    """A worker must not outlive a killed sweep (kill -9 gives the parent no chance to clean up)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
        except OSError:
            pass
        if os.getppid() == 1:   # the parent died before prctl took effect
            os._exit(1)


def _init_worker(threads: int, gpu_index: int | None = None) -> None:
    _die_with_parent()
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["MKL_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    if gpu_index is not None and torch.cuda.is_available():
        torch.cuda.set_device(gpu_index % torch.cuda.device_count())


@dataclass
class SweepSummary:
    total: int = 0                 # runs in this (shard of the) grid
    skipped: int = 0               # already done before this invocation
    done: int = 0                  # finished in this invocation
    failed: int = 0                # failed in this invocation (after retries)
    regimes: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)   # (run_id, error)
    elsewhere: int = 0             # unfinished, held by another live sweep on the same store
    wall_seconds: float = 0.0


class Progress:
    """One updating line on stderr: runs done / total, ETA, counts per regime so far."""

    def __init__(self, total: int, skipped: int = 0, stream=None, enabled: bool = True,
                 regimes: dict | None = None):
        self.total, self.skipped = total, skipped
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.started = time.time()
        self.done_now = 0
        self.failed = 0
        self.regimes = dict(regimes or {})
        self.running: dict[str, tuple[int, int]] = {}    # run id -> (epoch, horizon) of runs in flight
        self._last = 0.0
        self._width = 0
        self._shown = None

    def line(self) -> str:
        done = self.skipped + self.done_now + self.failed
        remaining = self.total - done
        in_flight = sum(e / h for e, h in self.running.values())     # runs' worth of epochs in flight
        worked = self.done_now + self.failed + in_flight
        if remaining == 0:
            eta = "done"
        elif worked:
            eta = "ETA " + _duration((time.time() - self.started) / worked * (remaining - in_flight))
        else:
            eta = "ETA ?"
        regimes = " ".join(f"{r} {n}" for r, n in self.regimes.items() if n)
        parts = [f"sweep: {done}/{self.total} runs", eta]
        if self.failed:
            parts.append(f"{self.failed} failed")
        if regimes:
            parts.append(regimes)
        if self.running:
            at = sorted(self.running.values(), key=lambda eh: eh[0] / eh[1])
            if len(at) <= 2:
                parts.append("running: epoch " + ", ".join(f"{e}/{h}" for e, h in at))
            else:
                e, h = at[len(at) // 2]
                parts.append(f"{len(at)} running, median at {100 * e // h}% of their epochs")
        return " | ".join(parts)

    def epoch(self, run_id: str, epoch: int, epochs: int) -> None:
        """A run in flight reached ``epoch`` of ``epochs``."""
        self.running[run_id] = (epoch, epochs)
        self.show()

    def update(self, regime: str | None = None, failed: bool = False, force: bool = False,
               run_id: str | None = None) -> None:
        self.running.pop(run_id, None)
        if failed:
            self.failed += 1
        else:
            self.done_now += 1
            if regime:
                self.regimes[regime] = self.regimes.get(regime, 0) + 1
        self.show(force=force)

    def note(self, message: str) -> None:
        """A line of its own above the progress line."""
        if not self.enabled:
            return
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
        self.stream.write(message + "\n")
        self.stream.flush()
        self._shown = None
        self.show(force=True)

    def show(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.time()
        if not force and not self.tty and now - self._last < 2.0 and \
                self.skipped + self.done_now + self.failed < self.total:
            return                                      # logs: at most a line every 2 s
        text = self.line()
        if text == self._shown and not self.tty:
            return
        self._last, self._shown = now, text
        if self.tty:
            pad = max(0, self._width - len(text))
            self.stream.write("\r" + text + " " * pad)
            self._width = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def run_sweep(configs: Sequence[RunConfig], store: Store, *, backend: str = "local",
              workers: int | None = None, threads: int | None = None, address: str | None = None,
              max_retries: int = 2, retry_failed: bool = True, ensemble: int | None = 1,
              train_fn: Callable | None = None, progress: bool | Progress = True) -> SweepSummary:
    """Register ``configs`` in ``store`` and run those not finished yet. Returns a SweepSummary.

    ``ensemble`` > 1 trains compatible runs (same everything but seed and λ, an architecture that
    vectorises) as vectorised ensembles of up to that many members (`fastdiag.grokking.ensemble_train`; None: the
    size `default_ensemble_size` picks per group); the others, and the members of an ensemble whose
    worker died, run one by one as usual.

    Each run is claimed in the store (`Lease`) right before it starts, so sweeps running at the same
    time on one store share the grid; runs a live sweep holds are left to it (``summary.elsewhere``).
    An interrupt (KeyboardInterrupt, SystemExit) stops the workers, keeps every finished run and
    frees the claims of the unfinished ones, then propagates."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    if max_retries < 0:
        raise ValueError(f"max_retries: must be >= 0, got {max_retries}")
    started = time.time()
    by_id = {c.run_id(): c for c in configs}
    store.add_runs([c.to_dict() for c in by_id.values()])
    status = store.status_of(by_id)
    redo = ("pending", "running", "failed") if retry_failed else ("pending", "running")
    todo = [by_id[rid] for rid in sorted(by_id) if status.get(rid) in redo]
    summary = SweepSummary(total=len(by_id), skipped=len(by_id) - len(todo))
    regimes_so_far: dict = {}
    for run in store.runs("done"):
        if run["run_id"] in by_id and run["result"]:
            r = run["result"].get("regime")
            regimes_so_far[r] = regimes_so_far.get(r, 0) + 1
    if isinstance(progress, Progress):
        bar = progress
    else:
        bar = Progress(summary.total, summary.skipped, enabled=bool(progress), regimes=regimes_so_far)
    bar.total, bar.skipped = summary.total, summary.skipped
    bar.show(force=True)

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

    with Lease(store) as lease:
        try:
            tasks = [[c] for c in todo]
            if todo and ensemble != 1 and train_fn is None:
                from fastdiag.grokking.ensemble_train import describe_packs, pack_runs

                tasks = pack_runs(todo, ensemble)
                for line in describe_packs(tasks):
                    bar.note(line)
            if backend == "ray":
                _run_ray(tasks, lease, finish, redo=redo, address=address, max_retries=max_retries,
                         train_fn=train_fn)
            else:
                _run_local(tasks, lease, finish, redo=redo, workers=workers, threads=threads,
                           max_retries=max_retries, train_fn=train_fn, report=bar.epoch)
            unfinished = [rid for rid, st in store.status_of(by_id).items() if st in redo]
            summary.elsewhere = len(lease.held_elsewhere(unfinished))
        finally:
            bar.show(force=True)
            bar.close()
    summary.wall_seconds = time.time() - started
    return summary


def _uses_cuda(cfg: RunConfig) -> bool:
    if cfg.device.startswith("cuda"):
        return True
    if cfg.device == "auto":
        try:
            import torch
            return torch.cuda.is_available()
        except ImportError:  # pragma: no cover
            return False
    return False


def _died(attempts: int) -> dict:
    return {"ok": False, "error": f"worker process died (killed, crashed or out of memory) on each of "
                                  f"{attempts} attempts"}


def _run_local(tasks: list[list[RunConfig]], lease, finish, *, redo, workers, threads, max_retries, train_fn,
               report=None) -> None:
    """Run ``tasks`` (one config: a run; more: an ensemble) in this process (one worker) or on a
    `_WorkerPool`. Every task is claimed right before it starts; tasks a live concurrent sweep holds
    are tried once more when everything else is done, and otherwise left to it."""
    cfgs = [c for task in tasks for c in task]
    if not cfgs:
        return
    n_workers, n_threads = plan_packs(cfgs, len(tasks), workers, threads)
    queue: collections.deque = collections.deque(tasks)
    held: list[list[RunConfig]] = []          # claimed by another sweep when we came to them
    last_look = [-math.inf]
    deaths: collections.Counter = collections.Counter()

    def claim(task: list[RunConfig]) -> tuple[list[RunConfig], list[RunConfig]]:
        """(members claimed now, members another sweep holds)."""
        claimed = set(lease.claim([c.run_id() for c in task], statuses=redo))
        return [c for c in task if c.run_id() in claimed], [c for c in task if c.run_id() not in claimed]

    def next_task() -> list[RunConfig] | None:
        """The claimed members of the next task that has any (None: nothing to claim now)."""
        while queue:
            members, others = claim(queue.popleft())
            if others:
                held.append(others)
            if members:
                return members
        # Our own tasks are all out: look again (not too often) at those other sweeps held, which
        # are free once their sweep died or stopped renewing its claims.
        if held and time.monotonic() - last_look[0] >= HELD_RETRY_S:
            last_look[0] = time.monotonic()
            again, held[:] = list(held), []
            for task in again:
                members, others = claim(task)
                if others:
                    held.append(others)
                if members:
                    queue.append(members)
            return next_task() if queue else None
        return None

    if n_workers == 1:
        # In this process: no pool, the simplest and most debuggable path; an interrupt simply raises.
        import torch
        previous = torch.get_num_threads()
        torch.set_num_threads(n_threads)
        try:
            while (task := next_task()) is not None:
                if len(task) == 1:
                    finish(task[0], _execute(task[0].to_dict(), train_fn, report))
                    continue
                stored: set[int] = set()

                def on_member(index: int, out: dict, task=task, stored=stored) -> None:
                    finish(task[index], out)
                    stored.add(index)
                outs = _execute_pack([c.to_dict() for c in task], report, on_member)
                for index, (cfg, out) in enumerate(zip(task, outs)):
                    if index not in stored:
                        finish(cfg, out)
        finally:
            torch.set_num_threads(previous)
        return

    pool = _WorkerPool(n_workers, n_threads, cuda=any(_uses_cuda(c) for c in cfgs))

    def handle(worker: "_Worker", message: tuple) -> None:
        kind, *msg = message
        task = worker.task
        if kind == "epoch":
            if report is not None:
                report(*msg)
        elif kind == "member":               # an ensemble member finished before the others
            index, out = msg
            finish(task[index], out)
            worker.stored.add(index)
        elif kind == "result":
            outs = [msg[0]] if len(task) == 1 else msg[0]
            for index, (cfg, out) in enumerate(zip(task, outs)):
                if index not in worker.stored:
                    finish(cfg, out)
        elif kind == "died":                  # only the task on that worker; the others go on
            if len(task) > 1:                 # which member killed it is unknown: the rest one by one
                queue.extend([cfg] for index, cfg in enumerate(task) if index not in worker.stored)
                return
            rid = task[0].run_id()
            deaths[rid] += 1
            if deaths[rid] > max_retries:
                finish(task[0], _died(deaths[rid]))
            else:
                queue.appendleft(task)

    try:
        while True:
            while pool.idle and (task := next_task()) is not None:
                pool.submit(pool.idle[0], task, train_fn)
            if not pool.busy:
                break
            for worker, message in pool.events(timeout=1.0):
                handle(worker, message)
    except BaseException:
        # Interrupted (Ctrl-C, SIGTERM, an error storing a run): keep what finished and is waiting in
        # the pipes, then stop the workers (finally). Their runs stay unfinished and unclaimed.
        with contextlib.suppress(Exception):
            for worker, message in pool.events(timeout=0, results_only=True):
                handle(worker, message)
        raise
    finally:
        pool.close()


class _Worker:
    """One spawned worker process, its pipe, and the task it holds (None: idle)."""

    def __init__(self, ctx, slot: int, threads: int, cuda: bool) -> None:
        self.slot = slot
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, threads, slot if cuda else None),
                                   name=f"fastdiag-worker-{slot}")
        self.process.start()
        child.close()
        self.task: list[RunConfig] | None = None
        self.stored: set[int] = set()     # members of its ensemble already finished


class _WorkerPool:
    """``size`` spawned worker processes, each with its own pipe and one task at a time.

    Unlike a ProcessPoolExecutor, which breaks as a whole when one worker dies, the driver knows
    which task each worker holds: a dead worker costs only its own task (retried or failed), a fresh
    worker takes its slot, and the others keep training. The driver reads every pipe continuously,
    so a worker never blocks on a result nobody reads."""

    def __init__(self, size: int, threads: int, cuda: bool) -> None:
        import multiprocessing

        self.ctx = multiprocessing.get_context("spawn")
        self.threads, self.cuda = threads, cuda
        self.workers = [_Worker(self.ctx, slot, threads, cuda) for slot in range(size)]

    @property
    def idle(self) -> list[_Worker]:
        return [w for w in self.workers if w.task is None]

    @property
    def busy(self) -> list[_Worker]:
        return [w for w in self.workers if w.task is not None]

    def submit(self, worker: _Worker, task: list[RunConfig], train_fn: Callable | None) -> None:
        worker.task, worker.stored = task, set()
        dicts = [c.to_dict() for c in task]
        try:
            worker.conn.send(("run", dicts[0], train_fn) if len(task) == 1 else ("pack", dicts, None))
        except OSError:                       # it died while idle: `events` reports it with this task
            pass

    def events(self, timeout: float, results_only: bool = False):
        """Yield ``(worker, message)`` for what busy workers sent (``("epoch", …)``, ``("member", i,
        out)``, ``("result", out)``) and ``(worker, ("died", exitcode))`` for a worker that died, which
        is then replaced. A worker is idle again once its result or death has been handled."""
        from multiprocessing.connection import wait

        busy = self.busy
        if not busy:
            return
        wait([w.conn for w in busy] + [w.process.sentinel for w in busy], timeout)
        for w in busy:
            while w.task is not None:
                try:
                    if not w.conn.poll():
                        break
                    message = w.conn.recv()
                except (EOFError, OSError):   # the worker died mid-message
                    break
                if results_only and message[0] == "epoch":
                    continue
                yield w, message
                if message[0] == "result":
                    w.task = None
            if w.task is not None and not w.process.is_alive() and not results_only:
                yield w, ("died", w.process.exitcode)
                self._replace(w)

    def _replace(self, dead: _Worker) -> None:
        dead.conn.close()
        dead.process.join(timeout=5)
        self.workers[self.workers.index(dead)] = _Worker(self.ctx, dead.slot, self.threads, self.cuda)

    def close(self) -> None:
        """Idle workers exit; workers still training (an interrupt) are terminated."""
        for w in self.workers:
            with contextlib.suppress(OSError, ValueError):
                if w.task is None:
                    w.conn.send(None)
                else:
                    w.process.terminate()
        for w in self.workers:
            w.process.join(timeout=10)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            w.conn.close()


def _worker_main(conn, threads: int, gpu_index: int | None) -> None:
    """A pool worker: trains the tasks the driver sends, one at a time, sending back epochs, ensemble
    members as they finish, and results. It ignores SIGINT: a Ctrl-C in a terminal reaches the whole
    process group, and the driver alone decides what it means (store what finished, stop the workers)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _init_worker(threads, gpu_index)

    def report(*msg) -> None:
        conn.send(("epoch", *msg))

    while True:
        try:
            task = conn.recv()
        except EOFError:                     # the driver is gone
            return
        if task is None:
            return
        kind, payload, train_fn = task
        if kind == "run":
            out = _execute(payload, train_fn, report)
        else:
            out = _execute_pack(payload, report, lambda index, member: conn.send(("member", index, member)))
        try:
            conn.send(("result", out))
        except Exception as exc:  # noqa: BLE001 - e.g. a result that does not pickle: a failed run
            error = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            conn.send(("result", error if kind == "run" else [error] * len(payload)))


def _execute_pack(cfg_dicts: list[dict], report: Callable[[str, int, int], None] | None = None,
                  on_member: Callable[[int, dict], None] | None = None) -> list[dict]:
    """Train runs as one vectorised ensemble; like `_execute`, failures come back as data.
    ``on_member(index, output)`` gets each member's output the moment it is done, so the driver
    stores it at once instead of when the whole pack ends; ``report`` gets members' epochs."""
    from fastdiag.grokking.ensemble_train import train_ensemble

    started = time.time()
    worker = f"{_hostname()}:{os.getpid()}"

    def output(outcome) -> dict:
        return {"ok": True, "result": dict(outcome.result), "trace": list(outcome.trace), "started": started,
                "finished": time.time(), "worker": worker}

    def on_finish(index, outcome) -> None:
        if on_member is not None:
            on_member(index, output(outcome))

    cfgs = [RunConfig.from_dict(d) for d in cfg_dicts]
    progress = None
    if report is not None:
        reporters = [_epoch_reporter(report, c.run_id(), c.epochs) for c in cfgs]

        def progress(index, row) -> None:
            reporters[index](row)
    try:
        outcomes = train_ensemble(cfgs, progress=progress, on_finish=on_finish)
    except Exception as exc:  # noqa: BLE001 - recorded as failed runs, the sweep goes on
        error = f"ensemble of {len(cfg_dicts)}: {type(exc).__name__}: {exc}"
        return [{"ok": False, "error": error, "started": started, "finished": time.time(), "worker": worker}
                for _ in cfg_dicts]
    return [output(o) for o in outcomes]


def _ray_execute_pack(cfg_dicts: list[dict]) -> list[dict]:
    _init_worker(1)
    return _execute_pack(cfg_dicts)


@contextlib.contextmanager
def _ray_session(address: str | None):
    """Connect to (or start) Ray for the duration of a sweep; shut down only what was started here."""
    try:
        import ray
    except ImportError:
        raise ValueError("backend: ray: the ray package is not installed (pip install 'ray[default]')") from None
    started_here = False
    if not ray.is_initialized():
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            raise ValueError(f"backend: ray: cannot connect to the Ray cluster "
                             f"{address or '(local)'}: {' '.join(str(exc).split())}") from None
        started_here = True
    try:
        yield ray
    finally:
        if started_here:
            ray.shutdown()


def _ray_completed(ray, refs: dict):
    """Yield ``(key, result, None)`` or ``(key, None, exception)`` for each Ray task as it completes
    (tasks added to ``refs`` meanwhile included)."""
    while refs:
        ready, _ = ray.wait(list(refs), num_returns=1)
        for ref in ready:
            key = refs.pop(ref)
            try:
                result, error = ray.get(ref), None
            except Exception as exc:  # noqa: BLE001 - the caller decides what a failure means
                result, error = None, exc
            yield key, result, error


def _run_ray(tasks: list[list[RunConfig]], lease, finish, *, redo, address, max_retries, train_fn) -> None:
    """Every task a Ray task (``max_retries`` for lost workers); an ensemble lost after its retries
    runs its members one by one. Ray schedules everything at once, so everything is claimed at once."""
    claimed = set(lease.claim([c.run_id() for task in tasks for c in task], statuses=redo, worker="ray"))
    tasks = [t for t in ([c for c in task if c.run_id() in claimed] for task in tasks) if t]
    if not tasks:
        return
    with _ray_session(address) as ray:
        gpus = ray.cluster_resources().get("GPU", 0)
        run_task = ray.remote(_ray_execute)
        pack_task = ray.remote(_ray_execute_pack).options(max_retries=max_retries, retry_exceptions=False,
                                                          num_cpus=1)

        def submit_run(cfg: RunConfig):
            want_gpu = cfg.device.startswith("cuda") or (cfg.device == "auto" and gpus > 0)
            opts = {"num_gpus": 1, "num_cpus": 1} if want_gpu else {"num_cpus": 1}
            return run_task.options(max_retries=max_retries, retry_exceptions=False, **opts).remote(
                cfg.to_dict(), train_fn)

        refs = {(pack_task.remote([c.to_dict() for c in t]) if len(t) > 1 else submit_run(t[0])): t for t in tasks}
        for task, out, exc in _ray_completed(ray, refs):
            if len(task) > 1:
                if exc is not None:           # lost after retries: its runs go one by one
                    refs.update({submit_run(c): [c] for c in task})
                    continue
                for cfg, member in zip(task, out):
                    finish(cfg, member)
                continue
            if exc is not None:               # lost worker after retries, task error, ...
                msg = " ".join(str(exc).split())
                if len(msg) > 500:
                    msg = msg[:500] + "..."
                out = {"ok": False, "error": f"ray task failed after {max_retries} retries: "
                                             f"{type(exc).__name__}: {msg}"}
            finish(task[0], out)


def _ray_execute(cfg_dict: dict, train_fn=None) -> dict:
    import ray
    try:
        cpus = int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)) or 1
    except Exception:  # noqa: BLE001
        cpus = 1
    _init_worker(max(1, cpus))
    return _execute(cfg_dict, train_fn)


# =============================================================================== reading back


GROUP_EXCLUDE = ("weight_decay", "seed", "device")


def file_safe(text) -> str:
    """Letters, digits and single dashes only: a name from a store (untrusted) that can be neither a
    path nor a hidden file."""
    return re.sub(r"[^A-Za-z0-9]+", "-", str(text)).strip("-")[:80] or "unnamed"


@dataclass
class Group:
    """Done runs that differ only in λ and seed: one experimental condition."""

    key: tuple
    config: dict                       # the shared configuration (λ, seed, device removed)
    runs: list = field(default_factory=list)    # store run dicts (status done)

    def _model_parts(self) -> list[str]:
        """arch [preset] [L.. H.. d.. ff..]"""
        c = self.config
        parts = [c["arch"]]
        if c["arch"] == "transformer" and c.get("preset") not in (None, "custom"):
            parts.append(c["preset"])
        return parts + [f"{short}{c[name]}" for name, short in
                        (("n_layers", "L"), ("n_heads", "H"), ("d_model", "d"), ("d_ff", "ff")) if c.get(name)]

    @property
    def label(self) -> str:
        c = self.config
        return " ".join(self._model_parts() + [f"a{c['op']}b mod {c['p']}", f"{c['epochs']} ep"])

    @property
    def slug(self) -> str:
        """A file-name-safe short name: arch[-preset][-L..-H..-d..-ff..]-op-pP-eE."""
        c = self.config
        parts = self._model_parts() + [{"+": "add", "-": "sub", "*": "mul", "/": "div"}.get(c["op"], "op"),
                                       f"p{c['p']}", f"e{c['epochs']}"]
        return file_safe("-".join(str(x) for x in parts)).lower()

    @property
    def n_params(self) -> int | None:
        values = sorted(r["result"]["n_params"] for r in self.runs if r["result"].get("n_params"))
        if values:
            return int(values[len(values) // 2])
        return parameter_count(RunConfig.from_dict({**self.config, "weight_decay": 1.0, "seed": 0}))

    def arrays(self):
        lambdas = [float(r["config"]["weight_decay"]) for r in self.runs]
        regimes = [r["result"].get("regime") for r in self.runs]
        grokked = [g in GROKKED for g in regimes]
        t_grok = [float(r["result"]["t_grok_epoch"]) if r["result"].get("t_grok_epoch") is not None
                  and g else float("nan") for r, g in zip(self.runs, grokked)]
        return lambdas, regimes, grokked, t_grok


def load_groups(store: Store) -> tuple[list[Group], dict[str, int]]:
    """Done runs grouped by everything but λ, seed and device; plus the store's status counts."""
    groups: dict[tuple, Group] = {}
    for run in store.runs("done"):
        cfg = {k: v for k, v in run["config"].items() if k not in GROUP_EXCLUDE}
        key = tuple(sorted((k, repr(v)) for k, v in cfg.items()))
        groups.setdefault(key, Group(key=key, config=cfg)).runs.append(run)
    ordered = sorted(groups.values(), key=lambda g: (g.config["arch"], g.n_params or 0, g.label))
    return ordered, store.counts()


def in_fit_range(lambdas, fit_max_lambda: float | None) -> list[bool]:
    """Which runs the λ_c and ν fits use (``--fit-max-lambda``: those with λ ≤ it; None: all)."""
    return [fit_max_lambda is None or lam <= fit_max_lambda for lam in lambdas]


def analyze_group(group: Group, n_boot: int = 1500, seed: int = 0, fit_max_lambda: float | None = None) -> dict:
    """λ_c, ν (fixed and joint), regime table and median t_grok of one group, as a JSON-able dict.
    A fit that cannot be made is ``{"error": reason}``, never a number. Runs with λ above
    ``fit_max_lambda`` (e.g. the collapse regime, which the logistic would count as "not grokked")
    stay in the regime table but out of the fits."""
    from fastdiag.analysis import fits as analysis

    lambdas, regimes, grokked, t_grok = group.arrays()
    n_zero = sum(1 for lam in lambdas if lam == 0)
    out: dict = {
        "group": group.label, "config": group.config, "n_runs": len(lambdas),
        "n_params": group.n_params, "n_zero_lambda": n_zero, "fit_max_lambda": fit_max_lambda,
        "notes": [],
    }
    if n_zero:
        out["notes"].append(f"{n_zero} run(s) at λ = 0 kept out of the λ_c fit (log-λ axis)")
    in_fit = in_fit_range(lambdas, fit_max_lambda)
    if not all(in_fit):
        out["notes"].append(f"{in_fit.count(False)} run(s) with λ > {fit_max_lambda:g} kept out of the "
                            "λ_c and ν fits (--fit-max-lambda)")
    fit_lambdas, fit_grokked, fit_t_grok = ([x for x, keep in zip(xs, in_fit) if keep]
                                            for xs in (lambdas, grokked, t_grok))
    try:
        fit = analysis.fit_lambda_c(fit_lambdas, fit_grokked, n_boot=n_boot, seed=seed, drop_zero=True)
        out["lambda_c"] = {"lambda_c": fit.lambda_c, "ci": list(fit.ci), "k": fit.k,
                           "n_boot_ok": fit.n_boot_ok, "n_boot": n_boot, "n_runs": fit.n_runs,
                           "bins": [list(b) for b in fit.bins]}
    except analysis.FitError as exc:
        out["lambda_c"] = {"error": str(exc)}
        fit = None
    for name, joint in (("nu", False), ("nu_joint", True)):
        if fit is None:
            out[name] = {"error": "nu: no λ_c (the λ_c fit failed, see above)"}
            continue
        try:
            nf = analysis.fit_nu(fit_lambdas, fit_t_grok, fit.lambda_c, n_boot=n_boot, seed=seed, joint=joint,
                                 grokked=fit_grokked)
            out[name] = {"nu": nf.nu, "ci": list(nf.ci), "amplitude": nf.amplitude, "n": nf.n,
                         "n_boot_ok": nf.n_boot_ok, "n_boot": n_boot, "lambda_c": nf.lambda_c}
        except analysis.FitError as exc:
            out[name] = {"error": str(exc)}
    table = analysis.regime_table(lambdas, regimes)
    medians = analysis.median_t_grok(lambdas, t_grok)
    out["regimes"] = [{"lambda": lam, **counts, "n": sum(counts.values()), "median_t_grok": medians.get(lam)}
                      for lam, counts in table.items()]
    return out
