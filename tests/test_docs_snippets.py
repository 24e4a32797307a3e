"""The docs' code blocks work as pasted (issue 31): every ```python block of docs/*.md runs in a fresh
process after a preamble that defines, at tiny sizes, only what the snippet leaves to the reader; every
`fastdiag …` command of the README's and docs/*.md's ```bash blocks parses, and runs — in order, block
by block, in a fresh directory — with tiny-size options appended (the last occurrence of an option
wins, so the printed line itself is not edited; only its λ grid and seed list are cut to their first
values). GPU-only lines (`--device cuda`) are left out on a machine without CUDA; a store a block
reads without making it (the reader's earlier sweep) is made first by a tiny sweep."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch

from fastdiag.cli import main
from fastdiag.testing import ATTACH_SNIPPET_PREAMBLE, run_snippet, snippet_key
from tests.helpers import assert_cli_line_parses

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))

# ------------------------------------------------------------------------------ python blocks


PREAMBLES = {
    "monitor = fastdiag.attach(": ATTACH_SNIPPET_PREAMBLE,
    "from fastdiag.integrations.hf import": """
        import os, tempfile
        import torch
        import transformers
        from transformers import Trainer
        os.chdir(tempfile.mkdtemp())
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=50, n_positions=16)
        model = transformers.GPT2LMHeadModel._from_config(config, attn_implementation="eager")
        ids = torch.randint(0, 50, (8, 8), generator=torch.Generator().manual_seed(0))
        data = [{"input_ids": row, "labels": row} for row in ids]
        # every=10 in the snippet: step 10 (the Trainer's numbering) is the first measured and logged one
        args = transformers.TrainingArguments(output_dir="out", max_steps=10, per_device_train_batch_size=2,
                                              logging_steps=5, report_to=[], use_cpu=True, save_strategy="no",
                                              disable_tqdm=True)
    """,
    "from fastdiag.integrations.lightning import": """
        import os, tempfile
        import torch
        import lightning.pytorch as L
        from fastdiag.testing import NanoGPT
        os.chdir(tempfile.mkdtemp())

        class TinyLM(L.LightningModule):
            '''The reader's module: a nanoGPT-style model, its data, and an epoch of 4 steps.'''
            def __init__(self):
                super().__init__()
                torch.manual_seed(0)
                self.net = NanoGPT(vocab=32, d_model=16, n_heads=4, n_layers=2, seq_len=8)

            def training_step(self, batch, batch_idx):
                (ids,) = batch
                logits = self.net(ids)
                return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 32), ids[:, 1:].reshape(-1))

            def train_dataloader(self):
                ids = torch.randint(0, 32, (16, 8), generator=torch.Generator().manual_seed(0))
                return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4)

            def on_train_epoch_end(self):
                self.trainer.should_stop = True       # one epoch is enough here

            def configure_optimizers(self):
                return torch.optim.AdamW(self.parameters(), lr=1e-3)

        module = TinyLM()
    """,
}

# After the snippet: what it promised is there.
CHECKS = {
    "monitor = fastdiag.attach(": """
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        assert monitor.latest()["step"] == 10, monitor.latest()
        events = EventAccumulator("runs/x")
        events.Reload()
        assert len(events.Scalars("fastdiag/s_bar")) == 2, events.Tags()
    """,
    "from fastdiag.integrations.hf import": """
        logged = [h for h in trainer.state.log_history if "fastdiag/s_bar" in h]
        assert [h["step"] for h in logged] == [10] and 0 <= logged[-1]["fastdiag/s_bar"] <= 1, trainer.state.log_history
    """,
    "from fastdiag.integrations.lightning import": """
        assert "fastdiag/s_bar" in trainer.logged_metrics, trainer.logged_metrics
    """,
}


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(encoding="utf-8"), flags=re.S | re.M)


DOC_BLOCKS = [(path.name, block) for path in DOCS for block in python_blocks(path)]


def test_every_docs_python_block_has_a_preamble():
    assert len(DOC_BLOCKS) >= 3
    for _, block in DOC_BLOCKS:
        snippet_key(block, PREAMBLES)          # StopIteration names a new snippet without fixtures


@pytest.mark.parametrize("name,block", DOC_BLOCKS, ids=lambda v: v if v.endswith(".md") else v.lstrip()[:40])
def test_docs_python_block_runs_as_printed(name, block, tmp_path):
    out = run_snippet(block, PREAMBLES, CHECKS, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]


def test_attach_docs_print_the_readmes_checked_latest():
    """docs/attach.md's `monitor.latest()` comment is the README's, which test_readme_snippets.py checks
    against a real run of the same snippet and preamble (keys and values)."""
    def latest_line(path: Path) -> str:
        return re.search(r"^print\(monitor\.latest\(\)\).*$", path.read_text(encoding="utf-8"), flags=re.M).group(0)

    assert latest_line(ROOT / "docs" / "attach.md") == latest_line(ROOT / "README.md")


def test_attach_docs_real_output_is_what_attach_prints():
    """docs/attach.md's "Real output" block (a model whose `attn` calls SDPA on [B·H, T, D] and whose `gate`
    takes a softmax it never multiplies with values) is what attach warns and `coverage()` returns."""
    import warnings

    import torch.nn as nn
    import torch.nn.functional as F

    import fastdiag

    class Folded(nn.Module):
        def forward(self, x):
            return F.scaled_dot_product_attention(x, x, x)

    class HeatMap(nn.Module):
        def forward(self, s):
            return torch.softmax(s, -1).sum()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.gate = Folded(), HeatMap()

        def forward(self, x):
            return self.attn(x).sum() + self.gate(torch.randn(2, 2, 3, 3))

    model = Net()
    monitor = fastdiag.attach(model, every=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(4, 6, 4))
    printed = [f"{w.category.__name__}: {w.message}" for w in caught] + [">>> monitor.coverage()", str(monitor.coverage())]
    monitor.detach()
    text = (ROOT / "docs" / "attach.md").read_text(encoding="utf-8")
    block = re.search(r"^Real output .*?^```\n(.*?)^```", text, flags=re.S | re.M).group(1).splitlines()
    assert block == printed


# ------------------------------------------------------------------------------ shell commands

def block_commands(path: Path) -> list[list[str]]:
    """Per ```bash block, its `fastdiag` commands and `mkdir -p` lines (continued lines joined, `&&`
    chains split, comments and output redirections cut off); a line with a `...same options...`
    placeholder is prose, left out."""
    blocks = re.findall(r"^```bash\n(.*?)^```", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    out = []
    for block in blocks:
        joined = re.sub(r"\\\n\s*", " ", block)
        lines = [re.split(r"\s#|\s>\s", part)[0].strip() for line in joined.splitlines() for part in line.split("&&")]
        lines = [line for line in lines if line.startswith(("fastdiag ", "mkdir -p ")) and "..." not in line]
        if lines:
            out.append(lines)
    return out


BLOCKS = [(path.name, i, lines) for path in [ROOT / "README.md", *DOCS]
          for i, lines in enumerate(block_commands(path))]
# A block of many training commands (the README's record of the paper runs: 11 sweeps, ~75 s at tiny
# sizes on a loaded 2-core machine) is a long end-to-end test: CI runs it, `-m "not slow"` skips it.
MANY_COMMANDS = 8
RUN_BLOCKS = [pytest.param(*b, marks=pytest.mark.slow) if len(b[2]) >= MANY_COMMANDS else b for b in BLOCKS]

# Sizes that make any training command finish in seconds on one CPU core: a 1-layer, 2-head model on
# a + b mod 7 (24 training pairs, one step an epoch) for 4 epochs, evaluated every epoch.
TINY_MODEL = ["--preset", "custom", "--layers", "1", "--heads", "2", "--d-model", "16", "--d-ff", "32", "--p", "7",
              "--train-frac", "0.5", "--batch", "512", "--epochs", "4", "--eval-every", "1", "--device", "cpu",
              "--threads", "1", "--quiet"]
TINY = {
    "run": TINY_MODEL[:-1],                                     # run has no --quiet
    # in this process: a pool's spawned workers each import torch and fastdiag (the README's paper-runs
    # block took 50 s on pools of 2); the pools have their own tests (test_sweep_e2e.py, test_resume.py)
    "sweep": TINY_MODEL + ["--workers", "1"],
    # a threshold below chance (1/7) "groks" at once, so the branch, the arms and their comparison all run
    "intervene": TINY_MODEL[:TINY_MODEL.index("--epochs")] + ["--epochs", "12", "--eval-every", "1", "--device", "cpu",
                                                            "--threads", "1", "--quiet", "--after-peak-epochs", "2",
                                                            "--peak-patience", "1", "--grok-threshold", "0.05"],
    # headdim sets the width and heads by lists and d_ff by --ff-mult: no --preset, no --d-ff
    "headdim": [a for i, a in enumerate(TINY_MODEL) if "--preset" not in TINY_MODEL[max(0, i - 1):i + 1]
                and "--d-ff" not in TINY_MODEL[max(0, i - 1):i + 1]] + ["--d-model", "8,16,32", "--heads", "2",
                                                                      "--n-boot", "20", "--workers", "1"],
    "analyze": ["--n-boot", "20"],
    "plot": ["--n-boot", "20", "--n-band", "20", "--format", "png"],
}
MAX_VALUES = 2            # λ values and seeds a printed grid is cut to


def _cut_grid(args: list[str]) -> list[str]:
    """The printed λ grid and seed list cut to their first MAX_VALUES values, in the printed syntax
    (a:b:n keeps its ends, a count stays a count, a list stays a list, a trailing comma stays)."""
    out = list(args)
    for i, arg in enumerate(out[:-1]):
        value = out[i + 1]
        if arg == "--wd":
            parts = value.split(":")
            out[i + 1] = (":".join(parts[:2] + [str(min(int(parts[2]), MAX_VALUES))]) if len(parts) == 3
                          else ",".join(value.split(",")[:MAX_VALUES]))
        elif arg == "--seeds":
            out[i + 1] = (str(min(int(value), MAX_VALUES)) if value.isdigit()
                          else ",".join(value.rstrip(",").split(",")[:MAX_VALUES]) + ("," if value.endswith(",") else ""))
    return out


# The transformer's own options, which the other architectures refuse (one line, exit 2).
TRANSFORMER_ONLY = {"--preset": 1, "--heads": 1, "--d-ff": 1}


def tiny_args(line: str) -> list[str]:
    """The command's arguments (after `fastdiag`) at tiny sizes."""
    args = shlex.split(line)[1:]
    tiny = list(TINY.get(args[0], []))
    arch = args[args.index("--arch") + 1] if "--arch" in args[:-1] else "transformer"
    if arch != "transformer":
        tiny = [a for i, a in enumerate(tiny) if a not in TRANSFORMER_ONLY and tiny[i - 1] not in TRANSFORMER_ONLY]
    return _cut_grid(args) + tiny


def store_of(args: list[str]) -> str | None:
    """The store an analyze / plot / export / merge line reads (its first argument)."""
    return args[1] if args[0] in ("analyze", "plot", "export") and len(args) > 1 else None


def gpu_only(line: str) -> bool:
    return "--device cuda" in line and not torch.cuda.is_available()


def test_every_docs_and_readme_command_is_found_and_parses():
    """The options of each command parse as printed (names, types, choices, required ones)."""
    lines = [line for _, _, block in BLOCKS for line in block if line.startswith("fastdiag ")]
    assert len(lines) >= 30 and any(name != "README.md" for name, _, _ in BLOCKS)
    for line in lines:
        assert_cli_line_parses(line)

@pytest.mark.parametrize("name,index,lines", RUN_BLOCKS, ids=lambda v: v if isinstance(v, str) and v.endswith(".md")
                         else (str(v) if isinstance(v, int) else v[0][9:40]))
def test_docs_commands_run_at_tiny_sizes(name, index, lines, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for line in lines:
        if gpu_only(line) or line.startswith("fastdiag paper "):
            # `fastdiag paper` reads the canonical stores and data/paper/ of the repository and measures the
            # canonical model: tests/test_paper_repro.py runs it; here its options parse (test above)
            continue
        if line.startswith("mkdir -p "):
            for directory in shlex.split(line)[2:]:
                Path(directory).mkdir(parents=True, exist_ok=True)
            continue
        args = tiny_args(line)
        store = store_of(args)
        if store and not Path(store).exists():
            # a store the reader made earlier (a sweep printed elsewhere): a tiny one in its place
            main(["sweep", "--wd", "0.1,1,3", "--seeds", "2", "--store", store, *TINY["sweep"]])
        capsys.readouterr()
        try:
            main(args)
        except SystemExit as exc:           # the CLI exits non-zero on an error; 0 is success
            assert exc.code in (0, None), f"{line}\n -> exit {exc.code}: {capsys.readouterr().err[-2000:]}"
        if args[0] == "intervene":          # the whole experiment ran, not an empty comparison
            assert re.search(r"experiment \S+: [1-9]\d* seed\(s\) with all arms", capsys.readouterr().out), line


# ------------------------------------------------------------------------------ links

def test_readme_and_docs_link_only_inside_the_repository():
    """A fresh clone has no ../shared/ beside it and no /work/: every relative link and image resolves
    inside the repository, and no path outside it is quoted as something to open."""
    for path in [ROOT / "README.md", *DOCS]:
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"\.\./shared|/work/|\]\(/", text), path.name
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            resolved = (path.parent / target).resolve()
            assert resolved.is_relative_to(ROOT) and resolved.exists(), (path.name, target)
