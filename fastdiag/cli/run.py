"""`fastdiag run`: train one grokking run (SPEC §4) with live diagnostics and write its outputs."""
from __future__ import annotations

import sys
import time

import click

from fastdiag.grokking.config import ARCHS, OPS, RunConfig


def _fmt(value, spec=".3f") -> str:
    return "–" if value is None else format(value, spec)


class _Progress:
    """A live line on stderr: rewritten in place on a terminal, an occasional full line otherwise."""

    def __init__(self, epochs: int, every_line: int = 50) -> None:
        self.epochs, self.every_line, self.count = epochs, every_line, 0
        self.tty = sys.stderr.isatty()
        self.started = time.perf_counter()
        self.width = 0

    def __call__(self, row: dict) -> None:
        self.count += 1
        text = (f"epoch {row['epoch']}/{self.epochs}  train {_fmt(row['train_acc'])}  "
                f"test {_fmt(row['test_acc'])}  s̄ {_fmt(row['s_bar'])}  σ_H {_fmt(row['sigma_h'])}  "
                f"{time.perf_counter() - self.started:.0f}s")
        if self.tty:
            click.echo("\r" + text.ljust(self.width), err=True, nl=False)
            self.width = len(text)
        elif self.count % self.every_line == 1:
            click.echo(text, err=True)

    def close(self) -> None:
        if self.tty and self.width:
            click.echo("", err=True)


@click.command("run")
@click.option("--arch", default="transformer", show_default=True, help=f"one of {', '.join(ARCHS)}")
@click.option("--preset", default="canonical", show_default=True,
              help="transformer size: canonical (4x8x128), 19m, 85m or custom")
@click.option("--layers", "n_layers", type=int, default=None, help="number of layers (overrides the preset)")
@click.option("--heads", "n_heads", type=int, default=None, help="attention heads (transformer)")
@click.option("--d-model", "d_model", type=int, default=None, help="model width (MLP/LSTM: hidden width)")
@click.option("--d-ff", "d_ff", type=int, default=None, help="feed-forward width (transformer)")
@click.option("--op", default="+", show_default=True, help=f"operation mod p: {' '.join(OPS)}")
@click.option("--p", "p", type=int, default=97, show_default=True, help="modulus (prime for /)")
@click.option("--wd", "weight_decay", type=float, default=1.0, show_default=True, help="AdamW weight decay λ")
@click.option("--lr", type=float, default=1e-3, show_default=True, help="learning rate")
@click.option("--batch", "batch_size", type=int, default=512, show_default=True, help="minibatch size")
@click.option("--epochs", type=int, default=1000, show_default=True, help="horizon in epochs")
@click.option("--seed", type=int, default=42, show_default=True)
@click.option("--train-frac", type=float, default=0.5, show_default=True, help="fraction of pairs for training")
@click.option("--eval-every", type=int, default=1, show_default=True, help="evaluate every N epochs")
@click.option("--diag-every", type=int, default=10, show_default=True, help="head diagnostics every N steps")
@click.option("--grok-threshold", type=float, default=0.99, show_default=True, help="accuracy defining t_mem/t_grok")
@click.option("--patience", type=int, default=0, show_default=True, help="epochs to keep training after grokking")
@click.option("--no-stop-at-grok", is_flag=True, help="train to the horizon even after grokking")
@click.option("--device", default="auto", show_default=True, help="auto (CUDA when available), cpu, cuda, cuda:N")
@click.option("--threads", type=int, default=2, show_default=True, help="CPU threads for torch")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="output directory [default: runs/<run_id>]")
@click.option("--quiet", is_flag=True, help="no live progress line")
def run(arch, preset, n_layers, n_heads, d_model, d_ff, op, p, weight_decay, lr, batch_size, epochs, seed,
        train_frac, eval_every, diag_every, grok_threshold, patience, no_stop_at_grok, device, threads,
        out_dir, quiet) -> None:
    """Train one run of a ∘ b mod p and write result.json, trace.csv and trajectory.png."""
    from fastdiag.cli.app import RUN_FLAGS, CLIError, option_errors, os_error_text

    if threads < 1:
        raise CLIError(f"--threads: must be >= 1, got {threads}")
    # Check everything the run needs before any training: the values, the task (÷ needs a prime p,
    # p² pairs must fit in memory), the model settings, the device, and the output directory.
    from fastdiag.sweep import check_buildable
    from fastdiag.grokking.train import prepare_out_dir, resolve_device, train_run, write_outputs

    with option_errors(RUN_FLAGS):
        cfg = RunConfig(arch=arch, preset=preset, n_layers=n_layers, n_heads=n_heads, d_model=d_model, d_ff=d_ff,
                        op=op, p=p, weight_decay=weight_decay, lr=lr, batch_size=batch_size, epochs=epochs,
                        seed=seed, train_frac=train_frac, eval_every=eval_every, diag_every=diag_every,
                        grok_threshold=grok_threshold, stop_at_grok=not no_stop_at_grok, patience=patience,
                        device=device)
        check_buildable(cfg)
        resolve_device(device)
    out_dir = out_dir or f"runs/{cfg.run_id()}"
    try:
        prepare_out_dir(out_dir)
    except OSError as exc:
        raise CLIError(f"--out: cannot write to {out_dir}: {os_error_text(exc)}") from None

    import torch

    torch.set_num_threads(threads)
    progress = None if quiet else _Progress(epochs)
    try:
        outcome = train_run(cfg, progress=progress)
    finally:
        if progress is not None:
            progress.close()
    r = outcome.result

    def when(kind: str) -> str:
        epoch = r[f"t_{kind}_epoch"]
        return "not reached" if epoch is None else f"epoch {epoch} (step {r[f't_{kind}_step']})"

    # The summary first: if the outputs cannot be written (disk full), the run's outcome is still said.
    click.echo(f"regime: {r['regime']}   t_mem: {when('mem')}   t_grok: {when('grok')}")
    click.echo(f"final: train acc {_fmt(r['final_train_acc'])}  test acc {_fmt(r['final_test_acc'])}  "
               f"peak s̄ {_fmt(r['peak_s_bar'])}  peak σ_H {_fmt(r['peak_sigma_h'])}  "
               f"({r['epochs_run']} epochs, {r['steps']} steps, {r['wall_seconds']:.1f} s on {r['device']})")
    try:
        paths = write_outputs(outcome, out_dir)
    except OSError as exc:
        raise CLIError(f"--out: the run finished but its outputs could not be written to {out_dir}: "
                       f"{os_error_text(exc)}") from None
    click.echo("wrote: " + ", ".join(str(path) for path in paths.values()))


COMMANDS = [run]
