"""`fastdiag sweep` (`merge` and `export` of its stores: cli/stores.py)."""
from __future__ import annotations

import sys

import click

from fastdiag.cli.app import CLIError, create_store, loading, option_errors
from fastdiag.cli.options import QUIET_HELP, SEEDS_HELP, THREADS_DEFAULT, numeric, run_fields, run_options
from fastdiag.cli.run import checkpoint_option, parse_checkpoint_every
from fastdiag.grokking.config import ARCHS, SWEEP_BACKENDS, RunConfig
from fastdiag.grokking.sweep_spec import parse_list, parse_seeds, parse_shard, parse_wd

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
@click.option("--backend", type=click.Choice(SWEEP_BACKENDS), default="local", show_default=True,
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
    with option_errors():                       # a bad grid is refused before torch loads
        weight_decays = parse_wd(wd)
        seed_list = parse_seeds(seeds)
        archs = parse_list(arch, "archs")
        presets = parse_list(preset, "presets")
        shard_spec = parse_shard(shard)
    with loading():         # the grid's model checks, the planner and the runner import torch: not for --help
        from fastdiag.sweep.grid import build_grid
        from fastdiag.sweep.grid import shard as shard_grid
        from fastdiag.sweep.run import check_devices, run_sweep
    with option_errors():
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
    with loading():         # scipy: not for --help
        import torch

        from fastdiag.analysis.paper_data import PAPER, predicted_t_grok
        from fastdiag.grokking.build import uses_cuda
        from fastdiag.sweep.plan import describe_estimate, estimate_sweep

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


COMMANDS = [sweep_cmd]
