"""The experiments stage of benchmarks/gpu_check.sh: is a training step bound by the device?

    python benchmarks/gpu_experiments.py [--dry-run] [--steps N]

JSON lines, one per measurement (``{"stage": "experiments", "what": ...}``):
- ``canonical_step``: ms per training step of the canonical run (SPEC §4, λ = 1, diagnostics every 10
  steps) through the trainer eagerly (``graphed=False``), graphed (the default on CUDA), and a bare
  PyTorch loop of the same model and AdamW without diagnostics; the ratio eager / graphed.
- ``ensemble``: packs of 1, 8, 64 and 256 canonical members (`measure_pack`, graphed): ms per pack
  step and per evaluation, runs per hour at the λ = 1 run length (130 epochs, evaluated every 10), and
  the ratio to one by one.
- ``mamba_step``: the canonical Mamba (4 × d 128, expand 4, d_state 16) through the trainer with the
  Triton scan (graphed), with the PyTorch scan (eager, what CUDA ran before), and the parameter-matched
  transformer (d_ff 648, 0.96 M parameters) graphed; ratio Mamba / transformer.
``--dry-run``: the same code on CPU with a tiny model and packs of 1/2/4/8, a few steps (CI proves
the script; its numbers mean nothing).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

import fastdiag.models.mamba as mamba
from fastdiag.grokking.build import build_model
from fastdiag.grokking.config import RunConfig
from fastdiag.grokking.ensemble_train import calibration_members, measure_pack, release_cuda_memory
from fastdiag.grokking.tasks import make_task
from fastdiag.grokking.train import Trainer
from fastdiag.models import count_parameters
from fastdiag.sweep.plan import steps_per_epoch

TINY = dict(preset="custom", n_layers=1, n_heads=2, d_model=16, d_ff=32, p=11)


def emit(dry_run: bool, what: str, **fields) -> None:
    """One JSON line to stdout and, as every gpu_check.sh stage does, to $OUT/results.jsonl."""
    line = json.dumps({"stage": "experiments", "dry_run": dry_run, "what": what, **fields}, default=str)
    print(line, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "results.jsonl"), "a") as f:
            f.write(line + "\n")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step, idx, device, steps: int, warmup: int = 25) -> float:
    """Milliseconds per ``step(idx)``, after ``warmup`` calls (graph captures included)."""
    for _ in range(warmup):
        step(idx)
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step(idx)
    _sync(device)
    return 1e3 * (time.perf_counter() - start) / steps


def trainer_step_ms(cfg: RunConfig, steps: int, warmup: int) -> tuple[float, Trainer]:
    trainer = Trainer(cfg)
    idx = torch.randperm(trainer.task.train_x.shape[0], device=trainer.device)[:cfg.batch_size]
    return time_steps(trainer._train_step, idx, trainer.device, steps, warmup), trainer


def bare_step_ms(cfg: RunConfig, steps: int, warmup: int) -> float:
    """The same model and AdamW (PyTorch's default implementation on the device) in a bare loop."""
    device = torch.device(cfg.device)
    task = make_task(cfg.op, cfg.p, cfg.train_frac, seed=cfg.seed, device=device)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, device=device).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=cfg.weight_decay)
    idx = torch.randperm(task.train_x.shape[0], device=device)[:cfg.batch_size]

    def step(i):
        loss = F.cross_entropy(model(task.train_x[i]), task.train_y[i])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return time_steps(step, idx, device, steps, warmup)


def canonical(base: RunConfig, dry: bool, steps: int, warmup: int) -> None:
    eager, _ = trainer_step_ms(dataclasses.replace(base, graphed=False), steps, warmup)
    graphed, trainer = trainer_step_ms(base, steps, warmup)
    bare = bare_step_ms(base, steps, warmup)
    emit(dry, "canonical_step", device=base.device, eager_ms=eager, graphed_ms=graphed, bare_loop_ms=bare,
         eager_over_graphed=eager / graphed, graphs=[list(k) for k in trainer.graphs.captured] if trainer.graphs else [],
         steps=steps)


def ensembles(base: RunConfig, dry: bool, steps: int, sizes: tuple[int, ...]) -> None:
    epochs, eval_every = 130, 10               # the λ = 1 run: groks at ≈ 130 epochs
    one = None
    for k in sizes:
        m = measure_pack(calibration_members(base, k), steps)
        seconds = epochs * steps_per_epoch(base) * m["step_seconds"] + epochs / eval_every * m["eval_seconds"]
        runs_per_hour = k * 3600 / seconds
        one = one or runs_per_hour
        emit(dry, "ensemble", members=k, step_ms=1e3 * m["step_seconds"], eval_ms=1e3 * m["eval_seconds"],
             runs_per_hour=runs_per_hour, over_one_by_one=runs_per_hour / one, peak_bytes=m["peak_bytes"], steps=steps)
        if base.device == "cuda":
            release_cuda_memory()


def mamba_vs_transformer(base: RunConfig, dry: bool, steps: int, warmup: int) -> None:
    shape = dict(d_model=16, n_layers=1) if dry else {}
    mamba_cfg = dataclasses.replace(base, arch="mamba", preset="canonical", n_heads=None, d_ff=None, **shape)
    matched = dataclasses.replace(base, preset="custom", d_ff=648) if not dry else base
    triton_ms, trainer = trainer_step_ms(mamba_cfg, steps, warmup)
    params = count_parameters(trainer.model)
    saved = mamba._scan_function
    mamba._scan_function = lambda u: mamba._SelectiveScanFn      # the PyTorch scan, as CUDA ran before
    try:
        pytorch_ms, _ = trainer_step_ms(dataclasses.replace(mamba_cfg, graphed=False), steps, warmup)
    finally:
        mamba._scan_function = saved
    transformer_ms, t = trainer_step_ms(matched, steps, warmup)
    emit(dry, "mamba_step", mamba_triton_graphed_ms=triton_ms, mamba_pytorch_scan_eager_ms=pytorch_ms,
         matched_transformer_graphed_ms=transformer_ms, mamba_over_transformer=triton_ms / transformer_ms,
         mamba_params=params, transformer_params=count_parameters(t.model), steps=steps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, a tiny model, a few steps")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per measurement [default: 200; dry run 2]")
    ap.add_argument("--parts", default="canonical,ensemble,mamba", help="comma list of canonical, ensemble, mamba")
    args = ap.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_experiments: no CUDA device (use --dry-run on CPU)", file=sys.stderr)
        return 2
    dry = args.dry_run
    steps = args.steps or (2 if dry else 200)
    warmup = 3 if dry else 25
    base = RunConfig(device="cpu", **TINY) if dry else RunConfig(device="cuda")
    if dry:
        torch.set_num_threads(1)
    parts = args.parts.split(",")
    if "canonical" in parts:
        canonical(base, dry, steps, warmup)
    if "ensemble" in parts:
        ensembles(base, dry, max(2, steps // 4), (1, 2, 4, 8) if dry else (1, 8, 64, 256))
    if "mamba" in parts:
        mamba_vs_transformer(base, dry, steps, warmup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
