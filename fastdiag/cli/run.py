"""`fastdiag run`: train one grokking run (docs/experiments.md) with live diagnostics and write its outputs."""
from __future__ import annotations

import click

from fastdiag.cli.app import CLIError, loading, option_errors, os_error_text
from fastdiag.cli.options import (CADENCE_HELP, DEFAULT_CADENCE, QUIET_HELP, THREADS_HELP, numeric, run_fields,
                                  run_options)
from fastdiag.grokking.config import RunConfig, fmt_or_dash, parse_cadence
from fastdiag.grokking.labels import largest, phase2_peak
from fastdiag.plots.background import FigureProcess
from fastdiag.plots.outputs import write_outputs
from fastdiag.store.files import prepare_out_dir


# Shared with `fastdiag sweep`: one spelling, one default.
checkpoint_option = click.option("--checkpoint-every", "checkpoint_every", default=DEFAULT_CADENCE,
                                 show_default=True, metavar="N|Nm|Ns|off", help=CADENCE_HELP)


def at_epoch(found: tuple[float, int] | None) -> str:
    """A (value, epoch) of `labels.largest` as the summary line prints it: "0.069 (epoch 6)", or "–"."""
    return "–" if found is None else f"{found[0]:.3f} (epoch {found[1]})"


def parse_checkpoint_every(text: str):
    try:
        return parse_cadence(text)
    except ValueError as exc:
        raise CLIError(f"--checkpoint-every:{str(exc).partition(':')[2]}") from None


@click.command("run")
@run_options()
@click.option("--threads", type=numeric("threads"), default=None, help=THREADS_HELP)
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Output directory [default: runs/<run_id>]")
@click.option("--quiet", is_flag=True, help=QUIET_HELP)
@checkpoint_option
def run(threads, out_dir, quiet, checkpoint_every, **fields) -> None:
    """Train one run of a ∘ b mod p and write result.json, trace.csv and trajectory.png."""
    # The figure's process loads matplotlib now, beside this one's torch (fastdiag/plots/background.py).
    with FigureProcess(fallback=_draw_here) as figure:
        _run(figure, threads, out_dir, quiet, checkpoint_every, fields)


def _draw_here(trace, path, result=None) -> None:
    """The trajectory figure drawn in this process (matplotlib loads now): the figure's process is gone."""
    from fastdiag.plots.run import plot_trajectory
    plot_trajectory(trace, path, result=result)


def _run(figure: FigureProcess, threads, out_dir, quiet, checkpoint_every, fields) -> None:
    with loading():         # torch and the trainer (torch._dynamo) load here, not for --help
        import torch

        from fastdiag.grokking.build import check_buildable
        from fastdiag.grokking.checkpoint import checkpoint_path, make_checkpointer
        from fastdiag.grokking.train import train_run
        from fastdiag.sweep.plan import plan_threads
        from fastdiag.sweep.progress import RunProgress

    cadence = parse_checkpoint_every(checkpoint_every)
    # Check everything the run needs before any training: the values, the task (÷ needs a prime p,
    # p² pairs must fit in memory), the model settings, the device, and the output directory.
    with option_errors():
        cfg = RunConfig(**run_fields(fields))
        check_buildable(cfg, device=True)
    out_dir = out_dir or f"runs/{cfg.run_id()}"
    try:
        prepare_out_dir(out_dir)
    except OSError as exc:
        raise CLIError(f"--out: cannot write to {out_dir}: {os_error_text(exc)}") from None

    torch.set_num_threads(threads or plan_threads([cfg]))
    # A rerun with the same settings and --out resumes from the checkpoint a killed run left there.
    checkpoint = make_checkpointer(checkpoint_path(out_dir, "run"), cfg.run_id(), cadence)
    progress = None if quiet else RunProgress(cfg.epochs)
    try:
        outcome = train_run(cfg, progress=progress, checkpoint=checkpoint)
    finally:
        if progress is not None:
            progress.close()
    r = outcome.result

    def when(kind: str) -> str:
        epoch = r[f"t_{kind}_epoch"]
        return "not reached" if epoch is None else f"epoch {epoch} (step {r[f't_{kind}_step']})"

    # The summary first: if the outputs cannot be written (disk full), the run's outcome is still said.
    click.echo(f"regime: {r['regime']}   t_mem: {when('mem')}   t_grok: {when('grok')}")
    train, test = (fmt_or_dash(r[k], ".3f") for k in ("final_train_acc", "final_test_acc"))
    # The largest s̄ and σ_H at any evaluation (σ_H's is often the transient after initialisation), and the
    # Phase-2 peak where the run went on past t_grok: what the figure marks (fastdiag/grokking/labels.py).
    peak = phase2_peak(outcome.trace, r["t_grok_epoch"])
    sigma_h = at_epoch(largest(outcome.trace, "sigma_h")) + (f", from t_grok on {at_epoch(peak)}" if peak else "")
    click.echo(f"final: train acc {train}  test acc {test}  largest s̄ {at_epoch(largest(outcome.trace, 's_bar'))}  "
               f"largest σ_H {sigma_h}  "
               f"({r['epochs_run']} epochs, {r['steps']} steps, {r['wall_seconds']:.1f} s on {r['device']}"
               + (f"; resumed from the checkpoint at epoch {checkpoint.resumed_epoch}"
                  if checkpoint is not None and checkpoint.resumed_epoch is not None else "") + ")")
    try:
        paths = write_outputs(outcome, out_dir, figure.plot)
    except OSError as exc:
        raise CLIError(f"--out: the run finished but its outputs could not be written to {out_dir}: "
                       f"{os_error_text(exc)}") from None
    if checkpoint is not None:            # the outcome is on disk: the checkpoint has done its work
        checkpoint.remove()
    click.echo("wrote: " + ", ".join(str(path) for path in paths.values()))


COMMANDS = [run]
