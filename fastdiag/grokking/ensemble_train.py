"""Vectorised ensembles: K runs of one architecture and size trained as one model.

Members differ only in their seed (initialisation, split, batch order) and weight decay λ_k. Each
member is built exactly as the single run with its seed is built, then the K models are stacked on a
leading member axis (`fastdiag.models.ensemble`). One step trains all members: the loss is the sum of
the members' mean losses, so each member's gradient is its single-run gradient; AdamW is applied
with each member's own decoupled weight decay. Evaluations go through the same `RunTracker` as single
runs, so traces and results have the same form. Finished members (grokked with no patience left,
diverged) are dropped from every stacked tensor at the next evaluation, so they stop costing time.
"""
from __future__ import annotations

import time
import warnings
import weakref
from collections import Counter
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from fastdiag.core.monitor import attach
from fastdiag.grokking import checkpoint as ckpt
from fastdiag.grokking.build import build_model, parameter_count, resolve_device
from fastdiag.grokking.config import RunConfig
from fastdiag.grokking.tasks import make_task
from fastdiag.grokking.tracking import RunTracker, eval_chunk, evaluate, summary_values
from fastdiag.grokking.train import RunOutcome
from fastdiag.models import attention_modules, count_parameters, mamba_ssm_available
from fastdiag.models.ensemble import VECTORISED, stack_models, vectorisable

# Members may differ in these fields only; everything else shapes the shared computation.
MEMBER_FIELDS = ("seed", "weight_decay")


def pack_key(cfg: RunConfig) -> tuple:
    """Runs with equal keys can share one ensemble."""
    return tuple(sorted((k, v) for k, v in cfg.to_dict().items() if k not in MEMBER_FIELDS))


def why_one_by_one(cfg: RunConfig) -> str | None:
    """Why runs like ``cfg`` cannot be packed into an ensemble, or None when they can."""
    if not vectorisable(cfg.arch):
        return f"{cfg.arch} cannot be vectorised; only {', '.join(VECTORISED)} can"
    if cfg.arch == "mamba" and resolve_device(cfg.device).type == "cuda" and mamba_ssm_available():
        return "mamba on CUDA runs mamba-ssm's kernels, one model per call; the PyTorch scan would pack"
    return None


def can_vectorise(cfg: RunConfig) -> bool:
    return why_one_by_one(cfg) is None


class EnsembleAdamW:
    """AdamW over stacked ``[K, ...]`` parameters with a weight decay per member.

    The update is PyTorch's single-tensor AdamW written out, so a member follows the same arithmetic
    as `torch.optim.AdamW` on the single run.
    """

    def __init__(self, params: list[torch.Tensor], lr: float, weight_decay: Sequence[float],
                 betas=(0.9, 0.98), eps: float = 1e-8) -> None:
        self.params, self.lr, self.betas, self.eps = params, lr, betas, eps
        self.decay = torch.tensor([1.0 - lr * wd for wd in weight_decay], dtype=torch.float64)
        self._decay_on: dict = {}     # (device, dtype) -> decay there: no host-to-device copy per step
        self.exp_avg = [torch.zeros_like(p) for p in params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in params]
        self.step_count = 0

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.step_count += 1
        beta1, beta2 = self.betas
        bias_correction1 = 1 - beta1 ** self.step_count
        bias_correction2_sqrt = (1 - beta2 ** self.step_count) ** 0.5
        step_size = self.lr / bias_correction1
        for p, m, v in zip(self.params, self.exp_avg, self.exp_avg_sq):
            key = (p.device, p.dtype)
            if key not in self._decay_on:
                self._decay_on[key] = self.decay.to(device=p.device, dtype=p.dtype)
            p.mul_(self._decay_on[key].view(-1, *([1] * (p.dim() - 1))))
            m.lerp_(p.grad, 1 - beta1)
            v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            denom = (v.sqrt() / bias_correction2_sqrt).add_(self.eps)
            p.addcdiv_(m, denom, value=-step_size)

    def keep(self, index: torch.Tensor) -> None:
        self.decay = self.decay.index_select(0, index.cpu())
        self._decay_on = {}
        self.exp_avg = [m.index_select(0, index) for m in self.exp_avg]
        self.exp_avg_sq = [v.index_select(0, index) for v in self.exp_avg_sq]


