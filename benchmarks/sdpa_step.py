"""The SDPA step comparison: a Hugging Face GPT-2 training step bare, with every SDPA call
through `fastdiag.qk.sdpa_with_stats`, and with eager attention + output_attentions + head_stats.

    python benchmarks/sdpa_step.py [--rounds 9] [--block-steps 5] [--attn-dropout 0] [--threads 1] [--device cpu]

The measurement itself lives in `fastdiag.bench.bench_sdpa_step` (so `fastdiag bench` can run it).
"""
import argparse
from dataclasses import asdict

import torch

from fastdiag.bench import bench_sdpa_step, format_sdpa_step_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--block-steps", type=int, default=5)
    parser.add_argument("--attn-dropout", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (1 on a shared machine: an oversubscribed OpenMP team "
                             "makes every op wait for a descheduled thread)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = bench_sdpa_step(torch.device(args.device), rounds=args.rounds, block_steps=args.block_steps,
                             attn_dropout=args.attn_dropout)
    print(format_sdpa_step_table([asdict(result)]))


if __name__ == "__main__":
    main()
