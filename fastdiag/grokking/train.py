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

import copy
import csv
import dataclasses
import json
import math
import os
import tempfile
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from fastdiag.grokking.config import RunConfig
from fastdiag.grokking.tasks import make_task

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


class RunTracker:
    """Bookkeeping of one run from its evaluations: trace rows, t_mem, t_grok, anti-grok, divergence,
    regime and the result dict. Shared by the single-run trainer and the ensemble trainer, so a member
    of an ensemble is judged exactly like a single run."""

    def __init__(self, cfg: RunConfig, layer_names: list[str]) -> None:
        self.cfg = cfg
        self.layer_names = layer_names
        self.trace: list[dict] = []
        self.t_mem = self.t_grok = self.anti_grok_epoch = None
        self.diverged = False

    def record(self, epoch: int, step: int, metrics: dict[str, float]) -> dict:
        """Add one evaluation. ``metrics``: host floats train_loss, train_acc, test_loss, test_acc,
        weight_norm, loss_sum (minibatch losses since the last evaluation) and, when diagnostics
        were taken, s_bar, sigma_h, sync/<layer>, spread/<layer>."""
        cfg = self.cfg
        row = {"epoch": epoch, "step": step,
               "train_loss": _finite_or_none(metrics["train_loss"]), "train_acc": metrics["train_acc"],
               "test_loss": _finite_or_none(metrics["test_loss"]), "test_acc": metrics["test_acc"],
               "s_bar": _finite_or_none(metrics.get("s_bar")), "sigma_h": _finite_or_none(metrics.get("sigma_h"))}
        for name in self.layer_names:
            row[f"sync/{name}"] = _finite_or_none(metrics.get(f"sync/{name}"))
            row[f"spread/{name}"] = _finite_or_none(metrics.get(f"spread/{name}"))
        row["weight_norm"] = _finite_or_none(metrics["weight_norm"])
        self.trace.append(row)
        if not all(math.isfinite(metrics[k]) for k in ("train_loss", "test_loss", "weight_norm", "loss_sum")):
            self.diverged = True
        else:
            if self.t_mem is None and row["train_acc"] >= cfg.grok_threshold:
                self.t_mem = (epoch, step)
            if self.t_grok is None and row["test_acc"] >= cfg.grok_threshold:
                self.t_grok = (epoch, step)
            if self.t_grok is not None and self.anti_grok_epoch is None and row["test_acc"] < ANTI_GROK_BELOW:
                self.anti_grok_epoch = epoch
        return row

    @property
    def stopped(self) -> bool:
        """Diverged, or grokked with the patience used up (when the run stops at grokking)."""
        if self.diverged:
            return True
        epoch = self.trace[-1]["epoch"] if self.trace else 0
        return self.cfg.stop_at_grok and self.t_grok is not None and epoch >= self.t_grok[0] + self.cfg.patience

    @property
    def regime(self) -> str:
        if self.diverged:
            return "diverged"
        if self.t_grok is not None:
            return "anti-grok" if self.anti_grok_epoch is not None else "grok"
        return "memorization" if self.t_mem is not None else "collapse"

    def result(self, *, epochs_run: int, steps: int, wall_seconds: float, has_attention: bool,
               n_params: int, device: torch.device) -> dict:
        cfg, trace = self.cfg, self.trace
        last = trace[-1] if trace else {}
        s_values = [r["s_bar"] for r in trace if r["s_bar"] is not None]
        h_values = [r["sigma_h"] for r in trace if r["sigma_h"] is not None]
        return {
            "run_id": cfg.run_id(),
            "regime": self.regime,
            "t_grok_epoch": self.t_grok[0] if self.t_grok else None,
            "t_grok_step": self.t_grok[1] if self.t_grok else None,
            "t_mem_epoch": self.t_mem[0] if self.t_mem else None,
            "t_mem_step": self.t_mem[1] if self.t_mem else None,
            "anti_grok_epoch": self.anti_grok_epoch,
            "final_train_acc": last.get("train_acc"),
            "final_test_acc": last.get("test_acc"),
            "final_train_loss": last.get("train_loss"),
            "final_test_loss": last.get("test_loss"),
            "final_s_bar": last.get("s_bar"),
            "final_sigma_h": last.get("sigma_h"),
            "final_weight_norm": last.get("weight_norm"),
            "peak_s_bar": max(s_values) if s_values else None,
            "peak_sigma_h": max(h_values) if h_values else None,
            "epochs_run": epochs_run,
            "steps": steps,
            "wall_seconds": wall_seconds,
            "has_attention": has_attention,
            "n_params": n_params,
            "device": str(device),
            "config": cfg.to_dict(),
        }


