"""One grokking training run (docs/experiments.md) with online head diagnostics.

``train_run(cfg)`` trains the model of a ``RunConfig`` on its modular-arithmetic task with AdamW
(betas 0.9/0.98, weight decay λ on all parameters), minibatches reshuffled every epoch, and returns a
``RunOutcome``: the config, a JSON-able ``result`` dict and a ``trace`` (one JSON-able row per
evaluation). Diagnostics come from the training step's own forward pass, measured by
``fastdiag.attach(model, every=diag_every)`` as in any other training loop; the statistics of all
measured steps since the previous evaluation are merged with ``+`` (`Monitor.merged_stats`) and
summarised at evaluation time, which is the only moment anything is read to the host.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from fastdiag.core.monitor import Monitor, attach
from fastdiag.grokking import checkpoint as ckpt
from fastdiag.grokking.build import build_model, resolve_device
from fastdiag.grokking.config import RunConfig
from fastdiag.grokking.graphed_step import GraphedSteps, graphed_device, make_adamw, make_capturable
from fastdiag.grokking.tasks import make_task
from fastdiag.grokking.tracking import RunTracker, eval_chunk, evaluate, summary_values
from fastdiag.models import attention_modules, count_parameters


@dataclass
class RunOutcome:
    config: RunConfig
    result: dict
    trace: list[dict] = field(default_factory=list)


class Trainer:
    """One run, an epoch at a time: ``while not t.done: t.run_epoch()``, then ``t.outcome()``.

    ``branch(**changes)`` deep-copies the whole state (model, optimizer, shuffle generator,
    bookkeeping) so an experiment can continue several arms from one checkpoint.

    ``monitor``: the `Monitor` measuring the model's attention (None for a model without any); its
    steps are the trainer's optimizer steps.
    """

    def __init__(self, cfg: RunConfig, progress: Callable[[dict], None] | None = None) -> None:
        self.cfg = cfg = cfg.validate()
        self.progress = progress
        self.started = time.perf_counter()
        self.device = device = resolve_device(cfg.device)
        self.task = make_task(cfg.op, cfg.p, cfg.train_frac, seed=cfg.seed, device=device)
        torch.manual_seed(cfg.seed)
        self.model = build_model(cfg, device=device).to(device)
        self.attn = attention_modules(self.model)
        graphed = graphed_device(cfg.graphed, device)   # CUDA only: the CPU loop is as it was
        self.opt = make_adamw(self.model.parameters(), cfg.lr, cfg.weight_decay, graphed)
        self.shuffle = torch.Generator().manual_seed(cfg.seed)
        self.tracker = RunTracker(cfg, list(self.attn))
        self.eval_chunk = eval_chunk(device)
        self.epoch = 0
        self.step = 0
        self.loss_sum = torch.zeros((), device=device)  # minibatch losses since the last evaluation
        self.monitor = self._attach()
        self.graphs = GraphedSteps(self._step_body, functools.partial(getattr, self, "monitor"), device) if graphed else None

    @property
    def done(self) -> bool:
        return self.tracker.stopped or self.epoch >= self.cfg.epochs

    def _attach(self) -> Monitor | None:
        """A monitor on the model measuring every ``diag_every``-th step from this trainer's step on."""
        if not self.attn:
            return None
        monitor = attach(self.model, every=self.cfg.diag_every, keep_records=False)
        monitor.set_step(self.step)
        weakref.finalize(self, monitor.detach)   # the model is free once the trainer is
        return monitor

    def _train_step(self, idx: torch.Tensor) -> None:
        (self.graphs or self._step_body)(idx)
        self.step += 1

    def _step_body(self, idx: torch.Tensor) -> None:
        logits = self.model(self.task.train_x[idx])     # measured by the monitor when due
        loss = F.cross_entropy(logits, self.task.train_y[idx])
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.loss_sum += loss.detach()

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
            train_loss, train_acc = evaluate(model, task.train_x, task.train_y, self.eval_chunk)
            test_loss, test_acc = evaluate(model, task.test_x, task.test_y, self.eval_chunk)
            weight_norm = torch.stack([p.detach().float().norm() for p in model.parameters()]).norm()
            values = {"train_loss": train_loss, "train_acc": train_acc, "test_loss": test_loss,
                      "test_acc": test_acc, "weight_norm": weight_norm, "loss_sum": self.loss_sum,
                      **summary_values(self._merged_stats(), list(self.attn))}
            host = torch.stack([v.detach().to(torch.float64).reshape(()) for v in values.values()]).tolist()
        self.loss_sum.zero_()
        return dict(zip(values, host))

    def _merged_stats(self) -> dict:
        """The head statistics since the last evaluation (the monitor's, plus the graphs' own); resets them."""
        stats = self.monitor.merged_stats(reset=True) if self.monitor else {}
        return self.graphs.merged_stats(stats) if self.graphs is not None else stats

    def outcome(self) -> RunOutcome:
        result = self.tracker.result(epochs_run=self.epoch, steps=self.step,
                                     wall_seconds=time.perf_counter() - self.started,
                                     has_attention=bool(self.attn), n_params=count_parameters(self.model),
                                     device=self.device)
        return RunOutcome(config=self.cfg, result=result, trace=list(self.tracker.trace))

    def state(self) -> dict:
        """Everything the rest of the run depends on, taken right after an evaluation (nothing pending):
        what a checkpoint saves (`fastdiag.grokking.checkpoint`)."""
        self._check_nothing_pending("Trainer.state")
        return {"epoch": self.epoch, "step": self.step, "model": self.model.state_dict(),
                "optimizer": self.opt.state_dict(), "shuffle": self.shuffle.get_state(),
                "rng": ckpt.rng_state(self.device), "tracker": ckpt.tracker_state(self.tracker),
                "elapsed": time.perf_counter() - self.started}

    def restore(self, state: dict) -> None:
        """Continue from ``state()`` of a trainer of the same config; one that does not fit (checked in
        full first, `ckpt.check_run_state`) raises `ckpt.UnusableCheckpoint` and changes nothing."""
        steps_per_epoch = -(-self.task.train_x.shape[0] // self.cfg.batch_size)
        ckpt.check_run_state(state, self.state(), list(self.model.parameters()), self.cfg, steps_per_epoch)
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        if self.graphs is not None:   # the optimizer's state tensors are new: capture again
            make_capturable(self.opt)
            self.graphs.reset()
        self.shuffle.set_state(state["shuffle"])
        ckpt.set_rng_state(state["rng"], self.device)
        ckpt.restore_tracker(self.tracker, state["tracker"])
        self.loss_sum.zero_()
        if self.monitor is not None:
            self.monitor.merged_stats(reset=True)
            self.monitor.set_step(self.step)
        self.started = time.perf_counter() - float(state["elapsed"])   # wall_seconds: all attempts

    def _check_nothing_pending(self, what: str) -> None:
        measured = self.monitor is not None and self.monitor.merged_stats()   # since the last evaluation
        if measured or self.epoch % self.cfg.eval_every and self.epoch != self.cfg.epochs:
            raise RuntimeError(f"{what}: only right after an evaluation (head statistics are pending)")

    def branch(self, **changes) -> "Trainer":
        """An independent copy continuing from this exact state, taken right after an evaluation;
        ``changes`` edit the config (e.g. a later horizon ``epochs=`` or ``stop_at_grok=False``).
        The copy gets its own monitor: the model is copied without this trainer's hooks."""
        self._check_nothing_pending("Trainer.branch")
        progress, self.progress = self.progress, None
        monitor, self.monitor = self.monitor, None
        if monitor is not None:
            monitor.detach()
        try:
            twin = copy.deepcopy(self)
        finally:
            self.progress = progress
            self.monitor = self._attach()
        twin.progress = progress
        if changes:
            twin.cfg = dataclasses.replace(self.cfg, **changes).validate()
            twin.tracker.cfg = twin.cfg
        twin.monitor = twin._attach()
        return twin


def train_run(cfg: RunConfig, progress: Callable[[dict], None] | None = None,
              checkpoint: ckpt.Checkpointer | None = None) -> RunOutcome:
    """Train one run to its end (grokking + patience, divergence or the horizon).

    With ``checkpoint`` the run first resumes from its saved state, if there is one, and saves its
    state at the checkpointer's cadence; the caller removes the file once the outcome is safe."""
    trainer = Trainer(cfg, progress)
    if checkpoint is not None:
        if checkpoint.resume(trainer.restore):
            checkpoint.last_epoch = checkpoint.resumed_epoch = trainer.epoch
        elif trainer.epoch or trainer.step:      # applying failed after the checks passed: start afresh
            trainer = Trainer(cfg, progress)
    while not trainer.done:
        row = trainer.run_epoch()
        if checkpoint is not None and row is not None and not trainer.done and checkpoint.due(trainer.epoch):
            checkpoint.save(trainer.state(), trainer.epoch)
    return trainer.outcome()
