"""A source file of this repository as of an older commit, for the before/after benchmarks."""
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def source_at(commit: str, path: str) -> tuple[str, str]:
    """(text, path in that commit) of ``fastdiag/core/<path>`` (the kernels now), ``fastdiag/<path>``
    (the models; the kernels before they moved into the core), or ``<path>`` in commits from before
    ``kernels/`` and ``models/`` moved under ``fastdiag/``."""
    for candidate in (f"fastdiag/core/{path}", f"fastdiag/{path}", path):
        shown = subprocess.run(["git", "show", f"{commit}:{candidate}"], cwd=ROOT, capture_output=True, text=True)
        if shown.returncode == 0:
            return shown.stdout, candidate
    raise SystemExit(f"{path}: not in commit {commit} (as fastdiag/core/{path}, fastdiag/{path} or {path})")
