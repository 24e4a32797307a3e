"""The run options of every command that trains, generated from ``RunConfig``'s fields, so that a
field has one flag spelling (older spellings kept as aliases), one type and one default everywhere;
and the map from library parameter names to the flags the user typed, for error messages."""
from __future__ import annotations

import dataclasses
import os

import click

from fastdiag.grokking.config import ARCHS, CHECKPOINT_EVERY_S, OPS, RunConfig

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
    "graphed": (("--graphed/--no-graphed",), "On CUDA, replay each training step as one CUDA graph (capturable "
                                            "AdamW; traces equal the eager loop's within float32 rounding). "
                                            "No effect on a CPU."),
}
_FIELDS = [f.name for f in dataclasses.fields(RunConfig)]
if set(RUN_FIELDS) != set(_FIELDS):      # a new RunConfig field needs its flag here
    raise RuntimeError(f"RUN_FIELDS and RunConfig fields differ: {sorted(set(RUN_FIELDS) ^ set(_FIELDS))}")


def _option(flags: tuple, name: str, default, help_text: str, kind=None, metavar: str | None = None):
    """One click option for a settings field: a bool is an on/off flag; ``kind`` (a click type) wins;
    a None default takes an int; otherwise the default's own type."""
    if isinstance(default, bool):
        return click.option(*flags, name, default=default, show_default=True, help=help_text)
    if kind is None:
        kind = int if default is None else type(default)
    return click.option(*flags, name, type=kind, default=default, show_default=default is not None,
                        metavar=metavar, help=help_text)


def dataclass_options(settings_class, fields: dict, skip=(), defaults: dict | None = None,
                      helps: dict | None = None, kinds: dict | None = None, metavars: dict | None = None):
    """Decorate a command with one option per field of the dataclass ``settings_class`` named in
    ``fields`` (field → (flags: the spelling first, then aliases; help)), except ``skip``, in the
    dataclass's field order, each passed to the command under the field's name with the field's default.
    ``defaults``, ``helps``, ``kinds`` (click types) and ``metavars`` override a field's."""
    defaults, helps, kinds, metavars = defaults or {}, helps or {}, kinds or {}, metavars or {}
    names = [f.name for f in dataclasses.fields(settings_class) if f.name in fields and f.name not in skip]
    instance = settings_class()

    def decorate(command):
        for name in reversed(names):
            flags, help_text = fields[name]
            command = _option(flags, name, defaults.get(name, getattr(instance, name)), helps.get(name, help_text),
                              kinds.get(name), metavars.get(name))(command)
        return command
    return decorate


def run_options(skip=(), defaults: dict | None = None, helps: dict | None = None):
    """Decorate a command with one option per RunConfig field (except ``skip``), passed to it under the
    field's name; ``defaults`` and ``helps`` override a field's default and help text."""
    return dataclass_options(RunConfig, RUN_FIELDS, skip=skip, defaults=defaults, helps=helps,
                             kinds={"op": click.Choice(OPS)})


def run_fields(kw: dict) -> dict:
    """The RunConfig fields among a command's keyword arguments."""
    return {name: kw[name] for name in _FIELDS if name in kw}


THREADS_DEFAULT = ("[default: 1 for models below 0.5 M parameters (× ensemble members), where a second thread "
                   "does not pay; else the cores, shared among the workers]")
THREADS_HELP = "CPU threads for torch " + THREADS_DEFAULT + "."
QUIET_HELP = "No progress output (the bar on a terminal, the status lines in a log)."
SEEDS_HELP = ("Seeds: a count N means seeds 0..N-1 ('9' is seeds 0-8), a range A-B is inclusive ('0-8'), "
              "a comma list names seeds ('0,3,5'; one seed k alone: 'k,'); ranges and seeds mix ('0-3,7').")
# --checkpoint-every (run, sweep), parsed by fastdiag.grokking.config.parse_cadence
CADENCE_HELP = ("When a run saves its checkpoint (right after an evaluation): every N epochs ('500'), every "
                "so many minutes or seconds of training ('5m', '90s'), or 'off'. A rerun resumes from it; it "
                "is removed once the run's outcome is written.")