def _check_pack(cfgs: Sequence[RunConfig]) -> None:
    if not cfgs:
        raise ValueError("cfgs: expected at least one run configuration")
    keys = {pack_key(c) for c in cfgs}
    if len(keys) > 1:
        raise ValueError(f"cfgs: ensemble members may differ only in {', '.join(MEMBER_FIELDS)}")
    reason = why_one_by_one(cfgs[0])
    if reason is not None:
        raise ValueError(f"arch: {cfgs[0].arch!r} runs one by one here ({reason}); train its runs one by one")
    if len({c.run_id() for c in cfgs}) != len(cfgs):
        raise ValueError("cfgs: duplicate runs in one ensemble")


class _Members:
    """The stacked tensors of the members still training: the model, its optimiser, their data."""

    def __init__(self, cfgs: Sequence[RunConfig], device: torch.device) -> None:
        tasks, models = [], []
        for cfg in cfgs:   # each member exactly as its single run: task split, then seeded initialisation
            tasks.append(make_task(cfg.op, cfg.p, cfg.train_frac, seed=cfg.seed, device=device))
            torch.manual_seed(cfg.seed)
            models.append(build_model(cfg, device=device).to(device))
        self.layer_names = list(attention_modules(models[0]))
        self.n_params = count_parameters(models[0])
        self.model = stack_models(cfgs[0].arch, models).to(device)
        self.data = [torch.stack([getattr(t, name) for t in tasks]) for name in ("train_x", "train_y", "test_x", "test_y")]
        self.opt = EnsembleAdamW(list(self.model.parameters()), cfgs[0].lr, [c.weight_decay for c in cfgs])
        self.loss_sum = torch.zeros(len(cfgs), device=device)
        # measures every diag_every-th step's attention, the members leading (`fastdiag.attach`)
        self.monitor = (attach(self.model, every=cfgs[0].diag_every, keep_records=False)
                        if self.layer_names else None)
        if self.monitor is not None:
            weakref.finalize(self, self.monitor.detach)   # the model is free once the pack is done

    def keep(self, index: torch.Tensor) -> None:
        """Drop every member not in ``index`` (slots) from every stacked tensor."""
        self.model.keep(index)
        self.opt.params = list(self.model.parameters())
        self.opt.keep(index)
        self.data = [t.index_select(0, index) for t in self.data]
        self.loss_sum = self.loss_sum.index_select(0, index)


def _train_epoch(m: _Members, perm: torch.Tensor, shared: RunConfig, step: int) -> int:
    """One epoch of every member over its own shuffle ``perm`` ``[K, n_train]``; returns the step count
    after it. The monitor measures the steps that are due."""
    train_x, train_y = m.data[0], m.data[1]
    m.model.train()
    members = torch.arange(perm.shape[0], device=perm.device)[:, None]
    for start in range(0, perm.shape[1], shared.batch_size):
        idx = perm[:, start:start + shared.batch_size]
        logits = m.model(train_x[members, idx])                          # [K, b, vocab]
        per_member = F.cross_entropy(logits.flatten(0, 1), train_y[members, idx].flatten(),
                                     reduction="none").view(perm.shape[0], -1).mean(1)
        m.opt.zero_grad()
        per_member.sum().backward()
        m.opt.step()
        m.loss_sum += per_member.detach()
        step += 1
    return step


def _evaluation_rows(m: _Members, chunk: int) -> list[dict[str, float]]:
    """Every active member's evaluation values (one host transfer for all), in slot order; the head
    statistics merged over the measured steps since the last evaluation."""
    metrics = _evaluate(m.model, *m.data, chunk)
    metrics["loss_sum"] = m.loss_sum
    metrics.update(summary_values(m.monitor.merged_stats(reset=True) if m.monitor else {}, m.layer_names))
    names = list(metrics)
    k = m.loss_sum.shape[0]
    host = torch.stack([metrics[name].detach().to(torch.float64).reshape(k) for name in names], 1).tolist()
    m.loss_sum.zero_()
    return [dict(zip(names, values)) for values in host]


