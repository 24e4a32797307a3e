"""Where a sweep's runs execute: ``local`` (this process, or a pool of spawned workers that survives a
dying worker) or ``ray`` (one Ray task per run or ensemble). Either way only the driver writes the store."""
from __future__ import annotations

import collections
import contextlib
import math
import multiprocessing
import os
import signal
import threading
import time
from multiprocessing.connection import wait
from typing import Callable

import torch

from fastdiag.grokking.build import uses_cuda
from fastdiag.grokking.config import RunConfig
from fastdiag.sweep.execute import execute, execute_pack, init_worker, passive_openmp, worker_main
from fastdiag.sweep.plan import plan_packs

HELD_RETRY_S = 5.0     # how often runs another sweep held are looked at again
# A worker holding a task that has made no progress for this long is stalled (stopped with SIGSTOP,
# blocked on a FIFO or a dead file system, deadlocked): it is killed and its task retried or failed
# like a dead worker's, so a sweep never waits for ever and its claim is not renewed for a run nobody
# trains. Progress is the worker process's CPU time (`_cpu_seconds`), which stops when its training
# stops whatever the reason, judged from the moment the task is handed over (a worker stopped before it
# says anything is caught too); a heartbeat thread would beat on in a blocked process. Where the CPU
# time cannot be read (no /proc), the worker's messages and heartbeats are the signal. Generous: a
# loaded or swapping machine slows training, and killing a slow but healthy run costs its whole work.
STALL_S = 120.0
# How long a closing pool waits for a worker to exit before SIGKILL: (normal end, interrupted).
_CLOSE_WAIT_S = {False: 10.0, True: 2.0}


def _stalled(attempts: int) -> dict:
    return {"ok": False, "error": f"worker process stalled (no progress for {STALL_S:g} s: stopped, blocked, hung "
                                  f"or starved) on each of {attempts} attempt(s); it was killed"}


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_seconds(pid: int) -> float | None:
    """The CPU time (user + system, all threads) process ``pid`` has used, or None where it cannot be
    read (no /proc, the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rpartition(b")")[2].split()      # after the name, which may hold spaces
        return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime
    except (OSError, ValueError, IndexError):
        return None


def _died(attempts: int) -> dict:
    return {"ok": False, "error": f"worker process died (killed, crashed or out of memory) on each of "
                                  f"{attempts} attempts"}


class _Tasks:
    """A sweep's tasks, each claimed right before it starts. Tasks a live concurrent sweep holds are
    set aside and looked at again (not too often) once ours are all out: they are free once their
    sweep died or stopped renewing its claims."""

    def __init__(self, tasks: list[list[RunConfig]], lease, redo):
        self.queue: collections.deque = collections.deque(tasks)
        self.held: list[list[RunConfig]] = []          # claimed by another sweep when we came to them
        self.lease, self.redo = lease, redo
        self.last_look = -math.inf

    def _claim(self, task: list[RunConfig]) -> tuple[list[RunConfig], list[RunConfig]]:
        """(members claimed now, members another sweep holds)."""
        claimed = set(self.lease.claim([c.run_id() for c in task], statuses=self.redo))
        return [c for c in task if c.run_id() in claimed], [c for c in task if c.run_id() not in claimed]

    def next(self) -> list[RunConfig] | None:
        """The claimed members of the next task that has any (None: nothing to claim now)."""
        while self.queue:
            members, others = self._claim(self.queue.popleft())
            if others:
                self.held.append(others)
            if members:
                return members
        if self.held and time.monotonic() - self.last_look >= HELD_RETRY_S:
            self.last_look = time.monotonic()
            again, self.held = self.held, []
            for task in again:
                members, others = self._claim(task)
                if others:
                    self.held.append(others)
                if members:
                    self.queue.append(members)
            return self.next() if self.queue else None
        return None


def run_local(tasks: list[list[RunConfig]], lease, finish, *, redo, workers, threads, max_retries, train_fn,
              report=None, checkpoints=None) -> None:
    """Run ``tasks`` (one config: a run; more: an ensemble) in this process (one worker) or on a
    `_WorkerPool`. Every task is claimed right before it starts (`_Tasks`). With ``checkpoints``
    (`fastdiag.sweep.checkpoints.SweepCheckpoints`, the real trainers only) every task resumes from
    and keeps its checkpoint, removed once the task's outcome is stored."""
    cfgs = [c for task in tasks for c in task]
    if not cfgs:
        return
    n_workers, n_threads = plan_packs(cfgs, len(tasks), workers, threads, members=max(map(len, tasks)))
    use_checkpoints = checkpoints is not None and train_fn is None

    def spec(task: list[RunConfig]) -> dict | None:
        return checkpoints.spec(task) if use_checkpoints else None

    def ended(task: list[RunConfig]) -> None:
        """The task's outcome is stored (or its pack split up): its checkpoint has done its work."""
        if use_checkpoints:
            checkpoints.discard(task)

    pending = _Tasks(tasks, lease, redo)
    if n_workers == 1:
        _run_in_process(pending, finish, ended, spec, train_fn, report, n_threads)
    else:
        pool = _WorkerPool(n_workers, n_threads, cuda=any(uses_cuda(c) for c in cfgs))
        _run_on_pool(pool, pending, finish, ended, spec, train_fn, report, max_retries)


