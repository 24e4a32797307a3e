"""`fastdiag intervene` (causal interventions at the Phase-2 peak) and `fastdiag headdim` (peak σ_H
against the per-head dimension d/H)."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import click

from fastdiag.grokking.config import ARCHS, OPS, RunConfig

_D = RunConfig()


def _run_options(func, *, epochs_default: int, epochs_help: str, eval_every_default: int = 1):
    """The model/task/optimiser options of `fastdiag run` (no --seed: these commands take --seeds)."""
    options = [
        click.option("--arch", default="transformer", show_default=True, help=f"one of {', '.join(ARCHS)}"),
        click.option("--preset", default="canonical", show_default=True,
                     help="transformer size: canonical (4x8x128), 19m, 85m or custom"),
        click.option("--layers", "n_layers", type=int, default=None, help="number of layers (overrides the preset)"),
        click.option("--op", default="+", show_default=True, help=f"operation mod p: {' '.join(OPS)}"),
        click.option("--p", "p", type=int, default=97, show_default=True, help="modulus (prime for /)"),
        click.option("--lr", type=float, default=1e-3, show_default=True, help="learning rate"),
        click.option("--batch", "batch_size", type=int, default=512, show_default=True, help="minibatch size"),
        click.option("--epochs", type=int, default=epochs_default, show_default=True, help=epochs_help),
        click.option("--train-frac", type=float, default=0.5, show_default=True,
                     help="fraction of pairs for training"),
        click.option("--eval-every", type=int, default=eval_every_default, show_default=True,
                     help="evaluate every N epochs"),
        click.option("--diag-every", type=int, default=10, show_default=True, help="head diagnostics every N steps"),
        click.option("--grok-threshold", type=float, default=0.99, show_default=True,
                     help="accuracy defining t_mem/t_grok"),
        click.option("--device", default="auto", show_default=True, help="auto (CUDA when available), cpu, cuda, cuda:N"),
        click.option("--threads", type=int, default=2, show_default=True, help="CPU threads for torch"),
        click.option("--seeds", default="3", show_default=True, metavar="N|LIST",
                     help="a count N (seeds 0..N-1) or a comma list of seeds"),
        click.option("--store", "store_path", default=None, type=click.Path(dir_okay=False),
                     help="result store (SQLite; created if missing)"),
        click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False),
                     help="directory for the JSON report and the figure"),
        click.option("--quiet", is_flag=True, help="no progress lines"),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _base_config(**kw) -> dict:
    return {k: kw[k] for k in ("arch", "preset", "n_layers", "op", "p", "lr", "batch_size", "epochs", "train_frac",
                               "eval_every", "diag_every", "grok_threshold", "device")}


def _check_runnable(cfg: RunConfig, threads: int) -> None:
    from fastdiag.cli.app import CLIError
    from fastdiag.models import resolve_run_config
    from fastdiag.grokking.tasks import all_pairs
    from fastdiag.grokking.train import resolve_device

    cfg.validate()
    if threads < 1:
        raise CLIError(f"--threads: must be >= 1, got {threads}")
    all_pairs(cfg.op, cfg.p)
    try:
        resolve_run_config(cfg, cfg.p + 1, 3)
    except TypeError as exc:
        raise ValueError(str(exc)) from None
    resolve_device(cfg.device)


def _write_json(path: Path, data: dict) -> None:
    from fastdiag.store import dumps

    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(json.loads(dumps(data)), indent=2, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


# ============================================================================ intervene


def _intervene(heads, d_model, d_ff, weight_decay, heads_to_reinit, reinit_heads, reinit_init, clip,
               after_peak_epochs, peak_patience, **kw):
    import torch

    from fastdiag.grokking import interventions as iv
    from fastdiag.store import Store
    from fastdiag.sweep import parse_seeds

    seeds = parse_seeds(kw["seeds"])
    base = _base_config(**kw)
    cfg0 = RunConfig(**base, n_heads=heads, d_model=d_model, d_ff=d_ff, weight_decay=weight_decay, seed=seeds[0],
                     stop_at_grok=False)
    if cfg0.arch != "transformer":
        raise ValueError(f"--arch: interventions re-initialise attention heads; need transformer, got {cfg0.arch!r}")
    _check_runnable(cfg0, kw["threads"])
    settings = iv.InterventionSettings(
        heads_to_reinit=heads_to_reinit, reinit_heads=iv.parse_heads(reinit_heads), reinit_init=reinit_init,
        clip=clip, after_peak_epochs=after_peak_epochs, peak_patience=peak_patience,
        max_epochs=kw["epochs"]).validate()
    from fastdiag.models import build_from_run_config

    with torch.device("meta"):                  # the heads must exist before hours of training
        iv.choose_heads(build_from_run_config(cfg0, cfg0.p + 1, 3, device=torch.device("meta")),
                        settings.heads_to_reinit, 0, settings.reinit_heads)
    out_dir = Path(kw["out_dir"]) if kw["out_dir"] else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(kw["threads"])
    experiment = iv.experiment_id(cfg0, settings)
    store = Store(kw["store_path"], create=True) if kw["store_path"] else None
    say = (lambda msg: None) if kw["quiet"] else (lambda msg: click.echo(msg, err=True))
    seeds_out = []
    try:
        done = iv.stored_seeds(store, experiment) if store is not None else set()
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
            rows = iv.load_experiments(store).get(experiment, [])
        else:
            rows = [{"seed": r["seed"], "arm": arm, "metrics": a["metrics"], "intervention": a["intervention"],
                     "branch_epoch": r["info"]["branch_epoch"]}
                    for r in seeds_out for arm, a in r["arms"].items()]
        cmp = iv.compare_arms(rows)
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
        click.echo(iv.format_comparison(cmp))
        if out_dir is not None:
            _write_json(out_dir / "intervention.json", report)
            written = [out_dir / "intervention.json"]
            if store is not None and cmp["n_seeds"]:
                import matplotlib
                matplotlib.use("Agg", force=True)
                from fastdiag.plots.sweep import intervention_figure

                traces = {r["arm_id"]: iv.arm_trace(store, r["arm_id"]) for r in rows}
                written += intervention_figure(rows, traces, out_dir / "intervention")
            click.echo("wrote: " + ", ".join(str(p) for p in written))
    finally:
        if store is not None:
            store.close()


@click.command("intervene")
@click.option("--heads", "heads", type=int, default=None, help="attention heads (transformer)")
@click.option("--d-model", "d_model", type=int, default=None, help="model width")
@click.option("--d-ff", "d_ff", type=int, default=None, help="feed-forward width")
@click.option("--wd", "weight_decay", type=float, default=1.0, show_default=True, help="AdamW weight decay λ")
@click.option("--heads-to-reinit", type=int, default=2, show_default=True,
              help="heads re-initialised per attention layer (drawn with the run's seed)")
@click.option("--reinit-heads", default=None, metavar="L:H[,L:H...]",
              help="explicit heads to re-initialise, as layer-index:head pairs (overrides --heads-to-reinit)")
@click.option("--reinit-init", type=click.Choice(["default"]), default="default", show_default=True,
              help="default: the heads' Q/K/V rows and output-projection columns from a freshly built model "
                   "(the model's own initialiser) seeded with seed + 10000")
@click.option("--clip", type=click.Choice(["all-2d", "attention"]), default="all-2d", show_default=True,
              help="which matrices' Frobenius norms are capped at their median (this seed, at the branch point): "
                   "all 2-D weight matrices, or the attention qkv/proj weights only")
@click.option("--after-peak-epochs", type=int, default=500, show_default=True,
              help="epochs every arm trains after the branch point")
@click.option("--peak-patience", type=int, default=10, show_default=True,
              help="evaluations without a new σ_H maximum (after grokking) that confirm the peak")
def intervene_cmd(**kw):
    """Causal interventions at the Phase-2 peak: per seed, train until the σ_H peak after grokking,
    then continue three arms from that checkpoint (control; k heads re-initialised; weight norms
    clipped to the median) and compare peak σ_H and test accuracy after the branch with paired tests."""
    _intervene(**kw)


intervene_cmd = _run_options(intervene_cmd, epochs_default=5000,
                             epochs_help="search horizon: epochs allowed for grokking and the σ_H peak")


# ============================================================================ headdim


def _int_list(spec: str, name: str) -> list[int]:
    items = [s.strip() for s in str(spec).split(",")]
    if not items or not all(s.isdigit() and int(s) > 0 for s in items):
        raise ValueError(f"--{name}: expected a comma list of positive integers, got {spec!r}")
    return sorted(set(int(s) for s in items))


def headdim_configs(base: dict, widths: list[int], heads: list[int], weight_decay: float, seeds: list[int],
                    ff_mult: int = 4) -> tuple[list[RunConfig], list[str]]:
    """Every (d_model, n_heads, seed) with H dividing d; d_ff = ff_mult·d. Returns (configs, skipped)."""
    from fastdiag.sweep import check_buildable

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


def format_headdim(a: dict) -> str:
    lines = [f"peak σ_H after grokking against d/H: {a['n_points']} grokked run(s)"
             + (f", {a['n_skipped']} left out (did not grok or no σ_H after t_grok)" if a["n_skipped"] else "")
             + (f", {a['n_single_head']} single-head run(s) left out (σ_H of one head is 0)"
                if a.get("n_single_head") else "")]
    lines.append(f"  {'d/H':>6} {'runs':>5} {'mean':>8} {'median':>8} {'std':>8}  (d, H)")
    for b in a["bins"]:
        lines.append(f"  {b['d_per_head']:>6g} {b['n']:>5} {b['mean']:>8.4f} {b['median']:>8.4f} "
                     f"{'-' if b['std'] is None else format(b['std'], '.4f'):>8}  "
                     + " ".join(f"({d},{h})" for d, h in b["configs"]))
    fit = a["fit"]
    if "error" in fit:
        lines.append(f"  saturating fit: no fit — {fit['error']}")
    else:
        ci = fit["ci"]
        lines.append(f"  saturating fit σ_max = c + a(1 − exp(−b·d/H)): c = {fit['c']:.4g} [{ci['c'][0]:.4g}, "
                     f"{ci['c'][1]:.4g}], a = {fit['a']:.4g} [{ci['a'][0]:.4g}, {ci['a'][1]:.4g}], "
                     f"b = {fit['b']:.4g} [{ci['b'][0]:.4g}, {ci['b'][1]:.4g}]; plateau c + a = "
                     f"{fit['plateau']:.4g} [{ci['plateau'][0]:.4g}, {ci['plateau'][1]:.4g}] "
                     f"(95% bootstrap CIs, {fit['n_boot_ok']}/{fit['n_boot']} resamples)")
    return "\n".join(lines)


@click.command("headdim")
@click.option("--d-model", "widths", default="32,64,128", show_default=True, help="comma list of model widths d")
@click.option("--heads", "heads", default="2,4,8", show_default=True, help="comma list of head counts H")
@click.option("--ff-mult", type=int, default=4, show_default=True, help="d_ff = FF_MULT × d")
@click.option("--wd", "weight_decay", type=float, default=1.0, show_default=True, help="AdamW weight decay λ (fixed)")
@click.option("--patience", type=int, default=500, show_default=True,
              help="epochs trained after grokking (Phase 2, where σ_H peaks)")
@click.option("--workers", type=int, default=None, help="local worker processes (default: what the cores hold)")
@click.option("--n-boot", type=int, default=1500, show_default=True, help="bootstrap resamples of the fit")
def headdim_cmd(widths, heads, ff_mult, weight_decay, patience, workers, n_boot, **kw):
    """Per-head dimension: train every (d, H, seed) at fixed λ (transformer, custom preset) into a store
    (finished runs are skipped), then fit peak σ_H after grokking against d/H with the saturating curve
    σ_max = c + a(1 − exp(−b·d/H)) and draw it."""
    from fastdiag.cli.app import CLIError
    from fastdiag.analysis.experiments import headdim_analysis
    from fastdiag.store import Store
    from fastdiag.sweep import parse_seeds, run_sweep

    if kw["store_path"] is None:
        raise CLIError("--store: required (the runs go into a result store)")
    if n_boot < 1:
        raise CLIError(f"--n-boot: must be >= 1, got {n_boot}")
    if patience < 0:
        raise CLIError(f"--patience: must be >= 0, got {patience}")
    if ff_mult < 1:
        raise CLIError(f"--ff-mult: must be >= 1, got {ff_mult}")
    base = {**_base_config(**kw), "arch": "transformer", "stop_at_grok": True, "patience": patience}
    if kw["arch"] != "transformer":
        raise CLIError(f"--arch: headdim varies attention heads; need transformer, got {kw['arch']!r}")
    head_counts = _int_list(heads, "heads")
    if min(head_counts) < 2:
        raise CLIError(f"--heads: σ_H is a spread across heads, so every H must be >= 2, got {heads}")
    configs, skipped = headdim_configs(base, _int_list(widths, "d-model"), head_counts,
                                       weight_decay, parse_seeds(kw["seeds"]), ff_mult)
    _check_runnable(configs[0], kw["threads"])
    for s in skipped:
        click.echo(f"headdim: skipped {s}", err=True)
    with Store(kw["store_path"], create=True) as store:
        summary = run_sweep(configs, store, workers=workers, threads=None if workers else kw["threads"],
                            progress=not kw["quiet"])
        ids = {c.run_id() for c in configs}
        runs = [r for r in store.runs("done") if r["run_id"] in ids]
        traces = {r["run_id"]: store.trace(r["run_id"]) for r in runs}
    click.echo(f"headdim: {summary.total} runs in {kw['store_path']}: {summary.skipped} already done, "
               f"{summary.done} finished now, {summary.failed} failed", err=True)
    a = headdim_analysis(runs, traces, n_boot=n_boot)
    click.echo(format_headdim(a))
    if kw["out_dir"]:
        out = Path(kw["out_dir"])
        out.mkdir(parents=True, exist_ok=True)
        _write_json(out / "headdim.json", {"weight_decay": weight_decay, "base": base, **a})
        import matplotlib
        matplotlib.use("Agg", force=True)
        from fastdiag.plots.sweep import headdim_figure

        paths = [out / "headdim.json"] + headdim_figure(a, out / "headdim", title_note=f"λ = {weight_decay:g}")
        click.echo("wrote: " + ", ".join(str(p) for p in paths))
    if summary.failed:
        sys.exit(1)


headdim_cmd = _run_options(headdim_cmd, epochs_default=3000, epochs_help="horizon in epochs")

COMMANDS = [intervene_cmd, headdim_cmd]
