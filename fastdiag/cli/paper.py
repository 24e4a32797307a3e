"""`fastdiag paper`: the README's "Reproducing the paper" section — its table and prose from data/paper/
(`regenerate`), the stores it came from (`export`, `table`), the figure (`figure`) and the measurements
behind its cost and step-0 rows (`cost`, `init`) and GPU estimate (`plan`)."""
from __future__ import annotations

import json
from pathlib import Path

import click

# The README's two GPU sweeps (λ grid, seeds, horizon) and the assumed (TFLOP/s, launch floor in ms).
GPU_GRIDS = [("0.005:10:23", 16, 20000), ("0.01:0.03:9", 16, 20000)]
GPU_ASSUMPTIONS = [(tflops, floor) for floor in (3.0, 6.0) for tflops in (10.0, 20.0, 40.0)]


def gpu_rows() -> list[tuple[float, float, list[float]]]:
    """Hours of the README's two GPU sweeps at each assumed rate (`fastdiag.sweep.gpu_plan.grid_plan`)."""
    from fastdiag.analysis.paper_data import predicted_t_grok
    from fastdiag.grokking.sweep_spec import parse_wd
    from fastdiag.sweep.gpu_plan import grid_plan

    return [(tflops, floor, [grid_plan(parse_wd(wd), seeds, epochs, 10, 32, tflops, floor, predicted_t_grok)["hours"]
                             for wd, seeds, epochs in GPU_GRIDS])
            for tflops, floor in GPU_ASSUMPTIONS]


def committed_data() -> Path:
    """data/paper/, the default of --data and --out: read from fastdiag.analysis.paper_data when a command
    runs (it loads scipy, which `fastdiag paper ... --help` does without)."""
    from fastdiag.analysis.paper_data import DATA

    return DATA


DATA_SHOWN = "data/paper/ of the repository"


def paper_block(data: Path | None = None) -> list[str]:
    """The README's generated block (markers included), from ``data`` (default: data/paper/) alone."""
    from fastdiag.analysis.paper import regenerate

    return regenerate(gpu_rows(), committed_data() if data is None else data)


@click.group("paper")
def paper_cmd() -> None:
    """The paper reproduction: the README's table from data/paper/, its runs, figure and measurements."""


@paper_cmd.command("regenerate")
@click.option("--data", type=click.Path(exists=True, file_okay=False, path_type=Path), default=committed_data,
              show_default=DATA_SHOWN, help="The committed data folder.")
@click.option("--write-readme", is_flag=True, help="Replace the README's generated block with it.")
def regenerate_cmd(data, write_readme):
    """Print the README's paper table (and the prose under it) from data/paper/ alone."""
    from fastdiag.analysis.paper import write_readme_block

    block = paper_block(data)
    if write_readme:
        write_readme_block(block)
    click.echo("\n".join(block))


@paper_cmd.command("export")
@click.argument("stores", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=committed_data,
              show_default=DATA_SHOWN)
def export_cmd(stores, out):
    """Append the done canonical runs of STORES (with their traces) to OUT/runs.csv and OUT/traces.csv."""
    from fastdiag.analysis.paper_data import export

    for path in export(list(stores), out):
        click.echo(str(path))


@paper_cmd.command("table")
@click.argument("stores", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the whole report as JSON.")
def table_cmd(stores, as_json):
    """t_grok, t_mem, phase values and regimes per λ of the done runs in STORES."""
    from fastdiag.analysis.paper_data import format_table, load_runs, table

    report = table(load_runs(list(stores)))
    click.echo(json.dumps(report, indent=1) if as_json else "\n".join(format_table(report)))


@paper_cmd.command("figure")
@click.argument("stores", nargs=-1, type=click.Path(dir_okay=False))
@click.option("--data", type=click.Path(exists=True, file_okay=False, path_type=Path), default=committed_data,
              show_default=DATA_SHOWN, help="The committed data folder, drawn when no store is given.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True)
@click.option("--init", "init_path", type=click.Path(dir_okay=False, path_type=Path),
              help="JSON written by `fastdiag paper init`: step-0 values, drawn left of the first epoch.")
def figure_cmd(stores, data, out, init_path):
    """The paper's Fig. 2 layout (test accuracy, s̄, σ_H against epoch) from STORES or data/paper/."""
    from fastdiag.analysis.paper_data import load_data, load_runs, runs_from_data
    from fastdiag.plots.paper import figure

    init = json.loads(init_path.read_text())["per_seed"] if init_path else None
    runs = load_runs(list(stores)) if stores else runs_from_data(load_data(data))
    for path in figure(runs, out, init):
        click.echo(str(path))


@paper_cmd.command("init")
@click.option("--seeds", type=click.IntRange(min=1), default=8, show_default=True, help="Seeds 0 … N−1.")
def init_cmd(seeds):
    """s̄ and σ_H of the initialised canonical model (step 0), per seed, as JSON."""
    from fastdiag.analysis.paper_data import summary
    from fastdiag.grokking.paper_measure import initial_diagnostics

    rows = initial_diagnostics(list(range(seeds)))
    click.echo(json.dumps({"per_seed": rows, "s_bar": summary([r["s_bar"] for r in rows]),
                           "sigma_h": summary([r["sigma_h"] for r in rows])}, indent=1))


@paper_cmd.command("cost")
@click.option("--epochs", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True)
def cost_cmd(epochs, threads):
    """CPU seconds of a canonical training epoch without and with its evaluation, as JSON."""
    from fastdiag.grokking.paper_measure import measure_cost

    click.echo(json.dumps(measure_cost(epochs, threads), indent=1))


@paper_cmd.command("plan")
@click.option("--wd", required=True, help="λ grid, as `fastdiag sweep --wd`.")
@click.option("--seeds", type=click.IntRange(min=1), required=True)
@click.option("--epochs", type=click.IntRange(min=1), required=True)
@click.option("--eval-every", type=click.IntRange(min=1), default=10, show_default=True)
@click.option("--ensemble", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--collapse-from", type=float, default=10.0, show_default=True)
@click.option("--tflops", type=float, default=20.0, show_default=True,
              help="Assumed sustained fp32 matmul TFLOP/s of a full ensemble step on the GPU.")
@click.option("--floor-ms", type=float, default=3.0, show_default=True,
              help="Assumed launch-bound floor of one ensemble step / evaluation on the GPU.")
def plan_cmd(wd, seeds, epochs, eval_every, ensemble, collapse_from, tflops, floor_ms):
    """GPU hours of a canonical grid, every run taking the paper's law's t_grok (an estimate), as JSON."""
    from fastdiag.analysis.paper_data import predicted_t_grok
    from fastdiag.grokking.sweep_spec import parse_wd
    from fastdiag.sweep.gpu_plan import grid_plan

    click.echo(json.dumps(grid_plan(parse_wd(wd), seeds, epochs, eval_every, ensemble, tflops, floor_ms,
                                    predicted_t_grok, collapse_from), indent=1))


COMMANDS = [paper_cmd]
