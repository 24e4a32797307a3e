"""The outputs of one run: ``result.json``, ``trace.csv`` and the trajectory figure, each written whole or
not at all. No matplotlib here: the figure is drawn by the ``plot`` given (`fastdiag.plots.run.
plot_trajectory`, or `fastdiag.plots.background.FigureProcess.plot`, which `fastdiag run` uses)."""
from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Callable

from fastdiag.store.files import atomic_path, prepare_out_dir


def trace_columns(trace: list[dict]) -> list[str]:
    columns: list[str] = []
    for row in trace:
        for key in row:
            if key not in columns:
                columns.append(key)
    return columns


def write_outputs(outcome, out_dir: str | os.PathLike, plot: Callable[..., None]) -> dict[str, Path]:
    """Write a run's (a ``RunOutcome``: ``result`` and ``trace``) ``result.json``, ``trace.csv`` and
    ``trajectory.png`` (drawn by ``plot(trace, path, result=...)``) into ``out_dir``; return their paths.
    Each file is written whole or not at all."""
    out = prepare_out_dir(out_dir)
    paths = {"result": out / "result.json", "trace": out / "trace.csv", "plot": out / "trajectory.png"}
    with atomic_path(paths["result"]) as tmp:
        tmp.write_text(json.dumps(outcome.result, indent=2, allow_nan=False) + "\n")
    with atomic_path(paths["trace"]) as tmp, open(tmp, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=trace_columns(outcome.trace))
        writer.writeheader()
        for row in outcome.trace:
            writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
    with atomic_path(paths["plot"]) as tmp:
        plot(outcome.trace, tmp, result=outcome.result)
    return paths
