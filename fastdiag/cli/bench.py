"""`fastdiag bench`: kernel and training-step overhead, as a table and optionally JSON."""
from __future__ import annotations

import json
import platform
import sys
from dataclasses import asdict
from datetime import datetime, timezone

import click
import torch

from fastdiag import bench
from fastdiag.cli.app import CLIError, os_error_text
from fastdiag.store.files import atomic_path, check_writable_file


def _status_line(msg: str) -> None:
    """What is being measured: one rewritten line on a terminal; on a pipe (logs) a line per message."""
    if sys.stderr.isatty():
        click.echo(f"\r\033[K{msg}", nl=False, err=True)
    elif msg:
        click.echo(msg, err=True)


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise click.ClickException("--device cuda: no CUDA device is available")
    return torch.device(name)


def _machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


def _known_names(text: str, known, option: str, what: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in known]
    if unknown:
        raise click.ClickException(f"{option}: unknown {what}(s) {', '.join(unknown)}; "
                                   f"expected some of {', '.join(known)}")
    return names


@click.command("bench")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--shapes", default=",".join(bench.KERNEL_SHAPES), show_default=True,
              help="Comma list of kernel shapes: " + ", ".join(f"{k}={v}" for k, v in bench.KERNEL_SHAPES.items()))
@click.option("--steps/--no-steps", default=True, show_default=True, help="Also time training steps with attach.")
@click.option("--ensembles/--no-ensembles", default=True, show_default=True,
              help="Also time a sweep's runs as one vectorised ensemble against one by one.")
@click.option("--archs/--no-archs", default=True, show_default=True,
              help="Also time a Mamba training step beside the transformer's (batch 512, T 3).")
@click.option("--members", type=click.IntRange(2), default=None, help="Ensemble size K (default: what `sweep --ensemble auto` picks).")
@click.option("--workloads", default=",".join(bench.ENSEMBLE_WORKLOADS), show_default=True,
              help="Comma list of sweep workloads for the ensemble rows: " + ", ".join(bench.ENSEMBLE_WORKLOADS))
@click.option("--no-compile", is_flag=True, help="Skip the torch.compile'd reference.")
@click.option("--repeats", type=click.IntRange(3), default=15, show_default=True, help="Timed repeats (CPU).")
@click.option("--blocks", type=click.IntRange(3), default=21, show_default=True, help="Alternating step blocks.")
@click.option("--kernel-report", is_flag=True,
              help="Instead of timing: compile every Triton kernel for sm_90 (H200) at the benchmark shapes, "
                   "no GPU needed, and print registers, spills, shared memory, hot-loop SASS per element and "
                   "the issue-bound ceiling as a fraction of copy bandwidth.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write all measurements to this JSON file.")
def bench_command(device, shapes, steps, ensembles, archs, members, workloads, no_compile, repeats, blocks,
                  kernel_report, json_path):
    """Measure fastdiag's overhead against a pure-PyTorch reference (kernel) and per training step."""
    if json_path:                                # refused now, not after the whole benchmark
        try:
            check_writable_file(json_path)
        except (OSError, ValueError) as exc:
            raise CLIError(f"--json: {os_error_text(exc) if isinstance(exc, OSError) else exc}") from None
    names = _known_names(shapes, bench.KERNEL_SHAPES, "--shapes", "shape")   # "" = no kernel rows

    progress = _status_line
    if kernel_report:
        _kernel_report(names, json_path, progress)
        return
    dev = _device(device)
    sweep_workloads = _known_names(workloads, bench.ENSEMBLE_WORKLOADS, "--workloads", "workload")
    if not names and not steps and not archs and not (ensembles and sweep_workloads):
        raise click.ClickException("nothing to run: --shapes and --workloads are empty or --no-steps, "
                                   "--no-archs and --no-ensembles are given; name at least one kernel shape, "
                                   "step or workload")

    kernel_rows = []
    for name in names:
        for dtype in bench.kernel_dtypes(dev):
            r = bench.bench_kernel(name, bench.KERNEL_SHAPES[name], dtype, dev, compiled=not no_compile,
                                   repeats=repeats, progress=progress)
            kernel_rows.append(r.row())
    step_rows, sdpa_rows = [], []
    if steps:
        for name, factory in bench.step_workloads(dev).items():
            step_rows.append(asdict(bench.bench_step(name, factory, dev, blocks=blocks, progress=progress)))
        sdpa_rows.append(asdict(bench.bench_sdpa_step(dev, rounds=blocks, progress=progress)))
    arch_rows = [asdict(r) for r in bench.bench_arch_steps(dev, blocks=blocks, progress=progress)] if archs else []
    ensemble_rows = []
    if ensembles:
        for workload in sweep_workloads:
            ensemble_rows.append(asdict(bench.bench_ensemble(dev, workload, members, progress=progress)))
    _status_line("")
    click.echo(f"fastdiag bench — {_machine(dev)}, torch {torch.__version__}, "
               f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC")
    if kernel_rows:
        click.echo(bench.format_kernel_table(kernel_rows))
    for rows, table in ((step_rows, bench.format_step_table), (sdpa_rows, bench.format_sdpa_step_table),
                        (arch_rows, bench.format_arch_table), (ensemble_rows, bench.format_ensemble_table)):
        if rows:
            click.echo()
            click.echo(table(rows))
    if json_path:
        payload = {"machine": _machine(dev), "device": dev.type, "torch": torch.__version__,
                   "python": sys.version.split()[0], "date": datetime.now(timezone.utc).isoformat(),
                   "kernel": kernel_rows, "step": step_rows, "sdpa_step": sdpa_rows,
                   "ensemble": ensemble_rows, "arch_steps": arch_rows}
        with atomic_path(json_path) as tmp, open(tmp, "w") as f:
            json.dump(payload, f, indent=2, default=str)
        click.echo(f"wrote {json_path}")


def _kernel_report(names: list[str], json_path: str | None, progress) -> None:
    try:
        rows = bench.kernel_report(names, progress=progress)
    except (ImportError, RuntimeError) as e:
        raise click.ClickException(f"--kernel-report: {e}") from None
    _status_line("")
    click.echo(f"fastdiag bench --kernel-report — compiled for sm_90 here, no GPU used, "
               f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC")
    click.echo(bench.format_kernel_report(rows))
    if json_path:
        payload = {"kind": "kernel-report", "date": datetime.now(timezone.utc).isoformat(),
                   "gpu_model": bench.REPORT_GPU, "kernels": [r.row() for r in rows]}
        with atomic_path(json_path) as tmp, open(tmp, "w") as f:
            json.dump(payload, f, indent=2, default=str)
        click.echo(f"wrote {json_path}")


COMMANDS = [bench_command]