def _finish_unstored(task: list[RunConfig], outs: list[dict], stored: set[int], finish) -> None:
    """Store the outcomes of a task's members not stored already (ensemble members are stored the
    moment each is done)."""
    for index, (cfg, out) in enumerate(zip(task, outs)):
        if index not in stored:
            finish(cfg, out)


def _run_in_process(pending: _Tasks, finish, ended, spec, train_fn, report, n_threads: int) -> None:
    """No pool: the simplest and most debuggable path; an interrupt simply raises."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n_threads)
    try:
        while (task := pending.next()) is not None:
            if len(task) == 1:
                finish(task[0], execute(task[0].to_dict(), train_fn, report, spec(task)))
                ended(task)
                continue
            stored: set[int] = set()

            def on_member(index: int, out: dict, task=task, stored=stored) -> None:
                finish(task[index], out)
                stored.add(index)
            _finish_unstored(task, execute_pack([c.to_dict() for c in task], report, on_member, spec(task)),
                             stored, finish)
            ended(task)
    finally:
        torch.set_num_threads(previous)


def _run_on_pool(pool: "_WorkerPool", pending: _Tasks, finish, ended, spec, train_fn, report,
                 max_retries: int) -> None:
    """Tasks to idle workers, their messages handled as they come; a dead or stalled worker costs only
    its own task (retried up to ``max_retries`` times, an ensemble split into single runs)."""
    deaths: collections.Counter = collections.Counter()

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
            _finish_unstored(task, [msg[0]] if len(task) == 1 else msg[0], worker.stored, finish)
            ended(task)
        elif kind in ("died", "stalled"):     # only the task on that worker; the others go on
            if len(task) > 1:                 # which member killed it is unknown: the rest one by one
                ended(task)
                pending.queue.extend([cfg] for index, cfg in enumerate(task) if index not in worker.stored)
                return
            rid = task[0].run_id()
            deaths[rid] += 1
            if deaths[rid] > max_retries:
                finish(task[0], _died(deaths[rid]) if kind == "died" else _stalled(deaths[rid]))
                ended(task)
            else:                             # retried from its checkpoint, if it saved one
                pending.queue.appendleft(task)

    interrupted = False
    try:
        while True:
            while pool.idle and (task := pending.next()) is not None:
                pool.submit(pool.idle[0], task, train_fn, spec(task))
            if not pool.busy:
                break
            for worker, message in pool.events(timeout=1.0):
                handle(worker, message)
    except BaseException:
        # Interrupted (Ctrl-C, SIGTERM, an error storing a run): keep what finished and is waiting in
        # the pipes, then stop the workers (finally). Their runs stay unfinished and unclaimed.
        interrupted = True
        with contextlib.suppress(Exception):
            for worker, message in pool.events(timeout=0, results_only=True):
                handle(worker, message)
        raise
    finally:
        pool.close(interrupted)


# Signals a sweep's driver answers (Ctrl-C, a scheduler's kill): held back while a worker is spawned.
_DRIVER_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def _signals_held():
    """Hold SIGINT and SIGTERM back for the duration (main thread only; elsewhere Python cannot set
    handlers) and deliver them right after. Spawning a worker is then all or nothing: an interrupt in
    the middle of ``Process.start`` left a child that was spawned but never sent its start-up data (it
    printed an EOFError traceback) and that no one knew to stop. The held time is one fork/exec and
    a pipe write, milliseconds."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {signum: signal.signal(signum, lambda signum, frame: caught.append(signum))
                for signum in _DRIVER_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(caught):     # each once, in the order they came
            signal.raise_signal(signum)


