"""The process of `fastdiag.plots.background.FigureProcess`: it loads matplotlib at once (beside the
caller's torch), then reads one job (JSON: trace, path, result) from stdin, draws the trajectory figure
and answers ``ok``."""
from __future__ import annotations

import json
import sys

from fastdiag.plots.run import plot_trajectory


def main() -> int:
    job = sys.stdin.read()
    if not job:                       # the caller ended (or had nothing to draw)
        return 0
    job = json.loads(job)
    plot_trajectory(job["trace"], job["path"], result=job["result"])
    print("ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
