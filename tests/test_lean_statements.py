"""Well-formedness checks for the Lean proof project in ``lean/``.

These run without a Lean toolchain, so they cannot tell whether the proofs compile;
they only check the project's shape: no ``sorry``/``admit``/``axiom`` in the sources,
pinned toolchain and Mathlib revision, and that every theorem named in the README's
theorem map is declared in some ``.lean`` file.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
LEAN_DIR = REPO_ROOT / "lean"
README = LEAN_DIR / "README.md"
SKIP_DIRS = {".lake", "lake-packages", "build"}

# A Lean identifier component (letters incl. Greek/unicode, digits, _, ', subscripts).
_IDENT = r"[^\s.:()\[\]{}`,]+"
_DECL_KEYWORDS = r"(?:theorem|lemma)"


def _lean_files() -> list[Path]:
    return sorted(
        p
        for p in LEAN_DIR.rglob("*.lean")
        if not any(part in SKIP_DIRS for part in p.relative_to(LEAN_DIR).parts)
    )


def _strip_comments(text: str) -> str:
    """Remove Lean comments (``-- ...`` and nested ``/- ... -/``), keeping strings simple."""
    out: list[str] = []
    i, depth, n = 0, 0, len(text)
    while i < n:
        if text.startswith("/-", i):
            depth += 1
            i += 2
        elif depth and text.startswith("-/", i):
            depth -= 1
            i += 2
        elif depth:
            i += 1
        elif text.startswith("--", i):
            j = text.find("\n", i)
            i = n if j == -1 else j
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _split_row(line: str) -> list[str]:
    cells = re.split(r"(?<!\\)\|", line.strip())
    return [c.strip() for c in cells[1:-1]]


def _theorem_map_names() -> list[str]:
    """Theorem names (first column, in backticks) of the README's "Theorem map" table."""
    lines = README.read_text(encoding="utf-8").splitlines()
    start = next(
        (i for i, l in enumerate(lines) if re.match(r"^#+\s*Theorem map\b", l, re.I)),
        None,
    )
    assert start is not None, "lean/README.md has no '## Theorem map' section"
    names: list[str] = []
    in_table = False
    for line in lines[start + 1 :]:
        if line.startswith("#"):
            break
        if not line.lstrip().startswith("|"):
            if in_table:
                break
            continue
        in_table = True
        cells = _split_row(line)
        if not cells or set(cells[0]) <= set("-: "):
            continue  # separator row
        found = re.findall(r"`([^`]+)`", cells[0])
        names.extend(found)
    return names


def test_lean_project_files_exist():
    assert (LEAN_DIR / "lean-toolchain").is_file()
    assert (LEAN_DIR / "lakefile.lean").is_file() or (LEAN_DIR / "lakefile.toml").is_file()
    assert (LEAN_DIR / "FastdiagProofs.lean").is_file()
    assert README.is_file()
    assert len(_lean_files()) >= 6


@pytest.mark.parametrize("path", _lean_files(), ids=lambda p: str(p.relative_to(LEAN_DIR)))
def test_no_sorry_admit_or_axiom(path: Path):
    raw = path.read_text(encoding="utf-8")
    code = _strip_comments(raw)
    # `sorry`/`admit` are rejected even inside comments, so nobody leaves a placeholder note.
    for word in ("sorry", "admit"):
        assert not re.search(rf"(?<![\w.']){word}(?![\w'])", raw), f"{path}: contains `{word}`"
    axiom_decl = re.compile(
        r"^\s*(?:@\[[^\]]*\]\s*)?(?:(?:private|protected|noncomputable|unsafe|partial)\s+)*"
        r"axiom\s",
        re.M,
    )
    assert not axiom_decl.search(code), f"{path}: declares an axiom"


def test_import_root_imports_every_module():
    root = (LEAN_DIR / "FastdiagProofs.lean").read_text(encoding="utf-8")
    imported = set(re.findall(r"^import\s+(\S+)", root, re.M))
    modules = {
        "FastdiagProofs." + ".".join(p.relative_to(LEAN_DIR / "FastdiagProofs").with_suffix("").parts)
        for p in (LEAN_DIR / "FastdiagProofs").rglob("*.lean")
    }
    assert modules, "no modules under lean/FastdiagProofs/"
    assert modules <= imported, f"not imported by FastdiagProofs.lean: {sorted(modules - imported)}"


def test_toolchain_is_pinned():
    text = (LEAN_DIR / "lean-toolchain").read_text(encoding="utf-8").strip()
    assert re.fullmatch(r"leanprover/lean4:v\d+\.\d+\.\d+(-rc\d+)?", text), text
    assert "stable" not in text and "nightly" not in text


def test_lakefile_pins_mathlib():
    lean_lf = LEAN_DIR / "lakefile.lean"
    toml_lf = LEAN_DIR / "lakefile.toml"
    toolchain = (LEAN_DIR / "lean-toolchain").read_text(encoding="utf-8").strip()
    version = toolchain.split(":", 1)[1]
    if lean_lf.is_file():
        text = lean_lf.read_text(encoding="utf-8")
        m = re.search(
            r'require\s+mathlib\s+from\s+git\s+"https://github\.com/leanprover-community/mathlib4(?:\.git)?"'
            r'\s*@\s*"([^"]+)"',
            text,
        )
    else:
        text = toml_lf.read_text(encoding="utf-8")
        block = re.search(r"\[\[require\]\][^\[]*name\s*=\s*\"mathlib\"[^\[]*", text, re.S)
        m = block and re.search(r'rev\s*=\s*"([^"]+)"', block.group(0))
    assert m, "lakefile does not require mathlib at an explicit revision"
    rev = m.group(1)
    assert rev not in {"master", "main", "stable", "nightly"}, rev
    assert re.fullmatch(r"v\d+\.\d+\.\d+(-rc\d+)?|[0-9a-f]{40}", rev), rev
    if rev.startswith("v"):
        # A Mathlib release tag must match the Lean toolchain it was built for.
        assert rev == version, f"mathlib {rev} does not match toolchain {version}"


def test_readme_states_unchecked_and_how_to_check():
    text = README.read_text(encoding="utf-8")
    assert "NOT" in text and "2026-12-02" in text
    assert "lake exe cache get && lake build" in text


def test_theorem_map_names_are_declared():
    names = _theorem_map_names()
    assert len(names) >= 10, names
    sources = "\n".join(_strip_comments(p.read_text(encoding="utf-8")) for p in _lean_files())
    missing = []
    for name in names:
        short = name.removeprefix("FastdiagProofs.")
        last = short.rsplit(".", 1)[-1]
        pattern = rf"(?m)^\s*(?:@\[[^\]]*\]\s*)?(?:(?:private|protected)\s+)?{_DECL_KEYWORDS}\s+(?:{_IDENT}\.)*{re.escape(last)}(?=[\s:({{\[]|$)"
        if not re.search(pattern, sources):
            missing.append(name)
    assert not missing, f"theorems in lean/README.md not declared in lean/: {missing}"
