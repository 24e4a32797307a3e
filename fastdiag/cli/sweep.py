"""`fastdiag sweep`, `fastdiag merge`, `fastdiag export`."""
from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path

import click

from fastdiag.cli.app import CLIError, create_store, open_store, option_errors
from fastdiag.cli.options import QUIET_HELP, THREADS_DEFAULT, numeric, run_fields, run_options
from fastdiag.cli.run import checkpoint_option, parse_checkpoint_every
from fastdiag.grokking.build import uses_cuda
from fastdiag.grokking.config import ARCHS, RunConfig
from fastdiag.store import STATUSES
from fastdiag.store.files import atomic_path, check_target
from fastdiag.sweep.grid import SEEDS_HELP, build_grid, parse_list, parse_seeds, parse_shard, parse_wd
from fastdiag.sweep.grid import shard as shard_grid
from fastdiag.sweep.plan import describe_estimate, estimate_sweep
from fastdiag.sweep.run import BACKENDS, check_devices, run_sweep

_DEFAULTS = RunConfig()


def _parse_ensemble(spec: str) -> int | None:
    """K, or None for auto (chosen per group of compatible runs)."""
    if spec == "auto":
        return None
    try:
        size = int(spec)
    except ValueError:
        raise CLIError(f"--ensemble: expected a positive integer or 'auto', got {spec!r}") from None
    if size < 1:
        raise CLIError(f"--ensemble: must be >= 1, got {size}")
    return size


@click.command("sweep")
@click.option("--wd", "wd", required=True, metavar="LIST|START:STOP:COUNT",
              help="Weight decays λ: a comma list (0,0.01,0.1,1) or COUNT log-spaced values, e.g. 1e-3:2:13.")
@click.option("--seeds", default="1", show_default=True, metavar="N|A-B|LIST",
              help=SEEDS_HELP)
@click.option("--arch", default=_DEFAULTS.arch, show_default=True, metavar="ARCH[,ARCH...]",
              help=f"Architectures: {', '.join(ARCHS)} (comma list: one grid per architecture).")
@click.option("--preset", default=_DEFAULTS.preset, show_default=True, metavar="NAME[,NAME...]",
              help="Transformer size: canonical, 19m, 85m, custom (comma list: one grid per size).")
@run_options(skip=("arch", "preset", "weight_decay", "seed"))
@click.option("--store", "store_path", default="sweep.sqlite", show_default=True, type=click.Path(),
              help="The SQLite result store (created if missing; finished runs in it are skipped).")
@click.option("--backend", type=click.Choice(BACKENDS), default="local", show_default=True,
              help="Where the runs execute: local processes or a Ray cluster.")
@click.option("--workers", type=numeric("workers"), default=None,
              help="Local processes (default: what the cores and memory hold).")
@click.option("--threads", type=numeric("threads"), default=None, help="Torch threads per local worker " + THREADS_DEFAULT)
@click.option("--address", default=None, help="Ray cluster address (default: start Ray locally).")
@click.option("--max-retries", type=numeric("max_retries"), default=2, show_default=True,
              help="Retries of a run whose worker was lost.")
@click.option("--shard", default=None, metavar="I/N",
              help="Run only shard I of N (0 <= I < N; runs split by run_id), e.g. $SLURM_ARRAY_TASK_ID/8.")
@click.option("--retry-failed/--skip-failed", default=True, show_default=True,
              help="Rerun runs recorded as failed by an earlier invocation.")
@click.option("--ensemble", default="auto", show_default=True, metavar="K|auto",
              help="Train up to K compatible runs (same all but seed and λ; transformer, mlp or PyTorch mamba) as one "
                   "vectorised model; 1 = one by one; auto = on a GPU 64-512 members, by measured memory and runs "
                   "per second; on a CPU 8 for models up to ~0.45 M parameters, 4 for canonical, 1 from ~2.5 M.")
@click.option("--dry-run", is_flag=True,
              help="Print the grid size and the time it will take here (from a short measured calibration), and exit.")
