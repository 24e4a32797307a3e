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

import dataclasses
import functools
import gc
import time
import weakref
from collections import Counter
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from fastdiag.core.monitor import attach
from fastdiag.grokking import checkpoint as ckpt
from fastdiag.grokking.build import build_model, parameter_count, resolve_device
from fastdiag.grokking.config import RunConfig
from fastdiag.grokking.graphed_step import WARMUP_STEPS, GraphedSteps, graphed_device
from fastdiag.grokking.tasks import make_task
from fastdiag.grokking.tracking import RunTracker, eval_chunk, evaluate, summary_values
from fastdiag.grokking.train import RunOutcome, Trainer
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
    as `torch.optim.AdamW` on the single run. ``capturable=True`` (graphed steps on CUDA): the
    capturable foreach form, the step counter and bias corrections on the device, as the graphed
    single run's ``torch.optim.AdamW(capturable=True, foreach=True)`` computes them.
    """

    def __init__(self, params: list[torch.Tensor], lr: float, weight_decay: Sequence[float],
                 betas=(0.9, 0.98), eps: float = 1e-8, capturable: bool = False) -> None:
        self.params, self.lr, self.betas, self.eps = params, lr, betas, eps
        self.decay = torch.tensor([1.0 - lr * wd for wd in weight_decay], dtype=torch.float64)
        self._decay_on: dict = {}     # (device, dtype) -> decay there: no host-to-device copy per step
        self.exp_avg = [torch.zeros_like(p) for p in params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in params]
        self.capturable = capturable
        self._step_t = torch.zeros((), dtype=torch.float32, device=params[0].device) if capturable else None
        self.step_count = 0

    @property
    def step_count(self) -> int:
        return int(self._step_t.item()) if self.capturable else self._count     # capturable: a host read

    @step_count.setter
    def step_count(self, value: int) -> None:
        self._count = int(value)
        if self.capturable:
            self._step_t.fill_(self._count)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def _decay(self, p: torch.Tensor) -> torch.Tensor:
        key = (p.device, p.dtype)
        if key not in self._decay_on:
            self._decay_on[key] = self.decay.to(device=p.device, dtype=p.dtype)
        return self._decay_on[key].view(-1, *([1] * (p.dim() - 1)))

    @torch.no_grad()
    def step(self) -> None:
        if self.capturable:
            return self._step_on_device()
        self.step_count += 1
        beta1, beta2 = self.betas
        bias_correction1 = 1 - beta1 ** self.step_count
        bias_correction2_sqrt = (1 - beta2 ** self.step_count) ** 0.5
        step_size = self.lr / bias_correction1
        for p, m, v in zip(self.params, self.exp_avg, self.exp_avg_sq):
            p.mul_(self._decay(p))
            m.lerp_(p.grad, 1 - beta1)
            v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            denom = (v.sqrt() / bias_correction2_sqrt).add_(self.eps)
            p.addcdiv_(m, denom, value=-step_size)

    def _step_on_device(self) -> None:
        """torch.optim.adam's capturable multi-tensor (foreach) branch, as the graphed single run's
        ``AdamW(capturable=True, foreach=True)`` computes it, with a weight decay per member: a few
        kernels for all parameters, no host value per step."""
        self._step_t += 1
        beta1, beta2 = self.betas
        grads = [p.grad for p in self.params]
        step_size = -self.lr / (1 - beta1 ** self._step_t)
        bias_correction2_sqrt = (1 - beta2 ** self._step_t).sqrt()
        torch._foreach_mul_(self.params, [self._decay(p) for p in self.params])
        torch._foreach_lerp_(self.exp_avg, grads, 1 - beta1)
        torch._foreach_mul_(self.exp_avg_sq, beta2)
        torch._foreach_addcmul_(self.exp_avg_sq, grads, grads, 1 - beta2)
        denom = torch._foreach_sqrt(self.exp_avg_sq)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, self.eps)
        torch._foreach_div_(denom, step_size)
        torch._foreach_addcdiv_(self.params, self.exp_avg, denom)

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
        graphed = graphed_device(cfgs[0].graphed, device)    # CUDA only: the CPU loop is as it was
        tasks, models = [], []
        for cfg in cfgs:   # each member exactly as its single run: task split, then seeded initialisation
            tasks.append(make_task(cfg.op, cfg.p, cfg.train_frac, seed=cfg.seed, device=device))
            torch.manual_seed(cfg.seed)
            models.append(build_model(cfg, device=device).to(device))
        self.layer_names = list(attention_modules(models[0]))
        self.n_params = count_parameters(models[0])
        self.model = stack_models(cfgs[0].arch, models).to(device)
        self.data = [torch.stack([getattr(t, name) for t in tasks]) for name in ("train_x", "train_y", "test_x", "test_y")]
        self.opt = EnsembleAdamW(list(self.model.parameters()), cfgs[0].lr, [c.weight_decay for c in cfgs],
                                 capturable=graphed)
        self.loss_sum = torch.zeros(len(cfgs), device=device)
        # measures every diag_every-th step's attention, the members leading (`fastdiag.attach`)
        self.monitor = (attach(self.model, every=cfgs[0].diag_every, keep_records=False)
                        if self.layer_names else None)
        if self.monitor is not None:
            weakref.finalize(self, self.monitor.detach)   # the model is free once the pack is done
        self.graphs = GraphedSteps(self.step, functools.partial(getattr, self, "monitor"), device) if graphed else None

    def step(self, idx: torch.Tensor) -> None:
        """One step of every member on its minibatch ``idx`` ``[K, b]`` (rows of its training half)."""
        members = torch.arange(idx.shape[0], device=idx.device)[:, None]
        logits = self.model(self.data[0][members, idx])                          # [K, b, vocab]
        per_member = F.cross_entropy(logits.flatten(0, 1), self.data[1][members, idx].flatten(),
                                     reduction="none").view(idx.shape[0], -1).mean(1)
        self.opt.zero_grad()
        per_member.sum().backward()
        self.opt.step()
        self.loss_sum += per_member.detach()

    def merged_stats(self) -> dict:
        """The head statistics since the last evaluation (the monitor's, plus the graphs'); resets them."""
        stats = self.monitor.merged_stats(reset=True) if self.monitor else {}
        return self.graphs.merged_stats(stats) if self.graphs is not None else stats

    def keep(self, index: torch.Tensor) -> None:
        """Drop every member not in ``index`` (slots) from every stacked tensor."""
        self.model.keep(index)
        self.opt.params = list(self.model.parameters())
        self.opt.keep(index)
        self.data = [t.index_select(0, index) for t in self.data]
        self.loss_sum = self.loss_sum.index_select(0, index)
        if self.graphs is not None:     # every tensor the graphs captured is new
            self.graphs.reset()


def _train_epoch(m: _Members, perm: torch.Tensor, shared: RunConfig, step: int) -> int:
    """One epoch of every member over its own shuffle ``perm`` ``[K, n_train]``; returns the step count
    after it. The monitor measures the steps that are due."""
    m.model.train()
    run_step = m.graphs or m.step
    for start in range(0, perm.shape[1], shared.batch_size):
        run_step(perm[:, start:start + shared.batch_size])
        step += 1
    return step


def _evaluation_rows(m: _Members, chunk: int) -> list[dict[str, float]]:
    """Every active member's evaluation values (one host transfer for all), in slot order; the head
    statistics merged over the measured steps since the last evaluation."""
    metrics = _evaluate(m.model, *m.data, chunk)
    metrics["loss_sum"] = m.loss_sum
    metrics.update(summary_values(m.merged_stats(), m.layer_names))
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
    if m.graphs is not None:       # the optimizer's moments are new tensors: capture again
        m.graphs.reset()
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
        template = _pack_state(m, ids, shuffles, trackers, 0, 0, device, started)
        resumed: list = []

        def restore(state: dict) -> None:      # checked in full before anything changes
            ckpt.check_pack_state(state, template, ids, shared, -(-n_train // shared.batch_size))
            resumed.append(None)                # from here on the pack is changed
            resumed[0] = _restore_pack(m, state, ids, shuffles, trackers, device)
            resumed.append(float(state["elapsed"]))

        if checkpoint.resume(restore):
            (epoch, step), elapsed = resumed
            if m.monitor is not None:
                m.monitor.set_step(step)
            started -= elapsed
            checkpoint.last_epoch = checkpoint.resumed_epoch = epoch
        elif resumed:                           # failed midway though checked: start afresh
            m = _Members(cfgs, device)
            shuffles = [torch.Generator().manual_seed(c.seed) for c in cfgs]
            trackers = [RunTracker(c, m.layer_names) for c in cfgs]
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
        k = size or default_ensemble_size(members[0], most=len(members))
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


def default_ensemble_size(cfg: RunConfig, most: int | None = None) -> int:
    """The ensemble size ``--ensemble auto`` gives runs like ``cfg``.

    On CUDA: `gpu_ensemble_size`, from the device's free memory and measured throughput. On a CPU a
    member-step costs about what a single run's step costs (benchmarks/RESULTS.md), so ensembles only
    pay where per-op overhead is large, i.e. for small models, and too many members push the
    activations out of the caches: 8 members up to ~0.45 M parameters, fewer above (canonical 0.82 M:
    4), one by one from ~2.5 M."""
    if resolve_device(cfg.device).type == "cuda":    # ``most``: the runs there are to pack (fewer sizes to time)
        return gpu_ensemble_size(cfg, sizes=sorted({min(k, most or k) for k in GPU_PACKS}))
    n = parameter_count(cfg) or 1_000_000
    return max(1, min(8, round(3.5e6 / n)))


# --ensemble auto on a GPU: the pack sizes tried (largest first fits the memory), the share of the free
# device memory a pack may take (its graphs keep a memory pool per step shape: room for the tail
# minibatch's), and what counts as as fast as the best (the smallest such pack is chosen: members that
# finish early leave a large pack emptier).
GPU_PACKS = (64, 128, 256, 512)
GPU_MEMORY_SHARE = 0.5
GPU_NEAR_BEST = 0.9
_GPU_SIZES: dict[tuple, dict] = {}


def release_cuda_memory() -> None:
    """Give back what a measurement held: its graphs sit in reference cycles (trainer ↔ its step), so
    they go only at a collection; then the allocator's cache."""
    gc.collect()
    torch.cuda.empty_cache()


