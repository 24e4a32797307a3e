"""`fastdiag bench`: states its plan first, prints and saves each section as it finishes, dashes (not
`nan`) with a footnote where a figure does not exist on the device."""
import json

import torch

from fastdiag import bench
from fastdiag.cli import main
from fastdiag.cli.bench import FULL, QUICK


def test_bench_plans_first_and_saves_each_section(capsys, tmp_path):
    out_json = tmp_path / "bench.json"
    main(["bench", "--device", "cpu", "--shapes", "grokking", "--no-steps", "--no-archs", "--no-ensembles",
          "--no-compile", "--repeats", "3", "--json", str(out_json)])
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("fastdiag bench (quick; --full for the whole measurement)")
    assert "sections: kernels grokking;" in lines[0] and "3 repeats" in lines[0]
    assert "nan" not in out and "–: not measured here" in out
    table_row = next(line for line in lines if line.startswith("grokking"))
    assert table_row.split()[3] == "–" and table_row.split()[-1] == "–"          # compiled, %copy
    saved = json.loads(out_json.read_text())
    assert len(saved["kernel"]) == len(bench.kernel_dtypes(torch.device("cpu"))) and saved["full"] is False


def test_quick_is_a_subset_of_full():
    assert set(QUICK["shapes"].split(",")) <= set(FULL["shapes"].split(",")) == set(bench.KERNEL_SHAPES)
    assert set(QUICK["workloads"].split(",")) <= set(FULL["workloads"].split(",")) == set(bench.ENSEMBLE_WORKLOADS)
    assert QUICK["repeats"] < FULL["repeats"] and QUICK["blocks"] < FULL["blocks"]
    assert FULL["ensembles"] and not QUICK["ensembles"]
