"""The README's Python snippets run as printed: each ```python block is executed in a fresh process
after a preamble that defines, at tiny sizes, only the names the snippet leaves to the reader (the
probabilities, Q/K/V, a model and its loop); the snippet's own lines are not edited."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from fastdiag.testing import ATTACH_SNIPPET_PREAMBLE, run_snippet, snippet_key

from tests.helpers import assert_cli_line_parses

ROOT = Path(__file__).resolve().parents[1]

# What a reader already has when they paste each snippet, keyed by a line the snippet starts with.
PREAMBLES = {
    "import fastdiag": """
        import os, tempfile
        import torch
        import torch.distributed as dist
        import fastdiag
        torch.manual_seed(0)
        probs = torch.softmax(torch.randn(2, 4, 5, 5), -1)                 # [B, H, Tq, Tk]
        stats_a = stats_b = s0 = s1 = fastdiag.head_stats(probs)
        dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
        group = dist.group.WORLD
    """,
    "from fastdiag.qk import": """
        import torch
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, 4, 6, 8) for _ in range(3))               # [B, H, T, D]
        attn_mask, dropout_p, is_causal, scale = None, 0.0, True, None
    """,
    "monitor = fastdiag.attach(": ATTACH_SNIPPET_PREAMBLE,
}


def printed_latest() -> dict:
    """The `monitor.latest()` the README prints in its comment (keys and values; `...` left out)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    comment = re.search(r"^print\(monitor\.latest\(\)\)\s+# (\{.*\})$", text, flags=re.M).group(1)
    return {k: (v.strip('"') if v.startswith('"') else float(v))
            for k, v in re.findall(r'"([^"]+)": ("[^"]*"|[-0-9.e]+)', comment)}


# After the snippet: what it promised is there.
CHECKS = {
    "monitor = fastdiag.attach(": f"""
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        latest = monitor.latest()
        assert latest["step"] == 10 and 0 <= latest["s_bar"] <= 1, latest
        # the README's comment shows the real keys and (seeded, to its printed digits) values
        for key, value in {printed_latest()!r}.items():
            assert key in latest, (key, latest)
            got = latest[key]
            assert got == value if isinstance(value, str) else float(f"{{got:.2g}}") == value, (key, got, value)
        events = EventAccumulator("runs/x")
        events.Reload()
        tags = events.Tags()["scalars"]
        assert "fastdiag/s_bar" in tags and len(events.Scalars("fastdiag/s_bar")) == 2, tags
    """,
}


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(encoding="utf-8"), flags=re.S | re.M)


README_BLOCKS = python_blocks(ROOT / "README.md")


def test_every_readme_python_block_has_a_preamble():
    assert len(README_BLOCKS) >= 3
    for block in README_BLOCKS:
        snippet_key(block, PREAMBLES)          # StopIteration names a new snippet without fixtures


@pytest.mark.parametrize("block", README_BLOCKS, ids=lambda b: b.lstrip().splitlines()[0][:40])
def test_readme_python_block_runs_as_printed(block, tmp_path):
    out = run_snippet(block, PREAMBLES, CHECKS, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]