def _pack_state(m: _Members, ids: list[str], shuffles, trackers, epoch: int, step: int, device, started) -> dict:
    """The state of the members still training, right after an evaluation (nothing pending): every
    stacked tensor keeps its member axis, so a resume may take any subset of ``member_ids``."""
    return {"epoch": epoch, "step": step, "member_ids": ids,
            "params": [p.detach() for p in m.model.parameters()],
            "exp_avg": m.opt.exp_avg, "exp_avg_sq": m.opt.exp_avg_sq, "step_count": m.opt.step_count,
            "decay": m.opt.decay, "shuffles": [g.get_state() for g in shuffles],
            "trackers": [ckpt.tracker_state(t) for t in trackers], "rng": ckpt.rng_state(device),
            "elapsed": time.perf_counter() - started}


@torch.no_grad()
def _restore_pack(m: _Members, state: dict, ids: list[str], shuffles, trackers, device) -> tuple[int, int]:
    """Load the members ``ids`` (all among the state's ``member_ids``) from a pack state; returns
    (epoch, step)."""
    slots = torch.tensor([state["member_ids"].index(rid) for rid in ids], dtype=torch.long)
    for p, saved in zip(m.model.parameters(), state["params"]):
        p.copy_(saved.index_select(0, slots))
    m.opt.exp_avg = [t.index_select(0, slots).to(device) for t in state["exp_avg"]]
    m.opt.exp_avg_sq = [t.index_select(0, slots).to(device) for t in state["exp_avg_sq"]]
    m.opt.step_count = int(state["step_count"])
    m.opt.decay = state["decay"].index_select(0, slots)
    m.opt._decay_on = {}
    for slot, g, t in zip(slots.tolist(), shuffles, trackers):
        g.set_state(state["shuffles"][slot])
        ckpt.restore_tracker(t, state["trackers"][slot])
    ckpt.set_rng_state(state["rng"], device)
    return int(state["epoch"]), int(state["step"])


def train_ensemble(cfgs: Sequence[RunConfig], progress: Callable[[int, dict], None] | None = None,
                   on_finish: Callable[[int, RunOutcome], None] | None = None,
                   checkpoint: ckpt.Checkpointer | None = None) -> list[RunOutcome]:
    """Train the runs ``cfgs`` as one vectorised model; returns their outcomes in the given order.

    ``progress(member_index, row)`` receives every member's trace rows; ``on_finish(member_index,
    outcome)`` is called as soon as a member is done, so a caller can store it before the others end.
    With ``checkpoint`` the pack resumes from its saved state when every run of ``cfgs`` is among the
    members it saved (members finished since are simply absent), and saves the members still training
    at the checkpointer's cadence; the caller removes the file once the outcomes are safe.
    """
    cfgs = [c.validate() for c in cfgs]
    _check_pack(cfgs)
    started = time.perf_counter()
    shared = cfgs[0]
    device = resolve_device(shared.device)
    m = _Members(cfgs, device)
    n_train = m.data[0].shape[1]
    shuffles = [torch.Generator().manual_seed(c.seed) for c in cfgs]
    trackers = [RunTracker(c, m.layer_names) for c in cfgs]
    active = list(range(len(cfgs)))        # positions in cfgs of the members still in the model
    outcomes: dict[int, RunOutcome] = {}
    chunk = eval_chunk(device)
    step = epoch = 0
    ids = [c.run_id() for c in cfgs]
    if checkpoint is not None:
        state = checkpoint.load()
        if state is not None and set(ids) <= set(state["member_ids"]):
            epoch, step = _restore_pack(m, state, ids, shuffles, trackers, device)
            if m.monitor is not None:
                m.monitor.set_step(step)
            started -= float(state["elapsed"])
            checkpoint.last_epoch = checkpoint.resumed_epoch = epoch
        elif state is not None:
            warnings.warn(f"checkpoint {checkpoint.path}: holds other members than this pack's; starting "
                          "from epoch 0", RuntimeWarning, stacklevel=2)
    while active:
        epoch += 1
        perm = torch.stack([torch.randperm(n_train, generator=shuffles[i]) for i in active]).to(device)
        step = _train_epoch(m, perm, shared, step)
        if epoch % shared.eval_every and epoch != shared.epochs:
            continue
        rows = _evaluation_rows(m, chunk)
        keep = []
        for slot, pos in enumerate(active):
            row = trackers[pos].record(epoch, step, rows[slot])
            if progress is not None:
                progress(pos, dict(row))
            if not (trackers[pos].stopped or epoch >= shared.epochs):
                keep.append(slot)
                continue
            result = trackers[pos].result(epochs_run=epoch, steps=step, wall_seconds=time.perf_counter() - started,
                                          has_attention=bool(m.layer_names), n_params=m.n_params, device=device)
            result["ensemble_size"] = len(cfgs)
            outcomes[pos] = RunOutcome(config=cfgs[pos], result=result, trace=list(trackers[pos].trace))
            if on_finish is not None:
                on_finish(pos, outcomes[pos])
        if len(keep) < len(active):   # compact: finished members stop costing time
            m.keep(torch.tensor(keep, dtype=torch.long, device=device))
            active = [active[s] for s in keep]
        if checkpoint is not None and active and checkpoint.due(epoch):
            checkpoint.save(_pack_state(m, [ids[i] for i in active], [shuffles[i] for i in active],
                                        [trackers[i] for i in active], epoch, step, device, started), epoch)
    return [outcomes[i] for i in range(len(cfgs))]


