"""The run options of every command that trains, generated from ``RunConfig``'s fields, so that a
field has one flag spelling (older spellings kept as aliases), one type and one default everywhere;
and the map from library parameter names to the flags the user typed, for error messages."""
from __future__ import annotations

import dataclasses

import click

from fastdiag.grokking.config import ARCHS, OPS, RunConfig

# RunConfig field → (flags: the spelling first, then aliases; help).
RUN_FIELDS = {
    "arch": (("--arch",), f"Architecture: {', '.join(ARCHS)}."),
    "preset": (("--preset",), "Transformer size: canonical (4x8x128), 19m, 85m or custom."),
    "n_layers": (("--layers",), "Number of layers (overrides the preset)."),
    "n_heads": (("--heads",), "Attention heads (transformer)."),
    "d_model": (("--d-model",), "Model width (MLP/LSTM: hidden width)."),
    "d_ff": (("--d-ff",), "Feed-forward width (transformer)."),
    "op": (("--op",), "The operation of c = a ∘ b mod p."),
    "p": (("--p",), "Modulus p (prime for /)."),
    "weight_decay": (("--wd",), "AdamW weight decay λ."),
    "lr": (("--lr",), "AdamW learning rate."),
    "batch_size": (("--batch-size", "--batch"), "Minibatch size."),
    "epochs": (("--epochs",), "Horizon in epochs."),
    "seed": (("--seed",), "Seed of the initialisation, the train/test split and the batch order."),
    "train_frac": (("--train-frac",), "Fraction of the pairs used for training."),
    "eval_every": (("--eval-every",), "Evaluate every N epochs."),
    "diag_every": (("--diag-every",), "Head diagnostics every N optimizer steps."),
    "grok_threshold": (("--grok-threshold",), "Accuracy defining t_mem and t_grok."),
    "stop_at_grok": (("--stop-at-grok/--no-stop-at-grok",), "Stop once grokked (after --patience epochs)."),
    "patience": (("--patience",), "Epochs to keep training after grokking."),
    "device": (("--device",), "Where to train: auto (CUDA when available), cpu, cuda, cuda:N."),
}
_FIELDS = [f.name for f in dataclasses.fields(RunConfig)]
if set(RUN_FIELDS) != set(_FIELDS):      # a new RunConfig field needs its flag here
    raise RuntimeError(f"RUN_FIELDS and RunConfig fields differ: {sorted(set(RUN_FIELDS) ^ set(_FIELDS))}")
_DEFAULTS = RunConfig()


def _option(name: str, default, help_text: str):
    flags, _ = RUN_FIELDS[name]
    if isinstance(default, bool):
        return click.option(*flags, name, default=default, show_default=True, help=help_text)
    if name == "op":
        kind = click.Choice(OPS)
    elif default is None:
        kind = int
    else:
        kind = type(default)
    return click.option(*flags, name, type=kind, default=default, show_default=default is not None, help=help_text)


def run_options(skip=(), defaults: dict | None = None, helps: dict | None = None):
    """Decorate a command with one option per RunConfig field (except ``skip``), passed to it under the
    field's name; ``defaults`` and ``helps`` override a field's default and help text."""
    defaults, helps = defaults or {}, helps or {}

    def decorate(command):
        for name in reversed(_FIELDS):
            if name not in skip:
                command = _option(name, defaults.get(name, getattr(_DEFAULTS, name)),
                                  helps.get(name, RUN_FIELDS[name][1]))(command)
        return command
    return decorate


def run_fields(kw: dict) -> dict:
    """The RunConfig fields among a command's keyword arguments."""
    return {name: kw[name] for name in _FIELDS if name in kw}


THREADS_DEFAULT = ("[default: 1 for models below 0.5 M parameters (× ensemble members), where a second thread "
                   "does not pay; else the cores, shared among the workers]")
THREADS_HELP = "CPU threads for torch " + THREADS_DEFAULT + "."
QUIET_HELP = "No progress output (the bar on a terminal, the status lines in a log)."

# Library parameter names (the prefix of a ValueError's message) → the flags the user typed.
PARAM_FLAGS = {
    **{name: flags[0].split("/")[0] for name, (flags, _) in RUN_FIELDS.items()},
    "archs": "--arch", "presets": "--preset", "weight_decays": "--wd", "seeds": "--seeds",
    "weight_decays, seeds": "--wd, --seeds", "eval_every and diag_every": "--eval-every and --diag-every",
    "shard": "--shard", "workers": "--workers", "threads": "--threads", "backend": "--backend",
    "max_retries": "--max-retries", "ensemble": "--ensemble", "max_epochs": "--epochs",
    "heads_to_reinit": "--heads-to-reinit", "reinit_heads": "--reinit-heads", "reinit_init": "--reinit-init",
    "clip": "--clip", "scope": "--clip", "after_peak_epochs": "--after-peak-epochs", "peak_patience": "--peak-patience",
    "peak_patience_epochs": "--peak-patience-epochs",
}