def readme_commands() -> list[str]:
    """Every `fastdiag ...` command of the README's bash blocks (continued lines joined, `&&` chains
    split, comments and output redirections cut off); a line with a `...same options...` placeholder is prose, left out."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M)
    joined = [re.sub(r"\\\n\s*", " ", block) for block in blocks]
    lines = [re.split(r"  #|\s>\s", part)[0].strip() for block in joined for line in block.splitlines()
             for part in line.split("&&")]
    return [line for line in lines if line.startswith("fastdiag ") and "..." not in line]


@pytest.mark.parametrize("line", readme_commands())
def test_readme_command_parses_as_pasted(line):
    """The options of each README command parse (names, types, choices, required ones): nothing runs."""
    assert_cli_line_parses(line)


def test_generated_gpu_paragraph_is_what_the_raw_gpu_runs_give():
    """The README's GPU paragraph is generated from benchmarks/gpu_runs/ (`python docs/generate.py gpu`):
    every range there is over all runs, dtypes and launch modes that measured it."""
    from fastdiag.analysis.docs_blocks import read_block
    from fastdiag.analysis.gpu_runs import gpu_paragraph, load_gpu_runs

    assert read_block("gpu") == gpu_paragraph(load_gpu_runs())


def test_gpu_paragraph_gives_the_full_range_of_synthetic_runs(tmp_path):
    import json

    from fastdiag.analysis.gpu_runs import gpu_paragraph, load_gpu_runs

    def kern(dtype, python, graph):
        return {"stage": "kernels", "kernel": "head_stats", "dims": [1, 1, 2, 8, 8], "dtype": dtype,
                "pct_of_copy": python, "pct_of_copy_graph": graph}
    for n, rows in ((1, [kern("torch.bfloat16", 11.0, 20.0), kern("torch.float32", 9.0, 12.0)]),
                    (2, [{"stage": "tests", "summary": "7 passed, 1 warning in 3s"}, kern("torch.bfloat16", 13.0, 24.0)])):
        (tmp_path / f"x-run{n}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n{truncated")
    text = "\n".join(gpu_paragraph(load_gpu_runs(tmp_path)))
    assert "run 2: 7 passed" in text and "warning" not in text
    assert ("streams 9–24 % of device-copy bandwidth" in text and "graph bf16 20–24 %, fp32 12 %" in text
            and "from Python bf16 11–13 %, fp32 9 %" in text), text


# ------------------------------------------------------------------------------ blocks generated from committed runs

DATA = ROOT / "data"


def test_demo_block_and_figure_are_the_committed_run():
    """The `make demo` block is data/demo/run.log (`python docs/generate.py demo`), and the figure the README
    shows marks the t_grok the block prints (they came from different runs once: 142 under text saying 143)."""
    import csv
    import json

    from fastdiag.analysis.docs_blocks import demo_lines, read_block
    from fastdiag.plots.run import draw_trajectory

    block = read_block("demo")
    assert block == demo_lines()
    result = json.loads((DATA / "demo" / "result.json").read_text())
    assert f"t_grok: epoch {result['t_grok_epoch']} (step {result['t_grok_step']})" in "\n".join(block)
    rows = list(csv.DictReader((DATA / "demo" / "trace.csv").open()))
    trace = [{k: (None if v == "" else float(v)) for k, v in row.items()} for row in rows]
    fig = draw_trajectory(trace, result)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert f"t_grok = {result['t_grok_epoch']}" in labels
    assert "![trajectory of the demo run](docs/img/demo_trajectory.png)" in (ROOT / "README.md").read_text()


def test_the_demo_prose_quotes_what_run_prints_for_its_largest_values():
    """The log predates the summary's wording ("peak s̄/σ_H"); the prose under it quotes what `fastdiag run`
    prints now for the same trace ("largest s̄ … (epoch N)")."""
    import csv

    from fastdiag.cli.run import at_epoch
    from fastdiag.grokking.labels import largest

    trace = [{"epoch": int(row["epoch"]), "s_bar": float(row["s_bar"]), "sigma_h": float(row["sigma_h"])}
             for row in csv.DictReader((DATA / "demo" / "trace.csv").open())]
    quoted = f"`largest s̄ {at_epoch(largest(trace, 's_bar'))}  largest σ_H {at_epoch(largest(trace, 'sigma_h'))}`"
    assert quoted in (ROOT / "README.md").read_text(), quoted


@pytest.mark.parametrize("name,args", [("sweep", ["readme.sqlite", "--n-boot", "500"]),
                                       ("predict", ["readme.sqlite", "--predict"]), ("intervention", ["iv.sqlite"])])
def test_sweep_blocks_are_what_analyze_prints_from_the_committed_store(name, args, monkeypatch, capsys):
    """The README's sweep, --predict and intervention blocks are `fastdiag analyze` of the stores the README's
    commands wrote, committed in data/readme/ (`python docs/generate.py sweep predict intervention`)."""
    from fastdiag.analysis.docs_blocks import intervention_seed_lines, read_block
    from fastdiag.cli import main

    monkeypatch.chdir(DATA / "readme")
    main(["analyze", *args])
    lines = capsys.readouterr().out.splitlines()
    first = {"predict": "== predictive value", "intervention": "== interventions"}.get(name)
    if first:
        lines = lines[next(i for i, line in enumerate(lines) if line.startswith(first)):]
    if name == "intervention":
        lines += intervention_seed_lines(DATA / "readme" / "iv.sqlite")
    assert read_block(name) == ["```", *lines, "```"]
    assert not [p.name for p in (DATA / "readme").iterdir() if p.suffix not in (".sqlite", ".json")]   # read, not written