def summary_values(pending: dict, layer_names: list[str]) -> dict[str, torch.Tensor]:
    """Device tensors s_bar, sigma_h, sync/<layer>, spread/<layer> of merged HeadStats (none if empty)."""
    if not pending:
        return {}
    from fastdiag.stats import summarize

    return summarize({name: pending[name] for name in layer_names}).tensors()


class Trainer:
    """One run, an epoch at a time: ``while not t.done: t.run_epoch()``, then ``t.outcome()``.

    ``branch(**changes)`` deep-copies the whole state (model, optimizer, shuffle generator,
    bookkeeping) so an experiment can continue several arms from one checkpoint.
    """

    def __init__(self, cfg: RunConfig, progress: Callable[[dict], None] | None = None) -> None:
        from fastdiag.models import attention_modules, build_from_run_config

        self.cfg = cfg = cfg.validate()
        self.progress = progress
        self.started = time.perf_counter()
        self.device = device = resolve_device(cfg.device)
        self.task = make_task(cfg.op, cfg.p, cfg.train_frac, seed=cfg.seed, device=device)
        torch.manual_seed(cfg.seed)
        self.model = build_from_run_config(cfg, self.task.vocab_size, self.task.seq_len, device=device).to(device)
        self.attn = attention_modules(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(0.9, 0.98),
                                     weight_decay=cfg.weight_decay)
        self.shuffle = torch.Generator().manual_seed(cfg.seed)
        self.tracker = RunTracker(cfg, list(self.attn))
        self.eval_chunk = 512 if device.type == "cpu" else 16384
        self.epoch = 0
        self.step = 0
        self.loss_sum = torch.zeros((), device=device)  # minibatch losses since the last evaluation
        self.pending: dict = {}                          # layer -> merged HeadStats since the last evaluation

    @property
    def done(self) -> bool:
        return self.tracker.stopped or self.epoch >= self.cfg.epochs

    def _train_step(self, idx: torch.Tensor) -> None:
        record = bool(self.attn) and self.step % self.cfg.diag_every == 0
        if record:
            for m in self.attn.values():
                m.record = True
        try:
            logits = self.model(self.task.train_x[idx])
        finally:
            if record:
                for m in self.attn.values():
                    m.record = False
        if record:
            for name, m in self.attn.items():
                stats, m.stats = m.stats, None
                self.pending[name] = stats if name not in self.pending else self.pending[name] + stats
        loss = F.cross_entropy(logits, self.task.train_y[idx])
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.loss_sum += loss.detach()
        self.step += 1

    def run_epoch(self) -> dict | None:
        """Train one epoch; evaluate when due. Returns the new trace row, or None."""
        cfg = self.cfg
        self.epoch += 1
        self.model.train()
        perm = torch.randperm(self.task.train_x.shape[0], generator=self.shuffle).to(self.device)
        for start in range(0, perm.shape[0], cfg.batch_size):
            self._train_step(perm[start:start + cfg.batch_size])
        if self.epoch % cfg.eval_every and self.epoch != cfg.epochs:
            return None
        row = self.tracker.record(self.epoch, self.step, self._evaluate())
        if self.progress is not None:
            self.progress(dict(row))
        return row

    def _evaluate(self) -> dict[str, float]:
        """The one host read-out of an evaluation interval."""
        task, model = self.task, self.model
        model.eval()
        with torch.no_grad():
            train_loss, train_acc = _evaluate(model, task.train_x, task.train_y, self.eval_chunk)
            test_loss, test_acc = _evaluate(model, task.test_x, task.test_y, self.eval_chunk)
            weight_norm = torch.stack([p.detach().float().norm() for p in model.parameters()]).norm()
            values = {"train_loss": train_loss, "train_acc": train_acc, "test_loss": test_loss,
                      "test_acc": test_acc, "weight_norm": weight_norm, "loss_sum": self.loss_sum,
                      **summary_values(self.pending, list(self.attn))}
            host = torch.stack([v.detach().to(torch.float64).reshape(()) for v in values.values()]).tolist()
        self.loss_sum.zero_()
        self.pending = {}
        return dict(zip(values, host))

    def outcome(self) -> RunOutcome:
        from fastdiag.models import count_parameters

        result = self.tracker.result(epochs_run=self.epoch, steps=self.step,
                                     wall_seconds=time.perf_counter() - self.started,
                                     has_attention=bool(self.attn), n_params=count_parameters(self.model),
                                     device=self.device)
        return RunOutcome(config=self.cfg, result=result, trace=list(self.tracker.trace))

    def branch(self, **changes) -> "Trainer":
        """An independent copy continuing from this exact state; ``changes`` edit the config
        (e.g. a later horizon ``epochs=`` or ``stop_at_grok=False``)."""
        progress, self.progress = self.progress, None
        try:
            twin = copy.deepcopy(self)
        finally:
            self.progress = progress
        twin.progress = progress
        if changes:
            twin.cfg = dataclasses.replace(self.cfg, **changes).validate()
            twin.tracker.cfg = twin.cfg
        return twin


