"""Generated blocks of the README and docs: a block sits between `<!-- generated: NAME ... -->` and
`<!-- generated: end NAME -->` and is rewritten only by `python docs/generate.py NAME`; tests compare
the fast ones with what their generator prints now."""
from __future__ import annotations

import json
from pathlib import Path

from fastdiag.store import open_existing
from fastdiag.store.interventions import load_experiments

README = Path(__file__).resolve().parents[2] / "README.md"
DEMO = Path(__file__).resolve().parents[2] / "data" / "demo"
DEMO_SHOWN = (3, 1)        # progress lines of the demo shown: the first 3 and the last 1


def begin_marker(name: str, how: str) -> str:
    return f"<!-- generated: {name} by `python docs/generate.py {name}`{how}; do not edit -->"


def end_marker(name: str) -> str:
    return f"<!-- generated: end {name} -->"


def _span(lines: list[str], name: str) -> tuple[int, int]:
    starts = [i for i, line in enumerate(lines) if line.startswith(f"<!-- generated: {name} by ")]
    ends = [i for i, line in enumerate(lines) if line == end_marker(name)]
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        raise ValueError(f"generated block {name!r}: expected one begin and one end marker")
    return starts[0], ends[0]


def read_block(name: str, path: Path = README) -> list[str]:
    """The block's lines between its markers (markers left out)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    start, end = _span(lines, name)
    return lines[start + 1:end]


def write_block(name: str, body: list[str], how: str = "", path: Path = README) -> None:
    """Replace the block (its begin marker rewritten with ``how``: e.g. the commit and load it was made at)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    start, end = _span(lines, name)
    path.write_text("\n".join(lines[:start] + [begin_marker(name, how)] + body + lines[end:]) + "\n", encoding="utf-8")


def demo_lines(folder: Path = DEMO) -> list[str]:
    """The README's `make demo` block from the committed run log: the command, the first and last progress
    lines (those between cut, marked ...), and everything the run printed after training."""
    stamp = json.loads((folder / "stamp.json").read_text())
    log = (folder / "run.log").read_text().splitlines()
    progress = [line for line in log if line.startswith("epoch ")]
    rest = [line for line in log if not line.startswith("epoch ")]
    first, last = DEMO_SHOWN
    shown = progress if len(progress) <= first + last else progress[:first] + ["..."] + progress[-last:]
    return ["```", f"$ {stamp['make_target']}", f".venv/bin/{stamp['command']}", *shown, *rest, "```"]


def intervention_seed_lines(store_path: Path) -> list[str]:
    """Per experiment of an intervention store, each arm's peak σ_H after the branch seed by seed (the
    values the paired comparison averages: a split response shows here, not in a mean)."""
    lines = []
    with open_existing(store_path) as store:
        for exp_id, rows in sorted(load_experiments(store).items()):
            seeds = sorted({r["seed"] for r in rows})
            lines.append(f"  peak σ_H after the branch per seed ({exp_id}, seeds {', '.join(map(str, seeds))}):")
            for arm in ("control", "reinit", "clip"):
                by_seed = {r["seed"]: r["metrics"].get("peak_sigma_h_after") for r in rows if r["arm"] == arm}
                if by_seed:
                    lines.append(f"    {arm:<8} " + " ".join("     -" if by_seed.get(s) is None else f"{by_seed[s]:6.4f}"
                                                         for s in seeds))
    return lines