@click.option("--calibrate-steps", type=numeric("calibrate_steps"), default=None, metavar="N",
              help="Timed training steps of --dry-run's calibration; 0: no estimate [default: 200 on CUDA, 10 on a CPU].")
@click.option("--quiet", "-q", is_flag=True, help=QUIET_HELP)
@checkpoint_option
def sweep_cmd(wd, seeds, arch, preset, store_path, backend, workers, threads, address, max_retries, shard,
              retry_failed, ensemble, dry_run, calibrate_steps, quiet, checkpoint_every, **fields):
    """Run a grid of training runs (λ × seeds × architectures/sizes) into a result store."""
    ensemble_size = _parse_ensemble(ensemble)
    cadence = parse_checkpoint_every(checkpoint_every)
    with option_errors():
        weight_decays = parse_wd(wd)
        seed_list = parse_seeds(seeds)
        archs = parse_list(arch, "archs")
        presets = parse_list(preset, "presets")
        shard_spec = parse_shard(shard)
        configs = build_grid(run_fields(fields), weight_decays, seed_list, archs, presets)
    if shard_spec is not None:
        grid_size = len(configs)
        configs = shard_grid(configs, *shard_spec)
        if not configs:
            click.echo(f"sweep: shard {shard} of a {grid_size}-run grid is empty; nothing to do", err=True)
            return
    if dry_run:
        click.echo(f"{len(configs)} runs: {len(archs)} arch × {len(presets)} preset × "
                   f"{len(weight_decays)} λ × {len(seed_list)} seeds"
                   + (f", shard {shard}" if shard_spec else ""))
        click.echo("λ: " + ", ".join(f"{w:g}" for w in weight_decays))
        _print_estimate(configs, ensemble_size, workers, threads, calibrate_steps)
        return
    with option_errors():
        check_devices(configs, backend)          # before the store exists: no runs recorded failed
    store = create_store(store_path)
    try:
        with option_errors():
            summary = run_sweep(configs, store, backend=backend, workers=workers, threads=threads,
                                   address=address, max_retries=max_retries, retry_failed=retry_failed,
                                   ensemble=ensemble_size, progress=not quiet, checkpoint_every=cadence)
    finally:
        store.close()
    regimes = ", ".join(f"{r} {n}" for r, n in sorted(summary.regimes.items())) or "none"
    click.echo(f"sweep: {summary.total} runs in {store_path}: {summary.skipped} already done, "
               + (f"{summary.skipped_failed} failed before and skipped (--skip-failed), "
                  if summary.skipped_failed else "")
               + f"{summary.done} finished now ({regimes}"
               + (f"; {summary.resumed} resumed from checkpoints" if summary.resumed else "")
               + f"), {summary.failed} failed, {summary.wall_seconds:.1f} s", err=True)
    if summary.elsewhere:
        click.echo(f"sweep: {summary.elsewhere} run(s) left to another sweep running on {store_path} "
                   "(rerun this command after it ends to pick up any it did not finish)", err=True)
    if summary.failures:
        for rid, error in summary.failures[:10]:
            click.echo(f"sweep: failed run {rid}: {' '.join(str(error).split())}", err=True)
        if len(summary.failures) > 10:
            click.echo(f"sweep: ... and {len(summary.failures) - 10} more failed runs", err=True)
        sys.exit(1)


def _print_estimate(configs, ensemble_size, workers, threads, steps) -> None:
    """The dry run's time estimate (`fastdiag.sweep.plan.estimate_sweep`), or why there is none."""
    import torch

    from fastdiag.analysis.paper_data import PAPER, predicted_t_grok     # scipy: not for --help

    if steps == 0:
        return
    if any(uses_cuda(c) for c in configs) and not torch.cuda.is_available():
        click.echo("estimate: none (the runs are for CUDA and this machine has no CUDA device to calibrate on; "
                   "run the dry run where the sweep will run)")
        return
    law = (f"the paper's law t_grok = {PAPER['t_grok_lambda1']}·((λ − λ_c)/(1 − λ_c))^−ν (λ_c {PAPER['lambda_c']}, "
           f"ν {PAPER['nu']}; canonical runs below λ = 10)")
    with option_errors():
        estimate = estimate_sweep(configs, ensemble_size, workers, threads, steps, predicted_t_grok, law)
    for line in describe_estimate(estimate):
        click.echo(line)