@torch.no_grad()
def _evaluate(model, train_x, train_y, test_x, test_y, chunk: int) -> dict[str, torch.Tensor]:
    model.eval()
    out = {}
    out["train_loss"], out["train_acc"] = evaluate(model, train_x, train_y, chunk)
    out["test_loss"], out["test_acc"] = evaluate(model, test_x, test_y, chunk)
    out["weight_norm"] = torch.stack([p.detach().float().flatten(1).norm(dim=1) for p in model.parameters()], 1).norm(dim=1)
    return out


def pack_runs(cfgs: Sequence[RunConfig], size: int | None) -> list[list[RunConfig]]:
    """Group runs into ensembles of at most ``size`` compatible members (None: `default_ensemble_size`
    of each group); runs that cannot be vectorised come back as packs of one."""
    if size is not None and size < 1:
        raise ValueError(f"ensemble size: must be >= 1, got {size}")
    groups: dict[tuple, list[RunConfig]] = {}
    packs: list[list[RunConfig]] = []
    for cfg in cfgs:
        if size == 1 or not can_vectorise(cfg):
            packs.append([cfg])
        else:
            groups.setdefault(pack_key(cfg), []).append(cfg)
    for members in groups.values():   # ceil(n / k) packs of near-equal size, not k, k, …, rest
        k = size or default_ensemble_size(members[0])
        n_packs = -(-len(members) // k)
        bounds = [round(i * len(members) / n_packs) for i in range(n_packs + 1)]
        packs += [members[a:b] for a, b in zip(bounds, bounds[1:])]
    return packs


def describe_packs(packs: list[list[RunConfig]]) -> list[str]:
    """What a sweep is about to do with its runs, in lines for the user."""
    lines = []
    multi = [p for p in packs if len(p) > 1]
    if multi:
        sizes = "/".join(str(n) for n in sorted({len(p) for p in multi}))
        lines.append(f"ensembles: {sum(map(len, multi))} runs as {len(multi)} vectorised ensemble(s) of "
                     f"{sizes} members")
    singles = [p[0] for p in packs if len(p) == 1]
    for (arch, reason), n in Counter((c.arch, why_one_by_one(c)) for c in singles if not can_vectorise(c)).items():
        lines.append(f"ensembles: {n} {arch} run(s) one by one ({reason})")
    alone = sum(1 for c in singles if can_vectorise(c))
    if alone:
        lines.append(f"ensembles: {alone} run(s) one by one (ensemble size 1, or no compatible run to pack with)")
    return lines


def default_ensemble_size(cfg: RunConfig) -> int:
    """The ensemble size ``--ensemble auto`` gives runs like ``cfg``.

    A GPU is idle with one tiny model: pack 32. On a CPU a member-step costs about what a single run's
    step costs (benchmarks/RESULTS.md), so ensembles only pay where per-op overhead is large, i.e. for
    small models, and too many members push the activations out of the caches: 8 members up to
    ~0.45 M parameters, fewer above (canonical 0.82 M: 4), one by one from ~2.5 M."""
    if resolve_device(cfg.device).type == "cuda":
        return 32
    n = parameter_count(cfg) or 1_000_000
    return max(1, min(8, round(3.5e6 / n)))


__all__ = ["EnsembleAdamW", "can_vectorise", "default_ensemble_size", "describe_packs", "pack_key", "pack_runs",
           "train_ensemble", "why_one_by_one"]
