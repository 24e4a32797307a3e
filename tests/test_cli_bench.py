"""`fastdiag bench`: states its plan first, prints and saves each section as it finishes, dashes (not
`nan`) with a footnote where a figure does not exist on the device."""
import json

import torch

from fastdiag import bench
from fastdiag.bench_workloads import ENSEMBLE_WORKLOADS, KERNEL_SHAPES
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
    assert set(QUICK["shapes"].split(",")) <= set(FULL["shapes"].split(",")) == set(KERNEL_SHAPES)
    assert set(QUICK["workloads"].split(",")) <= set(FULL["workloads"].split(",")) == set(ENSEMBLE_WORKLOADS)
    assert QUICK["repeats"] < FULL["repeats"] and QUICK["blocks"] < FULL["blocks"]
    assert FULL["ensembles"] and not QUICK["ensembles"]


def test_overheads_are_the_ratio_of_the_printed_medians_with_an_interval():
    """The ovh columns are the printed medians' ratio; a difference inside the blocks' interval is marked
    ~0 (never a bare negative overhead)."""
    base, every10, every1 = [10.0, 11.0, 12.0, 9.0, 10.5], [9.8, 11.5, 11.0, 9.2, 10.4], [20.0, 22.0, 24.0, 18.0, 21.0]
    lo, hi = bench.ratio_interval(every10, base)
    assert (lo, hi) == (min(a / b for a, b in zip(every10, base)), max(a / b for a, b in zip(every10, base)))
    assert bench.ratio_interval(list(range(1, 22)), [1] * 21) == (6, 16)     # sign test, 97.3 %
    row = bench.StepResult("demo", "cpu", 10.0, 10.4, 21.0, 100 * (10.4 / 10.0 - 1), 100 * (21.0 / 10.0 - 1), 5,
                           (100 * (lo - 1), 100 * (hi - 1)), (100 * (1.9 - 1), 100 * (2.2 - 1)))
    line = next(line for line in bench.format_step_table([row.__dict__]).splitlines() if line.startswith("demo"))
    assert "+4.0 [" in line and line.count("~0") == 1 and "+110.0 [+90.0, +120.0]" in line