@click.command("merge")
@click.argument("out", type=click.Path())
@click.argument("inputs", nargs=-1, required=True, type=click.Path())
def merge_cmd(out, inputs):
    """Merge shard stores IN... into OUT (created if missing). Idempotent: no run is duplicated, and a
    finished run is never replaced by an unfinished copy."""
    sources = []
    for path in inputs:                       # check every input before touching OUT
        sources.append(open_store(path))
    target = create_store(out)
    total = {"added": 0, "updated": 0, "unchanged": 0, "differ": 0, "intervention_arms_added": 0}
    try:
        for src in sources:
            stats = target.merge_from(src)
            for k in total:
                total[k] += stats[k]
        counts = target.counts()
    finally:
        target.close()
        for src in sources:
            src.close()
    differ = (f"{total['differ']} finished in both with different results (the first store's copy kept: a "
              "packed and a single run of one configuration are different evidence), " if total["differ"] else "")
    click.echo(f"merge: {len(sources)} store(s) into {out}: {total['added']} runs added, "
               f"{total['updated']} updated, {total['unchanged']} unchanged, {differ}"
               f"{total['intervention_arms_added']} intervention arms added; now "
               + ", ".join(f"{k} {v}" for k, v in counts.items()))


def flatten_runs(runs: list[dict]) -> tuple[list[str], list[dict]]:
    """Runs table rows as flat dicts: bookkeeping, then config fields, then result fields."""
    head = ["run_id", "status", "error", "attempts", "created_at", "started_at", "finished_at", "worker"]
    config_cols: list[str] = []
    result_cols: list[str] = []
    for run in runs:
        for k in run["config"]:
            if k not in config_cols:
                config_cols.append(k)
    for run in runs:
        for k in (run["result"] or {}):
            if k in ("run_id", "config"):
                continue
            name = k if k not in head and k not in config_cols else f"result_{k}"
            if name not in result_cols:
                result_cols.append(name)
    rows = []
    for run in runs:
        row = {k: run[k] for k in head}
        row.update(run["config"])
        for k, v in (run["result"] or {}).items():
            if k in ("run_id", "config"):
                continue
            name = k if k not in head and k not in config_cols else f"result_{k}"
            row[name] = json.dumps(v) if isinstance(v, (dict, list)) else v
        rows.append(row)
    return head + config_cols + result_cols, rows


# A spreadsheet opening the CSV runs a cell that starts with one of these as a formula
# (=cmd|' /C calc'!A0): OWASP's CSV-injection advice is to prefix such text cells with a quote.
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def _csv_cell(value):
    """A CSV cell that a spreadsheet shows as text, never runs: store content is untrusted. Spreadsheets
    skip leading blanks and line breaks before a formula (" =cmd", "\n=1+1"), so those are looked past."""
    if value is None:
        return ""
    if isinstance(value, str) and (value.startswith(_FORMULA_STARTS) or value.lstrip().startswith(_FORMULA_STARTS)):
        return "'" + value
    return value