class _Worker:
    """One spawned worker process, its pipe, and the task it holds (None: idle)."""

    def __init__(self, ctx, slot: int, threads: int, cuda: bool) -> None:
        self.slot = slot
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=worker_main, args=(child, threads, slot if cuda else None),
                                   name=f"fastdiag-worker-{slot}")
        try:
            with passive_openmp(), _signals_held():
                self.process.start()
        except BaseException:      # a held signal delivered on leaving: the started child goes too
            if self.process.pid is not None:
                self.process.kill()
                self.process.join()
            raise
        finally:
            child.close()
        self.task: list[RunConfig] | None = None
        self.stored: set[int] = set()     # members of its ensemble already finished
        self.progressed = 0.0             # when it last made progress on its task (time.monotonic)
        self.cpu: float | None = None     # its CPU time then

    def judge(self, now: float, heard: bool) -> bool:
        """Whether the worker made progress on its task: its CPU time grew (or, where that cannot be
        read, it sent something) since it was last judged. Records it; True when it did."""
        cpu = _cpu_seconds(self.process.pid)
        if (cpu is not None and self.cpu is not None and cpu > self.cpu) or (cpu is None and heard):
            self.progressed = now
        self.cpu = cpu
        return self.progressed == now


class _WorkerPool:
    """``size`` spawned worker processes, each with its own pipe and one task at a time.

    Unlike a ProcessPoolExecutor, which breaks as a whole when one worker dies, the driver knows
    which task each worker holds: a dead worker costs only its own task (retried or failed), a fresh
    worker takes its slot, and the others keep training. The driver reads every pipe continuously,
    so a worker never blocks on a result nobody reads."""

    def __init__(self, size: int, threads: int, cuda: bool) -> None:
        self.ctx = multiprocessing.get_context("spawn")
        self.threads, self.cuda = threads, cuda
        self.workers: list[_Worker] = []
        try:
            for slot in range(size):
                self.workers.append(_Worker(self.ctx, slot, threads, cuda))
        except BaseException:                 # interrupted while starting: stop those already started
            self.close(interrupted=True)
            raise

    @property
    def idle(self) -> list[_Worker]:
        return [w for w in self.workers if w.task is None]

    @property
    def busy(self) -> list[_Worker]:
        return [w for w in self.workers if w.task is not None]

    def submit(self, worker: _Worker, task: list[RunConfig], train_fn: Callable | None,
               checkpoint: dict | None = None) -> None:
        worker.task, worker.stored = task, set()
        worker.progressed, worker.cpu = time.monotonic(), _cpu_seconds(worker.process.pid)
        dicts = [c.to_dict() for c in task]
        try:
            worker.conn.send(("run", dicts[0], train_fn, checkpoint) if len(task) == 1
                             else ("pack", dicts, None, checkpoint))
        except OSError:                       # it died while idle: `events` reports it with this task
            pass

    def events(self, timeout: float, results_only: bool = False):
        """Yield ``(worker, message)`` for what busy workers sent (``("epoch", …)``, ``("member", i,
        out)``, ``("result", out)``) and ``(worker, ("died", exitcode))`` for a worker that died, which
        is then replaced. A worker is idle again once its result or death has been handled."""
        busy = self.busy
        if not busy:
            return
        wait([w.conn for w in busy] + [w.process.sentinel for w in busy], timeout)
        for w in busy:
            heard = False
            while w.task is not None:
                try:
                    if not w.conn.poll():
                        break
                    message = w.conn.recv()
                except (EOFError, OSError):   # the worker died mid-message
                    break
                heard = True
                if message[0] == "alive" or (results_only and message[0] == "epoch"):
                    continue
                yield w, message
                if message[0] == "result":
                    w.task = None
            if w.task is not None and not w.process.is_alive() and not results_only:
                yield w, ("died", w.process.exitcode)
                self._replace(w)
            elif w.task is not None and not results_only and not w.judge(time.monotonic(), heard) \
                    and time.monotonic() - w.progressed > STALL_S:
                w.process.kill()              # SIGKILL ends a stopped process too
                yield w, ("stalled", STALL_S)
                self._replace(w)

    def _replace(self, dead: _Worker) -> None:
        dead.conn.close()
        dead.process.join(timeout=5)
        self.workers[self.workers.index(dead)] = _Worker(self.ctx, dead.slot, self.threads, self.cuda)

    def close(self, interrupted: bool = False) -> None:
        """Idle workers exit; workers still training are terminated. ``interrupted`` (Ctrl-C, SIGTERM):
        every worker is terminated at once, idle ones too: a worker still starting up (importing
        torch, many seconds on a loaded machine) reads no goodbye until it has, and the user asked to
        stop now."""
        for w in self.workers:
            with contextlib.suppress(OSError, ValueError):
                if w.task is None and not interrupted:
                    w.conn.send(None)
                else:
                    w.process.terminate()
        for w in self.workers:
            w.process.join(timeout=_CLOSE_WAIT_S[interrupted])
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            w.conn.close()


