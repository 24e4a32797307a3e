"""`fastdiag bench`: kernel and training-step overhead, as a table and optionally JSON."""
from __future__ import annotations

import json
import platform
import sys
from dataclasses import asdict
from datetime import datetime, timezone

import click

from fastdiag.bench_workloads import ENSEMBLE_WORKLOADS, KERNEL_SHAPES
from fastdiag.cli.app import CLIError, loading, os_error_text
from fastdiag.grokking.config import RunConfig
from fastdiag.store.files import atomic_path, check_writable_file
# The measurements (fastdiag.bench, kernel_report, the models, the sweep) import torch: the functions below
# load them, so that `fastdiag bench --help` does not.


def _status_line(msg: str) -> None:
    """What is being measured: one rewritten line on a terminal; on a pipe (logs) a line per message."""
    if sys.stderr.isatty():
        click.echo(f"\r\033[K{msg}", nl=False, err=True)
    elif msg:
        click.echo(msg, err=True)


def _device(name: str) -> torch.device:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise click.ClickException("--device cuda: no CUDA device is available")
    return torch.device(name)


def _machine(device: torch.device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


def _check_members(members: int | None, workloads: list[str], dev: torch.device) -> None:
    """Refuse an ensemble size that cannot run before anything is built: the benchmark sweeps K runs
    per core (a sweep takes at most MAX_GRID_RUNS) and K members' weights, gradients and AdamW state
    must fit in memory (the GPU's on CUDA)."""
    if members is None:
        return
    import torch

    from fastdiag.grokking.build import TRAINING_BYTES_PER_PARAMETER, parameter_count
    from fastdiag.grokking.tasks import available_memory
    from fastdiag.grokking.sweep_spec import MAX_GRID_RUNS
    from fastdiag.sweep.plan import available_cores

    runs = members * (1 if dev.type == "cuda" else available_cores())
    if runs > MAX_GRID_RUNS:
        raise CLIError(f"--members: {members:,} members make a benchmark sweep of {runs:,} runs; a sweep takes "
                       f"at most {MAX_GRID_RUNS:,}")
    memory = (torch.cuda.get_device_properties(dev.index or 0).total_memory if dev.type == "cuda"
              else available_memory())
    for workload in workloads:
        n = parameter_count(RunConfig(device=dev.type, **ENSEMBLE_WORKLOADS[workload])) or 0
        need = members * n * TRAINING_BYTES_PER_PARAMETER
        if memory is not None and need > memory:
            raise CLIError(f"--members: {members:,} members of the {workload} workload's model ({n:,} parameters) "
                           f"need {need / 2**30:,.1f} GiB to train; {memory / 2**30:.1f} GiB is available")


def _known_names(text: str, known, option: str, what: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in known]
    if unknown:
        raise click.ClickException(f"{option}: unknown {what}(s) {', '.join(unknown)}; "
                                   f"expected some of {', '.join(known)}")
    return names


# The default run is quick (one kernel shape, few repeats, the small sweep workload) so that a first
# `fastdiag bench` finishes in minutes on a laptop; --full is the measurement benchmarks/RESULTS.md reports.
QUICK = {"shapes": "grokking", "repeats": 5, "blocks": 5, "workloads": "small", "ensembles": False}
FULL = {"shapes": ",".join(KERNEL_SHAPES), "repeats": 15, "blocks": 21, "workloads": ",".join(ENSEMBLE_WORKLOADS),
        "ensembles": True}


@click.command("bench")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where to measure: auto (CUDA when available), cpu, cuda.")
@click.option("--full", is_flag=True,
              help=f"The full measurement (shapes {FULL['shapes']}, {FULL['repeats']} repeats, {FULL['blocks']} "
                   f"blocks, workloads {FULL['workloads']}) instead of the quick default "
                   f"(shape {QUICK['shapes']}, {QUICK['repeats']} repeats, {QUICK['blocks']} blocks, no "
                   f"ensembles); options given explicitly override either.")
@click.option("--shapes", default=None,
              help="Comma list of kernel shapes: " + ", ".join(f"{k}={v}" for k, v in KERNEL_SHAPES.items()) + ".")
@click.option("--steps/--no-steps", default=True, show_default=True, help="Also time training steps with attach.")
@click.option("--ensembles/--no-ensembles", default=None,
              help="Also time a sweep's runs as one vectorised ensemble against one by one [default: only with "
                   "--full, not in the quick run: the longest section, about 5 minutes at load 7-9 on 2 cores].")
@click.option("--archs/--no-archs", default=True, show_default=True,
              help="Also time a Mamba training step beside the transformer's (batch 512, T 3).")
@click.option("--members", type=click.IntRange(2), default=None, help="Ensemble size K (default: what `sweep --ensemble auto` picks).")
@click.option("--workloads", default=None,
              help="Comma list of sweep workloads for the ensemble rows: " + ", ".join(ENSEMBLE_WORKLOADS) + ".")
@click.option("--no-compile", is_flag=True, help="Skip the torch.compile'd reference.")
@click.option("--repeats", type=click.IntRange(3), default=None, help="Timed repeats of each kernel (CPU).")
@click.option("--blocks", type=click.IntRange(3), default=None, help="Alternating blocks of each step timing.")
@click.option("--kernel-report", is_flag=True,
              help="Instead of timing: compile every Triton kernel for sm_90 (H200) at the benchmark shapes, "
                   "no GPU needed, and print registers, spills, shared memory, hot-loop SASS per element and "
                   "the issue-bound ceiling as a fraction of copy bandwidth.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write the measurements to this JSON file (rewritten after each section, so a cut-off run "
                   "keeps what finished).")
def bench_command(device, full, shapes, steps, ensembles, archs, members, workloads, no_compile, repeats, blocks,
                  kernel_report, json_path):
    """Measure fastdiag's overhead against a pure-PyTorch reference (kernel) and per training step."""
    with loading():
        import torch

        from fastdiag import bench
    if json_path:                                # refused now, not after the whole benchmark
        try:
            check_writable_file(json_path)
        except (OSError, ValueError) as exc:
            raise CLIError(f"--json: {os_error_text(exc) if isinstance(exc, OSError) else exc}") from None
    preset = FULL if full else QUICK
    shapes = preset["shapes"] if shapes is None else shapes
    workloads = preset["workloads"] if workloads is None else workloads
    repeats = preset["repeats"] if repeats is None else repeats
    blocks = preset["blocks"] if blocks is None else blocks
    ensembles = preset["ensembles"] if ensembles is None else ensembles
    names = _known_names(shapes, KERNEL_SHAPES, "--shapes", "shape")   # "" = no kernel rows

    progress = _status_line
    if kernel_report:
        _kernel_report(names, json_path, progress)
        return
    dev = _device(device)
    sweep_workloads = _known_names(workloads, ENSEMBLE_WORKLOADS, "--workloads", "workload")
    _check_members(members, sweep_workloads, dev)    # also when unused: an absurd value is a typo
    if not names and not steps and not archs and not (ensembles and sweep_workloads):
        raise click.ClickException("nothing to run: --shapes and --workloads are empty or --no-steps, "
                                   "--no-archs and --no-ensembles are given; name at least one kernel shape, "
                                   "step or workload")
    sections = [s for s, on in (("kernels " + ",".join(names), bool(names)), ("steps", steps), ("architectures", archs),
                                ("ensembles " + ",".join(sweep_workloads), ensembles and bool(sweep_workloads))) if on]
    click.echo(f"fastdiag bench ({'full' if full else 'quick; --full for the whole measurement'}) — "
               f"{_machine(dev)}, torch {torch.__version__}, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; "
               f"sections: {'; '.join(sections)}; {repeats} repeats, {blocks} blocks. Each table is printed"
               + (f" and saved to {json_path}" if json_path else "") + " as its section finishes.")
    payload = {"machine": _machine(dev), "device": dev.type, "torch": torch.__version__,
               "python": sys.version.split()[0], "date": datetime.now(timezone.utc).isoformat(),
               "full": full, "kernel": [], "step": [], "sdpa_step": [], "ensemble": [], "arch_steps": []}

    def finished(table: str) -> None:
        _status_line("")
        click.echo()
        click.echo(table)
        if json_path:
            with atomic_path(json_path) as tmp, open(tmp, "w") as f:
                json.dump(payload, f, indent=2, default=str)

    for name in names:
        for dtype in bench.kernel_dtypes(dev):
            r = bench.bench_kernel(name, KERNEL_SHAPES[name], dtype, dev, compiled=not no_compile,
                                   repeats=repeats, progress=progress)
            payload["kernel"].append(r.row())
    if names:
        finished(bench.format_kernel_table(payload["kernel"]))
    if steps:
        for name, factory in bench.step_workloads(dev).items():
            payload["step"].append(asdict(bench.bench_step(name, factory, dev, blocks=blocks, progress=progress)))
        finished(bench.format_step_table(payload["step"]))
        payload["sdpa_step"].append(asdict(bench.bench_sdpa_step(dev, rounds=blocks, progress=progress)))
        finished(bench.format_sdpa_step_table(payload["sdpa_step"]))
    if archs:
        payload["arch_steps"] = [asdict(r) for r in bench.bench_arch_steps(dev, blocks=blocks, progress=progress)]
        finished(bench.format_arch_table(payload["arch_steps"]))
    if ensembles:
        for workload in sweep_workloads:
            payload["ensemble"].append(asdict(bench.bench_ensemble(dev, workload, members, progress=progress)))
            finished(bench.format_ensemble_table(payload["ensemble"]))
    if json_path:
        click.echo(f"wrote {json_path}")


def _kernel_report(names: list[str], json_path: str | None, progress) -> None:
    from fastdiag import bench
    from fastdiag import kernel_report as report

    try:
        rows = bench.kernel_report(names, progress=progress)
    except (ImportError, RuntimeError) as e:
        raise click.ClickException(f"--kernel-report: {e}") from None
    _status_line("")
    click.echo(f"fastdiag bench --kernel-report — compiled for sm_90 here, no GPU used, "
               f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC")
    click.echo(report.format_report(rows))
    if json_path:
        payload = {"kind": "kernel-report", "date": datetime.now(timezone.utc).isoformat(),
                   "gpu_model": report.GPU, "kernels": [r.row() for r in rows]}
        with atomic_path(json_path) as tmp, open(tmp, "w") as f:
            json.dump(payload, f, indent=2, default=str)
        click.echo(f"wrote {json_path}")


COMMANDS = [bench_command]