def _write_table(columns: list[str], rows: list[dict], path: Path, fmt: str) -> None:
    if fmt == "csv":
        with atomic_path(path) as tmp, open(tmp, "w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow([_csv_cell(k) for k in columns])
            for row in rows:
                writer.writerow([_csv_cell(row.get(k)) for k in columns])
    else:
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise CLIError("export --format parquet: needs pyarrow (pip install pyarrow)") from None
        data = {}
        for col in columns:
            values = [row.get(col) for row in rows]
            kinds = {type(v) for v in values if v is not None}
            if kinds <= {int, bool} and bool in kinds and int not in kinds:
                data[col] = pa.array(values, type=pa.bool_())
            elif kinds <= {int}:
                data[col] = pa.array(values, type=pa.int64())
            elif kinds <= {int, float}:
                data[col] = pa.array([None if v is None else float(v) for v in values], type=pa.float64())
            else:
                data[col] = pa.array([None if v is None else str(v) for v in values], type=pa.string())
        with atomic_path(path) as tmp:
            pq.write_table(pa.table(data), tmp)


def _resolved(path: Path) -> Path:
    """``path`` with its links followed, or as it is where they cannot be (a symlink loop)."""
    try:
        return path.resolve()
    except (OSError, RuntimeError):
        return path.absolute()


def _same_file(a: Path, b: Path) -> bool:
    """The same file, by any spelling (a relative path, a symlink, a hard link) or, before it exists,
    the same absolute path."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return _resolved(a) == _resolved(b)


@click.command("export")
@click.argument("store_path", metavar="STORE", type=click.Path())
@click.option("--format", "fmt", type=click.Choice(["csv", "parquet"]), default="csv", show_default=True)
@click.option("--out", "out", required=True, type=click.Path(), help="Output file of the runs table.")
@click.option("--trace-out", default=None, type=click.Path(),
              help="Also write the trace rows (run_id, one column per trace field) to this file.")
@click.option("--status", default=None, type=click.Choice(STATUSES),
              help="Only runs with this status (default: all).")
def export_cmd(store_path, fmt, out, trace_out, status):
    """Export a store's runs table (config and result flattened into columns), optionally its traces."""
    outputs = [("--out", Path(out))] + ([("--trace-out", Path(trace_out))] if trace_out else [])
    # SQLite keeps its -wal/-shm next to the link's target when the store is reached through a symlink
    store_files = [Path(f"{base}{tail}") for base in {Path(store_path), _resolved(Path(store_path))}
                   for tail in ("", "-wal", "-shm", "-journal")]
    for flag, path in outputs:               # before reading anything: no half-done export
        try:
            os.stat(path)
        except FileNotFoundError:
            pass
        except OSError as exc:               # a symlink loop, a path through a file, no permission
            raise CLIError(f"{flag}: cannot write {path}: {exc.strerror}") from None
        if path.is_dir():
            raise CLIError(f"{flag}: {path} is a directory; expected a file name")
        if not path.parent.is_dir():
            raise CLIError(f"{flag}: directory {path.parent} does not exist")
        if any(_same_file(path, f) for f in store_files):
            raise CLIError(f"{flag}: {path} is the store being exported; choose another file name")
        try:
            check_target(path)
        except ValueError:
            raise CLIError(f"{flag}: {path} is not a regular file (a FIFO, device or socket); "
                           "refusing to replace it") from None
    if trace_out and _same_file(outputs[0][1], outputs[1][1]):
        raise CLIError(f"--trace-out: {trace_out} is also --out; the traces would overwrite the runs table")
    out_path = outputs[0][1]
    with open_store(store_path) as store:
        runs = store.runs(status)
        columns, rows = flatten_runs(runs)
        _write_table(columns, rows, out_path, fmt)
        n_trace = 0
        if trace_out:
            trace_path = outputs[1][1]
            wanted = {r["run_id"] for r in runs}
            trace_rows, trace_cols = [], ["run_id", "idx"]
            for rid, idx, row in store.traces():
                if rid not in wanted:
                    continue
                for k in row:
                    if k not in trace_cols:
                        trace_cols.append(k)
                trace_rows.append({"run_id": rid, "idx": idx, **row})
            _write_table(trace_cols, trace_rows, trace_path, fmt)
            n_trace = len(trace_rows)
    click.echo(f"export: {len(rows)} runs ({len(columns)} columns) to {out_path}"
               + (f"; {n_trace} trace rows to {trace_out}" if trace_out else ""))


COMMANDS = [sweep_cmd, merge_cmd, export_cmd]
