"""Regenerate what the README and docs show: `python docs/generate.py [NAME ...]` (no NAME: all;
`make docs`). Each NAME rewrites one generated block (between its markers) or figure, from data
committed in the repository; tests/test_readme_snippets.py checks the blocks in CI.

    paper    the paper table and its prose, from data/paper/ (= fastdiag paper regenerate --write-readme)
    gpu      the GPU paragraph, from benchmarks/gpu_runs/*.jsonl
    demo     the `make demo` output, from data/demo/ (run.log, stamp.json: the run it shows)
    sweep    `fastdiag analyze` of the README sweep, from its store data/readme/readme.sqlite
    predict  `fastdiag analyze --predict` of the same store
    intervention  `fastdiag analyze` of the README intervention's store data/readme/iv.sqlite, seed by seed
    figures  docs/img/*.png from the same data (not checked in CI: tens of seconds of drawing)

What the data came from (the commands, the commit, the load) is in each folder's stamp.json and in the
README's text beside the block: runs are not regenerated here, only what is printed and drawn from them.
"""
from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from fastdiag.analysis.docs_blocks import DEMO, demo_lines, intervention_seed_lines, write_block
from fastdiag.analysis.gpu_runs import gpu_paragraph, load_gpu_runs

ROOT = Path(__file__).resolve().parents[1]
SWEEP = ROOT / "data" / "readme"
IMG = ROOT / "docs" / "img"


def fastdiag_output(args: list[str], cwd: Path) -> list[str]:
    """What `fastdiag ARGS` prints (stdout) when run in ``cwd``."""
    out = subprocess.run([sys.executable, "-m", "fastdiag.cli", *args], cwd=cwd, capture_output=True, text=True,
                         check=True)
    return out.stdout.splitlines()


def analyze_lines() -> list[str]:
    return ["```", *fastdiag_output(["analyze", "readme.sqlite", "--n-boot", "500"], SWEEP), "```"]


def predict_lines() -> list[str]:
    lines = fastdiag_output(["analyze", "readme.sqlite", "--predict"], SWEEP)
    start = next(i for i, line in enumerate(lines) if line.startswith("== predictive value"))
    return ["```", *lines[start:], "```"]


def intervention_lines() -> list[str]:
    lines = fastdiag_output(["analyze", "iv.sqlite"], SWEEP)
    start = next(i for i, line in enumerate(lines) if line.startswith("== interventions"))
    return ["```", *lines[start:], *intervention_seed_lines(SWEEP / "iv.sqlite"), "```"]


def paper() -> None:
    from fastdiag.analysis.paper import write_readme_block
    from fastdiag.cli.paper import paper_block

    write_readme_block(paper_block())


def figures() -> None:
    """Every figure the README shows that is drawn from committed data."""
    from fastdiag.analysis.paper_data import load_data, runs_from_data
    from fastdiag.plots.paper import figure
    from fastdiag.plots.run import plot_trajectory

    trace = [{k: (None if v == "" else float(v)) for k, v in row.items()}
             for row in csv.DictReader((DEMO / "trace.csv").open())]
    for row in trace:
        row["epoch"] = int(row["epoch"])
    plot_trajectory(trace, IMG / "demo_trajectory.png", result=json.loads((DEMO / "result.json").read_text()))
    init = json.loads((ROOT / "data" / "paper" / "init.json").read_text())["per_seed"]
    figure(runs_from_data(load_data()), IMG / "paper_two_phase_data.png", init)
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "readme.sqlite"
        shutil.copy(SWEEP / "readme.sqlite", store)
        subprocess.run([sys.executable, "-m", "fastdiag.cli", "plot", str(store), "--out", tmp, "--predict",
                        "--format", "png"], check=True, capture_output=True)
        for name, target in (("p_grok", "sweep_p_grok"), ("trajectories", "sweep_trajectories"), ("predict", "predict")):
            shutil.copy(Path(tmp) / f"{name}.png", IMG / f"{target}.png")
        if (SWEEP / "iv.sqlite").exists():
            store = Path(tmp) / "iv.sqlite"
            shutil.copy(SWEEP / "iv.sqlite", store)
            subprocess.run([sys.executable, "-m", "fastdiag.cli", "plot", str(store), "--out", tmp, "--format", "png"],
                           check=True, capture_output=True)
            shutil.copy(Path(tmp) / "intervention.png", IMG / "intervention.png")


GENERATORS = {
    "paper": paper,
    "gpu": lambda: write_block("gpu", gpu_paragraph(load_gpu_runs())),
    "demo": lambda: write_block("demo", demo_lines()),
    "sweep": lambda: write_block("sweep", analyze_lines()),
    "predict": lambda: write_block("predict", predict_lines()),
    "intervention": lambda: write_block("intervention", intervention_lines()),
    "figures": figures,
}


def main(names: list[str]) -> None:
    unknown = [n for n in names if n not in GENERATORS]
    if unknown:
        sys.exit(f"generate.py: unknown name(s) {', '.join(unknown)}; known: {', '.join(GENERATORS)}")
    for name in names or list(GENERATORS):
        GENERATORS[name]()
        print(f"generated: {name}")


if __name__ == "__main__":
    main(sys.argv[1:])
