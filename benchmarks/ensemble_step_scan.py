"""Per-member time of one canonical training step against the ensemble size K, beside the device's
matmul peak — the ceiling any ensemble speed-up runs into (benchmarks/RESULTS.md, sweep level).

    python benchmarks/ensemble_step_scan.py [--device cpu|cuda] [--threads N] [--members 1,2,4,8]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from fastdiag.bench import time_fn
from fastdiag.grokking.ensemble_train import EnsembleAdamW
from fastdiag.models.ensemble import EnsembleTransformer
from fastdiag.models.transformer import Transformer, TransformerConfig

BATCH = 512


def step_flops(cfg: TransformerConfig) -> float:
    """Matmul FLOPs of one step (forward + backward = 3 × forward), attention scores excluded."""
    per_token = cfg.n_layers * (4 * cfg.d_model ** 2 + 2 * cfg.d_model * cfg.d_ff)
    return 3 * 2 * (BATCH * cfg.seq_len * per_token + BATCH * cfg.d_model * cfg.vocab_size)


def single_step(cfg: TransformerConfig, device: torch.device):
    model = Transformer(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1.0, betas=(0.9, 0.98))
    x = torch.randint(0, cfg.vocab_size - 1, (BATCH, cfg.seq_len), device=device)
    y = torch.randint(0, cfg.vocab_size - 1, (BATCH,), device=device)

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return step


def ensemble_step(cfg: TransformerConfig, k: int, device: torch.device):
    model = EnsembleTransformer([Transformer(cfg) for _ in range(k)]).to(device)
    opt = EnsembleAdamW(list(model.parameters()), 1e-3, [1.0] * k)
    x = torch.randint(0, cfg.vocab_size - 1, (k, BATCH, cfg.seq_len), device=device)
    y = torch.randint(0, cfg.vocab_size - 1, (k, BATCH), device=device)

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="none").view(k, -1).mean(1).sum().backward()
        opt.step()
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (one sweep worker's share)")
    ap.add_argument("--members", default=None, help="comma list of K (default 1,2,4,8 CPU; 1,8,32,64,128 GPU)")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    ks = [int(k) for k in (args.members or ("1,8,32,64,128" if device.type == "cuda" else "1,2,4,8")).split(",")]
    cfg = TransformerConfig()
    a = torch.randn(2048, 2048, device=device)
    peak = 2 * 2048 ** 3 / time_fn(lambda: a @ a, device, repeats=5).median_ms / 1e6
    flops = step_flops(cfg)
    single = time_fn(single_step(cfg, device), device, repeats=10).median_ms
    print(f"{device.type}, {args.threads} thread(s): fp32 matmul peak {peak:.0f} GFLOP/s (2048²); "
          f"canonical step {flops / 1e9:.2f} GFLOP of matmul ⇒ ≥ {flops / peak / 1e6:.1f} ms per member-step")
    print(f"{'':>12} {'ms/member':>10} {'GFLOP/s':>8} {'vs single':>9}")
    print(f"{'single':>12} {single:>10.2f} {flops / single / 1e6:>8.0f} {1.0:>9.2f}")
    for k in ks:
        ms = time_fn(ensemble_step(cfg, k, device), device, repeats=max(3, 16 // k)).median_ms / k
        print(f"{f'ensemble {k}':>12} {ms:>10.2f} {flops / ms / 1e6:>8.0f} {single / ms:>9.2f}")


if __name__ == "__main__":
    main()
