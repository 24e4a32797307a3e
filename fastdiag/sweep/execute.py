"""Executing the runs of a sweep in a worker: one run (`execute`) or a vectorised ensemble
(`execute_pack`), failures coming back as data; the worker process's set-up and its loop (`worker_main`)."""
from __future__ import annotations

import contextlib
import ctypes
import math
import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Callable

import torch

from fastdiag.grokking import train
from fastdiag.grokking.build import parameter_count
from fastdiag.grokking.config import RunConfig
from fastdiag.grokking.ensemble_train import train_ensemble
from fastdiag.sweep.checkpoints import checkpointer

EPOCH_REPORT_S = 2.0   # how often a run in flight tells the driver its epoch
# Where the driver cannot read a worker's CPU time (no /proc: `backends._cpu_seconds`), how often a
# worker training a task says it is alive (an epoch may take minutes). With /proc there is no heartbeat
# thread: its own wake-ups would count as CPU time of a worker that is otherwise blocked.
HEARTBEAT_S = 1.0


def epoch_reporter(report: Callable[[str, int, int], None], run_id: str, epochs: int) -> Callable[[dict], None]:
    """A trainer progress callback that passes (run id, epoch, horizon) on every EPOCH_REPORT_S at most."""
    last = [-math.inf]

    def on_row(row: dict) -> None:
        now = time.monotonic()
        if now - last[0] >= EPOCH_REPORT_S:
            last[0] = now
            report(run_id, int(row["epoch"]), epochs)
    return on_row


def execute(cfg_dict: dict, train_fn: Callable | None = None,
            report: Callable[[str, int, int], None] | None = None, checkpoint: dict | None = None) -> dict:
    """Run one config; never raises for a failing run (the error comes back as data). ``report``
    receives (run id, epoch, horizon) of the real trainer now and then; ``checkpoint`` (a
    `SweepCheckpoints.spec`) resumes the real trainer from its checkpoint and keeps it saved."""
    started = time.time()
    try:
        cfg = RunConfig.from_dict(cfg_dict)
        if train_fn is None:
            outcome = train.train_run(cfg, epoch_reporter(report, cfg.run_id(), cfg.epochs) if report else None,
                                      checkpoint=checkpointer(checkpoint))
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
    return socket.gethostname()


def _die_with_parent() -> None:
    """A worker must not outlive a killed sweep (kill -9 gives the parent no chance to clean up)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
        except OSError:
            pass
        if os.getppid() == 1:   # the parent died before prctl took effect
            os._exit(1)


@contextlib.contextmanager
def passive_openmp():
    """A spawned worker loads torch before it runs any of our code, and OpenMP reads its wait policy
    then: passive waiting (see `fastdiag.sweep.plan`) goes in through the environment it inherits,
    unless the user chose a policy."""
    chosen = os.environ.get("OMP_WAIT_POLICY")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        yield
    finally:
        if chosen is None:
            os.environ.pop("OMP_WAIT_POLICY", None)


def init_worker(threads: int, gpu_index: int | None = None) -> None:
    _die_with_parent()
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["MKL_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    if gpu_index is not None and torch.cuda.is_available():
        torch.cuda.set_device(gpu_index % torch.cuda.device_count())


def worker_main(conn, threads: int, gpu_index: int | None) -> None:
    """A pool worker: trains the tasks the driver sends, one at a time, sending back epochs, ensemble
    members as they finish, and results. It ignores SIGINT: a Ctrl-C in a terminal reaches the whole
    process group, and the driver alone decides what it means (store what finished, stop the workers)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    init_worker(threads, gpu_index)
    sending, training = threading.Lock(), threading.Event()

    def send(message) -> None:              # the heartbeat thread sends too: one message at a time
        with sending:
            conn.send(message)

    def heartbeat() -> None:
        # While a task trains, a beat every HEARTBEAT_S: the driver takes a worker silent for much
        # longer as stalled (stopped with SIGSTOP, hung) and kills it, instead of waiting for ever.
        while True:
            time.sleep(HEARTBEAT_S)
            if training.is_set():
                with contextlib.suppress(OSError, ValueError):
                    send(("alive",))

    if not os.path.exists(f"/proc/{os.getpid()}/stat"):
        threading.Thread(target=heartbeat, name="fastdiag-heartbeat", daemon=True).start()

    def report(*msg) -> None:
        send(("epoch", *msg))

    while True:
        try:
            task = conn.recv()
        except EOFError:                     # the driver is gone
            task = None
        if task is None:
            _leave()
        kind, payload, train_fn, checkpoint = task
        training.set()
        send(("alive",))
        if kind == "run":
            out = execute(payload, train_fn, report, checkpoint)
        else:
            out = execute_pack(payload, report, lambda index, member: send(("member", index, member)), checkpoint)
        training.clear()
        try:
            send(("result", out))
        except Exception as exc:  # noqa: BLE001 - e.g. a result that does not pickle: a failed run
            error = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            send(("result", error if kind == "run" else [error] * len(payload)))


def _leave() -> None:
    """A worker's end: nothing of it needs tearing down (the driver stores every outcome, checkpoints
    are written as they are taken), and the interpreter's own teardown with torch loaded is the
    slowest part of a pool's close, which every sweep waits for."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def execute_pack(cfg_dicts: list[dict], report: Callable[[str, int, int], None] | None = None,
                 on_member: Callable[[int, dict], None] | None = None, checkpoint: dict | None = None) -> list[dict]:
    """Train runs as one vectorised ensemble; like `execute`, failures come back as data.
    ``on_member(index, output)`` gets each member's output the moment it is done, so the driver
    stores it at once instead of when the whole pack ends; ``report`` gets members' epochs;
    ``checkpoint`` as for `execute`."""
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
        reporters = [epoch_reporter(report, c.run_id(), c.epochs) for c in cfgs]

        def progress(index, row) -> None:
            reporters[index](row)
    try:
        outcomes = train_ensemble(cfgs, progress=progress, on_finish=on_finish, checkpoint=checkpointer(checkpoint))
    except Exception as exc:  # noqa: BLE001 - recorded as failed runs, the sweep goes on
        error = f"ensemble of {len(cfg_dicts)}: {type(exc).__name__}: {exc}"
        return [{"ok": False, "error": error, "started": started, "finished": time.time(), "worker": worker}
                for _ in cfg_dicts]
    return [output(o) for o in outcomes]