def calibration_members(cfg: RunConfig, k: int) -> list[RunConfig]:
    """``k`` distinct runs like ``cfg`` (seeds cfg.seed, cfg.seed + 1, ...) to measure a pack with."""
    return [dataclasses.replace(cfg, seed=cfg.seed + i) for i in range(k)]


def gpu_ensemble_size(cfg: RunConfig, sizes: Sequence[int] = GPU_PACKS, steps: int = 30) -> int:
    """Members per pack for runs like ``cfg`` on their CUDA device: a pack of 8 measures the memory a
    member takes; of ``sizes``, those whose packs fit `GPU_MEMORY_SHARE` of the free memory are timed
    (``steps`` steps each) and the smallest within `GPU_NEAR_BEST` of the best runs per second wins
    (none fits: as many members as fit). Measured once per kind of run and device in a process;
    `gpu_ensemble_choice` tells what was measured."""
    key = _gpu_key(cfg, sizes)
    if key not in _GPU_SIZES:
        free = torch.cuda.mem_get_info(resolve_device(cfg.device))[0]
        probe = measure_pack(calibration_members(cfg, 8), steps=3)
        per_member = probe["peak_bytes"] / 8
        fits = [k for k in sizes if k * per_member <= GPU_MEMORY_SHARE * free]
        if not fits:
            fits = [max(1, int(GPU_MEMORY_SHARE * free // per_member))]
        rates = {}
        for k in fits:
            rates[k] = k / measure_pack(calibration_members(cfg, k), steps)["step_seconds"]
            release_cuda_memory()
        best = max(rates.values())
        _GPU_SIZES[key] = {"size": min(k for k in fits if rates[k] >= GPU_NEAR_BEST * best),
                           "member_steps_per_second": rates, "bytes_per_member": per_member, "free_bytes": free}
    return _GPU_SIZES[key]["size"]


def gpu_ensemble_choice(cfg: RunConfig, sizes: Sequence[int] = GPU_PACKS) -> dict | None:
    """What `gpu_ensemble_size` measured for runs like ``cfg`` (None before it ran): the size chosen, the
    member-steps per second of each pack size timed, the bytes per member and the free memory."""
    return _GPU_SIZES.get(_gpu_key(cfg, sizes))


def _gpu_key(cfg: RunConfig, sizes: Sequence[int]) -> tuple:
    device = str(resolve_device(cfg.device))
    return pack_key(dataclasses.replace(cfg, device=device)), device, tuple(sizes)


def measure_pack(cfgs: Sequence[RunConfig], steps: int, warmup: int = WARMUP_STEPS + 2) -> dict:
    """Seconds per training step and per evaluation of the runs ``cfgs`` trained as the sweep trains
    them (one run: its `Trainer`; several: one vectorised ensemble, graphed on CUDA when the configs
    say so), on random minibatches: ``warmup`` steps first (graph captures, allocator), then ``steps``
    timed ones, then two evaluations (the second timed). Also the peak device memory it took on CUDA."""
    if steps < 1:
        raise ValueError(f"steps: must be >= 1, got {steps}")
    cfgs = [c.validate() for c in cfgs]
    device = resolve_device(cfgs[0].device)
    cuda = device.type == "cuda"
    if cuda:
        release_cuda_memory()
        torch.cuda.reset_peak_memory_stats(device)
        held = torch.cuda.memory_allocated(device)      # not this measurement's
    if len(cfgs) == 1:
        trainer = Trainer(cfgs[0])
        n_train, step, evaluate_once = trainer.task.train_x.shape[0], trainer._train_step, trainer._evaluate
    else:
        _check_pack(cfgs)
        m = _Members(cfgs, device)
        m.model.train()
        n_train, step = m.data[0].shape[1], m.graphs or m.step
        chunk = eval_chunk(device)
        evaluate_once = lambda: _evaluation_rows(m, chunk)   # noqa: E731
    batch = min(cfgs[0].batch_size, n_train)
    shape = (len(cfgs), n_train) if len(cfgs) > 1 else (n_train,)
    perm = torch.rand(shape, device=device).argsort(-1)[..., :batch]
    sync = torch.cuda.synchronize if cuda else (lambda *_: None)
    for _ in range(warmup):
        step(perm)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step(perm)
    sync()
    step_seconds = (time.perf_counter() - start) / steps
    evaluate_once()
    start = time.perf_counter()
    evaluate_once()                  # ends in a host read: synchronised
    eval_seconds = time.perf_counter() - start
    return {"members": len(cfgs), "steps": steps, "step_seconds": step_seconds, "eval_seconds": eval_seconds,
            "peak_bytes": torch.cuda.max_memory_allocated(device) - held if cuda else None, "device": str(device)}


__all__ = ["EnsembleAdamW", "can_vectorise", "default_ensemble_size", "describe_packs", "gpu_ensemble_size",
           "measure_pack", "release_cuda_memory", "pack_key", "pack_runs", "train_ensemble", "why_one_by_one"]