DEFAULT_CADENCE = f"{CHECKPOINT_EVERY_S / 60:g}m"

# Library parameter names (the prefix of a ValueError's message) → the flags the user typed.
PARAM_FLAGS = {
    **{name: flags[0].split("/")[0] for name, (flags, _) in RUN_FIELDS.items()},
    "archs": "--arch", "presets": "--preset", "weight_decays": "--wd", "seeds": "--seeds",
    "weight_decays, seeds": "--wd, --seeds", "eval_every and diag_every": "--eval-every and --diag-every",
    "shard": "--shard", "workers": "--workers", "threads": "--threads", "backend": "--backend",
    "max_retries": "--max-retries", "ensemble": "--ensemble",
}   # `fastdiag intervene` adds its settings' flags (cli/intervene.py)


# ---------------------------------------------------------------------------- numeric option ranges
# Every numeric option of every command that is not a settings field (RunConfig and InterventionSettings
# check their own fields, named, in `validate`) takes its type from this one table, so that a value out
# of range -- nan, -1, 1e308, 1e20 -- is refused in one line while the command line is read, before any
# store is opened or any work starts, whether or not there is work to do. tests/test_hostile_round4.py
# checks that no numeric option of any command is left out.
class Ranged(click.ParamType):
    """An int or a finite float in [low, high] (``open_low`` / ``open_high``: the end itself excluded)."""

    def __init__(self, kind: type, low: float, high: float, open_low: bool = False, open_high: bool = False,
                 why: str = "") -> None:
        self.kind, self.low, self.high, self.open_low, self.open_high = kind, low, high, open_low, open_high
        self.name = kind.__name__
        self.why = why

    def describe(self) -> str:
        number = "an integer" if self.kind is int else "a finite number"
        low, high = (f"{int(v):,}" if float(v).is_integer() and abs(v) < 1e12 else f"{v:g}" for v in (self.low, self.high))
        return (f"{number} in {'(' if self.open_low else '['}{low}, {high}{')' if self.open_high else ']'}"
                + (f" ({self.why})" if self.why else ""))

    def convert(self, value, param, ctx):
        try:
            number = self.kind(value)
        except (TypeError, ValueError, OverflowError):
            self.fail(f"expected {self.describe()}, got {value!r}", param, ctx)
        low_ok = number > self.low if self.open_low else number >= self.low
        high_ok = number < self.high if self.open_high else number <= self.high
        if not (low_ok and high_ok):          # NaN fails both
            self.fail(f"expected {self.describe()}, got {value!r}", param, ctx)
        return number


_CORES = os.cpu_count() or 1
_SEED_MAX = 2**32 - 1                     # numpy's SeedSequence takes more, but no user needs more
# option parameter name → its type, the same for every command that has the option
OPTION_RANGES = {
    # more threads only queue behind each other, and OpenMP fails on absurd counts (100,000:
    # std::bad_alloc; 1,000,000: an abort)
    "threads": Ranged(int, 1, 4 * _CORES, why="4 per CPU here"),
    "workers": Ranged(int, 1, 4 * _CORES, why="4 per CPU here"),
    "max_retries": Ranged(int, 0, 100),
    "n_boot": Ranged(int, 1, 10**6),
    "n_band": Ranged(int, 1, 10**6),
    "seed": Ranged(int, 0, _SEED_MAX),             # the bootstrap's (analyze, plot); run seeds are RunConfig's
    "split_seed": Ranged(int, 0, _SEED_MAX),
    "retention_threshold": Ranged(float, 0.0, 1.0),
    "fit_max_lambda": Ranged(float, 0.0, 1e6, open_low=True),
    "t0": Ranged(float, 0.0, 1e9, open_low=True),
    "test_frac": Ranged(float, 0.0, 1.0, open_low=True, open_high=True),
    "ff_mult": Ranged(int, 1, 64),
    "calibrate_steps": Ranged(int, 0, 10**6),
}


def numeric(name: str) -> Ranged:
    """The type of the numeric option ``name`` (its parameter name): its range from OPTION_RANGES."""
    return OPTION_RANGES[name]