def _ray_execute_pack(cfg_dicts: list[dict]) -> list[dict]:
    init_worker(1)
    return execute_pack(cfg_dicts)


@contextlib.contextmanager
def _ray_session(address: str | None):
    """Connect to (or start) Ray for the duration of a sweep; shut down only what was started here."""
    try:
        import ray
    except ImportError:
        raise ValueError("backend: ray: the ray package is not installed (pip install 'ray[default]')") from None
    started_here = False
    if not ray.is_initialized():
        # ray.init takes SIGTERM for itself (sys.exit(15): exit status 15 or 1, and its C++ core a
        # signal dump): `_signals_held` puts the driver's own handlers back (the command line's: one
        # line, 130/143, every `finally` run, the runs released) and answers a signal that came meanwhile.
        try:
            with _signals_held():
                try:
                    ray.init(address=address, include_dashboard=False, log_to_driver=False)
                except BaseException:            # interrupted or failed while Ray starts: stop what it started
                    with contextlib.suppress(Exception):
                        ray.shutdown()
                    raise
        except SystemExit as exc:                # Ray's handler took a SIGTERM: the driver's answers it
            if exc.code == signal.SIGTERM and threading.current_thread() is threading.main_thread():
                signal.raise_signal(signal.SIGTERM)
            raise
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
    (tasks added to ``refs`` meanwhile included). Interrupted (SIGINT, SIGTERM), the tasks still out
    are cancelled. Waits a second at a time, signals held: the driver's handlers run between waits."""
    try:
        yield from _ray_results(ray, refs)
    except BaseException:
        for ref in list(refs):
            with contextlib.suppress(Exception):
                ray.cancel(ref, force=True)
        raise


def _ray_results(ray, refs: dict):
    while refs:
        # held while Ray waits: an exception raised by a handler inside Ray's C++ wait comes out as a
        # SystemError traceback; held, the signal is answered right after, in Python
        with _signals_held():
            ready, _ = ray.wait(list(refs), num_returns=1, timeout=1.0)
        for ref in ready:
            key = refs.pop(ref)
            try:
                result, error = ray.get(ref), None
            except Exception as exc:  # noqa: BLE001 - the caller decides what a failure means
                result, error = None, exc
            yield key, result, error


def run_ray(tasks: list[list[RunConfig]], lease, finish, *, redo, address, max_retries, train_fn) -> None:
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
    init_worker(max(1, cpus))
    return execute(cfg_dict, train_fn)
