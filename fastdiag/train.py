"""One grokking training run (SPEC §4) with online head diagnostics.

``train_run(cfg)`` trains the model of a ``RunConfig`` on its modular-arithmetic task with AdamW
(betas 0.9/0.98, weight decay λ on all parameters), minibatches reshuffled every epoch, and returns a
``RunOutcome``: the config, a JSON-able ``result`` dict and a ``trace`` (one JSON-able row per
evaluation). Diagnostics come from the training step's own forward pass: every ``diag_every``
optimizer steps the attention modules record their head statistics (``record = True`` for that
forward only); the statistics of all diagnostic steps since the previous evaluation are merged with
``+`` and summarised at evaluation time, which is the only moment anything is read to the host.
"""
from __future__ import annotations

import csv
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from .config import RunConfig
from .tasks import make_task

REGIMES = ("grok", "memorization", "collapse", "anti-grok", "diverged")
ANTI_GROK_BELOW = 0.5   # test accuracy that, after grokking, marks an anti-grok run


@dataclass
class RunOutcome:
    config: RunConfig
    result: dict
    trace: list[dict] = field(default_factory=list)


def resolve_device(device: str) -> torch.device:
    """``auto`` → CUDA when available, else CPU; anything else must be a usable torch device."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: {device!r} is not a torch device ({exc})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} requested but CUDA is not available on this machine")
    return dev


def _finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _evaluate(model, x, y, chunk: int):
    """Mean loss and accuracy over (x, y) as device tensors (no host sync), in chunks of ``chunk``
    rows: on CPU, chunks that stay in cache are several times faster than one big batch."""
    loss = torch.zeros((), device=x.device)
    correct = torch.zeros((), device=x.device)
    for start in range(0, x.shape[0], chunk):
        logits = model(x[start:start + chunk])
        target = y[start:start + chunk]
        loss += F.cross_entropy(logits, target, reduction="sum")
        correct += (logits.argmax(-1) == target).sum()
    return loss / x.shape[0], correct / x.shape[0]


def train_run(cfg: RunConfig, progress: Callable[[dict], None] | None = None) -> RunOutcome:
    from fastdiag.models import attention_modules, build_from_run_config, count_parameters

    cfg = cfg.validate()
    started = time.perf_counter()
    device = resolve_device(cfg.device)
    task = make_task(cfg.op, cfg.p, cfg.train_frac, seed=cfg.seed, device=device)

    torch.manual_seed(cfg.seed)
    model = build_from_run_config(cfg, task.vocab_size, task.seq_len, device=device).to(device)
    attn = attention_modules(model)
    layer_names = list(attn)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.98), weight_decay=cfg.weight_decay)
    shuffle = torch.Generator().manual_seed(cfg.seed)

    n_train = task.train_x.shape[0]
    eval_chunk = 512 if device.type == "cpu" else 16384
    trace: list[dict] = []
    step = 0
    loss_sum = torch.zeros((), device=device)   # minibatch losses since the last evaluation
    pending: dict = {}                           # layer name -> merged HeadStats since the last evaluation
    t_mem = t_grok = anti_grok_epoch = None
    diverged = False
    epoch = 0

    for epoch in range(1, cfg.epochs + 1):
        model.train()
        perm = torch.randperm(n_train, generator=shuffle).to(device)
        for start in range(0, n_train, cfg.batch_size):
            idx = perm[start:start + cfg.batch_size]
            record = bool(attn) and step % cfg.diag_every == 0
            if record:
                for m in attn.values():
                    m.record = True
            try:
                logits = model(task.train_x[idx])
            finally:
                if record:
                    for m in attn.values():
                        m.record = False
            if record:
                for name, m in attn.items():
                    stats, m.stats = m.stats, None
                    pending[name] = stats if name not in pending else pending[name] + stats
            loss = F.cross_entropy(logits, task.train_y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum += loss.detach()
            step += 1

        if epoch % cfg.eval_every and epoch != cfg.epochs:
            continue
        # ---- evaluation: the one host read-out of the interval ---------------------------------
        model.eval()
        with torch.no_grad():
            train_loss, train_acc = _evaluate(model, task.train_x, task.train_y, eval_chunk)
            test_loss, test_acc = _evaluate(model, task.test_x, task.test_y, eval_chunk)
            weight_norm = torch.stack([p.detach().float().norm() for p in params]).norm()
            values = [train_loss, train_acc, test_loss, test_acc, weight_norm, loss_sum]
            if pending:
                from fastdiag.stats import summarize

                summary = summarize({name: pending[name] for name in layer_names})
                values += [summary.s_bar, summary.sigma_h]
                for name in layer_names:
                    values += [summary.per_layer[name]["sync"], summary.per_layer[name]["spread"]]
            host = torch.stack([v.detach().to(torch.float64).reshape(()) for v in values]).tolist()
        loss_sum.zero_()
        pending = {}

        row = {"epoch": epoch, "step": step,
               "train_loss": _finite_or_none(host[0]), "train_acc": host[1],
               "test_loss": _finite_or_none(host[2]), "test_acc": host[3],
               "s_bar": None, "sigma_h": None}
        if len(host) > 6:
            row["s_bar"], row["sigma_h"] = _finite_or_none(host[6]), _finite_or_none(host[7])
        for i, name in enumerate(layer_names):
            got = len(host) > 6
            row[f"sync/{name}"] = _finite_or_none(host[8 + 2 * i]) if got else None
            row[f"spread/{name}"] = _finite_or_none(host[9 + 2 * i]) if got else None
        row["weight_norm"] = _finite_or_none(host[4])
        trace.append(row)

        if not all(math.isfinite(v) for v in (host[0], host[2], host[4], host[5])):
            diverged = True
        else:
            if t_mem is None and row["train_acc"] >= cfg.grok_threshold:
                t_mem = (epoch, step)
            if t_grok is None and row["test_acc"] >= cfg.grok_threshold:
                t_grok = (epoch, step)
            if t_grok is not None and anti_grok_epoch is None and row["test_acc"] < ANTI_GROK_BELOW:
                anti_grok_epoch = epoch
        if progress is not None:
            progress(dict(row))
        if diverged:
            break
        if cfg.stop_at_grok and t_grok is not None and epoch >= t_grok[0] + cfg.patience:
            break

    if diverged:
        regime = "diverged"
    elif t_grok is not None:
        regime = "anti-grok" if anti_grok_epoch is not None else "grok"
    elif t_mem is not None:
        regime = "memorization"
    else:
        regime = "collapse"

    last = trace[-1] if trace else {}
    s_values = [r["s_bar"] for r in trace if r["s_bar"] is not None]
    h_values = [r["sigma_h"] for r in trace if r["sigma_h"] is not None]
    result = {
        "run_id": cfg.run_id(),
        "regime": regime,
        "t_grok_epoch": t_grok[0] if t_grok else None,
        "t_grok_step": t_grok[1] if t_grok else None,
        "t_mem_epoch": t_mem[0] if t_mem else None,
        "t_mem_step": t_mem[1] if t_mem else None,
        "anti_grok_epoch": anti_grok_epoch,
        "final_train_acc": last.get("train_acc"),
        "final_test_acc": last.get("test_acc"),
        "final_train_loss": last.get("train_loss"),
        "final_test_loss": last.get("test_loss"),
        "final_s_bar": last.get("s_bar"),
        "final_sigma_h": last.get("sigma_h"),
        "final_weight_norm": last.get("weight_norm"),
        "peak_s_bar": max(s_values) if s_values else None,
        "peak_sigma_h": max(h_values) if h_values else None,
        "epochs_run": epoch,
        "steps": step,
        "wall_seconds": time.perf_counter() - started,
        "has_attention": bool(attn),
        "n_params": count_parameters(model),
        "device": str(device),
        "config": cfg.to_dict(),
    }
    return RunOutcome(config=cfg, result=result, trace=trace)


def trace_columns(trace: list[dict]) -> list[str]:
    columns: list[str] = []
    for row in trace:
        for key in row:
            if key not in columns:
                columns.append(key)
    return columns


def write_outputs(outcome: RunOutcome, out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write ``result.json``, ``trace.csv`` and ``trajectory.png`` into ``out_dir``; return their paths."""
    from .plots import plot_trajectory

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"result": out / "result.json", "trace": out / "trace.csv", "plot": out / "trajectory.png"}
    tmp = paths["result"].with_suffix(".json.tmp")
    tmp.write_text(json.dumps(outcome.result, indent=2, allow_nan=False) + "\n")
    os.replace(tmp, paths["result"])
    with open(paths["trace"], "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=trace_columns(outcome.trace))
        writer.writeheader()
        for row in outcome.trace:
            writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
    plot_trajectory(outcome.trace, paths["plot"], result=outcome.result)
    return paths
