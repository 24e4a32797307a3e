"""Generated blocks of the README and docs: a block sits between `<!-- generated: NAME ... -->` and
`<!-- generated: end NAME -->` and is rewritten only by `python docs/generate.py NAME`; tests compare
the fast ones with what their generator prints now."""
from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


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
