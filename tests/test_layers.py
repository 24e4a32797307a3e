"""The layers of fastdiag import one way, read from the source with ``ast`` (nothing is imported).

    cli → bench → plots → analysis → store
          bench → sweep → grokking → models → core → kernels

``analysis`` and ``plots`` take only ``grokking/config`` and ``grokking/labels`` (the vocabulary and
the regime rules, free of torch and numpy) from the training side; ``store`` imports nothing of fastdiag; nothing imports ``cli``; there are no import
cycles; project imports sit at module top everywhere but in ``cli/`` (whose command bodies may import
late to keep ``fastdiag --help`` fast). The checker is a plain function so that it is also run on a
synthetic package full of violations: a checker that finds nothing there is broken.
"""
from __future__ import annotations

import ast
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Import name → folder.
SOURCES = {"fastdiag": ROOT / "fastdiag"}

# Layer → the layers it may import (itself included). Anything in fastdiag not named below is the core.
ALLOWED = {
    "cli": {"cli", "bench", "plots", "analysis", "store", "sweep", "grokking", "config", "models", "core", "kernels"},
    "bench": {"bench", "plots", "analysis", "store", "sweep", "grokking", "config", "models", "core", "kernels"},
    "plots": {"plots", "analysis", "store", "config"},
    "analysis": {"analysis", "store", "config"},
    "sweep": {"sweep", "grokking", "config", "store", "models", "core", "kernels"},
    "grokking": {"grokking", "config", "store", "models", "core", "kernels"},
    "config": {"config"},
    "store": {"store"},
    "models": {"models", "core", "kernels"},
    "core": {"core", "kernels"},
    "kernels": {"kernels"},
}
# Third-party packages a layer must not import at all (statistics and figures run without torch).
# Modules that import an optional third-party dependency (Triton) at their top: loaded late on purpose.
OPTIONAL = {"fastdiag.core.kernels.head_stats_triton", "fastdiag.core.kernels.qk_stats_triton", "fastdiag.kernel_report.cases",
            "fastdiag.core.kernels.selective_scan_triton"}
FORBIDDEN = {"analysis": {"torch"}, "plots": {"torch"}, "config": {"torch", "numpy"}, "store": {"torch", "numpy"}}


def layer_of(module: str) -> str:
    parts = module.split(".")
    if parts[:2] == ["fastdiag", "grokking"] and parts[2:3] in (["config"], ["labels"]):
        return "config"
    if parts[1:3] == ["core", "kernels"]:
        return "kernels"
    second = parts[1] if len(parts) > 1 else ""
    if second in ("cli", "bench", "plots", "analysis", "store", "sweep", "grokking", "models", "kernels"):
        return second
    return "core"


def find_modules(sources: dict[str, Path]) -> dict[str, Path]:
    """Module name → file for every .py file under the source folders."""
    modules = {}
    for package, folder in sources.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]):
    """Yield (imported name, line, at module top) for every import in the file: project modules
    resolved to the module (``from fastdiag.x import y`` is fastdiag.x.y when that is a module),
    third-party ones as their top-level name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"

    def visit(node, top: bool):
        for child in ast.iter_child_nodes(node):
            local = not top or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, child.lineno, top
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[:len(base) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module
                for alias in child.names:
                    full = f"{target}.{alias.name}"
                    yield (full if full in modules else target), child.lineno, top
            yield from visit(child, top and not local)
    yield from visit(tree, True)


def violations(sources: dict[str, Path] = SOURCES) -> list[str]:
    modules = find_modules(sources)
    problems, graph = [], {m: set() for m in modules}
    for name, path in modules.items():
        layer = layer_of(name)
        for target, line, top in _imports(name, path, modules):
            where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{line}"
            if not target.startswith("fastdiag"):
                if target.split(".")[0] in FORBIDDEN.get(layer, ()):
                    problems.append(f"{where}: {name} ({layer}) imports {target}")
                continue
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target == name:
                continue
            graph[name].add(target)
            other = layer_of(target)
            if other == "cli" and layer != "cli":
                problems.append(f"{where}: {name} imports the command line {target}")
            elif other not in ALLOWED[layer]:
                problems.append(f"{where}: {name} ({layer}) imports {target} ({other})")
            if not top and layer != "cli" and target not in OPTIONAL:
                problems.append(f"{where}: {name} imports {target} inside a function; import at module top")
    problems = list(dict.fromkeys(problems))          # one line per import statement
    problems += [f"import cycle among {', '.join(c)}" for c in _cycles(graph)]
    return problems


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan): each holds a cycle."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def connect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_fastdiag_imports_flow_one_way():
    problems = violations()
    assert not problems, "\n".join(problems)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_checker_finds_every_kind_of_violation(tmp_path):
    _write(tmp_path, {
        "fastdiag/__init__.py": "",
        "fastdiag/core/__init__.py": "",
        "fastdiag/core/stats.py": "from fastdiag.grokking import train\n",                 # core → grokking
        "fastdiag/store/__init__.py": "",
        "fastdiag/store/db.py": "from fastdiag.grokking.config import RunConfig\n",      # store → fastdiag
        "fastdiag/grokking/__init__.py": "",
        "fastdiag/grokking/config.py": "import torch\n",                                   # config needs torch
        "fastdiag/grokking/train.py": "from fastdiag.sweep import run\n",                  # cycle with sweep.run
        "fastdiag/sweep/__init__.py": "",
        "fastdiag/sweep/run.py": """\
            from fastdiag.grokking import train

            def go():
                from fastdiag import cli                                                 # local, and cli
            """,
        "fastdiag/analysis/__init__.py": "import torch\nfrom fastdiag.sweep import run\n",  # torch, sweep
        "fastdiag/cli/__init__.py": "",
        "fastdiag/cli/app.py": "def main():\n    from fastdiag import stats\n",           # allowed in cli
        "fastdiag/models/__init__.py": "from . import lstm\n",
        "fastdiag/models/lstm.py": "from fastdiag.cli import app\n",                       # models → cli
        "fastdiag/core/kernels/__init__.py": "",
    })
    sources = {"fastdiag": tmp_path / "fastdiag"}
    text = "\n".join(violations(sources))
    expected = [
        "fastdiag.core.stats (core) imports fastdiag.grokking.train (grokking)",
        "fastdiag.store.db (store) imports fastdiag.grokking.config (config)",
        "fastdiag.grokking.config (config) imports torch",
        "import cycle among fastdiag.grokking.train, fastdiag.sweep.run",
        "fastdiag.grokking.train (grokking) imports fastdiag.sweep.run (sweep)",
        "fastdiag.sweep.run imports the command line fastdiag.cli",
        "fastdiag.sweep.run imports fastdiag.cli inside a function",
        "fastdiag.analysis (analysis) imports torch",
        "fastdiag.analysis (analysis) imports fastdiag.sweep.run (sweep)",
        "fastdiag.models.lstm imports the command line fastdiag.cli.app",
    ]
    for needle in expected:
        assert needle in text, f"missed: {needle}\n--- found:\n{text}"
    assert "fastdiag.cli.app imports" not in text        # cli may import late and anything
    assert "fastdiag.models imports" not in text          # relative imports resolve inside the package
