"""Moved into the package: `fastdiag paper …` (fastdiag/cli/paper.py; statistics in
fastdiag/analysis/paper*.py, the figure in fastdiag/plots/paper.py). This wrapper keeps old command
lines working: `python benchmarks/paper_repro.py regenerate` is `fastdiag paper regenerate`."""
import sys

from fastdiag.cli import main

if __name__ == "__main__":
    main(["paper", *sys.argv[1:]])
