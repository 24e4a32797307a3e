"""Regenerate what the README and docs show: `python docs/generate.py [NAME ...]` (default: every fast
block; `make docs`). Each NAME rewrites one generated block (between its markers) from data committed
in the repository; tests/test_readme_snippets.py checks the fast ones in CI.

    paper   the paper table and its prose, from data/paper/ (= fastdiag paper regenerate --write-readme)
    gpu     the GPU paragraph, from benchmarks/gpu_runs/*.jsonl
"""
from __future__ import annotations

import sys

from fastdiag.analysis.docs_blocks import write_block
from fastdiag.analysis.gpu_runs import gpu_paragraph, load_gpu_runs


def paper() -> None:
    from fastdiag.analysis.paper import write_readme_block
    from fastdiag.cli.paper import paper_block

    write_readme_block(paper_block())


def gpu() -> None:
    write_block("gpu", gpu_paragraph(load_gpu_runs()))


GENERATORS = {"paper": paper, "gpu": gpu}


def main(names: list[str]) -> None:
    unknown = [n for n in names if n not in GENERATORS]
    if unknown:
        sys.exit(f"generate.py: unknown block(s) {', '.join(unknown)}; known: {', '.join(GENERATORS)}")
    for name in names or list(GENERATORS):
        GENERATORS[name]()
        print(f"generated: {name}")


if __name__ == "__main__":
    main(sys.argv[1:])
