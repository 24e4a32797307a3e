"""GPU time of a canonical stop-at-grok grid, packed as `fastdiag sweep --ensemble K` packs it, under
assumed device rates (`fastdiag paper plan`, the README's GPU estimate)."""
from __future__ import annotations

import math
from typing import Callable

from fastdiag.grokking.config import RunConfig
from fastdiag.grokking.ensemble_train import pack_runs
from fastdiag.sweep.grid import build_grid

STEP_GFLOP = 7.29      # matmul GFLOP of one canonical training step (benchmarks/ensemble_step_scan.py)
EVAL_GFLOP = 44.7      # forward over all 9,409 pairs ≈ 9409/512 × STEP_GFLOP/3


def grid_plan(lambdas: list[float], seeds: int, epochs: int, eval_every: int, ensemble: int,
              tflops: float, floor_ms: float, t_grok_of: Callable[[float], float],
              collapse_from: float = 10.0) -> dict:
    """GPU time of a stop-at-grok canonical grid packed exactly as `fastdiag sweep --ensemble K` packs it
    (`fastdiag.grokking.ensemble_train.pack_runs`, packs run one after another on one GPU), every run taking the
    t_grok ``t_grok_of(λ)`` gives (the paper's law; inf: never), capped at the horizon; runs at λ ≥ ``collapse_from`` (the paper's
    collapse at λ = 10: never fit) and where the law says never train to the horizon.
    A pack-step costs max(floor_ms, live members × STEP_GFLOP / tflops): compute-bound with the assumed
    sustained fp32 matmul rate, launch-bound below floor_ms; an evaluation costs its forward FLOPs."""
    configs = build_grid(RunConfig(epochs=epochs, eval_every=eval_every, device="cuda").to_dict(), lambdas,
                         list(range(seeds)))
    packs = pack_runs(configs, ensemble)
    seconds = member_epochs = 0.0
    for pack in packs:
        ends = sorted(epochs if c.weight_decay >= collapse_from else min(t_grok_of(c.weight_decay), epochs)
                      for c in pack)
        start = 0.0
        for i, end in enumerate(ends):            # members still training between two finishes
            live = len(ends) - i
            step_ms = max(floor_ms, live * STEP_GFLOP / tflops)
            eval_ms = max(floor_ms, live * EVAL_GFLOP / tflops)
            seconds += (end - start) * (10 * step_ms + eval_ms / eval_every) / 1e3
            member_epochs += (end - start) * live
            start = end
    return {"runs": len(configs), "packs": len(packs), "member_epochs": member_epochs, "hours": seconds / 3600,
            "assumed_tflops": tflops, "assumed_floor_ms": floor_ms,
            "t_pred": {f"{lam:.4g}": (None if math.isinf(t_grok_of(lam)) else round(t_grok_of(lam)))
                       for lam in lambdas}}

