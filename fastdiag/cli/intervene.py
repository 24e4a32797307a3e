"""`fastdiag intervene` (causal interventions at the Phase-2 peak) and `fastdiag headdim` (peak σ_H
against the per-head dimension d/H)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from fastdiag.cli.analyze import format_comparison, format_headdim
from fastdiag.cli.app import CLIError, create_store, loading, option_errors
from fastdiag.cli.options import (PARAM_FLAGS, QUIET_HELP, SEEDS_HELP, THREADS_HELP, dataclass_options, numeric,
                                  run_fields, run_options)
from fastdiag.grokking.config import ARMS, N_BOOT, RunConfig
from fastdiag.grokking.intervention_settings import CLIP_SCOPES, REINIT_INITS, InterventionSettings, parse_heads
from fastdiag.grokking.sweep_spec import parse_seeds
from fastdiag.store import dumps
from fastdiag.store.files import atomic_path
from fastdiag.store import interventions as tables

def _experiment_options(command):
    """What intervene and headdim share beyond the run options: seeds, store, outputs, threads."""
    options = [
        click.option("--threads", type=numeric("threads"), default=None, help=THREADS_HELP),
        click.option("--seeds", default="3", show_default=True, metavar="N|A-B|LIST",
                     help=SEEDS_HELP),
        click.option("--store", "store_path", default=None, type=click.Path(dir_okay=False),
                     help="Result store (SQLite; created if missing)."),
        click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False),
                     help="Directory for the JSON report and the figure."),
        click.option("--quiet", is_flag=True, help=QUIET_HELP),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _check_runnable(cfg: RunConfig, threads: int | None) -> None:
    from fastdiag.grokking.build import check_buildable

    with option_errors():
        check_buildable(cfg, device=True)


def _write_json(path: Path, data: dict) -> None:
    with atomic_path(path) as tmp:      # an unpredictable temporary name, never a planted link
        tmp.write_text(json.dumps(json.loads(dumps(data)), indent=2, ensure_ascii=False) + "\n")


# ============================================================================ intervene


SETTINGS_DEFAULTS = InterventionSettings()
# InterventionSettings field → (flags, help): the options of `fastdiag intervene`, with the field's type
# and default (reinit_seed_offset is not a flag; max_epochs is the run options' --epochs).
INTERVENTION_FIELDS = {
    "heads_to_reinit": (("--heads-to-reinit",), "Heads re-initialised per attention layer (drawn with the run's seed)."),
    "reinit_heads": (("--reinit-heads",), "Explicit heads to re-initialise, as layer-index:head pairs (overrides "
                                          "--heads-to-reinit)."),
    "reinit_init": (("--reinit-init",), "How re-initialised heads are drawn; default: their Q/K/V rows and "
                                        "output-projection columns from a freshly built model (the model's own "
                                        f"initialiser) seeded with seed + {SETTINGS_DEFAULTS.reinit_seed_offset}."),
    "clip": (("--clip",), "Which matrices' Frobenius norms are capped at their median (this seed, at the branch "
                          "point): all 2-D weight matrices, or the attention qkv/proj weights only."),
    "after_peak_epochs": (("--after-peak-epochs",), "Epochs every arm trains after the branch point."),
    "peak_patience_epochs": (("--peak-patience-epochs",), "Epochs without a new σ_H maximum (after grokking) that "
                                                          "confirm the Phase-2 peak; the default is set from the "
                                                          "paper's timing (peak near epoch 1,300 at λ = 1, falling "
                                                          "until ~3,000)."),
    "peak_patience": (("--peak-patience",), "Evaluations without a new σ_H maximum that confirm the peak, instead of "
                                            "--peak-patience-epochs."),
}
# Library parameter names → flags, for intervene's errors: the run options', its settings', and the
# search horizon (the settings' max_epochs is --epochs).
INTERVENE_FLAGS = {**PARAM_FLAGS, **{name: flags[0] for name, (flags, _) in INTERVENTION_FIELDS.items()},
                   "max_epochs": "--epochs", "scope": "--clip"}


def _intervene(heads_to_reinit, reinit_heads, reinit_init, clip, after_peak_epochs, peak_patience,
               peak_patience_epochs, **kw):
    with loading():       # torch (the models, the trainer) and scipy load here, not for --help
        import torch

        from fastdiag.analysis.paired import compare_arms
        from fastdiag.grokking import interventions as iv
        from fastdiag.grokking.build import build_model
        from fastdiag.sweep.plan import plan_threads

    with option_errors():
        seeds = parse_seeds(kw["seeds"])
        cfg0 = RunConfig(**run_fields(kw), seed=seeds[0], stop_at_grok=False)
    if cfg0.arch != "transformer":
        raise CLIError(f"--arch: interventions re-initialise attention heads; need transformer, got {cfg0.arch!r}")
    _check_runnable(cfg0, kw["threads"])
    with option_errors(INTERVENE_FLAGS):
        settings = InterventionSettings(
            heads_to_reinit=heads_to_reinit, reinit_heads=parse_heads(reinit_heads), reinit_init=reinit_init,
            clip=clip, after_peak_epochs=after_peak_epochs, peak_patience=peak_patience,
            peak_patience_epochs=peak_patience_epochs,
            max_epochs=kw["epochs"]).validate()
        with torch.device("meta"):                  # the heads must exist before hours of training
            iv.choose_heads(build_model(cfg0, device=torch.device("meta")), settings.heads_to_reinit, 0,
                            settings.reinit_heads)
    out_dir = Path(kw["out_dir"]) if kw["out_dir"] else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(kw["threads"] or plan_threads([cfg0]))
    experiment = iv.experiment_id(cfg0, settings)
    store = create_store(kw["store_path"]) if kw["store_path"] else None
    say = (lambda msg: None) if kw["quiet"] else (lambda msg: click.echo(msg, err=True))
    seeds_out = []
    try:
        done = tables.stored_seeds(store, experiment, len(ARMS)) if store is not None else set()
        for seed in seeds:
            cfg = RunConfig.from_dict({**cfg0.to_dict(), "seed": seed})
            if seed in done:
                say(f"seed {seed}: already in {kw['store_path']} (experiment {experiment}); skipped")
                continue
            started = time.perf_counter()
            res = iv.run_seed(cfg, settings, progress=say)
            info = res["info"]
            if not res["arms"]:
                say(f"seed {seed}: no branch point — {info['error']}")
            else:
                say(f"seed {seed}: t_grok {info['t_grok_epoch']}, peak σ_H {info['peak_sigma_h']:.4f} at epoch "
                    f"{info['peak_epoch']}{'' if info['peak_confirmed'] else ' (not confirmed: search horizon)'}; "
                    f"{time.perf_counter() - started:.1f} s")
                if store is not None:
                    iv.record_seed(store, experiment, cfg, settings, res)
            seeds_out.append(res)
        if store is not None:
            rows = tables.load_experiments(store).get(experiment, [])
        else:
            rows = [{"seed": r["seed"], "arm": arm, "metrics": a["metrics"], "intervention": a["intervention"],
                     "branch_epoch": r["info"]["branch_epoch"]}
                    for r in seeds_out for arm, a in r["arms"].items()]
        cmp = compare_arms(rows)
        report = {"experiment": experiment, "config": cfg0.to_dict(), "settings": settings.to_dict(),
                  "seeds": seeds, "comparison": cmp,
                  "per_seed": [{"seed": r["seed"], "arm": r["arm"], "branch_epoch": r.get("branch_epoch"),
                                "metrics": r["metrics"], "intervention": r["intervention"]} for r in rows],
                  "searches": [r["info"] for r in seeds_out]}
        click.echo(f"experiment {experiment}: {cmp['n_seeds']} seed(s) with all arms"
                   + (f" in {kw['store_path']}" if store is not None else ""))
        click.echo(f"  per seed: re-init {settings.heads_to_reinit if not settings.reinit_heads else 'listed'} "
                   f"head(s) per layer ({settings.reinit_init} init); clip: Frobenius norm of each "
                   f"{settings.clip} weight matrix capped at the seed's median; {settings.after_peak_epochs} "
                   "epochs after the peak")
        click.echo(format_comparison(cmp))
        if out_dir is not None:
            _write_json(out_dir / "intervention.json", report)
            written = [out_dir / "intervention.json"]
            if store is not None and cmp["n_seeds"]:
                from fastdiag.plots.experiments import intervention_figure   # matplotlib, only when drawing

                traces = {r["arm_id"]: tables.arm_trace(store, r["arm_id"]) for r in rows}
                written += intervention_figure(rows, traces, out_dir / "intervention")
            click.echo("wrote: " + ", ".join(str(p) for p in written))
    finally:
        if store is not None:
            store.close()


@click.command("intervene")
@run_options(skip=("seed", "stop_at_grok", "patience"), defaults={"epochs": SETTINGS_DEFAULTS.max_epochs},
             helps={"epochs": "Search horizon: epochs allowed for grokking and the σ_H peak."})
@_experiment_options
@dataclass_options(InterventionSettings, INTERVENTION_FIELDS,
                   # heads are typed as text, parsed by parse_heads: none typed (None) is the settings' ()
                   defaults={"reinit_heads": None}, metavars={"reinit_heads": "L:H[,L:H...]"},
                   kinds={"reinit_heads": str, "reinit_init": click.Choice(REINIT_INITS),
                          "clip": click.Choice(CLIP_SCOPES)})
def intervene_cmd(**kw):
    """Causal interventions at the Phase-2 peak: per seed, train until the σ_H peak after grokking,
    then continue three arms from that checkpoint (control; k heads re-initialised; weight norms
    clipped to the median) and compare peak σ_H and test accuracy after the branch with paired tests."""
    _intervene(**kw)


# ============================================================================ headdim


def _int_list(spec: str, name: str) -> list[int]:
    items = [s.strip() for s in str(spec).split(",")]
    if not items or not all(s.isdigit() and int(s) > 0 for s in items):
        raise ValueError(f"--{name}: expected a comma list of positive integers, got {spec!r}")
    return sorted(set(int(s) for s in items))


def headdim_configs(base: dict, widths: list[int], heads: list[int], weight_decay: float, seeds: list[int],
                    ff_mult: int = 4) -> tuple[list[RunConfig], list[str]]:
    """Every (d_model, n_heads, seed) with H dividing d; d_ff = ff_mult·d. Returns (configs, skipped)."""
    from fastdiag.grokking.build import check_buildable

    configs, skipped = {}, []
    for d in widths:
        for h in heads:
            if d % h:
                skipped.append(f"d={d}, H={h} (H does not divide d)")
                continue
            for seed in seeds:
                cfg = RunConfig.from_dict({**base, "preset": "custom", "d_model": d, "n_heads": h, "d_ff": ff_mult * d,
                                           "weight_decay": weight_decay, "seed": seed})
                check_buildable(cfg)
                configs.setdefault(cfg.run_id(), cfg)
    if not configs:
        raise ValueError("headdim: empty grid (no head count divides any width)")
    return [configs[k] for k in sorted(configs)], skipped


# headdim trains each run this many epochs past grokking: the paper's Phase-2 σ_H peak lies ~1,200 epochs
# after its t_grok (≈ 1,300 vs ≈ 130 at λ = 1, Fig. 2); 500 stopped runs near epoch 650, before it.
HEADDIM_PATIENCE_EPOCHS = 2000


@click.command("headdim")
@run_options(skip=("arch", "preset", "seed", "n_heads", "d_model", "d_ff", "stop_at_grok"),   # a custom transformer
             # the horizon of intervene's search: grokking and the Phase-2 peak fit in it
             defaults={"epochs": SETTINGS_DEFAULTS.max_epochs, "patience": HEADDIM_PATIENCE_EPOCHS},
             helps={"weight_decay": "AdamW weight decay λ (fixed).",
                    "patience": "Epochs trained after grokking: long enough to pass the Phase-2 σ_H peak "
                                "(near epoch 1,300 at λ = 1 in the paper, t_grok ≈ 130)."})
@_experiment_options
@click.option("--d-model", "widths", default="16,32,64", show_default=True,
              help="Comma list of model widths d (the default with --heads 2,4,8 spans the paper's d/H 2–32).")
@click.option("--heads", "heads", default="2,4,8", show_default=True, help="Comma list of head counts H.")
@click.option("--ff-mult", type=numeric("ff_mult"), default=4, show_default=True, help="Feed-forward width d_ff = FF_MULT × d.")
@click.option("--workers", type=numeric("workers"), default=None, help="Local worker processes (default: what the cores hold).")
@click.option("--n-boot", type=numeric("n_boot"), default=N_BOOT, show_default=True, help="Bootstrap resamples of the fit.")
def headdim_cmd(widths, heads, ff_mult, workers, n_boot, **kw):
    """Per-head dimension: train every (d, H, seed) at fixed λ (transformer, custom preset) into a store
    (finished runs are skipped), then fit peak σ_H after grokking against d/H with the saturating curve
    σ_max = c + a(1 − exp(−b·d/H)) and draw it."""
    with loading():       # scipy and torch: not for --help
        from fastdiag.analysis.headdim import headdim_analysis
        from fastdiag.grokking.build import heads_width
        from fastdiag.sweep.run import run_sweep

    if kw["store_path"] is None:
        raise CLIError("--store: required (the runs go into a result store)")
    if kw["patience"] < 0:
        raise CLIError(f"--patience: must be >= 0, got {kw['patience']}")
    base = {**run_fields(kw), "arch": "transformer", "stop_at_grok": True}
    head_counts = _int_list(heads, "heads")
    if min(head_counts) < 2:
        raise CLIError(f"--heads: σ_H is a spread across heads, so every H must be >= 2, got {heads}")
    with option_errors():
        configs, skipped = headdim_configs(base, _int_list(widths, "d-model"), head_counts,
                                           kw["weight_decay"], parse_seeds(kw["seeds"]), ff_mult)
    _check_runnable(configs[0], kw["threads"])
    for s in skipped:
        click.echo(f"headdim: skipped {s}", err=True)
    with create_store(kw["store_path"]) as store:
        summary = run_sweep(configs, store, workers=workers, threads=None if workers else kw["threads"],
                            progress=not kw["quiet"])
        ids = {c.run_id() for c in configs}
        runs = [r for r in store.runs("done") if r["run_id"] in ids]
        traces = {r["run_id"]: store.trace(r["run_id"]) for r in runs}
    click.echo(f"headdim: {summary.total} runs in {kw['store_path']}: {summary.skipped} already done, "
               f"{summary.done} finished now, {summary.failed} failed", err=True)
    a = headdim_analysis(runs, traces, heads_width, n_boot=n_boot)
    click.echo(format_headdim(a))
    if kw["out_dir"]:
        out = Path(kw["out_dir"])
        out.mkdir(parents=True, exist_ok=True)
        _write_json(out / "headdim.json", {"weight_decay": kw["weight_decay"], "base": base, **a.to_dict()})
        from fastdiag.plots.experiments import headdim_figure   # matplotlib, only when drawing

        paths = [out / "headdim.json"] + headdim_figure(a, out / "headdim", title_note=f"λ = {kw['weight_decay']:g}")
        click.echo("wrote: " + ", ".join(str(p) for p in paths))
    if summary.failed:
        sys.exit(1)


COMMANDS = [intervene_cmd, headdim_cmd]
