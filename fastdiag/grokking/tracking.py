"""What single runs and ensembles share: the evaluation of a model on the task, and the bookkeeping of a
run from its evaluations (trace rows, t_mem, t_grok, regime, result), so that an ensemble member is
judged exactly like a single run."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fastdiag.core import stats
from fastdiag.grokking.config import RunConfig
from fastdiag.grokking.labels import anti_grok_epoch, regime_label


def eval_chunk(device: torch.device) -> int:
    """Rows per evaluation forward: on CPU, chunks that stay in cache are several times faster than
    one big batch; a GPU wants large ones."""
    return 512 if device.type == "cpu" else 16384


@torch.inference_mode()      # no autograd bookkeeping at all (no_grad still counts tensor versions)
def evaluate(model, x: torch.Tensor, y: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy and accuracy of ``model`` on (x, y) as device tensors (no host sync), in
    chunks of ``chunk`` rows. ``x`` is ``[..., N, T]`` and ``y`` ``[..., N]``: an ensemble's leading
    member axis gives one loss and accuracy per member."""
    n = y.shape[-1]
    loss = torch.zeros(y.shape[:-1], device=y.device)
    correct = torch.zeros(y.shape[:-1], device=y.device)
    for start in range(0, n, chunk):
        logits = model(x[..., start:start + chunk, :])
        target = y[..., start:start + chunk]
        loss += F.cross_entropy(logits.flatten(0, -2), target.flatten(), reduction="none").view(target.shape).sum(-1)
        correct += (logits.argmax(-1) == target).sum(-1)
    return loss / n, correct / n


def _finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


class RunTracker:
    """Bookkeeping of one run from its evaluations: trace rows, t_mem, t_grok, anti-grok, divergence,
    regime and the result dict. Shared by the single-run trainer and the ensemble trainer, so a member
    of an ensemble is judged exactly like a single run."""

    def __init__(self, cfg: RunConfig, layer_names: list[str]) -> None:
        self.cfg = cfg
        self.layer_names = layer_names
        self.trace: list[dict] = []
        self.t_mem = self.t_grok = None
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
        return row

    @property
    def stopped(self) -> bool:
        """Diverged, or grokked with the patience used up (when the run stops at grokking)."""
        if self.diverged:
            return True
        epoch = self.trace[-1]["epoch"] if self.trace else 0
        return self.cfg.stop_at_grok and self.t_grok is not None and epoch >= self.t_grok[0] + self.cfg.patience

    @property
    def anti_grok_epoch(self) -> int | None:
        """Where a sustained loss of generalisation began (fastdiag.grokking.labels), judged on the
        trace so far."""
        return None if self.diverged else anti_grok_epoch(self.trace, self.cfg.grok_threshold)

    @property
    def regime(self) -> str:
        """The label of the run so far, by the rules of fastdiag.grokking.labels."""
        return regime_label(self.trace, self.cfg.grok_threshold, diverged=self.diverged)

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
    return stats.summarize({name: pending[name] for name in layer_names}).tensors()
