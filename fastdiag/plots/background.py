"""A run's trajectory figure drawn by a second process that loads matplotlib while `fastdiag run` loads
torch and trains, so that the figure costs the run its drawing only, not matplotlib's import (0.6 CPU s,
about 3 % of a canonical 12-epoch run on 2 cores: issue 41). The command still returns only once the
figure is written; if that process is gone or fails, the figure is drawn in the caller as before (and a
failure to write it is reported as before). The process runs `fastdiag.plots.figure_worker`; this module
imports no matplotlib and nothing of fastdiag, so `fastdiag run` can start it before anything loads."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable


class FigureProcess:
    """``plot(trace, path, result)``: `fastdiag.plots.run.plot_trajectory`'s arguments, drawn in the
    process started at construction, or by ``fallback`` (same arguments) where that process is gone or
    failed. Use as a context manager (the process is ended on exit)."""

    def __init__(self, fallback: Callable[..., None]) -> None:
        self._fallback = fallback
        root = str(Path(__file__).resolve().parents[2])                   # the same fastdiag in the child
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        try:
            self._proc: subprocess.Popen | None = subprocess.Popen(
                [sys.executable, "-m", "fastdiag.plots.figure_worker"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        except OSError:
            self._proc = None

    def __enter__(self) -> "FigureProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def plot(self, trace: list[dict], path: str | os.PathLike, result: dict | None = None) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            job = json.dumps({"trace": trace, "path": os.fspath(path), "result": result})
            try:
                said, _ = proc.communicate(job, timeout=300)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                said = ""
            finally:
                _end(proc)
            if proc.returncode == 0 and said.strip() == "ok":
                return
        self._fallback(trace, path, result=result)

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            _end(proc)


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for stream in (proc.stdin, proc.stdout):
        if stream is not None and not stream.closed:
            try:
                stream.close()
            except OSError:            # a broken pipe on flush
                pass

