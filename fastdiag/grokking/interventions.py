"""Causal interventions at the Phase-2 peak (issue 8, part 1).

For each seed: train (``fastdiag.grokking.train.Trainer``, stop_at_grok off) until the Phase-2 peak, the
evaluation of maximal σ_H after grokking, found online: after t_grok, σ_H is tracked per evaluation
and a checkpoint (``Trainer.branch()``) is kept at its running maximum; the peak is confirmed when
σ_H has not exceeded that maximum for ``peak_patience`` evaluations (or the search horizon is reached:
then the running maximum is used and the seed is marked ``peak_confirmed = false``). From the
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
the control by paired tests across seeds (``analysis.paired_tests``); the t-test p-values of all
(arm, metric) comparisons form one Holm–Bonferroni family, the Wilcoxon p-values another.

Arms are stored in the result store in two extra tables (``intervention_runs``,
``intervention_trace``), so the sweep ``runs`` table and everything that reads it are unchanged.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from typing import Callable, Sequence

import numpy as np
import torch

from fastdiag.grokking.config import RunConfig

ARMS = ("control", "reinit", "clip")
CLIP_SCOPES = ("all-2d", "attention")
REINIT_INITS = ("default",)
METRICS = ("peak_sigma_h_after", "mean_sigma_h_after", "final_test_acc", "min_test_acc_after", "regrok_epochs")
TESTED_METRICS = ("peak_sigma_h_after", "final_test_acc")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS intervention_runs (
    arm_id       TEXT PRIMARY KEY,
    experiment   TEXT NOT NULL,
    seed         INTEGER NOT NULL,
    arm          TEXT NOT NULL,
    branch_of    TEXT NOT NULL,
    branch_epoch INTEGER,
    config       TEXT NOT NULL,
    settings     TEXT NOT NULL,
    intervention TEXT NOT NULL,
    result       TEXT NOT NULL,
    metrics      TEXT NOT NULL,
    created_at   REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS intervention_trace (
    arm_id TEXT NOT NULL,
    idx    INTEGER NOT NULL,
    epoch  INTEGER,
    step   INTEGER,
    row    TEXT NOT NULL,
    PRIMARY KEY (arm_id, idx)
) WITHOUT ROWID;
"""


@dataclasses.dataclass(frozen=True)
class InterventionSettings:
    heads_to_reinit: int = 2                 # per attention layer
    reinit_heads: tuple = ()                 # explicit ((layer index, head), ...); overrides the draw
    reinit_init: str = "default"
    reinit_seed_offset: int = 10_000         # fresh model seeded with seed + offset
    clip: str = "all-2d"
    after_peak_epochs: int = 500
    peak_patience: int = 10                  # evaluations without a new σ_H maximum
    max_epochs: int = 5000                   # search horizon for grokking + the peak

    def validate(self) -> "InterventionSettings":
        if self.heads_to_reinit < 1 and not self.reinit_heads:
            raise ValueError(f"--heads-to-reinit: must be >= 1, got {self.heads_to_reinit}")
        if self.reinit_init not in REINIT_INITS:
            raise ValueError(f"--reinit-init: expected one of {', '.join(REINIT_INITS)}, got {self.reinit_init!r}")
        if self.clip not in CLIP_SCOPES:
            raise ValueError(f"--clip: expected one of {', '.join(CLIP_SCOPES)}, got {self.clip!r}")
        if self.after_peak_epochs < 1:
            raise ValueError(f"--after-peak-epochs: must be >= 1, got {self.after_peak_epochs}")
        if self.peak_patience < 1:
            raise ValueError(f"--peak-patience: must be >= 1, got {self.peak_patience}")
        if self.max_epochs < 1:
            raise ValueError(f"--epochs: must be >= 1, got {self.max_epochs}")
        return self

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["reinit_heads"] = [list(x) for x in self.reinit_heads]
        return d


def parse_heads(spec: str | None) -> tuple:
    """``"0:1,2:3"`` → ((0, 1), (2, 3)): (layer index, head index) pairs."""
    if spec is None or not str(spec).strip():
        return ()
    out = []
    for item in str(spec).split(","):
        parts = item.strip().split(":")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"--reinit-heads: expected LAYER:HEAD pairs like 0:1,1:3, got {item.strip()!r}")
        out.append((int(parts[0]), int(parts[1])))
    return tuple(dict.fromkeys(out))


# ============================================================================ the interventions


def _attention_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    from fastdiag.models import attention_modules

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
                raise ValueError(f"--reinit-heads: layer {li} out of range (the model has {len(layers)} attention layers)")
            if not 0 <= h < layers[li][1].n_heads:
                raise ValueError(f"--reinit-heads: head {h} out of range (layer {li} has {layers[li][1].n_heads} heads)")
            chosen.append((li, h))
    else:
        rng = np.random.default_rng(seed)
        for li, (_, m) in enumerate(layers):
            if k > m.n_heads:
                raise ValueError(f"--heads-to-reinit: {k} heads per layer, but the layers have {m.n_heads}")
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