def train_run(cfg: RunConfig, progress: Callable[[dict], None] | None = None) -> RunOutcome:
    """Train one run to its end (grokking + patience, divergence or the horizon)."""
    trainer = Trainer(cfg, progress)
    while not trainer.done:
        trainer.run_epoch()
    return trainer.outcome()


def trace_columns(trace: list[dict]) -> list[str]:
    columns: list[str] = []
    for row in trace:
        for key in row:
            if key not in columns:
                columns.append(key)
    return columns


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path next to ``path`` to write to; on success it replaces ``path`` in one step (a
    reader never sees half a file), on failure (disk full, ...) it is removed. It keeps the suffix, so
    writers that pick the format from it (matplotlib) still can."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        with suppress(OSError):
            tmp.unlink(missing_ok=True)


def prepare_out_dir(out_dir: str | os.PathLike) -> Path:
    """Create ``out_dir`` and prove it writable now, so that a bad path fails before training, not
    after it (raises OSError: not a directory, read-only file system, permission denied, disk full)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out, prefix=".probe"):
        pass
    return out


def write_outputs(outcome: RunOutcome, out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write ``result.json``, ``trace.csv`` and ``trajectory.png`` into ``out_dir``; return their paths.
    Each file is written whole or not at all (`atomic_path`)."""
    from fastdiag.plots.run import plot_trajectory

    out = prepare_out_dir(out_dir)
    paths = {"result": out / "result.json", "trace": out / "trace.csv", "plot": out / "trajectory.png"}
    with atomic_path(paths["result"]) as tmp:
        tmp.write_text(json.dumps(outcome.result, indent=2, allow_nan=False) + "\n")
    with atomic_path(paths["trace"]) as tmp, open(tmp, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=trace_columns(outcome.trace))
        writer.writeheader()
        for row in outcome.trace:
            writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
    with atomic_path(paths["plot"]) as tmp:
        plot_trajectory(outcome.trace, tmp, result=outcome.result)
    return paths
