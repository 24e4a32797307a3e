"""Causal interventions at the Phase-2 peak (docs/experiments.md).

For each seed: train (``fastdiag.grokking.train.Trainer``, stop_at_grok off) until the Phase-2 peak, the
evaluation of maximal σ_H after grokking, found online: after t_grok, σ_H is tracked per evaluation
and a checkpoint (``Trainer.branch()``) is kept at its running maximum; the peak is confirmed when
σ_H has not exceeded that maximum for ``peak_patience_epochs`` epochs (``peak_patience`` evaluations
instead, where given), or the search horizon is reached: then the running maximum is used and the
seed is marked ``peak_confirmed = false``. The default, 500 epochs, is set from the paper's timing
(its Fig. 2, median of 50 runs at λ = 1): σ_H dips to ≈ 0.02 just after grokking (~130 epochs), rises
to its Phase-2 peak ≈ 0.095 near epoch 1,300 and falls over ~1,300–3,000; 500 epochs is longer than
any stall of that rise and shorter than the fall, so the peak is confirmed near epoch 1,800 and the
branch lands at it, in the differentiation phase — not just after grokking, where a rule counted in
evaluations (10 at eval_every 1) confirmed a transient maximum. From the
checkpoint three arms continue for ``after_peak_epochs`` epochs, stop_at_grok off:

* ``control``  — unchanged (bit for bit the run an un-branched trainer would have made, on CPU).
* ``reinit``   — k attention heads re-initialised (``reinit_heads``): per chosen (layer, head), the
  head's query, key and value rows of the layer's ``qkv`` weight and bias and the head's columns of the
  output projection ``proj.weight`` are replaced by those of a freshly built model of the same
  config seeded with ``reinit_seed`` (the model's own initialiser: PyTorch defaults). ``proj.bias``
  (shared by all heads) is left alone. By default k heads per attention layer, drawn without
  replacement by a generator seeded with the run's seed.
* ``clip``     — weight norms clipped once, at the branch point (``clip_weight_norms``): the
  Frobenius norm of each 2-D weight matrix (scope ``all-2d``: embeddings, qkv, attention and MLP
  projections, unembedding; scope ``attention``: only the attention ``qkv`` and ``proj`` weights) is
  capped at the median of those norms in that seed's model at the branch point (a matrix above the
  median is scaled down to it; the others are untouched).

AdamW's moment estimates are left as they are in every arm. Per arm, from the evaluations after the
branch epoch: ``peak_sigma_h_after`` (max σ_H), ``mean_sigma_h_after``, ``final_test_acc``,
``min_test_acc_after`` and ``regrok_epochs`` (epochs from the branch until test accuracy is back at
the grokking threshold, 0 if it never fell below, None if it never came back). Arms are compared with
the control by paired tests across seeds (``fastdiag.analysis.paired.compare_arms``); the t-test
p-values of all (arm, metric) comparisons form one Holm–Bonferroni family, the Wilcoxon p-values another.

Arms are stored in the result store in two extra tables (``fastdiag.store.interventions``), so the
sweep ``runs`` table and everything that reads it are unchanged.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from typing import Callable, Sequence

import numpy as np
import torch

from fastdiag.grokking.build import build_model
from fastdiag.grokking.config import ARMS, RunConfig, fmt_or_dash
from fastdiag.grokking.intervention_settings import CLIP_SCOPES, PEAK_PATIENCE_EPOCHS, InterventionSettings
from fastdiag.grokking.train import Trainer
from fastdiag.models import attention_modules
from fastdiag.store import interventions as tables

# ============================================================================ the interventions


def _attention_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    layers = list(attention_modules(model).items())
    for name, m in layers:
        if not all(hasattr(m, a) for a in ("qkv", "proj", "n_heads")):
            raise ValueError(f"intervene: attention layer {name} has no qkv/proj projections; head "
                             "re-initialisation needs fastdiag's transformer")
    if not layers:
        raise ValueError("intervene: the model has no attention layers (head re-initialisation needs a transformer)")
    return layers


def choose_heads(model: torch.nn.Module, k: int, seed: int, explicit: Sequence = ()) -> list[dict]:
    """The heads to re-initialise: ``explicit`` (layer index, head) pairs, else ``k`` heads per attention
    layer drawn without replacement (numpy generator seeded with ``seed``), sorted."""
    layers = _attention_layers(model)
    chosen = []
    if explicit:
        for li, h in explicit:
            if not 0 <= li < len(layers):
                raise ValueError(f"reinit_heads: layer {li} out of range (the model has {len(layers)} attention layers)")
            if not 0 <= h < layers[li][1].n_heads:
                raise ValueError(f"reinit_heads: head {h} out of range (layer {li} has {layers[li][1].n_heads} heads)")
            chosen.append((li, h))
    else:
        rng = np.random.default_rng(seed)
        for li, (_, m) in enumerate(layers):
            if k > m.n_heads:
                raise ValueError(f"heads_to_reinit: {k} heads per layer, but the layers have {m.n_heads}")
            chosen += [(li, int(h)) for h in rng.choice(m.n_heads, size=k, replace=False)]
    return [{"layer": layers[li][0], "layer_index": li, "head": h} for li, h in sorted(chosen)]


def _head_slices(m: torch.nn.Module, head: int):
    C = m.proj.weight.shape[0]
    dh = C // m.n_heads
    rows = [slice(part * C + head * dh, part * C + (head + 1) * dh) for part in range(3)]   # q, k, v
    cols = slice(head * dh, (head + 1) * dh)
    return rows, cols


@torch.no_grad()
def reinit_heads(model: torch.nn.Module, fresh: torch.nn.Module, heads: Sequence[dict]) -> dict:
    """Copy the chosen heads' Q/K/V rows (weight and bias of ``qkv``) and output-projection columns
    (``proj.weight``) from ``fresh`` (same architecture) into ``model``, in place."""
    mine, theirs = dict(_attention_layers(model)), dict(_attention_layers(fresh))
    for spec in heads:
        m, f = mine[spec["layer"]], theirs[spec["layer"]]
        rows, cols = _head_slices(m, spec["head"])
        for r in rows:
            m.qkv.weight[r] = f.qkv.weight[r]
            if m.qkv.bias is not None:
                m.qkv.bias[r] = f.qkv.bias[r]
        m.proj.weight[:, cols] = f.proj.weight[:, cols]
    return {"heads": [dict(h) for h in heads],
            "tensors": "per head: rows [part·d + h·d/H, part·d + (h+1)·d/H) of qkv.weight and qkv.bias for "
                       "part = q, k, v; columns [h·d/H, (h+1)·d/H) of proj.weight; proj.bias untouched"}


def fresh_model(cfg: RunConfig, seed: int, device) -> torch.nn.Module:
    """A newly built model of ``cfg`` with the global RNG seeded ``seed`` (the caller's RNG state is kept)."""
    with torch.random.fork_rng(devices=[] if torch.device(device).type == "cpu" else None):
        torch.manual_seed(seed)
        return build_model(cfg, device=device).to(device)


def clip_matrices(model: torch.nn.Module, scope: str = "all-2d") -> list[tuple[str, torch.nn.Parameter]]:
    if scope not in CLIP_SCOPES:
        raise ValueError(f"scope: expected one of {', '.join(CLIP_SCOPES)}, got {scope!r}")
    if scope == "all-2d":
        return [(n, p) for n, p in model.named_parameters() if p.dim() == 2]
    out = []
    for name, m in _attention_layers(model):
        out += [(f"{name}.qkv.weight", m.qkv.weight), (f"{name}.proj.weight", m.proj.weight)]
    return out


@torch.no_grad()
def clip_weight_norms(model: torch.nn.Module, scope: str = "all-2d") -> dict:
    """Cap the Frobenius norm of each matrix of ``scope`` at the median of their norms, in place."""
    mats = clip_matrices(model, scope)
    norms = [float(p.detach().double().norm()) for _, p in mats]
    median = float(np.median(norms))
    clipped = []
    for (name, p), n in zip(mats, norms):
        if n > median:
            p.mul_(median / n)
            clipped.append({"matrix": name, "norm_before": n, "norm_after": float(p.detach().double().norm())})
    return {"norm": "Frobenius", "scope": scope, "matrices": [n for n, _ in mats], "median": median,
            "rule": "each matrix with Frobenius norm above the median of the scope's norms (this seed, at "
                    "the branch point) is scaled to the median; once, at the branch point",
            "clipped": clipped}


# ============================================================================ one seed


def find_peak(trainer, patience: int | None = None, on_row: Callable[[dict], None] | None = None,
              patience_epochs: int = PEAK_PATIENCE_EPOCHS):
    """Advance ``trainer`` until the Phase-2 peak is confirmed (see the module docstring): no new σ_H
    maximum for ``patience`` evaluations where given, else for ``patience_epochs`` epochs. Returns
    (checkpoint Trainer or None, info dict)."""
    best, ckpt, since = None, None, 0
    confirmed = False
    while not trainer.done:
        row = trainer.run_epoch()
        if row is None:
            continue
        if on_row is not None:
            on_row(row)
        if trainer.tracker.t_grok is None or row.get("sigma_h") is None:
            continue
        if best is None or row["sigma_h"] > best:
            best, since = row["sigma_h"], 0
            ckpt = trainer.branch()
        else:
            since += 1
            waited = since >= patience if patience is not None else row["epoch"] - ckpt.epoch >= patience_epochs
            if waited:
                confirmed = True
                break
    t_grok = trainer.tracker.t_grok
    info = {"t_grok_epoch": t_grok[0] if t_grok else None, "peak_sigma_h": best,
            "peak_epoch": ckpt.epoch if ckpt is not None else None, "peak_confirmed": confirmed,
            "search_epochs": trainer.epoch, "diverged": trainer.tracker.diverged}
    return ckpt, info


def arm_metrics(trace: Sequence[dict], branch_epoch: int, grok_threshold: float) -> dict:
    after = [r for r in trace if r["epoch"] > branch_epoch]
    sig = [r["sigma_h"] for r in after if r.get("sigma_h") is not None]
    acc = [(r["epoch"], r["test_acc"]) for r in after if r.get("test_acc") is not None]
    regrok = None
    if acc:
        if min(a for _, a in acc) >= grok_threshold:
            regrok = 0
        else:
            first_low = next(i for i, (_, a) in enumerate(acc) if a < grok_threshold)
            back = next((e for e, a in acc[first_low:] if a >= grok_threshold), None)
            regrok = back - branch_epoch if back is not None else None
    return {"peak_sigma_h_after": max(sig) if sig else None,
            "mean_sigma_h_after": float(np.mean(sig)) if sig else None,
            "final_test_acc": acc[-1][1] if acc else None,
            "min_test_acc_after": min(a for _, a in acc) if acc else None,
            "regrok_epochs": regrok, "n_evals_after": len(after)}


def run_seed(cfg: RunConfig, settings: InterventionSettings, progress: Callable[[str], None] | None = None) -> dict:
    """One seed of the experiment: the search for the peak, then the three arms. Returns a dict with
    ``info`` and (if a peak was found) ``arms`` = {arm: {"outcome", "intervention", "metrics"}}."""
    settings.validate()
    search_cfg = dataclasses.replace(cfg, stop_at_grok=False, epochs=settings.max_epochs, patience=0).validate()
    trainer = Trainer(search_cfg)
    started = time.perf_counter()
    ckpt, info = find_peak(trainer, settings.peak_patience, patience_epochs=settings.peak_patience_epochs)
    info["search_seconds"] = time.perf_counter() - started
    if ckpt is None:
        info["error"] = ("diverged before a peak" if info["diverged"] else
                         f"did not grok within {settings.max_epochs} epochs" if info["t_grok_epoch"] is None
                         else "no σ_H after grokking")
        return {"seed": cfg.seed, "info": info, "arms": {}}
    del trainer
    branch_epoch = ckpt.epoch
    horizon = branch_epoch + settings.after_peak_epochs
    arms = {}
    for arm in ARMS:
        t = ckpt.branch(epochs=horizon, stop_at_grok=False)
        if arm == "control":
            intervention = {"kind": "none"}
        elif arm == "reinit":
            heads = choose_heads(t.model, settings.heads_to_reinit, cfg.seed, settings.reinit_heads)
            reinit_seed = cfg.seed + settings.reinit_seed_offset
            fresh = fresh_model(t.cfg, reinit_seed, t.device)
            intervention = {"kind": "reinit_heads", "init": settings.reinit_init,
                            "init_source": f"a freshly built model of the same config, torch seed {reinit_seed}",
                            "optimizer_state": "kept", **reinit_heads(t.model, fresh, heads)}
            del fresh
        else:
            intervention = {"kind": "clip_weight_norms", "optimizer_state": "kept",
                            **clip_weight_norms(t.model, settings.clip)}
        t0 = time.perf_counter()
        while not t.done:
            t.run_epoch()
        outcome = t.outcome()
        metrics = arm_metrics(outcome.trace, branch_epoch, cfg.grok_threshold)
        metrics["seconds"] = time.perf_counter() - t0
        arms[arm] = {"outcome": outcome, "intervention": intervention, "metrics": metrics}
        if progress is not None:
            progress(f"seed {cfg.seed} {arm}: peak σ_H after {fmt_or_dash(metrics['peak_sigma_h_after'])}, "
                     f"final test acc {fmt_or_dash(metrics['final_test_acc'])}")
    info["branch_epoch"] = branch_epoch
    return {"seed": cfg.seed, "info": info, "arms": arms}


# ============================================================================ the store


def experiment_id(cfg: RunConfig, settings: InterventionSettings) -> str:
    base = cfg.to_dict()
    for k in ("seed", "device"):
        base.pop(k)
    blob = json.dumps({"config": base, "settings": settings.to_dict()}, sort_keys=True, separators=(",", ":"))
    return "iv-" + hashlib.sha256(blob.encode()).hexdigest()[:12]


def record_seed(store, experiment: str, cfg: RunConfig, settings: InterventionSettings, seed_out: dict) -> None:
    """The three arms of one seed, in one transaction."""
    now = time.time()
    arms = [{"arm_id": f"{experiment}-s{cfg.seed}-{arm}", "experiment": experiment, "seed": cfg.seed, "arm": arm,
             "branch_of": cfg.run_id(), "branch_epoch": seed_out["info"]["branch_epoch"],
             "config": a["outcome"].config.to_dict(), "settings": settings.to_dict(), "intervention": a["intervention"],
             "result": {**a["outcome"].result, "search": seed_out["info"]}, "metrics": a["metrics"], "created_at": now}
            for arm, a in seed_out["arms"].items()]
    tables.record_arms(store, arms, [a["outcome"].trace for a in seed_out["arms"].values()])