def fresh_model(cfg: RunConfig, vocab_size: int, seq_len: int, seed: int, device) -> torch.nn.Module:
    """A newly built model of ``cfg`` with the global RNG seeded ``seed`` (the caller's RNG state is kept)."""
    from fastdiag.models import build_from_run_config

    with torch.random.fork_rng(devices=[] if torch.device(device).type == "cpu" else None):
        torch.manual_seed(seed)
        return build_from_run_config(cfg, vocab_size, seq_len, device=device).to(device)


def clip_matrices(model: torch.nn.Module, scope: str = "all-2d") -> list[tuple[str, torch.nn.Parameter]]:
    if scope not in CLIP_SCOPES:
        raise ValueError(f"--clip: expected one of {', '.join(CLIP_SCOPES)}, got {scope!r}")
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


def find_peak(trainer, patience: int, on_row: Callable[[dict], None] | None = None):
    """Advance ``trainer`` until the Phase-2 peak is confirmed (see the module docstring). Returns
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
            if since >= patience:
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
    from fastdiag.grokking.train import Trainer

    settings.validate()
    search_cfg = dataclasses.replace(cfg, stop_at_grok=False, epochs=settings.max_epochs, patience=0).validate()
    trainer = Trainer(search_cfg)
    started = time.perf_counter()
    ckpt, info = find_peak(trainer, settings.peak_patience)
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
            fresh = fresh_model(t.cfg, t.task.vocab_size, t.task.seq_len, reinit_seed, t.device)
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
            progress(f"seed {cfg.seed} {arm}: peak σ_H after {_f(metrics['peak_sigma_h_after'])}, "
                     f"final test acc {_f(metrics['final_test_acc'])}")
    info["branch_epoch"] = branch_epoch
    return {"seed": cfg.seed, "info": info, "arms": arms}


def _f(x, spec=".4f"):
    return "–" if x is None else format(x, spec)


# ============================================================================ the store


def experiment_id(cfg: RunConfig, settings: InterventionSettings) -> str:
    base = cfg.to_dict()
    for k in ("seed", "device"):
        base.pop(k)
    blob = json.dumps({"config": base, "settings": settings.to_dict()}, sort_keys=True, separators=(",", ":"))
    return "iv-" + hashlib.sha256(blob.encode()).hexdigest()[:12]


def ensure_tables(store) -> None:
    with store.transaction() as conn:
        for statement in _SCHEMA.split(";"):
            if statement.strip():
                conn.execute(statement)


def has_tables(store) -> bool:
    names = {r[0] for r in store.conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    return "intervention_runs" in names


def stored_seeds(store, experiment: str) -> set[int]:
    if not has_tables(store):
        return set()
    rows = store.conn.execute("SELECT seed, COUNT(*) FROM intervention_runs WHERE experiment = ? GROUP BY seed",
                              (experiment,)).fetchall()
    return {seed for seed, n in rows if n == len(ARMS)}


def record_seed(store, experiment: str, cfg: RunConfig, settings: InterventionSettings, seed_out: dict) -> None:
    """The three arms of one seed in one transaction."""
    from fastdiag.store import dumps

    ensure_tables(store)
    now = time.time()
    with store.transaction() as conn:
        for arm, a in seed_out["arms"].items():
            arm_id = f"{experiment}-s{cfg.seed}-{arm}"
            conn.execute("DELETE FROM intervention_trace WHERE arm_id = ?", (arm_id,))
            conn.execute(
                "INSERT OR REPLACE INTO intervention_runs (arm_id, experiment, seed, arm, branch_of, branch_epoch, "
                "config, settings, intervention, result, metrics, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (arm_id, experiment, cfg.seed, arm, cfg.run_id(), seed_out["info"]["branch_epoch"],
                 dumps(a["outcome"].config.to_dict()), dumps(settings.to_dict()), dumps(a["intervention"]),
                 dumps({**a["outcome"].result, "search": seed_out["info"]}), dumps(a["metrics"]), now))
            conn.executemany("INSERT INTO intervention_trace (arm_id, idx, epoch, step, row) VALUES (?, ?, ?, ?, ?)",
                             [(arm_id, i, r.get("epoch"), r.get("step"), dumps(r))
                              for i, r in enumerate(a["outcome"].trace)])


def merge_tables(dst, src) -> int:
    """Copy the intervention arms of store ``src`` missing from ``dst`` (with their traces); idempotent.
    Returns how many arms were added."""
    if not has_tables(src):
        return 0
    ensure_tables(dst)
    have = {r[0] for r in dst.conn.execute("SELECT arm_id FROM intervention_runs")}
    # The input's column names are untrusted text: copy only the columns this schema has, quoted.
    known = [r[1] for r in dst.conn.execute("PRAGMA table_info(intervention_runs)")]
    present = {r[1] for r in src.conn.execute("PRAGMA table_info(intervention_runs)")}
    cols = [c for c in known if c in present]
    quoted = ", ".join('"' + c.replace('"', '""') + '"' for c in cols)
    added = 0
    for row in src.conn.execute(f"SELECT {quoted} FROM intervention_runs").fetchall():
        arm_id = row[cols.index("arm_id")]
        if arm_id in have:
            continue
        trace = src.conn.execute("SELECT arm_id, idx, epoch, step, row FROM intervention_trace WHERE arm_id = ?",
                                 (arm_id,)).fetchall()
        with dst.transaction() as conn:
            conn.execute(f"INSERT INTO intervention_runs ({quoted}) VALUES ({', '.join('?' * len(cols))})", row)
            conn.executemany("INSERT INTO intervention_trace (arm_id, idx, epoch, step, row) VALUES (?, ?, ?, ?, ?)", trace)
        added += 1
    return added


def load_experiments(store) -> dict[str, list[dict]]:
    """experiment id → arm rows (dicts with parsed JSON), ordered by seed and arm."""
    if not has_tables(store):
        return {}
    out: dict[str, list[dict]] = {}
    cols = ("arm_id", "experiment", "seed", "arm", "branch_of", "branch_epoch", "config", "settings",
            "intervention", "result", "metrics")
    for row in store.conn.execute(f"SELECT {', '.join(cols)} FROM intervention_runs ORDER BY experiment, seed, arm"):
        d = dict(zip(cols, row))
        for k in ("config", "settings", "intervention", "result", "metrics"):
            d[k] = json.loads(d[k])
        out.setdefault(d["experiment"], []).append(d)
    return out


def arm_trace(store, arm_id: str) -> list[dict]:
    return [json.loads(r[0]) for r in store.conn.execute(
        "SELECT row FROM intervention_trace WHERE arm_id = ? ORDER BY idx", (arm_id,))]


# ============================================================================ statistics


def compare_arms(rows: Sequence[dict]) -> dict:
    """Paired tests of each treated arm against the control over the seeds that have all arms."""
    from fastdiag.analysis import fits as analysis

    by_seed: dict[int, dict[str, dict]] = {}
    for r in rows:
        by_seed.setdefault(r["seed"], {})[r["arm"]] = r["metrics"]
    seeds = sorted(s for s, arms in by_seed.items() if all(a in arms for a in ARMS))
    tests = []
    for arm in ARMS[1:]:
        for metric in TESTED_METRICS:
            pairs = [(by_seed[s]["control"].get(metric), by_seed[s][arm].get(metric)) for s in seeds]
            pairs = [(c, t) for c, t in pairs if c is not None and t is not None]
            entry = {"arm": arm, "metric": metric, "n": len(pairs),
                     "control_mean": float(np.mean([c for c, _ in pairs])) if pairs else None,
                     "arm_mean": float(np.mean([t for _, t in pairs])) if pairs else None}
            try:
                pt = analysis.paired_tests([c for c, _ in pairs], [t for _, t in pairs])
                entry.update({"mean_diff": pt.mean_diff, "t": pt.t_statistic, "t_p": pt.t_pvalue,
                              "wilcoxon": pt.wilcoxon_statistic, "wilcoxon_p": pt.wilcoxon_pvalue,
                              "cohens_d": pt.cohens_d})
            except ValueError as exc:
                entry["mean_diff"] = (float(np.mean([t - c for c, t in pairs])) if pairs else None)
                entry["error"] = " ".join(str(exc).split())
            tests.append(entry)
    for key in ("t_p", "wilcoxon_p"):
        family = [e for e in tests if e.get(key) is not None and math.isfinite(e[key])]
        if family:
            adjusted = analysis.holm_bonferroni([e[key] for e in family])
            for e, p in zip(family, adjusted):
                e[key + "_holm"] = float(p)
    return {"seeds": seeds, "n_seeds": len(seeds), "tests": tests,
            "holm_families": "t-test p-values of all (arm, metric) tests; Wilcoxon p-values likewise"}


def format_comparison(cmp: dict) -> str:
    lines = [f"paired over {cmp['n_seeds']} seed(s); differences are arm − control; Holm–Bonferroni over "
             f"{sum(1 for t in cmp['tests'] if 't_p' in t)} t-tests (and separately the Wilcoxon tests)"]
    lines.append(f"  {'arm':<7} {'metric':<19} {'n':>3} {'control':>9} {'arm':>9} {'Δ mean':>9} "
                 f"{'t p':>9} {'t p_Holm':>9} {'W p':>9} {'W p_Holm':>9} {'Cohen d':>8}")
    for t in cmp["tests"]:
        if "error" in t:
            lines.append(f"  {t['arm']:<7} {t['metric']:<19} {t['n']:>3} {_f(t['control_mean']):>9} "
                         f"{_f(t['arm_mean']):>9} {_f(t['mean_diff']):>9}   no test: {t['error']}")
            continue
        lines.append(f"  {t['arm']:<7} {t['metric']:<19} {t['n']:>3} {_f(t['control_mean']):>9} "
                     f"{_f(t['arm_mean']):>9} {t['mean_diff']:>+9.4f} {t['t_p']:>9.2g} "
                     f"{t.get('t_p_holm', float('nan')):>9.2g} {t['wilcoxon_p']:>9.2g} "
                     f"{t.get('wilcoxon_p_holm', float('nan')):>9.2g} {t['cohens_d']:>+8.2f}")
    return "\n".join(lines)
